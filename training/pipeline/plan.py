"""The step plan: what the leader replica decides at each step boundary, between the step barriers. Whether the
step counts (every node agrees it completed, and whether any stops after it), and if it does, its gradients
summed over replicas and nodes and clipped, its loss and metrics, and whether any of it is not finite."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from training.pipeline.gradients import sum_and_clip_gradients
from training.pipeline.interface import (
    AcrossNodes,
    DrafterWorker,
    PipelineConfig,
    StepGradients,
    StepPlan,
    StepReport,
)


class StepPlanner:
    """The leader replica's decision for a step, the same on every node (the collectives run in one order)."""

    def __init__(self, config: PipelineConfig, drafters: Sequence[DrafterWorker], nodes: AcrossNodes):
        self.config = config
        self.drafters = drafters
        self.nodes = nodes
        self.loss_divisor = config.global_micro_batches_per_step or config.micro_batches_per_step

    def plan(self, step: int, complete_here: bool, stop_requested: Callable[[], bool],
             request_stop: Callable[[], None], step_sums: list[dict[str, torch.Tensor]]) -> StepPlan:
        """`complete_here`: this node did every micro-batch of the step; `step_sums`: each replica's sums."""
        complete, stop_after = self.nodes.agree(step, complete_here, stop_requested())
        if (stop_after or not complete) and not stop_requested():
            request_stop()  # another node stops: this one stops with it, at the same step
        if not complete:
            return StepPlan(complete=False, stop_after=stop_after)
        sums: dict[str, float] = {}
        for replica_sums in step_sums:
            for key, value in replica_sums.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        # Every node has the same keys: its replicas' loss() metrics, the loss and its weight.
        sums = dict(zip(sorted(sums), self.nodes.sum_numbers(step, [sums[k] for k in sorted(sums)])))
        weight = max(sums.pop("weight"), 1e-12)
        replicas = [w.trainable_parameters() for w in self.drafters]
        grads = [[torch.zeros_like(p) if p.grad is None else p.grad for p in params] for params in replicas]
        devices = self.config.replica_devices
        summed, norm = sum_and_clip_gradients(grads, devices, self.config.grad_clip,
                                              lambda total: self.nodes.sum_tensors(step, total), 1.0 / weight)
        # The sum and copies ran on this thread's streams of every drafter GPU: finish them before the other
        # drafters read their gradients on their own streams.
        for device in {d for d in devices if d.type == "cuda"}:
            torch.cuda.current_stream(device).synchronize()
        loss, grad_norm = sums.pop("loss") / weight, float(norm)
        means = {key: value / self.loss_divisor for key, value in sums.items()}
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
