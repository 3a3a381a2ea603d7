"""The step boundary's arithmetic: batches moved between devices, the replicas' gradients summed and clipped."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.cuda.comm  # a submodule torch 2.11 does not import by itself

from training.pipeline.interface import DrafterWorker

# Gradient buckets for the NCCL reduce/broadcast: a 1 B-parameter drafter is then a few dozen calls.
_COMM_BUCKET_BYTES = 256 * 2**20


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
    across_nodes: Callable[[list[torch.Tensor]], None] = lambda total: None, scale: float = 1.0,
) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Sum per-replica gradient lists onto replica 0's device, clip the sum like clip_grad_norm_, and give
    every replica its own copy of the result.

    Returns (one gradient list per replica, the pre-clip total norm). On distinct GPUs this is an NCCL
    reduce + broadcast (torch.cuda.comm); otherwise (CPU, or replicas sharing a GPU) a plain sum in replica
    order. `across_nodes` (for one node: nothing), in a multi-node run, sums this process's sum with the other nodes' (in place),
    before the norm: every node then clips the same global sum. `scale` multiplies the global sum before the
    norm (the step's 1 / total loss weight: the gradient of a weighted mean over the whole step).
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
    across_nodes(total)
    if scale != 1.0:
        torch._foreach_mul_(total, scale)
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
