"""DFlash2's selector objective (training/model/selector_loss.py) against a dense reference written out in full:
candidates with the label put in, teacher-forced predecessors, the chunked candidate logits and their gradient."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from training.model.dflash2 import build_drafter
from training.model.drafter import DrafterConfig
from training.model.loss import decay_weights, dflash_loss
from training.model.selector_loss import CandidateLogits, dflash2_loss, predecessors, training_candidates

VOCAB, HIDDEN, BLOCK, TOP_K = 50, 32, 4, 5


def test_a_missing_label_takes_the_weakest_candidates_place():
    top = torch.tensor([[7, 3, 9], [4, 5, 6], [1, 2, 8]])
    labels = torch.tensor([3, 0, 8])
    candidates, target, covered = training_candidates(top, labels)
    assert candidates.tolist() == [[7, 3, 9], [4, 5, 0], [1, 2, 8]]
    assert target.tolist() == [1, 2, 2] and covered.tolist() == [True, False, True]
    assert top.tolist() == [[7, 3, 9], [4, 5, 6], [1, 2, 8]]  # the unary top-k itself is untouched


def test_the_predecessor_of_each_block_position_is_the_label_before_it():
    labels = torch.tensor([[[10, 11, 12, 13], [20, 21, 22, 23]]])
    assert predecessors(labels).tolist() == [[[10, 10, 11, 12], [20, 20, 21, 22]]]


def test_candidate_logits_and_their_gradient_equal_the_dense_product():
    torch.manual_seed(0)
    hidden = torch.randn(13, HIDDEN, requires_grad=True)
    head = torch.randn(VOCAB, HIDDEN)
    candidates = torch.randint(0, VOCAB, (13, TOP_K))
    ours = CandidateLogits.apply(hidden, head, candidates, 4)
    dense = (hidden @ head.T).gather(1, candidates)
    torch.testing.assert_close(ours, dense, rtol=0, atol=1e-5)
    grad = torch.randn(13, TOP_K)
    (ours_grad,) = torch.autograd.grad(ours, hidden, grad)
    (dense_grad,) = torch.autograd.grad(dense, hidden, grad)
    torch.testing.assert_close(ours_grad, dense_grad, rtol=0, atol=1e-5)


def tiny_dflash2():
    target = SimpleNamespace(hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             intermediate_size=48, rms_norm_eps=1e-6, vocab_size=VOCAB, num_hidden_layers=4,
                             max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    config = DrafterConfig.from_target(target, 1, BLOCK, [1, 2], VOCAB - 1, architecture="dflash2",
                                       conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=TOP_K)
    torch.manual_seed(0)
    table = torch.randn(VOCAB, HIDDEN)
    drafter = build_drafter(config, table, table)
    with torch.no_grad():  # a selector far from its small initial values
        for p in drafter.candidate_selector.parameters():
            p.normal_()
    return drafter


def dense_objective(hidden, drafter, labels, weights, alpha):
    """The objective written out over full logits: DFlash's weighted CE plus alpha times the weighted K-way CE of
    the selector's scores after the teacher-forced predecessor, over the top-k with the label put in."""
    head, selector = drafter.lm_head_weight, drafter.candidate_selector
    previous = predecessors(labels)
    logits = hidden @ head.T  # [B, T, V]
    flat_weights = weights.reshape(-1)
    unary_ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    unary_loss = (flat_weights * unary_ce).sum() / flat_weights.sum()
    top = logits.detach().topk(TOP_K, dim=-1).indices.reshape(-1, TOP_K)
    candidates, target, _ = training_candidates(top, labels.reshape(-1))
    unary = logits.reshape(-1, VOCAB).gather(1, candidates)
    context = selector.predecessor_codebook[previous.reshape(-1)] * selector.hidden_projection(hidden.reshape(-1,
                                                                                                        HIDDEN))
    scores = unary + (context[:, None, :] * selector.successor_codebook[candidates]).sum(-1)
    selector_ce = F.cross_entropy(scores, target, reduction="none")
    return unary_loss + alpha * (flat_weights * selector_ce).sum() / flat_weights.sum()


def batch(drafter):
    torch.manual_seed(1)
    hidden = torch.randn(2, 3 * BLOCK, HIDDEN, requires_grad=True)
    labels = torch.randint(0, VOCAB - 1, (2, 3, BLOCK))
    weights = decay_weights(BLOCK, 4.0).expand(2, 3, BLOCK).clone()
    weights[1, 2] = 0  # a padding block
    weights[0, 1, 3] = 0  # a position without loss
    return hidden, labels, weights


def test_the_chunked_objective_and_its_gradients_equal_the_dense_one():
    drafter = tiny_dflash2()
    hidden, labels, weights = batch(drafter)
    ours, accuracy = dflash2_loss(hidden, drafter, labels, weights.reshape(2, 3, BLOCK), 5, 0.7)
    dense = dense_objective(hidden, drafter, labels, weights, 0.7)
    torch.testing.assert_close(ours, dense, rtol=1e-5, atol=1e-5)
    assert 0 <= float(accuracy) <= 1
    params = [hidden, *drafter.candidate_selector.parameters()]
    for a, b in zip(torch.autograd.grad(ours, params), torch.autograd.grad(dense, params)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_with_alpha_0_the_objective_is_the_dflash_loss():
    drafter = tiny_dflash2()
    hidden, labels, weights = batch(drafter)
    ours, _ = dflash2_loss(hidden, drafter, labels, weights, 5, 0.0)
    unary, _ = dflash_loss(hidden, drafter.lm_head_weight, labels, weights, 5)
    torch.testing.assert_close(ours, unary, rtol=0, atol=0)


def test_counted_dflash2_flops_equal_the_matrix_products_that_run():
    """The trainer's FLOP count (training/layout/flops.py) of a DFlash2 step, against FlopCounterMode: every matrix
    product but attention (counted over the allowed pairs) is what runs."""
    from torch.utils.flop_counter import FlopCounterMode

    from training.layout.flops import drafter_flops
    from training.model.attention import build_mask
    from training.model.loss import block_targets

    drafter = tiny_dflash2().train()
    generator = torch.Generator().manual_seed(2)
    features = torch.randn(1, 24, 2 * HIDDEN, generator=generator)
    tokens = torch.randint(0, VOCAB - 1, (1, 24), generator=generator)
    anchors, valid = torch.tensor([[2, 9, 15]]), torch.tensor([[True, True, False]])
    labels, weights = block_targets(tokens, torch.ones_like(tokens, dtype=torch.bool), anchors, valid, BLOCK, 4.0)
    with FlopCounterMode(display=False) as counter:
        hidden = drafter(features, tokens.gather(1, anchors), anchors, build_mask("sdpa", anchors, valid, 24, BLOCK))
        dflash2_loss(hidden, drafter, labels, weights, 5, 1.0)[0].backward()
    counts = counter.get_flop_counts()["Global"]
    matmul = sum(n for op, n in counts.items() if "attention" not in str(op))
    counted = drafter_flops(drafter.config, 1, 24, anchors, valid, int((weights > 0).sum()))
    assert {"DFlash2 convolution kernel projections", "DFlash2 selector"} <= counted.keys()
    assert matmul == sum(flop for name, flop in counted.items() if not name.startswith("attention"))
