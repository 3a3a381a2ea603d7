"""The drafter's half of a training step: its forward pass and loss on the target's features (the caller,
the pipeline's replica thread, runs backward and steps; the target's half is `Target.features`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.data.chat import Batch
from training.layout.devices import autocast
from training.model.attention import FlexAttention, build_mask
from training.model.drafter import Drafter
from training.model.loss import block_targets, dflash_loss, teacher_rows
from training.model.selector_loss import dflash2_loss


@dataclass
class DrafterOutput:
    loss: torch.Tensor  # scalar, with gradient
    accuracy: torch.Tensor  # top-1 accuracy over positions with loss, no gradient
    weight: torch.Tensor  # the sum of the loss's position weights (its normaliser), no gradient


def drafter_loss(drafter: Drafter, features: torch.Tensor, batch: Batch, backend: str, gamma: float,
                  chunk_size: int, dtype: torch.dtype, flex_attention: FlexAttention | None = None,
                  selector_loss_alpha: float = 1.0, compiled: bool = False, distill: bool = False) -> DrafterOutput:
    """Forward pass and loss; `batch` must already be on the drafter's device. The flex backend calls
    `flex_attention` (see training/model/attention.py). A DFlash2 drafter adds its selector's objective
    (training/model/selector_loss.py), weighted by `selector_loss_alpha`. `compiled`: the drafter's forward through
    its compiled stages, where compile = "all" gave it some (training/compile/stages.py). `distill`: the features end
    with the target's final hidden state (Target.training_features), and the loss adds the KL divergence to
    the target's next-token distribution (training/model/loss.py)."""
    block = drafter.config.block_size
    teacher = None
    if distill:
        features, final = features[..., : -drafter.config.hidden_size], features[..., -drafter.config.hidden_size:]
        teacher = teacher_rows(final, batch.anchors, block)
    mask = build_mask(backend, batch.anchors, batch.block_valid, batch.input_ids.shape[1], block, flex_attention,
                      sliding_window=drafter.config.attention_window)
    labels, weights = block_targets(batch.input_ids, batch.loss_mask, batch.anchors, batch.block_valid, block, gamma)
    with autocast(features.device, dtype):
        anchor_tokens = batch.input_ids.gather(1, batch.anchors)
        hidden = drafter(features, anchor_tokens, batch.anchors, mask, compiled=compiled)
        if drafter.config.architecture == "dflash2":
            loss, accuracy = dflash2_loss(hidden, drafter, labels, weights, chunk_size, selector_loss_alpha, teacher)
        else:
            loss, accuracy = dflash_loss(hidden, drafter.lm_head_weight, labels, weights, chunk_size, teacher)
    return DrafterOutput(loss, accuracy, weights.sum().float())
