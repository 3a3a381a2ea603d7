"""The run records, read through a container's connection: one call to the container's inspect.sh, which
reports the records (and what else is asked for: GPUs, a log's end, the loss history) in one reply."""

from __future__ import annotations

from gpuctl.remote.container import Container
from gpuctl.remote.protocol import Inspection


def inspect(ct: Container, run_number: int = 0, *, all_runs: bool = False, gpus: bool = False,
            tail_lines: int = 0, rest_from: int | None = None, history: int = 0, queue: bool = False) -> Inspection:
    """The run records (and what else is asked for) as inspect.sh reports them."""
    return ct.call("inspect", Inspection, "reading the run records", run_number=run_number, all_runs=all_runs,
                   gpus=gpus, tail_lines=tail_lines, rest_from=rest_from, history=history, queue=queue)
