"""The drafter sees exactly what it will have at inference: context strictly before its anchor, its own block."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import training.model.drafter as model_module
from training.compile.flex import AttentionShape, projected_qkv
from training.model.attention import build_mask
from training.model.drafter import Drafter, DrafterConfig
from training.serve.evaluate import EvalSet, acceptance_length, produced_per_step

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from drafter_baseline import use_old  # the pre-fusion drafter code, kept for the benchmark

CONFIG = DrafterConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                       rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       vocab_size=50, num_layers=2, num_features=3, block_size=4, target_layers=[1, 2, 3],
                       mask_token_id=49, num_target_layers=6, max_position_embeddings=128)


def make_drafter(seed: int = 0) -> Drafter:
    torch.manual_seed(seed)
    return Drafter(CONFIG, torch.randn(50, 32), torch.randn(50, 32)).eval()


def run(drafter, features, tokens, anchors, block_valid):
    mask = build_mask("sdpa", anchors, block_valid, features.shape[1], CONFIG.block_size)
    with torch.no_grad():
        out = drafter(features, tokens.gather(1, anchors), anchors, mask)
    return out.view(anchors.shape[0], anchors.shape[1], CONFIG.block_size, -1)


def test_a_block_never_sees_the_target_state_at_or_after_its_anchor():
    """The target has not yet processed the anchor token at inference: its features at the anchor (and later)
    must not reach the block. Fails if the mask were kv <= anchor (SpecForge's bug)."""
    drafter = make_drafter()
    features = torch.randn(1, 30, 96)
    tokens = torch.randint(0, 50, (1, 30))
    anchors, valid = torch.tensor([[10, 20]]), torch.tensor([[True, True]])
    base = run(drafter, features, tokens, anchors, valid)

    at_anchor = features.clone()
    at_anchor[0, 10:] += 5.0  # the first block's anchor position and everything after it
    moved = run(drafter, at_anchor, tokens, anchors, valid)
    torch.testing.assert_close(moved[0, 0], base[0, 0], rtol=0, atol=0)
    assert not torch.allclose(moved[0, 1], base[0, 1])  # anchor 20 does see position 10

    before = features.clone()
    before[0, 9] += 5.0
    assert not torch.allclose(run(drafter, before, tokens, anchors, valid)[0, 0], base[0, 0])


def test_blocks_do_not_see_each_other_and_padding_blocks_are_inert():
    drafter = make_drafter()
    features = torch.randn(2, 30, 96)
    tokens = torch.randint(0, 50, (2, 30))
    anchors = torch.tensor([[5, 12, 0], [7, 9, 0]])
    valid = torch.tensor([[True, True, False], [True, True, False]])
    base = run(drafter, features, tokens, anchors, valid)
    other_tokens = tokens.clone()
    other_tokens[:, 12] = (other_tokens[:, 12] + 1) % 50  # block 1 of row 0 gets another anchor token
    changed = run(drafter, features, other_tokens, anchors, valid)
    torch.testing.assert_close(changed[0, 0], base[0, 0], rtol=0, atol=0)
    assert not torch.allclose(changed[0, 1], base[0, 1])
    moved_padding = run(drafter, features, tokens, torch.tensor([[5, 12, 20], [7, 9, 3]]), valid)
    torch.testing.assert_close(moved_padding[:, :2], base[:, :2], rtol=0, atol=0)
    assert base.isfinite().all()


def test_only_the_drafter_layers_train():
    drafter = make_drafter()
    trainable = {name for name, p in drafter.named_parameters() if p.requires_grad}
    assert "embed_weight" not in trainable and "lm_head_weight" not in trainable
    assert set(drafter.state_dict()) == {name for name, _ in drafter.named_parameters()}  # no frozen copies saved
    assert "fc.weight" in trainable
    assert not any("mask" in name for name in trainable)  # masked positions embed mask_token_id, nothing learned


def test_masked_block_positions_are_the_mask_token_embedded_by_the_target_table():
    """What the engines feed a served drafter: the anchor token, then mask_token_id, through the target's own
    embedding. Changing the mask token's row moves the outputs; changing any other unused row does not."""
    drafter = make_drafter()
    features, tokens = torch.randn(1, 30, 96), torch.randint(0, 40, (1, 30))
    anchors, valid = torch.tensor([[10, 20]]), torch.tensor([[True, True]])
    base = run(drafter, features, tokens, anchors, valid)
    drafter.embed_weight[45] += 1.0  # a row no input uses
    torch.testing.assert_close(run(drafter, features, tokens, anchors, valid), base, rtol=0, atol=0)
    drafter.embed_weight[CONFIG.mask_token_id] += 1.0
    assert not torch.allclose(run(drafter, features, tokens, anchors, valid), base)


class OracleDrafter(torch.nn.Module):
    """Drafts the true continuation for its first `right` positions, then a wrong token."""

    def __init__(self, tokens: torch.Tensor, right: int, block: int = 4, vocab: int = 50):
        super().__init__()
        self.config = DrafterConfig(**{**CONFIG.to_dict(), "block_size": block})
        self.tokens, self.right, self.vocab = tokens, right, vocab

    def forward(self, features, anchor_tokens, anchors, mask):
        block = self.config.block_size
        positions = (anchors + torch.arange(block)).clamp(max=self.tokens.shape[1] - 1)
        drafted = self.tokens.gather(1, positions)
        drafted[:, 1 + self.right:] = (drafted[:, 1 + self.right:] + 1) % self.vocab
        return torch.nn.functional.one_hot(drafted, self.vocab).float()

    def logits(self, hidden):
        return hidden


def test_acceptance_length_counts_accepted_drafts_plus_the_bonus_token():
    tokens = torch.randint(0, 50, (2, 60))
    # Rows of 57 real tokens: from anchors 12 and 4, 44 and 52 tokens follow, whole blocks of 4 (the serving
    # loop's count: the anchor is the prompt's prefill token, each step produces accepted drafts + 1).
    evalset = EvalSet(tokens, torch.zeros(2, 60, 1), first_anchor=torch.tensor([12, 4]),
                      lengths=torch.tensor([57, 57]))
    assert acceptance_length(OracleDrafter(tokens, right=3), evalset, torch.float32) == 4.0  # the whole block
    assert acceptance_length(OracleDrafter(tokens, right=1), evalset, torch.float32) == 2.0
    assert acceptance_length(OracleDrafter(tokens, right=0), evalset, torch.float32) == 1.0


def test_acceptance_length_counts_every_step_as_the_serving_loop_does():
    """The last step produces only what is left (not a whole block), and it counts: 10 tokens after the
    anchor with blocks of 4 are steps of 4, 4, 2 (tau 10/3), where whole-block-only counting said 4.0."""
    tokens = torch.randint(0, 50, (1, 20))
    evalset = EvalSet(tokens, torch.zeros(1, 20, 1), first_anchor=torch.tensor([5]), lengths=torch.tensor([16]))
    assert produced_per_step(OracleDrafter(tokens, right=3), evalset, torch.float32) == [[4, 4, 2]]
    assert acceptance_length(OracleDrafter(tokens, right=3), evalset, torch.float32) == 10 / 3
    # A first token that ends the reply (its end-of-turn) leaves nothing to draft: no step.
    ended = EvalSet(tokens, torch.zeros(1, 20, 1), first_anchor=torch.tensor([5]), lengths=torch.tensor([6]))
    assert produced_per_step(OracleDrafter(tokens, right=3), ended, torch.float32) == [[]]


def forward_backward(drafter, features, tokens, anchors, valid):
    """The drafter's output and every trainable parameter's gradient of a fixed function of it."""
    drafter.zero_grad(set_to_none=True)
    mask = build_mask("sdpa", anchors, valid, features.shape[1], CONFIG.block_size)
    out = drafter(features, tokens.gather(1, anchors), anchors, mask)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in drafter.named_parameters()}


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_projections_and_norms_compute_what_the_separate_ones_did(autocast):
    """q/k/v of the block tokens (and k/v of the context) in one matmul each, RMSNorm through F.rms_norm: the same
    function and gradients as separate projections and the float32 norm chain: in float64 to float32 rounding
    (the norm computes in float32 either way), and under bf16 autocast to bf16 precision."""
    drafter = make_drafter().train()
    if not autocast:
        drafter = drafter.double()
    dtype = torch.float64 if not autocast else torch.float32
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(2, 30, 96, generator=gen, dtype=dtype)
    tokens = torch.randint(0, 50, (2, 30), generator=gen)
    anchors, valid = torch.tensor([[5, 12, 20], [7, 9, 0]]), torch.tensor([[True, True, True], [True, True, False]])

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        new_out, new_grads = forward_backward(drafter, features, tokens, anchors, valid)
        with use_old(drafter, ["norm", "qkv", "rope"]):
            old_out, old_grads = forward_backward(drafter, features, tokens, anchors, valid)
    assert type(drafter.layers[0]) is model_module.DraftLayer  # the old classes were swapped back
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(new_out, old_out, **tolerance)
    assert new_grads.keys() == old_grads.keys()
    for name, grad in new_grads.items():
        scale = old_grads[name].abs().max().clamp_min(1e-6)  # compare bf16 gradients relative to their size
        torch.testing.assert_close(grad / scale, old_grads[name] / scale, **tolerance, msg=name)


def test_attention_inputs_keep_the_layout_the_shared_flex_attention_is_warmed_with(monkeypatch):
    """The threaded trainer's compiled flex_attention is warmed with `projected_qkv` and refuses any other
    stride (it would recompile): the fused projections must hand attention the same layout."""
    seen = []
    real_attend = model_module.attend

    def spy(q, k, v, mask):
        seen.append((q, k, v))
        return real_attend(q, k, v, mask)

    monkeypatch.setattr(model_module, "attend", spy)
    features, tokens = torch.randn(1, 30, 96), torch.randint(0, 50, (1, 30))
    anchors, valid = torch.tensor([[5, 12, 20]]), torch.tensor([[True, True, True]])
    forward_backward(make_drafter().train(), features, tokens, anchors, valid)
    q_len = anchors.shape[1] * CONFIG.block_size
    shape = AttentionShape(1, CONFIG.num_heads, CONFIG.num_kv_heads, q_len, 30 + q_len, CONFIG.head_dim)
    warmed = projected_qkv(shape, torch.device("cpu"), torch.float32, requires_grad=True)
    assert len(seen) == CONFIG.num_layers
    for got, expected in zip(seen[0], warmed):
        assert got.shape == expected.shape and got.stride() == expected.stride()
