"""The two attention backends agree, and rows that see nothing give 0 (never NaN) in both."""

from __future__ import annotations

import math

import pytest
import torch

from training.model.attention import attend, build_mask, compile_flex_attention
from training.model.mask import dense_mask


def make_case(seed: int, device="cpu", dtype=torch.float32, batch=2, heads=4, kv_heads=2, head_dim=16,
              context_len=70, num_blocks=6, block=8):
    gen = torch.Generator().manual_seed(seed)
    anchors = torch.randint(0, context_len - block + 1, (batch, num_blocks), generator=gen).sort(dim=1).values
    block_valid = torch.ones((batch, num_blocks), dtype=torch.bool)
    block_valid[1, -2:] = False  # padding blocks
    q_len = num_blocks * block
    q = torch.randn((batch, heads, q_len, head_dim), generator=gen)
    k = torch.randn((batch, kv_heads, context_len + q_len, head_dim), generator=gen)
    v = torch.randn((batch, kv_heads, context_len + q_len, head_dim), generator=gen)
    to = {"device": device, "dtype": dtype}
    return (q.to(**to), k.to(**to), v.to(**to), anchors.to(device), block_valid.to(device), context_len, block)


def naive_attention(q, k, v, anchors, block_valid, context_len, block):
    """Softmax over allowed keys written out by hand; a row with no allowed key is 0."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1).float(), v.repeat_interleave(groups, 1).float()
    scores = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = dense_mask(anchors, block_valid, context_len, block)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


def test_sdpa_backend_matches_naive_attention_and_zeroes_padding_rows():
    q, k, v, anchors, block_valid, context_len, block = make_case(0)
    out = attend(q, k, v, build_mask("sdpa", anchors, block_valid, context_len, block))
    assert not out.isnan().any()
    torch.testing.assert_close(out, naive_attention(q, k, v, anchors, block_valid, context_len, block))
    assert (out[1, :, -2 * block:] == 0).all()


def test_sdpa_backend_gradients_are_finite_with_padding_rows():
    q, k, v, anchors, block_valid, context_len, block = make_case(1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    attend(q, k, v, build_mask("sdpa", anchors, block_valid, context_len, block)).sum().backward()
    assert all(t.grad.isfinite().all() for t in (q, k, v))
    assert (q.grad[1, :, -2 * block:] == 0).all()


def test_compiled_flex_forward_equals_sdpa_on_cpu():
    """The flex path (compiled flex_attention with the block mask) against the dense-mask SDPA path."""
    q, k, v, anchors, block_valid, context_len, block = make_case(2)
    with torch.no_grad():
        flex = attend(q, k, v, build_mask("flex", anchors, block_valid, context_len, block, compile_flex_attention()))
        sdpa = attend(q, k, v, build_mask("sdpa", anchors, block_valid, context_len, block))
    assert not flex.isnan().any()
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("context_len,num_blocks", [(200, 12), (1000, 40)])
def test_flex_forward_and_backward_equal_sdpa_on_gpu(context_len, num_blocks):
    case = make_case(3, device="cuda", dtype=torch.bfloat16, heads=8, kv_heads=2, head_dim=64,
                     context_len=context_len, num_blocks=num_blocks, block=16)
    q, k, v, anchors, block_valid, context_len, block = case
    probe = torch.randn(q.shape, device="cuda")
    results, flex_attention = {}, compile_flex_attention()
    for backend in ("flex", "sdpa"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves, build_mask(backend, anchors, block_valid, context_len, block, flex_attention))
        (out.float() * probe).sum().backward()
        results[backend] = [out.float()] + [t.grad.float() for t in leaves]
    for flex, sdpa in zip(results["flex"], results["sdpa"]):
        assert flex.isfinite().all()
        torch.testing.assert_close(flex, sdpa, atol=2e-2, rtol=2e-2)
