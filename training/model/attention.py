"""Attention backends for the drafter: compiled flex_attention with a block mask, or SDPA with a dense mask.

Both come from the one `mask_mod` in training/model/mask.py. A mask is built once per batch (`build_mask`) and shared
by every drafter layer. Rows that see nothing (padding blocks) give 0 in both backends, never NaN.

The compiled flex_attention is never found through module state: whoever builds the mask passes it in (the
threaded trainer its SharedFlexAttention, training/compile/flex.py; single-threaded tools `compile_flex_attention()`),
and the mask carries it to `attend`, so two trainers in one process cannot reach each other's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask
from torch.nn.attention.flex_attention import flex_attention as uncompiled_flex_attention

from training.model.mask import build_block_mask, dense_mask, sliding_window_mask

# Called like flex_attention(q, k, v, block_mask=..., enable_gqa=...): a SharedFlexAttention or a compiled one.
FlexAttention = Callable[..., torch.Tensor]


def compile_flex_attention() -> FlexAttention:
    """A plain compiled flex_attention (fixed shapes, whole graph or a loud error) for single-threaded use:
    tests and benchmarks. Threads sharing one must use training/compile/flex.py's discipline instead (ARCHITECTURE §6)."""
    return torch.compile(uncompiled_flex_attention, dynamic=False, fullgraph=True)


def resolve_backend(name: str, device: torch.device | str) -> str:
    """auto -> flex on CUDA, sdpa elsewhere (torch refuses flex_attention's backward on the CPU)."""
    if name == "auto":
        return "flex" if torch.device(device).type == "cuda" else "sdpa"
    return name


@dataclass
class AttentionMask:
    backend: str  # "flex" or "sdpa"
    block_mask: BlockMask | None = None  # flex
    dense: torch.Tensor | None = None  # sdpa: [B, 1, Q, KV] bool, empty rows opened (see below)
    row_visible: torch.Tensor | None = None  # sdpa: [B, 1, Q, 1], False for rows that see nothing
    flex_attention: FlexAttention | None = None  # flex: the compiled function every layer calls
    sliding: AttentionMask | None = None  # the same mask within a sliding window, for sliding-window layers


def build_mask(backend: str, anchors: torch.Tensor, block_valid: torch.Tensor, context_len: int,
               block_size: int, flex_attention: FlexAttention | None = None,
               block_lengths: torch.Tensor | None = None, sliding_window: int | None = None) -> AttentionMask:
    """The DFlash mask for one batch, on the anchors' device; the flex backend needs the compiled
    `flex_attention` to call (the SDPA one ignores it). `block_lengths` [B, N] (SDPA only, for evaluation):
    the tokens of each block that exist, as in the serving loop's last step, whose block is cut at its
    max_length (the keys past them are hidden: block attention is not causal, so they would change the rest).
    `sliding_window` (SDPA only): also the mask of the drafter's sliding-window layers, as `.sliding`."""
    if sliding_window is not None:
        if backend != "sdpa":
            raise ValueError("sliding-window drafter layers train with attention sdpa (no flex block mask yet)")
        full = build_mask(backend, anchors, block_valid, context_len, block_size, block_lengths=block_lengths)
        window = sliding_window_mask(anchors, context_len, block_size, sliding_window)[:, None]
        full.sliding = _sdpa_mask(full.dense & full.row_visible & window)
        return full
    if backend == "flex":
        if flex_attention is None:
            raise ValueError("attention backend 'flex' needs a compiled flex_attention: the trainer's "
                             "SharedFlexAttention, or compile_flex_attention() outside threads")
        block_mask = build_block_mask(anchors, block_valid, context_len, block_size)
        return AttentionMask("flex", block_mask=block_mask, flex_attention=flex_attention)
    if backend != "sdpa":
        raise ValueError(f"unknown attention backend {backend!r}")
    dense = dense_mask(anchors, block_valid, context_len, block_size)
    if block_lengths is not None:
        offsets = torch.arange(block_size, device=anchors.device)
        exists = (offsets < block_lengths[..., None]).reshape(anchors.shape[0], 1, -1)
        dense[:, :, context_len:] &= exists
    return _sdpa_mask(dense[:, None])


def _sdpa_mask(dense: torch.Tensor) -> AttentionMask:
    """dense [B, 1, Q, KV] bool as SDPA takes it."""
    visible = dense.any(dim=-1, keepdim=True)
    # SDPA turns a fully masked row into NaN (softmax over nothing); let it attend anywhere and zero it after.
    return AttentionMask("sdpa", dense=dense | ~visible, row_visible=visible)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """q [B, H, Q, d], k/v [B, Hkv, KV, d] (grouped-query) -> [B, H, Q, d]."""
    if mask.backend == "flex":
        return mask.flex_attention(q, k, v, block_mask=mask.block_mask, enable_gqa=q.shape[1] != k.shape[1])
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # expand the KV heads: keeps the memory-efficient kernels usable on every torch version
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense)
    return out * mask.row_visible
