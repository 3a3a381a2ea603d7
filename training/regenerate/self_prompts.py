"""The "self" prompt source (training/data/prompts.py): the target writes the user's turn itself.

The target's chat template is rendered up to where a user's message begins (with its default system turn, if it
has one), and the target samples from there (`self_temperature`, `self_top_p`, each batch seeded from `seed`,
the round and the batch) until its end-of-turn token: a user turn in the target's own distribution, which the
target then answers greedily like any other prompt. Unlimited prompts, no dataset. A turn cut at
`self_max_tokens` (unfinished) or shorter than MIN_CHARS is dropped.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from training.config import ConfigError, RegenerateConfig
from training.data.chat import render_chat
from training.regenerate.generation import ReplicaGenerator, left_padded, reply_of

MIN_CHARS = 16
MARKER = "\ue000gpuctl-user-turn\ue000"  # a private-use character: no template or tokenizer alters it


def user_turn_prefix(tokenizer, template_options: dict) -> list[int]:
    """The token ids of the template up to where a user's message begins."""
    text = render_chat(tokenizer, [{"role": "user", "content": MARKER}], False, template_options)
    if MARKER not in text:
        raise ConfigError("the self source needs a chat template that shows the user's message as it is")
    return tokenizer(text[: text.index(MARKER)], add_special_tokens=False)["input_ids"]


class SelfPrompts:
    """write_user_turns(count, round) for training.data.prompts.build_mix, on one generator's replica."""

    def __init__(self, generator: ReplicaGenerator, config: RegenerateConfig):
        if type(generator) is not ReplicaGenerator:  # the vLLM engine takes conversations, not a template's prefix
            raise ConfigError("the self source samples with the transformers backend: set backend = "
                              "\"transformers\" to make the prompts, then run the engine on them")
        sampling = dataclasses.replace(config, temperature=config.self_temperature, top_p=config.self_top_p,
                                       max_new_tokens=config.self_max_tokens)
        self.writer = ReplicaGenerator(generator.model, generator.tokenizer, sampling)
        self.prefix = user_turn_prefix(generator.tokenizer, config.template_options())
        self.config = config

    def _seed(self, round_: int, batch: int) -> None:
        value = int(hashlib.sha256(f"{self.config.seed}/self/{round_}/{batch}".encode()).hexdigest()[:15], 16)
        if self.writer.device.type == "cuda":
            with torch.cuda.device(self.writer.device):
                torch.cuda.manual_seed(value)
        else:
            torch.default_generator.manual_seed(value)

    @torch.no_grad()
    def __call__(self, count: int, round_: int) -> list[str]:
        texts = []
        rows = self.config.batch_size
        for batch in range((count + rows - 1) // rows):
            self._seed(round_, batch)
            ids, mask = left_padded([self.prefix], rows, len(self.prefix), self.writer.pad_id)
            for tokens in self.writer.new_tokens(ids, mask):
                turn, _, cut = reply_of(tokens, self.writer.eos_ids)
                text = self.writer.tokenizer.decode(turn, skip_special_tokens=True).strip()
                if not cut and len(text) >= MIN_CHARS:
                    texts.append(text)
        return texts[:count]
