"""The DFlash loss: same-position labels, decaying position weights, cross-entropy chunked over positions.

Block token k (k = 0 is the clean anchor) predicts the token at anchor + k: labels are NOT shifted, and
position 0 carries no loss. Weights w_k = exp(-(k - 1) / gamma) favour early positions, which decide how many
drafted tokens are accepted. The loss is sum(w * CE) / sum(w) over valid positions.

At Qwen3-8B shapes (512 x 16 positions x 151,936 vocabulary) full logits would be ~5 GB in float32, plus as much
again for their gradient. `ChunkedCrossEntropy` computes the loss and its gradient with respect to the hidden
states chunk by chunk in the forward pass, keeping only that [P, D] gradient: one logits matmul and one gradient
matmul per chunk, never all logits at once.

With `distill = true` (ARCHITECTURE §5, "Sample efficiency") each position also carries the target's own
next-token distribution q (the target's final hidden state at the position before, through the same frozen LM
head) and the loss adds KL(q || p), weighted like the cross-entropy: sum(w * (CE + KL)) / sum(w). Its gradient
with respect to the logits is w / W * (p - q), so the chunk's work grows by one logits matmul and one softmax.
"""

from __future__ import annotations

import torch


def decay_weights(block_size: int, gamma: float, device: torch.device | str | None = None) -> torch.Tensor:
    """[block_size] weights: 0 at the anchor, exp(-(k - 1) / gamma) for k >= 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def block_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                  block_valid: torch.Tensor, block_size: int, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [B, N, block] (the token at anchor + k) and weights [B, N, block] (0 where there is no loss:
    the anchor itself, padding blocks, non-assistant tokens, past the sequence)."""
    batch, length = input_ids.shape
    positions = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)
    inside = positions < length
    flat = positions.clamp(max=length - 1).reshape(batch, -1)
    labels = input_ids.gather(1, flat).view_as(positions)
    has_loss = loss_mask.gather(1, flat).view_as(positions) & inside & block_valid[:, :, None]
    weights = decay_weights(block_size, gamma, anchors.device) * has_loss
    return labels, weights


# torch.mm(a, b, out_dtype=float32) for bf16 operands: CUDA only, and not in every torch version.
MATMUL_WRITES_FLOAT32 = "dtype" in torch.ops.aten.mm.overloads()


