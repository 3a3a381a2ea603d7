"""The drafter step as it was before the speed changes (commit 1256200), kept only so that
bench/drafter_bench.py can time old and new side by side in one run, and tests can check they compute the
same function. Not used by the trainer.

Five parts, each revertible on its own (`use_old`): "norm" (RMSNorm as separate float32 ops), "qkv" (q, k
and v of the block tokens and k, v of the context as separate matmuls), "rope" (the rotation's halves as two
slices), "loss" (logits rounded to bf16, then logsumexp, argmax and the softmax gradient as separate float32
passes), and "mask" (the block mask through create_block_mask, every query-key pair evaluated: the code before
issue 12's tile construction; the benchmark builds the mask, so `use_old` only checks the name).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

import training.model.drafter as model_module
from training.model.attention import AttentionMask, attend
from training.model.drafter import Drafter, DraftLayer, RMSNorm
from training.model.loss import dflash_loss

PARTS = ("norm", "qkv", "rope", "loss", "mask")


class OldRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed).to(x.dtype)


def old_apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class OldDraftLayer(DraftLayer):
    def forward(self, hidden: torch.Tensor, context: torch.Tensor, rope_q: tuple, rope_kv: tuple,
                mask: AttentionMask) -> torch.Tensor:
        batch, q_len, _ = hidden.shape
        kv_len = context.shape[1] + q_len
        x = self.input_norm(hidden)
        q = self.q_norm(self.q_proj(x).view(batch, q_len, self.num_heads, self.head_dim))
        k = torch.cat([self.k_proj(context), self.k_proj(x)], dim=1).view(batch, kv_len, self.num_kv_heads, -1)
        v = torch.cat([self.v_proj(context), self.v_proj(x)], dim=1).view(batch, kv_len, self.num_kv_heads, -1)
        q = model_module.apply_rotary(q.transpose(1, 2), *rope_q)  # old or new: the "rope" part decides
        k = model_module.apply_rotary(self.k_norm(k).transpose(1, 2), *rope_kv)
        out = attend(q, k, v.transpose(1, 2), mask)
        hidden = hidden + self.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))
        x = self.post_attention_norm(hidden)
        return hidden + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OldChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, head, labels, weights, chunk_size: int):
        total_weight = weights.sum().float().clamp_min(1e-12)
        loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
        correct = torch.zeros(labels.shape, device=hidden.device, dtype=torch.bool)
        needs_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if needs_grad else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = (hidden[rows].to(head.dtype) @ head.T).float()
            label = labels[rows, None]
            log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)
            loss += (weights[rows] * (log_norm - logits.gather(1, label)).squeeze(1)).sum()
            correct[rows] = logits.argmax(dim=-1) == labels[rows]
            if needs_grad:
                probs = logits.sub_(log_norm).exp_()
                probs.scatter_add_(1, label, torch.full_like(label, -1, dtype=probs.dtype))
                probs.mul_((weights[rows] / total_weight)[:, None])
                grad_hidden[rows] = (probs.to(head.dtype) @ head).float()
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct)
        ctx.hidden_dtype = hidden.dtype
        return loss / total_weight, correct

    @staticmethod
    def backward(ctx, grad_loss, grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        return (grad_hidden * grad_loss).to(ctx.hidden_dtype), None, None, None, None


def old_dflash_loss(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                    chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, labels, weights = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), weights.reshape(-1)
    keep = weights.nonzero().squeeze(1)
    loss, correct = OldChunkedCrossEntropy.apply(hidden[keep], head, labels[keep], weights[keep], chunk_size)
    accuracy = correct.float().mean() if keep.numel() else torch.zeros((), device=hidden.device)
    return loss, accuracy


@contextlib.contextmanager
def use_old(drafter: Drafter, parts: Iterable[str]) -> Iterator:
    """Within the block, the drafter runs the old code of `parts` (same parameters: module classes and the
    rotary function are swapped, not modules); yields the loss function to use."""
    parts = set(parts)
    if unknown := parts - set(PARTS):
        raise ValueError(f"unknown old parts {sorted(unknown)}; choose from {PARTS}")
    swaps = {RMSNorm: OldRMSNorm} if "norm" in parts else {}
    if "qkv" in parts:
        swaps[DraftLayer] = OldDraftLayer
    swapped = [(module, module.__class__) for module in drafter.modules() if type(module) in swaps]
    for module, cls in swapped:
        module.__class__ = swaps[cls]
    new_apply_rotary = model_module.apply_rotary
    if "rope" in parts:
        model_module.apply_rotary = old_apply_rotary
    try:
        yield old_dflash_loss if "loss" in parts else dflash_loss
    finally:
        model_module.apply_rotary = new_apply_rotary
        for module, cls in swapped:
            module.__class__ = cls
