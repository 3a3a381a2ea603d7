"""The pipeline from the main thread: it builds the handoff, the step plan and the threads, starts them, and
supervises them to the end (a stop, a Ctrl-C, a stall); see training/pipeline/__init__.py for what keeps them
correct."""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from training.distributed.single import SingleNode
from training.pipeline.gradients import check_replicas_identical
from training.pipeline.handoff import Handoff
from training.pipeline.interface import (
    AcrossNodes,
    DrafterWorker,
    PipelineConfig,
    PipelineError,
    PipelineStalled,
    RunResult,
    StepReport,
    TargetWorker,
    Utilisation,
)
from training.pipeline.plan import StepPlanner
from training.pipeline.threads import PipelineThreads

_ONE_NODE = SingleNode()  # a run of one process: every collective is the identity


def _check_shape(config: PipelineConfig, targets: Sequence[TargetWorker], drafters: Sequence[DrafterWorker],
                 colocated: Sequence[tuple[TargetWorker, DrafterWorker]]) -> None:
    """Refuse (ValueError) a pipeline whose roles cannot work together, or whose workers do not match them."""
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
        nodes: AcrossNodes = _ONE_NODE,
    ):
        _check_shape(config, targets, drafters, colocated)
        self.config = config
        # Every drafter replica, in replica order: the leader (replica 0) logs and checkpoints.
        self.drafters = [*drafters, *(drafter for _, drafter in colocated)]
        self._start_step = start_step
        self._max_steps = max(max_steps, start_step)
        self._on_step = on_step
        per_step = config.micro_batches_per_step
        self._handoff = Handoff(micro_batches, (self._max_steps - start_step) * per_step, per_step, start_step,
                                config.queue_depth)
        self._error: tuple[str, BaseException] | None = None
        self._error_lock = threading.Lock()
        self._stop_requested = False
        self._steps_done = start_step
        self._threads = PipelineThreads(
            config, list(targets), self.drafters, [target for target, _ in colocated], self._handoff,
            StepPlanner(config, self.drafters, nodes), start_step=start_step, max_steps=self._max_steps,
            on_step=self._step_done, on_steady=on_steady, fail=self._fail, failed=lambda: self.failed,
            stop_requested=lambda: self._stop_requested, request_stop=self.request_stop)

    # Control, from any thread.
    def request_stop(self) -> None:
        """Stop at the next step boundary (finish the current step if all its micro-batches are done)."""
        self._stop_requested = True
        self._handoff.stop(abort=False)

    @property
    def failed(self) -> bool:
        """A thread failed (or the run was aborted): every thread is ending."""
        return self._error is not None

    def utilisation(self) -> Utilisation:
        """Busy fractions and queue depth since the previous call (or since steady state began)."""
        _, busy = self._threads.clocks.take_window()
        mean, peak = self._handoff.take_depth_window()
        return Utilisation(busy, mean, peak, self.config.queue_depth)

    def _fail(self, thread: str, error: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = (thread, error)
        self._handoff.stop(abort=True)
        self._threads.abort()

    def _step_done(self, steps_done: int, report: StepReport) -> None:
        """In the leader replica's thread, after each step it took."""
        self._steps_done = steps_done
        if self._on_step is not None:
            self._on_step(report)

    # The main thread.
    def run(self, stop: Callable[[], str | None] | None = None) -> RunResult:
        """Run every thread to the end; raises PipelineError when any of them failed.

        `stop`, polled by this thread about every 0.2 s, returns why to stop (e.g. "SIGTERM") or None: a reason
        stops the run at the next step boundary. A KeyboardInterrupt here aborts every thread (PipelineError).
        """
        if self._max_steps == self._start_step:
            return RunResult(self._start_step, stopped=False)
        check_replicas_identical(self.drafters)
        threads = self._threads.threads()
        try:
            for thread in threads:
                thread.start()
        except KeyboardInterrupt as interrupt:
            self._fail(threading.current_thread().name, interrupt)
        self._supervise(threads, stop)
        if self._error is not None:
            thread, error = self._error
            raise PipelineError(thread, error, [t.name for t in threads if t.is_alive()],
                                self._threads.devices.get(thread), self._threads.in_hand.get(thread))
        return RunResult(self._steps_done, stopped=self._stop_requested and self._steps_done < self._max_steps)

    def _supervise(self, threads: list[threading.Thread], stop: Callable[[], str | None] | None) -> None:
        """Until every thread has ended (after an abort, at most abort_grace_s more): act on `stop`, on a
        KeyboardInterrupt, and on a stall."""
        last_progress, last_change = self._threads.progress, time.monotonic()
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
                if self._threads.progress != last_progress:
                    last_progress, last_change = self._threads.progress, now
                elif not self._threads.steady:
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
