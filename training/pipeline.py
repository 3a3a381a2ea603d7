"""The threaded training pipeline: target threads turn micro-batches into features, drafter threads train.

One process, one thread per device entry, in three roles. Each target thread owns a frozen target replica;
each drafter thread owns a drafter replica and its optimizer; each colocated thread owns both, and runs the
target forward and then the drafter step on its own micro-batches (the serial loop, as one role of the same
pipeline: no queue, no copy between devices). Drafter and colocated threads are the replicas. A global step is
M = `micro_batches_per_step` micro-batches; every replica accumulates the gradients of the micro-batches it
took (each loss scaled by 1/M), then at the step boundary the gradients are summed across replicas (NCCL
through torch.cuda.comm on distinct GPUs, a plain sum otherwise), clipped once, and every replica steps its own
optimizer on the same gradients, so the replicas stay bit-identical. A step whose loss or summed gradient is
not finite updates nothing, on every replica alike (they share the sum): its StepReport says what was not
finite, and the micro-batches are spent.

What keeps it correct:
- Order: micro-batch n of the source belongs to step start + n // M, index n % M, whichever thread computes
  it; the source is read in that order. Target threads read ahead (within the bound below); a colocated thread
  reads the next micro-batch only while it belongs to the step it is in. Drafters take the target threads'
  micro-batches of a step in index order, so with one drafter the accumulation order is fixed too.
- Bounded: at most `queue_depth` micro-batches live between a target's claim and a drafter's take; targets may
  run ahead into later steps within that bound, drafters never start step g+1 before their step g update.
- Streams: on CUDA each thread works on its own stream and synchronizes it at the end of every busy span;
  tensors cross threads only after that, and each consumer holds them until its own stream has synchronized.
- Stop: an exception in any thread aborts every wait and ends every thread; `run` raises `PipelineError` with
  that thread's error and traceback, and so does a KeyboardInterrupt in the thread running `run` (Ctrl-C, or
  the trainer's second stop signal). A requested stop (`request_stop`, or the `stop` that `run` polls) ends at
  a step boundary: the current step finishes if all its micro-batches were already done, otherwise it is
  dropped. The pipeline installs no signal handler: the process's entry point owns signals.
- Compile discipline: each thread calls its workers' optional `warm_up()` on its own device, then every thread
  meets at one barrier before steady state (no thread works while another may still be compiling).
- Nodes: in a multi-node run (training/distributed.py) this process computes its share of each step's
  micro-batches (each loss scaled by 1 / the step's micro-batches on every node together), and the leader
  replica's thread joins the other processes at the step boundary through `AcrossNodes`: whether every node
  completed the step and whether any stops after it, the gradient all-reduce after the in-process sum and
  before the clip, the sum of the step's loss and metrics. Only that thread talks to other nodes.
- Layouts: target threads need drafter threads and the other way round; colocated threads need neither, so a
  run may be all colocated, all disaggregated (T targets : D drafters), or a mix of the two.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.cuda.comm  # a submodule torch 2.11 does not import by itself

# How long a blocked wait sleeps before re-checking the stop flags (waits are also woken on every change).
_POLL_S = 0.5
# Gradient buckets for the NCCL reduce/broadcast: a 1 B-parameter drafter is then a few dozen calls.
_COMM_BUCKET_BYTES = 256 * 2**20


class TargetWorker(Protocol):
    """A frozen target replica on one device. May also define `warm_up(self) -> None`."""

    def features(self, batch: Any) -> Any:
        """The drafter's input features for one micro-batch (called under torch.no_grad)."""


class AcrossNodes(Protocol):
    """The other processes of a multi-node run (training/distributed.py: Nodes), as the leader replica's thread
    uses them once a step, in this order on every node."""

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
        """The mean loss of one micro-batch, optionally with other scalar metrics to average like it (e.g.
        accuracy); features and batch are already on this replica's device."""

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


