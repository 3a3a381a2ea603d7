"""Acceptance length tau by simulated greedy speculative decoding on held-out prompts.

Greedy verification is lossless, so the tokens a speculative decoder emits are exactly the target's greedy
continuation. That continuation (and the target's features over it, which are causal) is computed once; then
each step drafts a block from the current anchor (the last token the target produced, not yet processed by it),
accepts the longest prefix of drafts equal to the continuation, and adds the target's bonus token, which is the
next anchor.

Steps are counted as the serving loop counts them (the reference's `dflash_generate`, which the acceptance
command runs): every verification step counts, the first token comes from the prompt's prefill and is not a
step, a step produces at most the tokens left before the continuation's end (its end-of-turn token, or
max_new_tokens), and the last blocks are cut at max_new_tokens as the loop cuts them. tau = tokens produced /
steps. So on the same prompts and drafter the two agree (in float32, up to near-ties).

A DFlash2 drafter drafts through its candidate selector (the reference's `propose`, greedy), not the argmax.

This path uses SDPA: its shapes vary, and they must never reach the compiled flex_attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.layout.devices import autocast
from training.model.attention import build_mask
from training.model.drafter import Drafter
from training.target.frozen import Target


@dataclass
class EvalSet:
    tokens: torch.Tensor  # [E, S] prompt + greedy continuation, right-padded
    features: torch.Tensor  # [E, S, n*D] the target's features over tokens
    first_anchor: torch.Tensor  # [E] the first generated position
    lengths: torch.Tensor  # [E] real length of each row
    limits: torch.Tensor | None = None  # [E] prompt + max_new_tokens (the loop's max_length); None = lengths


def build_eval_set(target: Target, prompts: list[list[int]], new_tokens: int, device: torch.device | str,
                   continuations: list[list[int]] | None = None) -> EvalSet:
    """`continuations`: the target's greedy replies when the caller has them (else generated here)."""
    if continuations is None:
        continuations = target.generate_greedy(prompts, new_tokens)
    rows = [prompt + continuation for prompt, continuation in zip(prompts, continuations)]
    width = max(len(row) for row in rows)
    tokens = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    features = target.features(tokens.to(target.device)).to(device)
    first = torch.tensor([len(p) for p in prompts], device=device)
    return EvalSet(tokens.to(device), features, first, torch.tensor([len(row) for row in rows], device=device),
                   first + new_tokens)


@torch.no_grad()
def produced_per_step(drafter: Drafter, evalset: EvalSet, dtype: torch.dtype) -> list[list[int]]:
    """Each row's tokens produced by each verification step (accepted drafts + the target's bonus token)."""
    block = drafter.config.block_size
    offsets = torch.arange(1, block, device=evalset.tokens.device)
    lengths = evalset.lengths
    limits = lengths if evalset.limits is None else evalset.limits
    anchors = evalset.first_anchor.clone()
    active = anchors + 1 < lengths
    produced_by_row: list[list[int]] = [[] for _ in range(len(lengths))]
    was_training = drafter.training
    drafter.eval()
    width = evalset.tokens.shape[1]
    while bool(active.any()):
        at = anchors.clamp(max=width - 1)[:, None]  # finished rows may point one past the end; they are masked
        verify = (limits - anchors).clamp(min=1, max=block)  # the block the loop verifies: cut at max_length
        mask = build_mask("sdpa", at, active[:, None], width, block, block_lengths=verify[:, None],
                          sliding_window=drafter.config.attention_window)
        with autocast(evalset.tokens.device, dtype):
            anchor_tokens = evalset.tokens.gather(1, at)
            hidden = drafter(evalset.features, anchor_tokens, at, mask)
            if drafter.config.architecture == "dflash2":  # the selector's path, as the served drafter proposes
                drafts = drafter.propose(hidden[:, 1:], anchor_tokens[:, 0])
            else:
                drafts = drafter.logits(hidden[:, 1:]).argmax(dim=-1)  # [E, block - 1]
        truth_at = (at + offsets).clamp(max=width - 1)
        agree = (drafts == evalset.tokens.gather(1, truth_at)) & (offsets < verify[:, None])
        accepted = agree.long().cumprod(dim=-1).sum(dim=-1)
        produced = torch.minimum(accepted + 1, lengths - anchors - 1)
        for row in active.nonzero().flatten().tolist():
            produced_by_row[row].append(int(produced[row]))
        anchors = torch.where(active, anchors + produced, anchors)
        active &= anchors + 1 < lengths
    drafter.train(was_training)
    return produced_by_row


def tau(produced_by_row: list[list[int]]) -> float:
    """Tokens per verification step over every step of every row (0.0 when no step was taken)."""
    steps = [n for row in produced_by_row for n in row]
    return sum(steps) / len(steps) if steps else 0.0


def acceptance_length(drafter: Drafter, evalset: EvalSet, dtype: torch.dtype) -> float:
    """Mean tokens per verification step (accepted drafts + the target's bonus token)."""
    return tau(produced_per_step(drafter, evalset, dtype))
