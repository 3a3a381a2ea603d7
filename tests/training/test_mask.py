"""The DFlash mask_mod against a reference written from its definition (ARCHITECTURE §5)."""

from __future__ import annotations

import pytest
import torch

from training.model.mask import build_block_mask, dense_mask, dflash_mask_mod


def reference_mask(anchors: torch.Tensor, block_valid: torch.Tensor, context_len: int, block: int) -> torch.Tensor:
    """Loops over every (query, key) pair: a valid block's token sees context kv < anchor and its own block."""
    batch, num_blocks = anchors.shape
    q_len = num_blocks * block
    out = torch.zeros((batch, q_len, context_len + q_len), dtype=torch.bool)
    for b in range(batch):
        for q in range(q_len):
            n = q // block
            if not block_valid[b, n]:
                continue
            for kv in range(context_len + q_len):
                if kv < context_len:
                    out[b, q, kv] = kv < int(anchors[b, n])
                else:
                    out[b, q, kv] = (kv - context_len) // block == n
    return out


def random_case(seed: int, batch: int, num_blocks: int, context_len: int, block: int):
    gen = torch.Generator().manual_seed(seed)
    anchors = torch.randint(0, context_len - block + 1, (batch, num_blocks), generator=gen)
    block_valid = torch.rand((batch, num_blocks), generator=gen) > 0.3
    block_valid[0, -1] = False  # always at least one padding block
    return anchors, block_valid


@pytest.mark.parametrize("batch,num_blocks,context_len,block", [(2, 5, 37, 4), (3, 7, 129, 16), (1, 3, 100, 8)])
def test_dense_mask_equals_reference(batch, num_blocks, context_len, block):
    anchors, block_valid = random_case(batch * 100 + context_len, batch, num_blocks, context_len, block)
    expected = reference_mask(anchors, block_valid, context_len, block)
    assert torch.equal(dense_mask(anchors, block_valid, context_len, block), expected)


def test_context_bound_is_strict_and_blocks_are_private():
    anchors = torch.tensor([[5, 9]])
    mask = dense_mask(anchors, torch.tensor([[True, True]]), context_len=12, block_size=4)[0]
    first_block_token, second_block_token = mask[1], mask[4]
    assert first_block_token[:12].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]  # kv < 5, never kv == 5
    assert second_block_token[:12].nonzero().flatten().tolist() == list(range(9))
    assert first_block_token[12:].tolist() == [True] * 4 + [False] * 4  # its own block, all of it (non-causal)
    assert second_block_token[12:].tolist() == [False] * 4 + [True] * 4


def test_padding_blocks_see_nothing():
    anchors = torch.tensor([[3, 0]])
    mask = dense_mask(anchors, torch.tensor([[True, False]]), context_len=10, block_size=4)[0]
    assert not mask[4:].any()


@pytest.mark.parametrize("context_len,num_blocks,block", [(37, 5, 4), (200, 9, 16), (1000, 3, 16)])
def test_block_mask_builds_for_lengths_not_multiple_of_128(context_len, num_blocks, block):
    """create_block_mask pads Q and KV to 128: an unclamped index would read past anchors/block_valid."""
    anchors, block_valid = random_case(context_len, 2, num_blocks, context_len, block)
    block_mask = build_block_mask(anchors, block_valid, context_len, block)
    q_len = num_blocks * block
    assert block_mask.shape[-2:] == (q_len, context_len + q_len)
    # Block-level sparsity must cover every allowed pair: a 128x128 tile with any allowed pair is present.
    tiles = block_mask.to_dense()[:, 0].bool()  # [B, Q tiles, KV tiles]
    dense = dense_mask(anchors, block_valid, context_len, block)
    padded = torch.zeros((2, tiles.shape[1] * 128, tiles.shape[2] * 128), dtype=torch.bool)
    padded[:, :q_len, : context_len + q_len] = dense
    needed = padded.view(2, tiles.shape[1], 128, tiles.shape[2], 128).any(dim=(2, 4))
    assert torch.equal(tiles | needed, tiles)


@pytest.mark.parametrize("context_len,num_blocks,block", [(37, 5, 4), (200, 9, 16)])
def test_mask_mod_on_the_128_padded_grid_stays_in_bounds(context_len, num_blocks, block):
    """flex_attention evaluates mask_mod on Q and KV padded to multiples of 128; eager indexing raises on any
    out-of-bounds read (on a GPU it would be an illegal memory access), and the padding must be masked out."""
    anchors, block_valid = random_case(context_len, 2, num_blocks, context_len, block)
    q_len, kv_len = num_blocks * block, context_len + num_blocks * block
    q_pad, kv_pad = -(-q_len // 128) * 128, -(-kv_len // 128) * 128
    mask_mod = dflash_mask_mod(anchors, block_valid, context_len, block)
    b = torch.arange(2)[:, None, None]
    full = mask_mod(b, None, torch.arange(q_pad)[None, :, None], torch.arange(kv_pad)[None, None, :])
    assert torch.equal(full[:, :q_len, :kv_len], reference_mask(anchors, block_valid, context_len, block))
    assert not full[:, q_len:].any() and not full[:, :, kv_len:].any()


def block_mask_tensors(block_mask) -> dict:
    fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
              "full_q_num_blocks", "full_q_indices")
    return {name: getattr(block_mask, name) for name in fields}


@pytest.mark.parametrize("batch,num_blocks,context_len,block", [
    (2, 5, 37, 4), (3, 9, 200, 16), (1, 3, 1000, 16), (2, 40, 256, 16), (1, 64, 384, 8), (2, 13, 300, 10),
    (1, 32, 3072, 16),  # a whole q tile of blocks; context a multiple of 128, so full tiles exist
])
def test_block_mask_from_tiles_equals_create_block_mask(batch, num_blocks, context_len, block):
    """The tile-counting construction gives exactly the tensors create_block_mask computes from every pair."""
    from training.model.mask import create_block_mask_reference

    anchors, block_valid = random_case(batch * 7 + num_blocks, batch, num_blocks, context_len, block)
    anchors = anchors.sort(dim=1).values  # the trainer's anchors ascend
    if context_len == 3072:
        block_valid[:] = True  # no padding block: tiles of 8 whole blocks deep in the context are full
    got = build_block_mask(anchors, block_valid, context_len, block)
    want = create_block_mask_reference(anchors, block_valid, context_len, block)
    assert got.shape == want.shape and got.BLOCK_SIZE == want.BLOCK_SIZE
    assert got.mask_mod.__code__ is want.mask_mod.__code__
    for name, tensor in block_mask_tensors(want).items():
        mine = block_mask_tensors(got)[name]
        assert mine.dtype == tensor.dtype and mine.stride() == tensor.stride(), name
        assert torch.equal(mine, tensor), name
    if context_len == 3072:
        assert int(want.full_kv_num_blocks.sum()) > 0  # the case exercises full tiles


@pytest.mark.gpu
def test_block_mask_from_tiles_equals_create_block_mask_on_cuda():
    """The same on the GPU's torch (2.11 on the H200 box), at the recipe's shape: 512 blocks of 16, context 3072."""
    from training.model.mask import create_block_mask_reference

    anchors, block_valid = random_case(0, 1, 512, 3072, 16)
    anchors, block_valid = anchors.sort(dim=1).values.cuda(), block_valid.cuda()
    got = build_block_mask(anchors, block_valid, 3072, 16)
    want = create_block_mask_reference(anchors, block_valid, 3072, 16)
    for name, tensor in block_mask_tensors(want).items():
        assert torch.equal(block_mask_tensors(got)[name], tensor), name