def move_to_device(obj: Any, device: torch.device) -> Any:
    """Tensors inside tensors/lists/tuples/dicts/dataclasses moved to `device`; anything else unchanged."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {key: move_to_device(value, device) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        moved = [move_to_device(value, device) for value in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f.name for f in dataclasses.fields(obj) if f.init]
        changes = {name: move_to_device(getattr(obj, name), device) for name in fields}
        return dataclasses.replace(obj, **changes)
    return obj


def sum_and_clip_gradients(
    grads: list[list[torch.Tensor]], devices: Sequence[torch.device], max_norm: float | None,
    across_nodes: Callable[[list[torch.Tensor]], None] | None = None,
) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Sum per-replica gradient lists onto replica 0's device, clip the sum like clip_grad_norm_, and give
    every replica its own copy of the result.

    Returns (one gradient list per replica, the pre-clip total norm). On distinct GPUs this is an NCCL
    reduce + broadcast (torch.cuda.comm); otherwise (CPU, or replicas sharing a GPU) a plain sum in replica
    order. `across_nodes`, in a multi-node run, sums this process's sum with the other nodes' (in place),
    before the norm: every node then clips the same global sum.
    """
    distinct_gpus = all(d.type == "cuda" for d in devices) and len({d.index for d in devices}) == len(devices)
    if len(grads) == 1:
        total = list(grads[0])
    elif distinct_gpus:
        total = list(torch.cuda.comm.reduce_add_coalesced(grads, devices[0].index, _COMM_BUCKET_BYTES))
    else:
        total = [g.clone() for g in grads[0]]
        for replica_grads in grads[1:]:
            torch._foreach_add_(total, [g.to(devices[0]) for g in replica_grads])
    if across_nodes is not None:
        across_nodes(total)
    norm = torch.nn.utils.get_total_norm(total)
    if max_norm is not None:
        # Same arithmetic as clip_grad_norm_, so one replica here equals a plain single-device step. A non-finite
        # norm leaves the sum unclipped, with no sync here: such a step is skipped, and the sum still shows which
        # gradient was not finite (a NaN factor would make them all NaN).
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(total, torch.where(torch.isfinite(norm), factor, 1.0))
    if len(grads) == 1:
        return [total], norm
    if distinct_gpus:
        # One list per entry of `devices`, in that order (devices[0], the source, must come first).
        copies = torch.cuda.comm.broadcast_coalesced(total, [d.index for d in devices], _COMM_BUCKET_BYTES)
        return [list(c) for c in copies], norm
    return [total] + [[t.to(device, copy=True) for t in total] for device in devices[1:]], norm


def check_replicas_identical(drafters: Sequence[DrafterWorker]) -> None:
    """Replicas must start equal: the shared update keeps equal replicas equal, and unequal ones unequal."""
    first = drafters[0].trainable_parameters()
    for replica, worker in enumerate(drafters[1:], 1):
        params = worker.trainable_parameters()
        if len(params) != len(first):
            raise ValueError(
                f"drafter replica {replica} has {len(params)} trainable tensors, replica 0 {len(first)}"
            )
        for i, (a, b) in enumerate(zip(first, params)):
            same_kind = a.shape == b.shape and a.dtype == b.dtype
            if not (same_kind and torch.equal(a.detach().to(b.device), b.detach())):
                raise ValueError(f"drafter replica {replica} differs from replica 0 in trainable tensor {i}")


