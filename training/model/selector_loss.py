"""DFlash2's training objective: DFlash's loss on the unary logits plus `selector_loss_alpha` times the
candidate selector's K-way cross-entropy, teacher-forced.

No official DFlash2 training code was published; this follows what the public trainers describe (read, not
copied): SpecForge's DFlash2 path (sgl-project/SpecForge #772: `dflash2_selector_loss_alpha`, the label put
into the candidates when it is missing; #793 only adds an optional stop-gradient, not taken here) and vLLM
speculators (#1006: "an alpha-weighted K-way CE term over unary top-K; a missing hard target is injected only
into the loss candidate set"; the selector term decay-weighted and normalised like the unary one).

- Candidates: each block position's `selector_top_k` tokens with the highest unary logits, the set the serving
  walk ranks; where the position's label is not among them it takes the weakest candidate's place, in the loss
  only, so that every position has a label among its K.
- Predecessor: teacher forcing. The serving walk scores position k after the token it chose at k - 1; a
  proposal counts only while every earlier one was accepted, that is, equal to the label. So in training the
  predecessor of position k is the label at k - 1, and the anchor token for position 1.
- Score: the selector's own `scores` (unary logit + transition), the function the serving walk takes the
  argmax of; the cross-entropy over the K candidates runs in float32.
- Weights: DFlash's position weights w_k, normalised by their sum, as in the unary loss. The selector's
  gradient reaches the backbone through the candidates' unary logits and the hidden states (SpecForge's default).

The returned accuracy is the selector's, teacher-forced: its top choice is the label, and the label was among
the unary top-k (what serving could propose), over positions with loss. For DFlash2 the unary argmax is not the
proposal, so its accuracy would measure the drafter with the selector switched off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from training.model.loss import ChunkedCrossEntropy


class CandidateLogits(torch.autograd.Function):
    """hidden [P, D] and candidates [P, K] -> their logits hidden . head[candidates] [P, K] in float32, chunk by
    chunk; `head` is frozen. Backward gathers the candidates' head rows again per chunk instead of keeping all
    [P, K, D] of them (at Qwen3-8B shapes 8192 x 16 x 4096)."""

    @staticmethod
    def forward(ctx, hidden, head, candidates, chunk_size: int):
        logits = torch.empty(candidates.shape, device=hidden.device, dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits[rows] = torch.einsum("pd,pkd->pk", hidden[rows].to(head.dtype), head[candidates[rows]]).float()
        ctx.save_for_backward(head, candidates)
        ctx.chunk_size, ctx.hidden_dtype = chunk_size, hidden.dtype
        return logits

    @staticmethod
    def backward(ctx, grad_logits):
        head, candidates = ctx.saved_tensors
        grad_hidden = torch.empty((candidates.shape[0], head.shape[1]), device=grad_logits.device,
                                  dtype=ctx.hidden_dtype)
        for start in range(0, candidates.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            grad_hidden[rows] = torch.einsum("pk,pkd->pd", grad_logits[rows].to(head.dtype),
                                             head[candidates[rows]]).to(ctx.hidden_dtype)
        return grad_hidden, None, None, None


def training_candidates(top: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """top [P, K] (best first) and labels [P] -> (the loss's candidates: the label in the last slot where it was
    missing, the label's slot [P], whether the label was among the unary top-k [P])."""
    match = top == labels[:, None]
    covered = match.any(dim=-1)
    last = top.shape[-1] - 1
    target = torch.where(covered, match.long().argmax(dim=-1), torch.full_like(labels, last))
    candidates = top.clone()
    candidates[:, last] = torch.where(covered, top[:, last], labels)
    return candidates, target, covered


def predecessors(labels: torch.Tensor) -> torch.Tensor:
    """labels [..., block] -> each position's teacher-forced predecessor: the label before it (position 0, the
    anchor, carries no loss; position 1's predecessor is the anchor token, labels[..., 0])."""
    return torch.cat([labels[..., :1], labels[..., :-1]], dim=-1)


def dflash2_loss(hidden: torch.Tensor, drafter, labels: torch.Tensor, weights: torch.Tensor, chunk_size: int,
                 selector_loss_alpha: float, teacher: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [B, N*block, D] of a DFlash2Drafter, labels/weights [B, N, block] -> (unary DFlash loss + alpha *
    selector loss, the selector's teacher-forced accuracy). Only positions with a weight are computed. With
    `teacher` [B, N, block, D] the unary loss adds the KL divergence to the target's distribution (loss.py)."""
    c = drafter.config
    if c.output_multiplier != 1.0 or c.final_logit_softcapping > 0:
        raise ValueError("training a DFlash2 drafter supports output_multiplier 1 and no softcapping only")
    selector, head = drafter.candidate_selector, drafter.lm_head_weight
    previous = predecessors(labels).reshape(-1)
    hidden, labels, weights = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), weights.reshape(-1)
    keep = weights.nonzero().squeeze(1)
    hidden, labels, weights, previous = hidden[keep], labels[keep], weights[keep], previous[keep]
    teacher = None if teacher is None else teacher.reshape(-1, teacher.shape[-1])[keep]
    unary_loss, _, top = ChunkedCrossEntropy.apply(hidden, head, labels, weights, chunk_size, selector.top_k,
                                                   teacher)
    candidates, target, covered = training_candidates(top, labels)
    unary = CandidateLogits.apply(hidden, head, candidates, chunk_size)
    scores = selector.scores(hidden, previous, candidates, unary)
    selector_ce = F.cross_entropy(scores.float(), target, reduction="none")
    selector_loss = (weights * selector_ce).sum() / weights.sum().float().clamp_min(1e-12)
    with torch.no_grad():
        correct = (scores.argmax(dim=-1) == target) & covered
        accuracy = correct.float().mean() if keep.numel() else torch.zeros((), device=hidden.device)
    return unary_loss + selector_loss_alpha * selector_loss, accuracy
