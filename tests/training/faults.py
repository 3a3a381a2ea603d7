"""Faults the tests inject into the real trainer: steps whose loss is made NaN, to exercise the bad-step guard
end to end. The trainer has no hook for them: `with_nan_loss` wraps `Trainer.build_pipeline`, so the pipeline
gets the world's own replicas and batches, wrapped.

    python -m tests.training.faults STEPS TRAIN_ARGS...   (python -m training.train TRAIN_ARGS..., with the loss
                                                           of STEPS, a JSON list of steps numbered as logged, NaN)
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from training.data.chat import Batch
from training.entry import run_entry_point
from training.train import main
from training.trainer import Trainer


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


def with_nan_loss(build_pipeline: Callable, steps: Iterable[int]) -> Callable:
    """`Trainer.build_pipeline`, its pipeline fed the loss of `steps` NaN: the world's replicas wrapped, and
    its source of micro-batches (only the pipeline's: the checkpoints keep reading the run's own)."""
    steps = list(steps)

    def build(trainer: Trainer, nodes, world, source, share: list[int], step: int, **callbacks):
        nan_world = dataclasses.replace(world, replicas=[NanLossReplica(r) for r in world.replicas])
        return build_pipeline(trainer, nodes, nan_world, nan_loss_batches(source, len(share), step, steps), share,
                              step, **callbacks)
    return build


if __name__ == "__main__":
    Trainer.build_pipeline = with_nan_loss(Trainer.build_pipeline, json.loads(sys.argv[1]))
    del sys.argv[1]
    run_entry_point(main)