class _Handoff:
    """Micro-batches from the source to the threads that compute them, bounded and in order.

    The source is read in order, under one lock, by target threads (which publish features for drafter
    threads) and by colocated threads (which keep what they read). A micro-batch's key (step, index) follows
    from its position in the source, whoever reads it."""

    def __init__(self, source: Iterable[Any], total: int, per_step: int, start_step: int, bound: int):
        self._source: Iterator[Any] = iter(source)
        self._source_lock = threading.Lock()
        self._total = total
        self._per_step = per_step
        self._start_step = start_step
        self.bound = bound
        self.cond = threading.Condition()
        self.stopping = False  # no new work: a requested stop or an abort
        self.aborted = False
        self._source_position = 0  # micro-batches read from the source so far
        self._live = 0  # reserved or published by a target thread and not yet taken by a drafter
        self._ready: dict[tuple[int, int], Any] = {}
        self._readers: dict[tuple[int, int], str] = {}  # key -> "target" or "colocated", once read
        self._next_index: dict[int, int] = {}  # step -> next index drafters look at
        self._done: dict[int, int] = {}  # step -> micro-batches whose backward finished
        self._depth_area = 0.0
        self._depth_since = time.perf_counter()
        self._depth_max = 0

    def _note_depth_change(self) -> None:
        now = time.perf_counter()
        self._depth_area += len(self._ready) * (now - self._depth_since)
        self._depth_since = now

    def take_depth_window(self, window_s: float) -> tuple[float, int]:
        with self.cond:
            self._note_depth_change()
            mean = self._depth_area / window_s if window_s > 0 else 0.0
            peak = self._depth_max
            self._depth_area, self._depth_max = 0.0, len(self._ready)
            return mean, peak

    def _wait(self) -> None:
        self.cond.wait(_POLL_S)

    def stop(self, abort: bool) -> None:
        with self.cond:
            self.stopping = True
            self.aborted = self.aborted or abort
            self.cond.notify_all()

    def _key(self, ordinal: int) -> tuple[int, int]:
        return self._start_step + ordinal // self._per_step, ordinal % self._per_step

    def _read(self, reader: str, only_step: int | None = None) -> tuple[tuple[int, int], Any] | None:
        """The next micro-batch of the source and its key; None when the run's share is read (or, with
        `only_step`, when the next one belongs to a later step). The source lock, not the handoff's,
        serialises data work, so drafters are not held up by it."""
        with self._source_lock:
            ordinal = self._source_position
            if ordinal >= self._total or self.stopping:
                return None
            key = self._key(ordinal)
            if only_step is not None and key[0] != only_step:
                return None
            try:
                batch = next(self._source)
            except StopIteration:
                raise RuntimeError(
                    f"the micro-batch source ended after {ordinal} micro-batches; "
                    f"{self._total} were needed ({self._per_step} per step)"
                ) from None
            self._source_position += 1
        with self.cond:
            self._readers[key] = reader
            self.cond.notify_all()
        return key, batch

    # Target side.
    def claim_for_target(self) -> tuple[tuple[int, int], Any] | None:
        """The next micro-batch in source order, once there is room; None when there is no more work."""
        with self.cond:
            while not self.stopping and self._source_position < self._total and self._live >= self.bound:
                self._wait()
            if self.stopping or self._source_position >= self._total:
                return None
            self._live += 1
        claim = None
        try:
            claim = self._read("target")
        finally:
            if claim is None:
                with self.cond:
                    self._live -= 1
                    self.cond.notify_all()
        return claim

    def publish(self, key: tuple[int, int], item: Any) -> None:
        with self.cond:
            self._note_depth_change()
            self._ready[key] = item
            self._depth_max = max(self._depth_max, len(self._ready))
            self.cond.notify_all()

    # Colocated side.
    def claim_own(self, step: int) -> tuple[tuple[int, int], Any] | None:
        """The next micro-batch of the source while it belongs to `step`; None once the step's are all read
        (or work stops)."""
        return self._read("colocated", only_step=step)

    # Drafter side.
    def claim_for_drafter(self, step: int) -> int | None:
        """The next index of `step` that a target thread read, in index order (waiting until the next one is
        read); None once every index of the step is claimed or read by a colocated thread, or work stops."""
        with self.cond:
            while True:
                index = self._next_index.get(step, 0)
                if self.stopping or index >= self._per_step:
                    return None
                reader = self._readers.get((step, index))
                if reader is None:
                    self._wait()
                    continue
                self._next_index[step] = index + 1
                if reader == "target":
                    return index

    def take(self, key: tuple[int, int]) -> Any | None:
        """The published item for `key`; None when work stops first (the step is then dropped)."""
        with self.cond:
            while key not in self._ready and not self.stopping:
                self._wait()
            if key not in self._ready or self.aborted:
                return None
            self._note_depth_change()
            item = self._ready.pop(key)
            self._live -= 1
            self.cond.notify_all()
            return item

    def mark_done(self, step: int) -> None:
        with self.cond:
            self._done[step] = self._done.get(step, 0) + 1
            for key in [k for k in self._readers if k[0] < step]:
                del self._readers[key]

    def step_complete(self, step: int) -> bool:
        with self.cond:
            return self._done.get(step, 0) == self._per_step


