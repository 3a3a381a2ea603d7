"""The pipeline's worker threads: one per target, drafter and colocated device entry. Each warms its workers up
on its own device and meets the others (then steady state begins), works micro-batches through the handoff, and
the replicas meet at each step boundary, where the leader makes the step's plan and every replica follows it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from training.layout.devices import on_own_stream
from training.pipeline.gradients import move_to_device
from training.pipeline.handoff import BusyClocks, Handoff
from training.pipeline.interface import DrafterWorker, PipelineConfig, StepPlan, StepReport, TargetWorker
from training.pipeline.plan import StepPlanner


class PipelineThreads:
    """The threads of one pipeline run and what they share: the barriers, each replica's step sums, the plan.

    `fail(thread, error)` ends the run (every thread stops); `failed()` says whether it has; `stop_requested()`
    and `request_stop()` are the pipeline's stop at the next step boundary; `on_step(steps_done, report)` runs in
    the leader's thread after every step it took."""

    def __init__(self, config: PipelineConfig, targets: Sequence[TargetWorker], drafters: Sequence[DrafterWorker],
                 colocated_targets: Sequence[TargetWorker], handoff: Handoff, planner: StepPlanner, *,
                 start_step: int, max_steps: int, on_step: Callable[[int, StepReport], None],
                 on_steady: Callable[[], None] | None, fail: Callable[[str, BaseException], None],
                 failed: Callable[[], bool], stop_requested: Callable[[], bool], request_stop: Callable[[], None]):
        self.config = config
        self.targets, self.drafters, self.colocated_targets = targets, drafters, colocated_targets
        self._handoff, self._planner = handoff, planner
        self._start_step, self._max_steps = start_step, max_steps
        self._on_step, self._on_steady = on_step, on_steady
        self._fail, self._failed = fail, failed
        self._stop_requested, self._request_stop = stop_requested, request_stop
        self.target_names = [f"target{i}" for i in range(len(config.target_devices))]
        self.drafter_names = [f"drafter{i}" for i in range(len(config.drafter_devices))]
        self.colocated_names = [f"colocated{i}" for i in range(len(config.colocated_devices))]
        names = self.target_names + self.drafter_names + self.colocated_names
        self.clocks = BusyClocks(names)
        self.devices = dict(zip(names, [*config.target_devices, *config.drafter_devices,
                                        *config.colocated_devices]))
        self.in_hand: dict[str, Any] = {}  # thread -> the micro-batch (from the source) it works on now
        self.progress = 0  # grows with every piece of work done: the watchdog's sign of life
        self.steady = False  # every thread has passed warm-up
        replicas = len(config.replica_devices)
        self._ready_barrier = threading.Barrier(len(config.target_devices) + replicas,
                                                action=self._start_steady_state)
        self._step_barrier = threading.Barrier(replicas)
        # Per replica: the step's summed loss and companion metrics, read by the leader at the step boundary.
        self._step_sums: list[dict[str, torch.Tensor]] = [{} for _ in range(replicas)]
        # Made by the leader replica between the two step barriers, read by every replica after the second.
        self._plan = StepPlan(complete=False, stop_after=False)

    def threads(self) -> list[threading.Thread]:
        """One daemon thread per device entry, not started (a thread stuck inside a device call must not keep
        the process alive)."""
        roles = [
            (self.target_names, self.config.target_devices, self._target_loop),
            (self.drafter_names, self.config.drafter_devices, self._drafter_loop),
            (self.colocated_names, self.config.colocated_devices, self._colocated_loop),
        ]
        return [threading.Thread(target=self._thread_main, args=(name, device, loop, i), name=name, daemon=True)
                for names, devices, loop in roles
                for i, (name, device) in enumerate(zip(names, devices))]

    def abort(self) -> None:
        """Every thread waiting at a barrier, or coming to one, ends (BrokenBarrierError)."""
        self._ready_barrier.abort()
        self._step_barrier.abort()

    def _thread_main(self, name: str, device: torch.device, loop: Callable, index: int) -> None:
        try:
            with on_own_stream(device) as stream:
                loop(name, device, stream, index)
        except threading.BrokenBarrierError:
            if not self._failed():
                self._fail(name, RuntimeError("a pipeline barrier broke without an error"))
        except BaseException as error:  # noqa: BLE001 - every failure must reach the main thread
            self._fail(name, error)

    def _start_steady_state(self) -> None:
        self.steady = True
        self.clocks.take_window()
        self._handoff.take_depth_window()
        if self._on_steady is not None:
            self._on_steady()

    @contextmanager
    def _busy(self, name: str, stream: torch.cuda.Stream | None):
        self.clocks.start(name)
        try:
            yield
            if stream is not None:
                stream.synchronize()  # busy means device work: the span ends when the device is done
        finally:
            self.clocks.stop(name)
            self.progress += 1

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
            self.in_hand[name] = batch
            with self._busy(name, stream), torch.no_grad():
                features = worker.features(batch)
            del self.in_hand[name]
            self._handoff.publish(key, (features, batch))

    def _drafter_loop(self, name: str, device: torch.device, stream, index: int) -> None:
        """A drafter replica on the target threads' features."""
        worker = self.drafters[index]
        self._warm_up_and_meet(worker)

        def next_micro_batch(step: int) -> Any | None:
            micro = self._handoff.claim_for_drafter(step)
            item = None if micro is None else self._handoff.take((step, micro))
            if item is not None:
                self.in_hand[name] = item[1]  # the source's batch (its features are the target's output)
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
                self.in_hand[name] = claim[1]
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
                    # The step's loss is sum(loss) / sum(weight) over every micro-batch of every replica and
                    # node (the interface's contract): the gradient of this sum is divided by that total at
                    # the step boundary, so how a step is split changes nothing.
                    loss.backward()
                    weight = metrics.pop("weight", None)
                    weight = torch.ones((), device=loss.device) if weight is None else weight
                    for key, value in {"loss": loss, "weight": weight, **metrics}.items():
                        sums[key] = sums[key] + value.detach() if key in sums else value.detach().float()
                # Only now, with this stream synchronized, may the target's tensors be freed.
                del item, features, batch, output, loss, self.in_hand[name]
                self._handoff.mark_done(step)
            self._step_sums[replica] = sums
            self._step_barrier.wait()
            if leader:
                with self._busy(name, stream):
                    self._plan = self._planner.plan(step, self._handoff.step_complete(step), self._stop_requested,
                                                    self._request_stop, self._step_sums)
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
                self.progress += 1
                self._on_step(step + 1, plan.report)
            if plan.stop_after:
                return
