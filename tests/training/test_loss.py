"""Labels, weights and the chunked cross-entropy of the DFlash loss."""

from __future__ import annotations

import math

import pytest
import torch

from training.model.loss import block_targets, decay_weights, dflash_loss


def test_labels_are_same_position_not_shifted():
    """Block token k is trained on the token at anchor + k (SpecForge shipped anchor + k + 1)."""
    input_ids = torch.arange(100, 140)[None]  # token value = 100 + position
    anchors = torch.tensor([[3, 20]])
    labels, weights = block_targets(input_ids, torch.ones_like(input_ids, dtype=torch.bool), anchors,
                                    torch.tensor([[True, True]]), block_size=4, gamma=7.0)
    assert labels.tolist() == [[[103, 104, 105, 106], [120, 121, 122, 123]]]
    assert (weights[..., 0] == 0).all()  # the anchor is given, never predicted
    assert (weights[..., 1:] > 0).all()


def test_weights_drop_padding_blocks_non_assistant_tokens_and_positions_past_the_end():
    input_ids = torch.arange(12)[None]
    loss_mask = torch.ones((1, 12), dtype=torch.bool)
    loss_mask[0, 6] = False  # a user token inside the second block
    anchors = torch.tensor([[4, 10, 0]])
    block_valid = torch.tensor([[True, True, False]])
    _, weights = block_targets(input_ids, loss_mask, anchors, block_valid, block_size=4, gamma=7.0)
    w = decay_weights(4, 7.0)
    assert torch.equal(weights[0, 0], torch.tensor([0.0, w[1], 0.0, w[3]]))  # position 6 masked
    assert torch.equal(weights[0, 1], torch.tensor([0.0, w[1], 0.0, 0.0]))  # 12, 13 lie past the sequence
    assert (weights[0, 2] == 0).all()


def test_decay_weights():
    w = decay_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    for k in range(1, 16):
        assert math.isclose(float(w[k]), math.exp(-(k - 1) / 7.0), rel_tol=1e-6)


def reference_loss(hidden, head, labels, weights):
    logits = hidden.reshape(-1, hidden.shape[-1]) @ head.T
    ce = torch.nn.functional.cross_entropy(logits, labels.reshape(-1), reduction="none")
    return (weights.reshape(-1) * ce).sum() / weights.sum()


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_chunked_loss_equals_unchunked_in_value_and_gradient(chunk_size):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn((3, 5, 8, 32), generator=gen)
    head = torch.randn((50, 32), generator=gen)
    labels = torch.randint(0, 50, (3, 5, 8), generator=gen)
    weights = decay_weights(8, 4.0).expand(3, 5, 8).clone()
    weights[1, 2:] = 0  # padding blocks

    chunked_hidden = hidden.clone().requires_grad_()
    loss, accuracy = dflash_loss(chunked_hidden, head, labels, weights, chunk_size)
    (loss * 3.0).backward()  # a non-unit upstream gradient must scale through
    reference_hidden = hidden.clone().requires_grad_()
    expected = reference_loss(reference_hidden, head, labels, weights)
    (expected * 3.0).backward()

    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(chunked_hidden.grad, reference_hidden.grad)
    predicted = (hidden @ head.T).argmax(-1)
    assert math.isclose(float(accuracy), float((predicted == labels)[weights > 0].double().mean()), rel_tol=1e-6)


def test_loss_of_an_empty_batch_is_zero_not_nan():
    hidden = torch.randn((2, 4, 16), requires_grad=True)
    loss, _ = dflash_loss(hidden, torch.randn((10, 16)), torch.zeros((2, 4), dtype=torch.long),
                          torch.zeros((2, 4)), 8)
    loss.backward()
    assert float(loss.detach()) == 0.0 and (hidden.grad == 0).all()


def test_gradient_of_a_confident_prediction_keeps_p_minus_one_with_a_bf16_head():
    """With the label's probability 1 - 2e-3, bf16 would round p to 1 and the label's gradient p - 1 to 0; the
    loss computes p - 1 in float32 before the cast. Integer logits are exact in bf16, so the float64 reference
    sees the same logits."""
    gen = torch.Generator().manual_seed(0)
    vocab, dim = 50, 16
    head = torch.randint(-1, 2, (vocab, dim), generator=gen).float()
    head[7] = 0
    head[7, :10] = 1
    hidden = torch.zeros(1, 4, dim)
    hidden[..., :10] = 1  # logit 10 for token 7, |logit| <= 6 for the others
    labels = torch.full((1, 4), 7)
    weights = torch.ones(1, 4)

    bf16_hidden = hidden.bfloat16().requires_grad_()
    loss, accuracy = dflash_loss(bf16_hidden, head.bfloat16(), labels, weights, chunk_size=3)
    loss.backward()
    reference_hidden = hidden.double().requires_grad_()
    expected = reference_loss(reference_hidden, head.double(), labels, weights.double())
    expected.backward()

    assert float(accuracy) == 1.0
    torch.testing.assert_close(loss.double(), expected, rtol=1e-3, atol=0)
    torch.testing.assert_close(bf16_hidden.grad.double(), reference_hidden.grad, rtol=2e-2, atol=1e-5)
    assert bf16_hidden.grad.abs().max() > 1e-4  # the label's p - 1 survived


def test_accuracy_counts_a_tie_as_the_first_maximum_like_argmax():
    head = torch.eye(4)
    hidden = torch.tensor([[[1.0, 0.0, 1.0, 0.0]]])  # tokens 0 and 2 tie
    for label, right in ((0, 1.0), (2, 0.0)):
        _, accuracy = dflash_loss(hidden, head, torch.tensor([[label]]), torch.ones(1, 1), chunk_size=8)
        assert float(accuracy) == right
