"""Acceptance length tau by simulated greedy speculative decoding on held-out prompts.

Greedy verification is lossless, so the tokens a speculative decoder emits are exactly the target's greedy
continuation. That continuation (and the target's features over it, which are causal) is computed once; then
each step drafts a block from the current anchor (the last token the target produced, not yet processed by it),
accepts the longest prefix of drafts equal to the continuation, and adds the target's bonus token, which is the
next anchor. tau = mean of (accepted + 1) over verification steps. Only steps whose whole block lies inside the
known continuation count.

This path uses SDPA: its shapes vary, and they must never reach the compiled flex_attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.attention import build_mask
from training.devices import autocast
from training.model import Drafter
from training.target import Target


@dataclass
class EvalSet:
    tokens: torch.Tensor  # [E, S] prompt + greedy continuation, right-padded
    features: torch.Tensor  # [E, S, n*D] the target's features over tokens
    first_anchor: torch.Tensor  # [E] the first generated position
    lengths: torch.Tensor  # [E] real length of each row


def build_eval_set(target: Target, prompts: list[list[int]], new_tokens: int, device: torch.device | str) -> EvalSet:
    continuations = target.generate_greedy(prompts, new_tokens)
    rows = [prompt + continuation for prompt, continuation in zip(prompts, continuations)]
    width = max(len(row) for row in rows)
    tokens = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    features = target.features(tokens.to(target.device)).to(device)
    return EvalSet(tokens.to(device), features, torch.tensor([len(p) for p in prompts], device=device),
                   torch.tensor([len(row) for row in rows], device=device))


@torch.no_grad()
def acceptance_length(drafter: Drafter, evalset: EvalSet, dtype: torch.dtype) -> float:
    """Mean tokens per verification step (accepted drafts + the target's bonus token)."""
    block = drafter.config.block_size
    offsets = torch.arange(1, block, device=evalset.tokens.device)
    anchors = evalset.first_anchor.clone()
    active = anchors + block <= evalset.lengths
    tokens_emitted, steps = 0, 0
    was_training = drafter.training
    drafter.eval()
    width = evalset.tokens.shape[1]
    while bool(active.any()):
        at = anchors.clamp(max=width - 1)[:, None]  # finished rows may point one past the end; they are masked
        mask = build_mask("sdpa", at, active[:, None], width, block)
        with autocast(evalset.tokens.device, dtype):
            hidden = drafter(evalset.features, evalset.tokens.gather(1, at), at, mask)
            drafts = drafter.logits(hidden[:, 1:]).argmax(dim=-1)  # [E, block - 1]
        truth_at = (at + offsets).clamp(max=width - 1)
        agree = drafts == evalset.tokens.gather(1, truth_at)
        accepted = agree.long().cumprod(dim=-1).sum(dim=-1)
        emitted = accepted + 1
        tokens_emitted += int(emitted[active].sum())
        steps += int(active.sum())
        anchors = torch.where(active, anchors + emitted, anchors)
        active &= anchors + block <= evalset.lengths
    drafter.train(was_training)
    return tokens_emitted / max(steps, 1)
