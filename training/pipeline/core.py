"""The pipeline's threads (see training/pipeline/__init__.py for what keeps them correct)."""

from __future__ import annotations

import math
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from training.devices import on_own_stream
from training.distributed.single import SingleNode
from training.pipeline.gradients import check_replicas_identical, move_to_device, sum_and_clip_gradients
from training.pipeline.handoff import BusyClocks, Handoff
from training.pipeline.interface import (
    AcrossNodes,
    DrafterWorker,
    PipelineConfig,
    PipelineError,
    PipelineStalled,
    RunResult,
    StepGradients,
    StepPlan,
    StepReport,
    TargetWorker,
    Utilisation,
)

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
        self._nodes = nodes  # the other processes of a multi-node run, or the single node
        self._handoff = Handoff(
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
        self._clocks = BusyClocks(names)
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
        # Made by the leader replica between the two step barriers, read by every replica after the second.
        self._plan = StepPlan(complete=False, stop_after=False)

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
            with on_own_stream(device) as stream:
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
                    self._plan = self._plan_step(step)
            self._step_barrier.wait()
            plan = self._plan
            if not plan.complete:
                return
            with self._busy(name, stream):
                for param, grad in zip(params, plan.gradients.take(replica)):
                    param.grad = grad  # the replica's .grad is now the only reference
                if not plan.skip:  # every replica decides alike: they share the summed gradients
                    worker.optimizer_step()
                for param in params:
                    param.grad = None
            if leader:
                self._steps_done = step + 1
                self._progress += 1
                if self._on_step is not None:
                    self._on_step(plan.report)
            if plan.stop_after:
                return

    def _plan_step(self, step: int) -> StepPlan:
        """Leader only, between the step barriers: decide whether the step counts, and if so reduce it."""
        complete, stop_after = self._nodes.agree(step, self._handoff.step_complete(step), self._stop_requested)
        if (stop_after or not complete) and not self._stop_requested:
            self.request_stop()  # another node stops: this one stops with it, at the same step
        if not complete:
            return StepPlan(complete=False, stop_after=stop_after)
        replicas = [w.trainable_parameters() for w in self.drafters]
        grads = [[torch.zeros_like(p) if p.grad is None else p.grad for p in params] for params in replicas]
        devices = self.config.replica_devices
        summed, norm = sum_and_clip_gradients(grads, devices, self.config.grad_clip,
                                              lambda total: self._nodes.sum_tensors(step, total))
        # The sum and copies ran on this thread's streams of every drafter GPU: finish them before the other
        # drafters read their gradients on their own streams.
        for device in {d for d in devices if d.type == "cuda"}:
            torch.cuda.current_stream(device).synchronize()
        sums: dict[str, float] = {}
        for replica_sums in self._step_sums:
            for key, value in replica_sums.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        # Every node has the same keys: its replicas' loss() metrics.
        sums = dict(zip(sorted(sums), self._nodes.sum_numbers(step, [sums[k] for k in sorted(sums)])))
        means = {key: value / self._loss_divisor for key, value in sums.items()}
        loss, grad_norm = means.pop("loss"), float(norm)
        skipped = self._not_finite(loss, grad_norm, summed[0])
        report = StepReport(step=step + 1, loss=loss, grad_norm=grad_norm, metrics=means, skipped=skipped)
        return StepPlan(complete=True, stop_after=stop_after, skip=skipped is not None,
                        gradients=StepGradients(summed), report=report)

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


