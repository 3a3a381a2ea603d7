"""Shared fixtures for the trainer tests: few CPU threads, `gpu` tests skipped without CUDA, the tiny target once
per module (the tiny world itself, `tiny_world`, is tests/conftest.py's: the CLI tests seed containers with it)."""

from __future__ import annotations

import time

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
    from training.target.frozen import Target

    return Target.load(str(tiny_world.target), "cpu", torch.float32)
