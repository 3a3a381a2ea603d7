"""Shared fixtures for the trainer tests: few CPU threads, `gpu` tests skipped without CUDA, one tiny world per
session."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@dataclass
class TinyWorld:
    target: Path
    train: Path
    eval: Path

    def overrides(self, output_dir: Path) -> list[str]:
        """--set arguments pointing the tiny preset at this world and a private output dir."""
        return [f"target_path={self.target}", f"data_path={self.train}", f"eval_data_path={self.eval}",
                f"output_dir={output_dir}"]


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> TinyWorld:
    """The tiny random target and its generated data, built once (the tiny preset's own builder)."""
    from training.tiny import ensure_tiny

    root = tmp_path_factory.mktemp("tiny-world")
    world = TinyWorld(root / "target", root / "train.jsonl", root / "eval.jsonl")
    ensure_tiny(str(world.target), str(world.train), str(world.eval))
    return world


@pytest.fixture(autouse=True)
def _no_inherited_metrics_path(monkeypatch):
    """Runs in tests write metrics under their output_dir unless a test sets $GPUCTL_METRICS itself."""
    monkeypatch.delenv("GPUCTL_METRICS", raising=False)


@pytest.fixture
def reference_timer_on_the_cpu(monkeypatch):
    """The reference dflash loop times itself with torch.cuda.synchronize, which the CPU build of torch refuses."""
    if not torch.cuda.is_available():
        from dflash import model as reference

        monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)


@pytest.fixture(scope="module")
def target(tiny_world):
    """The tiny target, float32 on the CPU, once per module."""
    from training.target import Target

    return Target.load(str(tiny_world.target), "cpu", torch.float32)