def float32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as float32. bf16 operands accumulate in float32 anyway; on CUDA the product is written in float32
    directly (no bf16 rounding, no separate cast pass over [rows, vocabulary])."""
    if a.dtype != torch.float32 and a.is_cuda and MATMUL_WRITES_FLOAT32:
        return torch.ops.aten.mm.dtype(a, b, torch.float32)
    return (a @ b).float()


class ChunkedCrossEntropy(torch.autograd.Function):
    """sum(w * CE(hidden @ head.T, labels)) / sum(w), chunk by chunk; `head` is frozen (no gradient).

    Also returns, without gradient, whether each position's top-1 prediction equals its label, and with
    `top_k` > 0 each position's `top_k` highest-scoring tokens, best first ([P, 0] otherwise): DFlash2's
    selector candidates, from the same logits matmul.
    Per chunk of R rows the vocabulary-wide work is one float32 logits matmul, one max pass (the logsumexp's
    shift and the top-1), one softmax, and one pass writing the scaled gradient in the head's dtype: no
    separate cast, logsumexp temporaries or in-place passes over [R, vocabulary].
    """

    @staticmethod
    def forward(ctx, hidden, head, labels, weights, chunk_size: int, top_k: int = 0, teacher=None):
        """`teacher` [P, D] (no gradient): the target's hidden state whose logits give each position's q."""
        total_weight = weights.sum().float().clamp_min(1e-12)
        loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
        correct = torch.zeros(labels.shape, device=hidden.device, dtype=torch.bool)
        candidates = torch.zeros((labels.shape[0], top_k), device=hidden.device, dtype=torch.long)
        needs_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if needs_grad else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            label = labels[rows, None]
            logits = float32_matmul(hidden[rows].to(head.dtype), head.T)
            label_logit = logits.gather(1, label)
            top_logit, top = logits.max(dim=-1, keepdim=True)  # the first of equal maxima, as argmax
            correct[rows] = top.squeeze(1) == labels[rows]
            if top_k:
                candidates[rows] = logits.topk(top_k, dim=-1).indices
            teacher_probs, divergence = None, 0.0
            if teacher is not None:
                teacher_probs, divergence = teacher_terms(teacher[rows], head, logits)
            probs = torch.softmax(logits, dim=-1)
            del logits
            # logsumexp = max + log(sum(exp(logits - max))), and the softmax at the max is 1 / that sum.
            log_norm = top_logit - probs.gather(1, top).log()
            if teacher is not None:
                divergence = divergence + log_norm  # KL(q || p), with p's logsumexp
            loss += (weights[rows] * (log_norm - label_logit + divergence).squeeze(1)).sum()
            if needs_grad:  # d(loss)/d(logits) = w / W * (softmax - onehot) [+ w / W * (softmax - q)]
                scale = (weights[rows] / total_weight)[:, None]
                if teacher_probs is not None:
                    probs = probs.mul_(2).sub_(teacher_probs)
                    del teacher_probs
                label_grad = (probs.gather(1, label) - 1) * scale  # in float32: p - 1 stays exact where p ~ 1
                grad_logits = torch.mul(probs, scale, out=torch.empty_like(probs, dtype=head.dtype))
                grad_logits.scatter_(1, label, label_grad.to(head.dtype))
                grad_hidden[rows] = float32_matmul(grad_logits, head)
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct, candidates)
        ctx.hidden_dtype = hidden.dtype
        return loss / total_weight, correct, candidates

    @staticmethod
    def backward(ctx, grad_loss, grad_correct, grad_candidates):
        (grad_hidden,) = ctx.saved_tensors
        return (grad_hidden * grad_loss).to(ctx.hidden_dtype), None, None, None, None, None, None


def teacher_terms(teacher: torch.Tensor, head: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution q [R, V] from its hidden states [R, D], and KL(q || softmax(logits)) [R, 1]
    but for its last term: KL = sum(q * (t - logits)) - logsumexp(t) + logsumexp(logits), and the caller has
    logsumexp(logits) already (the cross-entropy's)."""
    teacher_logits = float32_matmul(teacher.to(head.dtype), head.T)
    teacher_log_norm = torch.logsumexp(teacher_logits, dim=-1, keepdim=True)
    teacher_probs = torch.softmax(teacher_logits, dim=-1)
    cross = (teacher_probs * teacher_logits.sub_(logits)).sum(dim=-1, keepdim=True)
    return teacher_probs, cross - teacher_log_norm


def teacher_rows(teacher_hidden: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """The target's final hidden states [B, L, D] -> [B, N, block, D]: for block token k the state at anchor +
    k - 1, whose next-token distribution is the target's for the token at anchor + k (the one k predicts).
    Position 0 and positions past the sequence carry no loss weight; their rows are clamped in range."""
    batch, length, width = teacher_hidden.shape
    positions = (anchors[:, :, None] + torch.arange(-1, block_size - 1, device=anchors.device)).clamp(0, length - 1)
    flat = positions.reshape(batch, -1, 1).expand(-1, -1, width)
    return teacher_hidden.gather(1, flat).view(*positions.shape, width)


def dflash_loss(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                chunk_size: int, teacher: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [..., D] with labels/weights [...] -> (weighted mean CE, top-1 accuracy over positions with loss);
    with `teacher` [..., D] (`teacher_rows`), the weighted mean of CE + KL to the target's distribution.

    Only positions with a weight are sent through the vocabulary (anchors and padding blocks cost nothing)."""
    hidden, labels, weights = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), weights.reshape(-1)
    keep = weights.nonzero().squeeze(1)
    teacher = None if teacher is None else teacher.reshape(-1, teacher.shape[-1])[keep]
    loss, correct, _ = ChunkedCrossEntropy.apply(hidden[keep], head, labels[keep], weights[keep], chunk_size, 0,
                                                 teacher)
    accuracy = correct.float().mean() if keep.numel() else torch.zeros((), device=hidden.device)
    return loss, accuracy
