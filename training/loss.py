"""The DFlash loss: same-position labels, decaying position weights, cross-entropy chunked over positions.

Block token k (k = 0 is the clean anchor) predicts the token at anchor + k: labels are NOT shifted, and
position 0 carries no loss. Weights w_k = exp(-(k - 1) / gamma) favour early positions, which decide how many
drafted tokens are accepted. The loss is sum(w * CE) / sum(w) over valid positions.

At Qwen3-8B shapes (512 x 16 positions x 151,936 vocabulary) full logits would be ~5 GB in float32, plus as much
again for their gradient. `ChunkedCrossEntropy` computes the loss and its gradient with respect to the hidden
states chunk by chunk in the forward pass, keeping only that [P, D] gradient: one logits matmul and one gradient
matmul per chunk, never all logits at once.
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


class ChunkedCrossEntropy(torch.autograd.Function):
    """sum(w * CE(hidden @ head.T, labels)) / sum(w), chunk by chunk; `head` is frozen (no gradient).

    Also returns, without gradient, whether each position's top-1 prediction equals its label.
    """

    @staticmethod
    def forward(ctx, hidden, head, labels, weights, chunk_size: int):
        total_weight = weights.sum().float().clamp_min(1e-12)
        loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
        correct = torch.zeros(labels.shape, device=hidden.device, dtype=torch.bool)
        needs_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if needs_grad else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = (hidden[rows].to(head.dtype) @ head.T).float()
            label = labels[rows, None]
            log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)
            loss += (weights[rows] * (log_norm - logits.gather(1, label)).squeeze(1)).sum()
            correct[rows] = logits.argmax(dim=-1) == labels[rows]
            if needs_grad:  # d(loss)/d(logits) = w / W * (softmax - onehot), reusing the logits' memory
                probs = logits.sub_(log_norm).exp_()
                probs.scatter_add_(1, label, torch.full_like(label, -1, dtype=probs.dtype))
                probs.mul_((weights[rows] / total_weight)[:, None])
                grad_hidden[rows] = (probs.to(head.dtype) @ head).float()
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct)
        ctx.hidden_dtype = hidden.dtype
        return loss / total_weight, correct

    @staticmethod
    def backward(ctx, grad_loss, grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        return (grad_hidden * grad_loss).to(ctx.hidden_dtype), None, None, None, None


def dflash_loss(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [..., D] with labels/weights [...] -> (weighted mean CE, top-1 accuracy over positions with loss).

    Only positions with a weight are sent through the vocabulary (anchors and padding blocks cost nothing)."""
    hidden, labels, weights = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), weights.reshape(-1)
    keep = weights.nonzero().squeeze(1)
    loss, correct = ChunkedCrossEntropy.apply(hidden[keep], head, labels[keep], weights[keep], chunk_size)
    accuracy = correct.float().mean() if keep.numel() else torch.zeros((), device=hidden.device)
    return loss, accuracy
