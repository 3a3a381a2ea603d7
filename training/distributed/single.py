"""The single node: a run of one process has the interface of a multi-node run's `Nodes` (the null object,
as torchtitan builds its fault-tolerance manager when fault tolerance is off): every collective is the
identity, every wait returns at once, the one node leads. So neither the trainer nor the pipeline asks how
many nodes there are."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch


class SingleNode:
    """Node 0 of 1 (see the module doc); each method is Nodes' for one node."""

    rank, world_size, leader = 0, 1, True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        pass

    def close(self) -> None:
        pass

    def form_group(self, device: torch.device, backend: str = "auto") -> None:
        pass

    def share(self, per_step: int) -> list[int]:
        return list(range(per_step))

    def begin(self, first_step: int) -> None:
        pass

    def stall_timeout_s(self, alone_s: float) -> float:
        return alone_s

    def check_same(self, fingerprint: Callable[[], dict[str, Any]]) -> None:
        """Nothing to compare with (and the fingerprint, a sum over every weight, is not computed)."""

    @contextlib.contextmanager
    def resume_from(self, checkpoint: Path | None, into: Path) -> Iterator[Path | None]:
        yield checkpoint

    def agree(self, step: int, complete: bool, stop: bool) -> tuple[bool, bool]:
        return complete, stop

    def any_stops(self, stop: bool) -> bool:
        return stop

    def sum_numbers(self, step: int, values: list[float]) -> list[float]:
        return values

    def sum_tensors(self, step: int, tensors: list[torch.Tensor]) -> None:
        pass

    def take_all_reduce_ms(self) -> float | None:
        return None

    def gather(self, value: Any, what: str, check: Callable[[int], Callable[[Any], None]]) -> list[Any]:
        return [value]

    def combine_figures(self, step: int, tokens_per_s: float, tflops_per_s: float,
                        busy: dict[str, float]) -> tuple[float, float, dict[str, Any]]:
        return tokens_per_s, tflops_per_s, {}

    def wait_for_leader(self, what: str) -> None:
        pass
