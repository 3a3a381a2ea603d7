"""distill = true (ARCHITECTURE §5, "Sample efficiency"): the loss adds KL(target's next-token distribution ||
the drafter's) at each block position, weighted like the cross-entropy; the target's half hands the drafter its
final hidden state beside the features; and the real trainer trains with it on the tiny world."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from training.config import load_config
from training.model.loss import ChunkedCrossEntropy, dflash_loss, teacher_rows
from training.train import main


def reference_loss(hidden, head, labels, weights, teacher):
    """sum(w * (CE + KL(q || p))) / sum(w), by autograd over the whole vocabulary at once."""
    log_p = torch.log_softmax(hidden @ head.T, dim=-1)
    q = torch.softmax(teacher @ head.T, dim=-1)
    ce = -log_p.gather(1, labels[:, None]).squeeze(1)
    kl = (q * (q.log() - log_p)).sum(dim=-1)
    return (weights * (ce + kl)).sum() / weights.sum()


@pytest.mark.parametrize("chunk_size", [5, 64])
def test_the_distilled_loss_and_its_gradient_are_ce_plus_kl_weighted_like_the_ce(chunk_size):
    torch.manual_seed(0)
    rows, width, vocabulary = 37, 16, 50
    hidden = torch.randn(rows, width, requires_grad=True)
    head, teacher = torch.randn(vocabulary, width), torch.randn(rows, width)
    labels, weights = torch.randint(0, vocabulary, (rows,)), torch.rand(rows)
    loss, _, _ = ChunkedCrossEntropy.apply(hidden, head, labels, weights, chunk_size, 0, teacher)
    loss.backward()
    ours = hidden.grad.clone()
    hidden.grad = None
    expected = reference_loss(hidden, head, labels, weights, teacher)
    expected.backward()
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    torch.testing.assert_close(ours, hidden.grad, rtol=1e-4, atol=1e-6)


def test_a_teacher_that_agrees_with_the_drafter_adds_nothing_and_one_that_differs_adds_its_divergence():
    torch.manual_seed(1)
    hidden, head = torch.randn(20, 8), torch.randn(30, 8)
    labels, weights = torch.randint(0, 30, (20,)), torch.rand(20)
    plain, _ = dflash_loss(hidden, head, labels, weights, 7)
    agreeing, _ = dflash_loss(hidden, head, labels, weights, 7, teacher=hidden)
    differing, _ = dflash_loss(hidden, head, labels, weights, 7, teacher=torch.randn(20, 8))
    assert float(agreeing) == pytest.approx(float(plain), abs=1e-5)  # KL(p || p) = 0
    assert float(differing) > float(plain) + 0.1


def test_block_token_k_is_taught_by_the_targets_state_at_anchor_plus_k_minus_1():
    final = torch.arange(2 * 10, dtype=torch.float32).view(2, 10, 1).expand(2, 10, 3)  # row b, position i: 10b + i
    anchors = torch.tensor([[2, 6], [0, 8]])
    rows = teacher_rows(final, anchors, block_size=4)
    assert rows.shape == (2, 2, 4, 3)
    assert rows[0, 0, :, 0].tolist() == [1, 2, 3, 4]  # k = 1 predicts the token at 3: the target's state at 2
    assert rows[0, 1, :, 0].tolist() == [5, 6, 7, 8]
    assert rows[1, 0, :, 0].tolist() == [10, 10, 11, 12]  # k = 0 (no loss) clamped to position 0
    assert rows[1, 1, :, 0].tolist() == [17, 18, 19, 19]  # past the sequence (no loss): clamped to the last


def test_a_teacher_target_hands_over_its_final_state_whose_logits_are_the_targets_own(target):
    from training.target.frozen import Target

    teacher = Target(target.model, target.tokenizer, target.layers, teacher=True)
    ids = torch.randint(0, target.config.vocab_size, (2, 24))
    features = teacher.training_features(ids)
    width = target.hidden_size
    assert features.shape == (2, 24, (target.num_features + 1) * width)
    torch.testing.assert_close(features[..., :-width], target.features(ids))
    logits = features[..., -width:] @ target.model.get_output_embeddings().weight.T
    torch.testing.assert_close(logits, target.model(ids).logits, rtol=1e-4, atol=1e-4)
    assert target.training_features(ids).shape[-1] == target.num_features * width  # without distill: as before


def test_the_trainer_trains_with_distill_and_its_loss_carries_the_divergence(tiny_world, tmp_path, capsys):
    def losses(name: str, *sets: str) -> dict[int, float]:
        out = tmp_path / name
        args = [*tiny_world.overrides(out), "num_threads=1", "eval_every=0", "log_every=1", "max_steps=3", *sets]
        assert main(["--config", "tiny"] + [a for s in args for a in ("--set", s)]) == 0
        assert (out / "export" / "model.safetensors").is_file()
        records = map(json.loads, Path(out / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["loss"] for r in records if "loss" in r}

    plain, distilled = losses("plain"), losses("distill", "distill=true")
    assert sorted(distilled) == [1, 2, 3] and all(map(math.isfinite, distilled.values()))
    # Step 1 starts from the same weights and data: the distilled loss is the CE plus a KL >= 0, here > 0.
    assert distilled[1] > plain[1] + 1e-3
    assert load_config("tiny", ["distill=true"]).distill is True
