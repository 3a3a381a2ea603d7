"""What must be alike on every node of a run, and how a node differs from node 0, in words."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch

from training.distributed.env import PER_NODE_KEYS


def tensor_sums(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, tuple[float, float]]:
    """Each tensor's sum and sum of magnitudes, in float64: equal weights give sums equal within a rounding
    bound whatever the device and its order of addition, a different model does not (read where the weights
    live: an 8 B target is milliseconds on a GPU, where hashing its files is minutes)."""
    return {name: (float(t.detach().sum(dtype=torch.float64)),
                   float(torch.linalg.vector_norm(t.detach(), 1, dtype=torch.float64))) for name, t in named}


def run_fingerprint(config: dict[str, Any], data_id: dict[str, Any], target_config: dict,
                    target_weights: dict[str, tuple[float, float]],
                    drafter_weights: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """What must be alike on every node of a run (Nodes.check_same)."""
    shared = {key: value for key, value in config.items() if key not in PER_NODE_KEYS}
    target = hashlib.sha256(json.dumps(target_config, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"config": shared, "data": data_id, "target": target, "target_weights": target_weights,
            "drafter_weights": drafter_weights}


def fingerprint_difference(first: dict[str, Any], theirs: dict[str, Any], rel_tol: float = 1e-7) -> str | None:
    """How `theirs` differs from node 0's `first`, in words; None when alike."""
    for key in sorted(set(first["config"]) | set(theirs["config"])):
        if first["config"].get(key) != theirs["config"].get(key):
            return (f"has {key}={theirs['config'].get(key)!r} where node 0 has {first['config'].get(key)!r} "
                    "in its training config")
    for key in sorted(set(first["data"]) | set(theirs["data"])):
        if first["data"].get(key) != theirs["data"].get(key):
            return (f"reads other training data than node 0 ({key}: {theirs['data'].get(key)!r} vs "
                    f"{first['data'].get(key)!r})")
    if first["target"] != theirs["target"]:
        return "has another target model config than node 0"
    for what in ("target_weights", "drafter_weights"):
        if list(first[what]) != list(theirs[what]):
            return f"has other {what.replace('_', ' ')} than node 0 (other tensor names)"
        for name, (value, magnitude) in first[what].items():
            other, other_magnitude = theirs[what][name]
            # Float64 sums of the same values in another order differ by far less than 1e-7 of their magnitude.
            if abs(other - value) > rel_tol * max(magnitude, other_magnitude, 1e-30):
                return f"has other {what.replace('_', ' ')} than node 0 ({name}: sum {other!r} vs {value!r})"
    return None
