"""The DFlash training mask: one `mask_mod`, used by flex_attention and, densified, by SDPA.

Layout (per sequence): queries are N blocks of `block_size` tokens; keys/values are
[S context positions | the same N blocks]. A block token sees the context strictly before
its anchor (kv < anchor) and every token of its own block; nothing of other blocks.
Padding blocks (block_valid False) see nothing.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


def dflash_mask_mod(anchors: torch.Tensor, block_valid: torch.Tensor, context_len: int, block_size: int):
    """Return a flex_attention mask_mod for anchors [B, N] (context positions) and block_valid [B, N]."""
    num_blocks = anchors.shape[1]
    q_len = num_blocks * block_size
    kv_len = context_len + q_len

    def mask_mod(b, h, q_idx, kv_idx):
        # create_block_mask pads Q and KV to multiples of 128: clamp every index we gather with.
        q_block = torch.clamp(q_idx // block_size, 0, num_blocks - 1)
        kv_block = torch.clamp((kv_idx - context_len) // block_size, 0, num_blocks - 1)
        in_context = kv_idx < context_len
        sees_context = in_context & (kv_idx < anchors[b, q_block])
        same_block = (~in_context) & (kv_block == q_block)
        in_range = (q_idx < q_len) & (kv_idx < kv_len)
        return in_range & block_valid[b, q_block] & (sees_context | same_block)

    return mask_mod


def build_block_mask(
    anchors: torch.Tensor, block_valid: torch.Tensor, context_len: int, block_size: int
) -> BlockMask:
    """The block-sparse mask for flex_attention, built on the anchors' device (no tracing)."""
    batch, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    return create_block_mask(
        dflash_mask_mod(anchors, block_valid, context_len, block_size),
        B=batch,
        H=None,
        Q_LEN=q_len,
        KV_LEN=context_len + q_len,
        device=anchors.device,
    )


def dense_mask(anchors: torch.Tensor, block_valid: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """The same mask as a dense boolean [B, Q, KV] tensor (the SDPA path and the tests' reference)."""
    batch, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    device = anchors.device
    mask_mod = dflash_mask_mod(anchors, block_valid, context_len, block_size)
    b = torch.arange(batch, device=device)[:, None, None]
    q = torch.arange(q_len, device=device)[None, :, None]
    kv = torch.arange(context_len + q_len, device=device)[None, None, :]
    return mask_mod(b, None, q, kv)