class _BusyClocks:
    """Busy time per thread, read as fractions of a window (spans still open count up to now)."""

    def __init__(self, names: Sequence[str]):
        self._lock = threading.Lock()
        self._busy = dict.fromkeys(names, 0.0)
        self._open: dict[str, float] = {}
        self.window_start = time.perf_counter()

    def start(self, name: str) -> None:
        with self._lock:
            self._open[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        with self._lock:
            self._busy[name] += time.perf_counter() - self._open.pop(name)

    def take_window(self) -> tuple[float, dict[str, float]]:
        with self._lock:
            now = time.perf_counter()
            window = now - self.window_start
            fractions = {}
            for name in self._busy:
                busy = self._busy[name]
                if name in self._open:
                    busy += now - self._open[name]
                    self._open[name] = now
                fractions[name] = min(1.0, busy / window) if window > 0 else 0.0
                self._busy[name] = 0.0
            self.window_start = now
            return window, fractions


@contextmanager
def _on_device(device: torch.device):
    """Run the calling thread on `device`, on a stream of its own when it is a GPU."""
    if device.type != "cuda":
        yield None
        return
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        yield stream


class Pipeline:
    """Runs steps [start_step, max_steps) with one thread per target, drafter and colocated worker (see the
    module doc).

    Workers are built by the caller, one per device entry (in the main thread, one at a time: transformers
    patches torch.nn.init globally while it loads, so building in parallel threads is not safe); drafter
    replicas (the drafters, then the colocated entries' drafters) must start identical. Each thread calls its
    workers' optional `warm_up()` on its own device. `on_steady` runs once, when every thread has warmed up
    and none has started working.
    """

    def __init__(
        self,
        config: PipelineConfig,
        targets: Sequence[TargetWorker],
        drafters: Sequence[DrafterWorker],
        micro_batches: Iterable[Any],
        *,
        start_step: int,
        max_steps: int,
        on_step: Callable[[StepReport], None] | None = None,
        colocated: Sequence[tuple[TargetWorker, DrafterWorker]] = (),
        on_steady: Callable[[], None] | None = None,
        nodes: AcrossNodes | None = None,
    ):
        if config.micro_batches_per_step < 1:
            raise ValueError("micro_batches_per_step must be at least 1")
        if config.queue_depth < 1:
            raise ValueError("queue_depth must be at least 1")
        if not config.replica_devices:
            raise ValueError("the pipeline needs at least one drafter or colocated device")
        if bool(config.target_devices) != bool(config.drafter_devices):
            raise ValueError("target threads need drafter threads and drafter threads need target threads "
                             f"(targets {len(config.target_devices)}, drafters {len(config.drafter_devices)})")
        if (len(targets) != len(config.target_devices) or len(drafters) != len(config.drafter_devices)
                or len(colocated) != len(config.colocated_devices)):
            raise ValueError("one target worker per target device, one drafter worker per drafter device and "
                             "one (target, drafter) pair per colocated device")
        self.config = config
        self.targets = list(targets)
        self.colocated_targets = [target for target, _ in colocated]
        # Every drafter replica, in replica order: the leader (replica 0) logs and checkpoints.
        self.drafters = [*drafters, *(drafter for _, drafter in colocated)]
        self._start_step = start_step
        self._max_steps = max(max_steps, start_step)
        self._on_step = on_step
        self._on_steady = on_steady
        self._per_step = config.micro_batches_per_step
        self._loss_divisor = config.global_micro_batches_per_step or config.micro_batches_per_step
        self._nodes = nodes
        self._handoff = _Handoff(
            micro_batches,
            (self._max_steps - start_step) * self._per_step,
            self._per_step,
            start_step,
            config.queue_depth,
        )
        self.target_names = [f"target{i}" for i in range(len(config.target_devices))]
        self.drafter_names = [f"drafter{i}" for i in range(len(config.drafter_devices))]
        self.colocated_names = [f"colocated{i}" for i in range(len(config.colocated_devices))]
        names = self.target_names + self.drafter_names + self.colocated_names
        self._clocks = _BusyClocks(names)
        self._devices = dict(zip(names, [*config.target_devices, *config.drafter_devices,
                                         *config.colocated_devices]))
        self._in_hand: dict[str, Any] = {}  # thread -> the micro-batch (from the source) it works on now
        self._error: tuple[str, BaseException] | None = None
        self._error_lock = threading.Lock()
        self._stop_requested = False
        self._progress = 0
        self._steps_done = start_step
        self._steady = False  # every thread has passed warm-up
        replicas = len(config.replica_devices)
        self._ready_barrier = threading.Barrier(len(config.target_devices) + replicas,
                                                action=self._start_steady_state)
        self._step_barrier = threading.Barrier(replicas)
        # Per replica: the step's summed loss and companion metrics, read by the leader at the step boundary.
        self._step_sums: list[dict[str, torch.Tensor]] = [{} for _ in range(replicas)]
        # Written by the leader replica between the two step barriers, read by every replica after the second.
        self._plan_complete = False
        self._plan_skip = False  # the step's loss or summed gradient is not finite: no update
        self._plan_stop_after = False
        self._plan_grads: list[list[torch.Tensor]] = []
        self._report = StepReport(step=start_step, loss=float("nan"), grad_norm=float("nan"))

    # Control, from any thread.
    def request_stop(self) -> None:
        """Stop at the next step boundary (finish the current step if all its micro-batches are done)."""
        self._stop_requested = True
        self._handoff.stop(abort=False)

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    @property
    def failed(self) -> bool:
        """A thread failed (or the run was aborted): every thread is ending."""
        return self._error is not None

    def utilisation(self) -> Utilisation:
        """Busy fractions and queue depth since the previous call (or since steady state began)."""
        window, busy = self._clocks.take_window()
        mean, peak = self._handoff.take_depth_window(window)
        return Utilisation(busy, mean, peak, self.config.queue_depth)

    def _fail(self, thread: str, error: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = (thread, error)
        self._handoff.stop(abort=True)
        self._ready_barrier.abort()
        self._step_barrier.abort()

    # The main thread.
    def run(self, stop: Callable[[], str | None] | None = None) -> RunResult:
        """Run every thread to the end; raises PipelineError when any of them failed.

        `stop`, polled by this thread about every 0.2 s, returns why to stop (e.g. "SIGTERM") or None: a reason
        stops the run at the next step boundary. A KeyboardInterrupt here aborts every thread (PipelineError).
        """
        if self._max_steps == self._start_step:
            return RunResult(self._start_step, stopped=False)
        check_replicas_identical(self.drafters)
        roles = [
            (self.target_names, self.config.target_devices, self._target_loop),
            (self.drafter_names, self.config.drafter_devices, self._drafter_loop),
            (self.colocated_names, self.config.colocated_devices, self._colocated_loop),
        ]
        threads = [
            threading.Thread(target=self._thread_main, args=(name, device, loop, i), name=name)
            for names, devices, loop in roles
            for i, (name, device) in enumerate(zip(names, devices))
        ]
        for thread in threads:
            thread.daemon = True  # a thread stuck inside a device call must not keep the process alive
        try:
            for thread in threads:
                thread.start()
        except KeyboardInterrupt as interrupt:
            self._fail(threading.current_thread().name, interrupt)
        self._supervise(threads, stop)
        if self._error is not None:
            thread, error = self._error
            raise PipelineError(thread, error, [t.name for t in threads if t.is_alive()], self._devices.get(thread),
                                self._in_hand.get(thread))
        return RunResult(self._steps_done, stopped=self._stop_requested and self._steps_done < self._max_steps)

    def _supervise(self, threads: list[threading.Thread], stop: Callable[[], str | None] | None) -> None:
        """Until every thread has ended (after an abort, at most abort_grace_s more): act on `stop`, on a
        KeyboardInterrupt, and on a stall."""
        last_progress, last_change = self._progress, time.monotonic()
        aborted_at = None
        while True:
            # A KeyboardInterrupt may land on any line of this loop: it aborts, and supervising goes on, so
            # that `run` never returns while threads still work.
            try:
                alive = [t for t in threads if t.is_alive()]
                if not alive:
                    return
                alive[0].join(0.2)
                reason = stop() if stop is not None and not self._stop_requested else None
                if reason is not None:
                    print(f"pipeline: {reason}: stopping at the next step boundary", file=sys.stderr, flush=True)
                    self.request_stop()
                now = time.monotonic()
                if self._progress != last_progress:
                    last_progress, last_change = self._progress, now
                elif not self._steady:
                    last_change = now
                elif self._error is None and now - last_change > self.config.stall_timeout_s:
                    self._fail("watchdog", PipelineStalled(self._stall_message(threads)))
                if self._error is not None:
                    aborted_at = aborted_at or now
                    if now - aborted_at > self.config.abort_grace_s:
                        return
            except KeyboardInterrupt as interrupt:
                self._fail(threading.current_thread().name, interrupt)

    def _stall_message(self, threads: list[threading.Thread]) -> str:
        frames = sys._current_frames()
        stacks = [
            f"--- {t.name}\n" + "".join(traceback.format_stack(frames[t.ident]))
            for t in threads
            if t.is_alive() and t.ident in frames
        ]
        return f"no progress for {self.config.stall_timeout_s:.0f} s; thread stacks:\n" + "\n".join(stacks)

    # The worker threads.
    def _thread_main(self, name: str, device: torch.device, loop: Callable, index: int) -> None:
        try:
            with _on_device(device) as stream:
                loop(name, device, stream, index)
        except threading.BrokenBarrierError:
            if self._error is None:
                self._fail(name, RuntimeError("a pipeline barrier broke without an error"))
        except BaseException as error:  # noqa: BLE001 - every failure must reach the main thread
            self._fail(name, error)

    def _start_steady_state(self) -> None:
        self._steady = True
        self._clocks.take_window()
        self._handoff.take_depth_window(0.0)
        if self._on_steady is not None:
            self._on_steady()

    @contextmanager
    def _busy(self, name: str, stream: torch.cuda.Stream | None):
        self._clocks.start(name)
        try:
            yield
            if stream is not None:
                stream.synchronize()  # busy means device work: the span ends when the device is done
        finally:
            self._clocks.stop(name)
            self._progress += 1

    def _warm_up_and_meet(self, *workers: Any) -> None:
        for worker in workers:
            warm_up = getattr(worker, "warm_up", None)
            if warm_up is not None:
                warm_up()
        self._ready_barrier.wait()

    def _target_loop(self, name: str, device: torch.device, stream, index: int) -> None:
        worker = self.targets[index]
        self._warm_up_and_meet(worker)
        while (claim := self._handoff.claim_for_target()) is not None:
            key, batch = claim
            self._in_hand[name] = batch
            with self._busy(name, stream), torch.no_grad():
                features = worker.features(batch)
            del self._in_hand[name]
            self._handoff.publish(key, (features, batch))

    def _drafter_loop(self, name: str, device: torch.device, stream, index: int) -> None:
        """A drafter replica on the target threads' features."""
        worker = self.drafters[index]
        self._warm_up_and_meet(worker)

        def next_micro_batch(step: int) -> Any | None:
            micro = self._handoff.claim_for_drafter(step)
            item = None if micro is None else self._handoff.take((step, micro))
            if item is not None:
                self._in_hand[name] = item[1]  # the source's batch (its features are the target's output)
            return item

        def features_and_batch(item: Any) -> tuple[Any, Any]:
            return move_to_device(item, device)

        self._replica_loop(name, stream, index, worker, next_micro_batch, features_and_batch)

    def _colocated_loop(self, name: str, device: torch.device, stream, index: int) -> None:
        """Target forward and drafter step, one after the other, on the micro-batches this thread reads."""
        target = self.colocated_targets[index]
        replica = len(self.config.drafter_devices) + index
        worker = self.drafters[replica]
        self._warm_up_and_meet(target, worker)

        def next_micro_batch(step: int) -> Any | None:
            claim = self._handoff.claim_own(step)
            if claim is not None:
                self._in_hand[name] = claim[1]
            return None if claim is None else claim[1]

        def features_and_batch(item: Any) -> tuple[Any, Any]:
            batch = move_to_device(item, device)
            with torch.no_grad():
                return target.features(batch), batch

        self._replica_loop(name, stream, replica, worker, next_micro_batch, features_and_batch)

    def _replica_loop(self, name: str, stream, replica: int, worker: DrafterWorker,
                      next_micro_batch: Callable[[int], Any | None],
                      features_and_batch: Callable[[Any], tuple[Any, Any]]) -> None:
        """Steps of one replica: its micro-batches' gradients, then the shared update at each step boundary."""
        params = list(worker.trainable_parameters())
        leader = replica == 0
        for step in range(self._start_step, self._max_steps):
            sums: dict[str, torch.Tensor] = {}
            while (item := next_micro_batch(step)) is not None:
                with self._busy(name, stream):
                    features, batch = features_and_batch(item)
                    output = worker.loss(features, batch)
                    loss, metrics = output if isinstance(output, tuple) else (output, {})
                    (loss / self._loss_divisor).backward()
                    for key, value in {"loss": loss, **metrics}.items():
                        sums[key] = sums[key] + value.detach() if key in sums else value.detach().float()
                # Only now, with this stream synchronized, may the target's tensors be freed.
                del item, features, batch, output, loss, self._in_hand[name]
                self._handoff.mark_done(step)
            self._step_sums[replica] = sums
            self._step_barrier.wait()
            if leader:
                with self._busy(name, stream):
                    self._plan_step(step)
            self._step_barrier.wait()
            if not self._plan_complete:
                return
            with self._busy(name, stream):
                for param, grad in zip(params, self._plan_grads[replica]):
                    param.grad = grad
                self._plan_grads[replica] = []  # the replica's .grad is now the only reference
                if not self._plan_skip:  # every replica decides alike: they share the summed gradients
                    worker.optimizer_step()
                for param in params:
                    param.grad = None
            if leader:
                self._steps_done = step + 1
                self._progress += 1
                if self._on_step is not None:
                    self._on_step(self._report)
            if self._plan_stop_after:
                return

    def _plan_step(self, step: int) -> None:
        """Leader only, between the step barriers: decide whether the step counts, and if so reduce it."""
        complete, stop_after = self._handoff.step_complete(step), self._stop_requested
        if self._nodes is not None:
            complete, stop_after = self._nodes.agree(step, complete, stop_after)
            if (stop_after or not complete) and not self._stop_requested:
                self.request_stop()  # another node stops: this one stops with it, at the same step
        self._plan_complete, self._plan_stop_after = complete, stop_after
        self._plan_skip = False
        self._plan_grads = []
        if not self._plan_complete:
            return
        replicas = [w.trainable_parameters() for w in self.drafters]
        grads = [[torch.zeros_like(p) if p.grad is None else p.grad for p in params] for params in replicas]
        devices = self.config.replica_devices
        across = None if self._nodes is None else (lambda total: self._nodes.sum_tensors(step, total))
        self._plan_grads, norm = sum_and_clip_gradients(grads, devices, self.config.grad_clip, across)
        # The sum and copies ran on this thread's streams of every drafter GPU: finish them before the other
        # drafters read their gradients on their own streams.
        for device in {d for d in devices if d.type == "cuda"}:
            torch.cuda.current_stream(device).synchronize()
        sums: dict[str, float] = {}
        for replica_sums in self._step_sums:
            for key, value in replica_sums.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        if self._nodes is not None:  # every node has the same keys: its replicas' loss() metrics
            sums = dict(zip(sorted(sums), self._nodes.sum_numbers(step, [sums[k] for k in sorted(sums)])))
        means = {key: value / self._loss_divisor for key, value in sums.items()}
        loss, grad_norm = means.pop("loss"), float(norm)
        skipped = self._not_finite(loss, grad_norm, self._plan_grads[0])
        self._plan_skip = skipped is not None
        self._report = StepReport(step=step + 1, loss=loss, grad_norm=grad_norm, metrics=means, skipped=skipped)

    def _not_finite(self, loss: float, grad_norm: float, summed: list[torch.Tensor]) -> str | None:
        """What of the step is not finite: the loss, else the first summed gradient that is not (by name when
        the worker names its parameters); None when all is finite. Syncs only when something is not."""
        if not math.isfinite(loss):
            return f"loss ({loss})"
        if math.isfinite(grad_norm):
            return None
        index = next((i for i, grad in enumerate(summed) if not bool(torch.isfinite(grad).all())), None)
        if index is None:  # every gradient finite, their norm not: it overflowed
            return f"gradient norm ({grad_norm})"
        names = getattr(self.drafters[0], "parameter_names", None)
        return f"gradient of {names()[index] if names else f'trainable tensor {index}'}"

