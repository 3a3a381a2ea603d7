"""The DFlash training mask: one `mask_mod`, used by flex_attention and, densified, by SDPA.

Layout (per sequence): queries are N blocks of `block_size` tokens; keys/values are
[S context positions | the same N blocks]. A block token sees the context strictly before
its anchor (kv < anchor) and every token of its own block; nothing of other blocks.
Padding blocks (block_valid False) see nothing.

`build_block_mask` builds flex_attention's BlockMask from that structure, tile by tile, instead of evaluating
the mask at every (query, key) pair as `create_block_mask` does (8,192 x 11,264 pairs at the 8B recipe's
shapes, through a few hundred small kernels): the same tensors (tests/training/test_mask.py holds it to
`create_block_mask`), built in a couple of dozen small operations.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

TILE = 128  # flex_attention's default sparse block size, for queries and keys alike


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
    """The block-sparse mask for flex_attention, built on the anchors' device (no tracing): equal to
    `create_block_mask(dflash_mask_mod(...), B, None, Q_LEN, KV_LEN)`, counted per 128 x 128 tile.

    A query row (block n, anchor a) sees, in the key tile [s, s + 128), the context keys below min(a, S) and
    the keys of its own block: a count per (row, tile) from interval arithmetic. A tile whose rows see all
    128 x 128 pairs is full, one that sees some is partial (padded rows and keys see nothing, so a tile with
    padding is never full), as create_block_mask classifies them."""
    batch, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    kv_len = context_len + q_len
    q_tiles, kv_tiles = -(-q_len // TILE), -(-kv_len // TILE)
    device = anchors.device
    rows = torch.arange(q_tiles * TILE, device=device)
    row_block = torch.clamp(rows // block_size, max=num_blocks - 1)
    row_sees = (rows < q_len) & block_valid[:, row_block]  # [B, Q'] (padding rows and blocks see nothing)
    tile_start = torch.arange(kv_tiles, device=device) * TILE  # [KV']
    # Context keys of each tile below the row's anchor.
    context_end = torch.clamp(tile_start + TILE, max=context_len)
    seen = torch.clamp(torch.minimum(anchors[:, row_block, None], context_end) - tile_start, min=0)
    # The row's own block, [S + n * block, S + (n + 1) * block), within each tile.
    own_start = (context_len + row_block * block_size)[:, None]
    own = torch.minimum(own_start + block_size, tile_start + TILE) - torch.maximum(own_start, tile_start)
    seen = (seen + torch.clamp(own, min=0)) * row_sees[..., None]  # [B, Q', KV']
    pairs = seen.view(batch, 1, q_tiles, TILE, kv_tiles).sum(dim=3)  # [B, 1, Q tiles, KV tiles]
    full = pairs == TILE * TILE
    partial = (pairs > 0) & ~full
    kv_num_blocks, kv_indices = _ordered(partial)
    full_kv_num_blocks, full_kv_indices = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, BLOCK_SIZE=(TILE, TILE),
        mask_mod=dflash_mask_mod(anchors, block_valid, context_len, block_size), seq_lengths=(q_len, kv_len),
    )


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query tile, the number of marked key tiles and every key tile index, marked ones first (ascending),
    as int32: the layout create_block_mask gives BlockMask."""
    dense = tiles.to(torch.int32)
    count = dense.sum(dim=-1).to(torch.int32, memory_format=torch.contiguous_format)
    order = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return count, order.to(torch.int32, memory_format=torch.contiguous_format)


def create_block_mask_reference(
    anchors: torch.Tensor, block_valid: torch.Tensor, context_len: int, block_size: int
) -> BlockMask:
    """The same mask through torch's create_block_mask (every pair evaluated): the reference for tests and
    the benchmark's "before"."""
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


def sliding_window_mask(anchors: torch.Tensor, context_len: int, block_size: int, window: int) -> torch.Tensor:
    """[B, Q, KV] bool: the pairs within `window` positions of each other, either way, as the served model's
    sliding-window layers see them (the reference's `_attention_mask(..., is_causal=False, sliding_window=W)`:
    |query position - key position| < W). Positions: context key i is at i; block n's token k at anchor_n + k.
    Combined with `dense_mask`, which keeps each query to the context before its anchor and its own block."""
    batch = anchors.shape[0]
    offsets = torch.arange(block_size, device=anchors.device)
    block_positions = (anchors[:, :, None] + offsets).reshape(batch, -1)  # [B, Q]
    context_positions = torch.arange(context_len, device=anchors.device).expand(batch, -1)
    key_positions = torch.cat([context_positions, block_positions], dim=1)  # [B, KV]
    return (block_positions[:, :, None] - key_positions[:, None, :]).abs() < window
