"""The devices a run asks for, checked against this machine, and the dtype it computes in on them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from training.config import ConfigError


def check_devices(devices: Iterable[torch.device]) -> None:
    """Refuse (ConfigError) a CUDA device this machine does not have."""
    for device in devices:
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"{device} requested but CUDA is not available")
        if device.type == "cuda" and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{device} requested but only {torch.cuda.device_count()} GPU(s) are visible")


def compute_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The dtype of the target's weights and of the drafter's autocast: auto = bf16 on CUDA, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, name)


def autocast(device: torch.device | str, dtype: torch.dtype):
    """bf16 autocast over float32 master weights, or nothing when computing in float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


@contextlib.contextmanager
def on_own_stream(device: torch.device) -> Iterator[torch.cuda.Stream | None]:
    """Run the calling thread on `device`, on a stream of its own when it is a GPU (the pipeline's threads, and
    the layout trial's pair: two threads on one GPU overlap only on distinct streams)."""
    if device.type != "cuda":
        yield None
        return
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        yield stream
