"""Tests only (`debug_nan_steps`): steps whose loss is made NaN, to exercise the bad-step guard end to end.
Built only when `debug_nan_steps` is set, around the production pieces, so these have no test hook."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from training.data import Batch


@dataclasses.dataclass
class NanLossBatch(Batch):
    """A micro-batch whose loss NanLossReplica makes NaN."""


def nan_loss_batches(batches: Iterable[Batch], per_step: int, start_step: int,
                     nan_steps: Iterable[int]) -> Iterator[Batch]:
    """`batches` (`per_step` of them to a step, from `start_step`), those of `nan_steps` (numbered as logged,
    from 1) as NanLossBatch."""
    marked = set(nan_steps)
    for index, batch in enumerate(batches):
        step = start_step + index // per_step
        yield NanLossBatch(**vars(batch)) if step + 1 in marked else batch


class NanLossReplica:
    """A drafter replica whose loss is NaN on a NanLossBatch; everything else is the replica's own."""

    def __init__(self, replica: Any):
        self.replica = replica

    def __getattr__(self, name: str) -> Any:
        return getattr(self.replica, name)

    def loss(self, features: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = self.replica.loss(features, batch)
        return (loss * float("nan") if isinstance(batch, NanLossBatch) else loss), metrics
