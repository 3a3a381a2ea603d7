"""The drafter sees exactly what it will have at inference: context strictly before its anchor, its own block."""

from __future__ import annotations

import torch

from training.attention import build_mask
from training.evaluate import EvalSet, acceptance_length
from training.model import Drafter, DrafterConfig

CONFIG = DrafterConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                       rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=50, num_layers=2, num_features=3,
                       block_size=4, target_layers=[1, 2, 3])


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
    assert "mask_embedding" in trainable and "fc.weight" in trainable


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
    # With whole blocks accepted, row 0 walks 12, 16, .., 56 and its last block ends exactly at the end, leaving
    # its anchor one past it while row 1 (2, 6, .., 54) still drafts.
    evalset = EvalSet(tokens, torch.zeros(2, 60, 1), first_anchor=torch.tensor([12, 2]),
                      lengths=torch.tensor([60, 60]))
    assert acceptance_length(OracleDrafter(tokens, right=3), evalset, torch.float32) == 4.0  # the whole block
    assert acceptance_length(OracleDrafter(tokens, right=1), evalset, torch.float32) == 2.0
    assert acceptance_length(OracleDrafter(tokens, right=0), evalset, torch.float32) == 1.0
