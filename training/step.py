"""One training step, as two stages that may run on different devices (and, in the pipeline, threads):

- target stage: the frozen target turns a batch's tokens into features, delivered on the drafter's device;
- drafter stage: the drafter's forward pass and loss on those features (the caller runs backward and steps).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from training.attention import FlexAttention, build_mask
from training.data import Batch
from training.loss import block_targets, dflash_loss
from training.model import Drafter
from training.target import Target


@dataclass
class DrafterOutput:
    loss: torch.Tensor  # scalar, with gradient
    accuracy: torch.Tensor  # top-1 accuracy over positions with loss, no gradient


def compute_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The dtype of the target's weights and of the drafter's autocast: auto = bf16 on CUDA, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, name)


def autocast(device: torch.device | str, dtype: torch.dtype):
    """bf16 autocast over float32 master weights, or nothing when computing in float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def target_stage(target: Target, batch: Batch, drafter_device: torch.device | str) -> torch.Tensor:
    """[B, L, n*D] features of the batch's tokens, on the drafter's device."""
    return target.features(batch.input_ids).to(drafter_device, non_blocking=True)


def drafter_stage(drafter: Drafter, features: torch.Tensor, batch: Batch, backend: str, gamma: float,
                  chunk_size: int, dtype: torch.dtype, flex_attention: FlexAttention | None = None) -> DrafterOutput:
    """Forward pass and loss; `batch` must already be on the drafter's device. The flex backend calls
    `flex_attention` (see training/attention.py)."""
    block = drafter.config.block_size
    mask = build_mask(backend, batch.anchors, batch.block_valid, batch.input_ids.shape[1], block, flex_attention)
    labels, weights = block_targets(batch.input_ids, batch.loss_mask, batch.anchors, batch.block_valid, block, gamma)
    with autocast(features.device, dtype):
        anchor_tokens = batch.input_ids.gather(1, batch.anchors)
        hidden = drafter(features, anchor_tokens, batch.anchors, mask)
        loss, accuracy = dflash_loss(hidden, drafter.lm_head_weight, labels, weights, chunk_size)
    return DrafterOutput(loss, accuracy)
