"""What the export tests share: an export loaded by the reference `dflash` package, strictly, and the tiny world's
held-out prompts."""

from __future__ import annotations

from pathlib import Path

import dflash.model as reference
import torch

from training.data.chat import eval_prompts, load_conversations


def served(path: Path, model_class=reference.DFlashDraftModel):
    """The export as the reference loads it, in float32; every weight loaded, none missing or left over."""
    model, info = model_class.from_pretrained(str(path), output_loading_info=True, dtype=torch.float32)
    assert info and all(len(entries) == 0 for entries in info.values()), info
    return model.eval()


def prompts(world, target, count: int) -> list[list[int]]:
    return eval_prompts(target.tokenizer, load_conversations(str(world.eval)))[:count]
