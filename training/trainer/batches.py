"""The pipeline's micro-batches, step by step, with what each step's records and checkpoint need to know."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from training.config import TrainConfig
from training.data.chat import Batch, BatchStream
from training.layout.flops import drafter_flops, target_flops
from training.model.drafter import DrafterConfig
from training.model.loss import block_targets
from training.target.frozen import Target


class StepBatches:
    """The pipeline's micro-batches, `per_step` to a step, read from the stream in order. Remembers each
    step's token count, its counted FLOPs (`flops_of`, training/layout/flops.py) and the stream's state before it:
    targets read ahead, so a checkpoint after step s needs the state from before step s + 1's first
    micro-batch, not the stream's current one. In a multi-node run, `share` is the indices of each step's micro-batches this node
    computes: every node moves through the whole stream (so every node's data position is the run's), makes
    only its own micro-batches (skipping the others' costs an index each) and counts only their tokens."""

    def __init__(self, stream: BatchStream, per_step: int, start_step: int,
                 flops_of: Callable[[Batch], float] | None = None, share: list[int] | None = None):
        self.stream, self.per_step, self.start_step = stream, per_step, start_step
        self.share = set(range(per_step) if share is None else share)
        self.flops_of = flops_of
        self._lock = threading.Lock()  # the target threads read, the checkpointing thread asks for states
        self._state_before: dict[int, dict] = {}
        self._tokens: dict[int, int] = {}
        self._flops: dict[int, float] = {}

    def __iter__(self):
        last_own = max(self.share)
        for step in itertools.count(self.start_step):
            for index in range(last_own + 1):
                with self._lock:
                    if index == 0:
                        self._state_before[step] = self.stream.state_dict()
                    if index not in self.share:
                        self.stream.skip()
                        continue
                    batch = next(self.stream)
                    self._tokens[step] = self._tokens.get(step, 0) + batch.num_tokens
                    if index == last_own:  # the step's later micro-batches are other nodes': move past them now
                        for _ in range(last_own + 1, self.per_step):
                            self.stream.skip()
                flops = self.flops_of(batch) if self.flops_of is not None else 0.0
                with self._lock:
                    self._flops[step] = self._flops.get(step, 0.0) + flops
                yield batch

    def state_before(self, step: int) -> dict:
        """The stream's state with exactly the micro-batches of steps before `step` read."""
        with self._lock:
            for old in [s for s in self._state_before if s < step]:
                del self._state_before[old]
            # No micro-batch of `step` read yet: the stream stands right there.
            return self._state_before.get(step) or self.stream.state_dict()

    def pop_tokens(self, step: int) -> tuple[int, float]:
        """The step's real tokens and counted FLOPs."""
        with self._lock:
            return self._tokens.pop(step, 0), self._flops.pop(step, 0.0)


def step_flops(config: TrainConfig, target: Target, drafter_config: DrafterConfig) -> Callable[[Batch], float]:
    """Counted FLOPs of one micro-batch (training/layout/flops.py): the target forward over its padded length, up to
    the last feature layer, and the drafter's forward + backward."""

    def flops_of(batch: Batch) -> float:
        rows, length = batch.input_ids.shape
        _, weights = block_targets(batch.input_ids, batch.loss_mask, batch.anchors, batch.block_valid,
                                   config.block_size, config.gamma)
        drafter = drafter_flops(drafter_config, rows, length, batch.anchors, batch.block_valid,
                                int((weights > 0).sum()))
        return target_flops(target.config, rows, length, target.layers_run) + sum(drafter.values())

    return flops_of
