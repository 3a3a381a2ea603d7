"""What the pipeline takes (its workers, the other nodes, its config) and what it gives back (each step's
report, the run's result, its utilisation, its errors); and the step plan the leader replica hands the others."""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class TargetWorker(Protocol):
    """A frozen target replica on one device. May also define `warm_up(self) -> None`."""

    def features(self, batch: Any) -> Any:
        """The drafter's input features for one micro-batch (called under torch.no_grad)."""


class AcrossNodes(Protocol):
    """The other processes of a multi-node run (training/distributed/: Nodes; for one node, SingleNode), as
    the leader replica's thread uses them once a step, in this order on every node."""

    def agree(self, step: int, complete: bool, stop: bool) -> tuple[bool, bool]:
        """(every node completed the step, some node asks to stop after it)."""

    def sum_numbers(self, step: int, values: list[float]) -> list[float]:
        """The sums over the nodes of a few numbers."""

    def sum_tensors(self, step: int, tensors: list[torch.Tensor]) -> None:
        """Sum tensors over the nodes, in place."""


class DrafterWorker(Protocol):
    """A drafter replica and its optimizer on one device. May also define `warm_up(self) -> None`."""

    def trainable_parameters(self) -> list[torch.Tensor]:
        """The parameters that train, in the same order on every replica."""

    def loss(self, features: Any, batch: Any) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one micro-batch, optionally with other scalar metrics (averaged over the step's
        micro-batches, e.g. accuracy); features and batch are already on this replica's device. With a metric
        "weight" the loss is a weighted sum (the DFlash loss: sum of w * CE) and `weight` its sum of weights;
        without, a mean of weight 1. The step's loss, and the gradient it steps on, is the sum of every
        micro-batch's loss over the sum of their weights, over all replicas and nodes: a weighted mean over
        the whole step, whichever way the step is split."""

    def optimizer_step(self) -> None:
        """Step the optimizer (and LR schedule) on the gradients the pipeline has put in `.grad`; not called
        for a step whose loss or gradient is not finite. A worker may also define `parameter_names(self) ->
        list[str]` (the names of trainable_parameters()), which a report of a non-finite gradient then uses."""


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    target_devices: Sequence[torch.device]
    drafter_devices: Sequence[torch.device]
    micro_batches_per_step: int
    queue_depth: int = 4
    grad_clip: float | None = 1.0
    # In steady state, no progress (no micro-batch done, no step) for this long is a hang: abort with every
    # thread's stack. Warm-up is not timed here: compiling may take long, and its barrier has its own timeout.
    stall_timeout_s: float = 1800.0
    # After an abort, how long to wait for threads still inside a long device call before giving up on them.
    abort_grace_s: float = 60.0
    # One thread per entry running target forward + drafter step on its own micro-batches (the serial loop).
    colocated_devices: Sequence[torch.device] = ()
    # A multi-node run: a step's micro-batches on every node together (each loss is scaled by 1/this); 0 = this
    # process's micro_batches_per_step (a single-node run).
    global_micro_batches_per_step: int = 0

    @property
    def replica_devices(self) -> list[torch.device]:
        """The drafter replicas' devices, in replica order: drafter threads first, then colocated ones."""
        return [*self.drafter_devices, *self.colocated_devices]


@dataclasses.dataclass(frozen=True)
class StepReport:
    step: int  # steps completed, this one included
    loss: float  # mean micro-batch loss of the step
    grad_norm: float  # total gradient norm before clipping
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # loss companions, averaged alike
    skipped: str | None = None  # what was not finite ("loss (nan)", "gradient of ..."): no update; else None


class StepGradients:
    """A step's summed and clipped gradients, one list per replica. Each replica takes its own list once, so
    that its `.grad` holds the only reference and the memory goes with its optimizer step."""

    def __init__(self, per_replica: list[list[torch.Tensor]]):
        self._lists = dict(enumerate(per_replica))

    def take(self, replica: int) -> list[torch.Tensor]:
        return self._lists.pop(replica, [])


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What the leader replica decided for a step, between the step barriers; every replica reads the same
    plan after the second one. `complete`: every micro-batch of the step (on every node) is done; without it
    the step is dropped. `skip`: its loss or summed gradient is not finite, so no replica steps its
    optimizer. `stop_after`: the run ends after this step."""

    complete: bool
    stop_after: bool
    skip: bool = False
    gradients: StepGradients = dataclasses.field(default_factory=lambda: StepGradients([]))
    report: StepReport | None = None


@dataclasses.dataclass(frozen=True)
class RunResult:
    steps_done: int
    stopped: bool  # a stop was requested before max_steps


@dataclasses.dataclass(frozen=True)
class Utilisation:
    busy: dict[str, float]  # thread name -> fraction of the window it was busy
    queue_depth_mean: float  # time-weighted mean of ready micro-batches waiting for a drafter
    queue_depth_max: int
    queue_bound: int

    def as_metrics(self) -> dict[str, Any]:
        return {
            "busy": {name: round(fraction, 4) for name, fraction in self.busy.items()},
            "queue_depth": {
                "mean": round(self.queue_depth_mean, 3),
                "max": self.queue_depth_max,
                "bound": self.queue_bound,
            },
        }


class PipelineError(RuntimeError):
    """A pipeline thread failed (or the pipeline stalled); carries that thread's formatted traceback, its device
    and the micro-batch it was working on (None outside one: warm-up, the step boundary)."""

    def __init__(self, thread: str, error: BaseException, still_running: Sequence[str] = (),
                 device: torch.device | None = None, batch: Any = None):
        super().__init__(f"{thread} failed: {type(error).__name__}: {error}")
        self.thread = thread
        self.error = error
        self.traceback_text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        self.still_running = list(still_running)
        self.device = device
        self.batch = batch


class PipelineStalled(RuntimeError):
    """No progress in steady state for `stall_timeout_s`: a hang. The message holds every thread's stack."""
