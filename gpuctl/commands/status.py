"""`gpuctl status`, `runs` and `plot`'s data: one container's run, its progress and GPUs; every run; a run's
metrics with the runs it resumed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuctl.commands.records import inspect
from gpuctl.errors import ExitCode, GpuctlError
from gpuctl.remote import scripts
from gpuctl.remote.container import Container, ContainerNotRunning
from gpuctl.remote.protocol import TAIL_BYTES, MetricsChain
from gpuctl.runs import Run, number, parse_metrics_lines

LOSS_HISTORY_POINTS = 60  # losses `status` fetches for its sparkline


@dataclass
class Gpu:
    index: int
    name: str
    utilization: int | None
    memory_used_mib: int | None
    memory_total_mib: int | None

    def to_json(self) -> dict:
        return dict(self.__dict__)


def parse_gpus(csv: bytes | None) -> list[Gpu]:
    """nvidia-smi --query-gpu=index,name,utilization.gpu,memory.used,memory.total --format=csv,noheader,nounits"""

    def number(text: str) -> int | None:
        return int(text) if text.strip().isdigit() else None  # "[N/A]" on some boards

    gpus = []
    for line in (csv or b"").decode(errors="replace").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 5 and parts[0].isdigit():
            gpus.append(Gpu(int(parts[0]), parts[1], number(parts[2]), number(parts[3]), number(parts[4])))
    return gpus


@dataclass
class StatusReport:
    ctid: int
    host: str
    container_status: str  # "running", or "stopped" (then nothing inside it could be read)
    run: Run | None
    gpus: list[Gpu]
    losses: list[float] = field(default_factory=list)  # a sample of the run's losses, oldest first
    last_line: str | None = None  # the log's last line (asked for: a multi-node run's node)
    gpus_error: str | None = None  # why there is no GPU table: nvidia-smi did not answer in time
    ct_origin: str = ""  # where the container's number came from, when the remembered target gave it
    queue: list[int] = field(default_factory=list)  # launch --queue's runs waiting their turn, in order

    def to_json(self) -> dict:
        keys = ("run_id", "name", "state", "exit_code", "pid", "pgid", "started_at", "queued_at", "ended_at",
                "elapsed_s", "log_path", "log_size", "progress", "config", "sets", "killed_signal", "failure",
                "resumed_from", "task", "python", "record_problem",
                "attempt", "attempts_left", "retry_of", "attempts", "last_failure", "retried_as", "retry_stopped")
        doc = self.run.to_json() if self.run else dict.fromkeys(keys)
        doc["gpus"] = [g.to_json() for g in self.gpus]
        doc["gpus_error"] = self.gpus_error
        doc["queue"] = [f"tl{n}" for n in self.queue]
        doc["container"] = {"ctid": self.ctid, "status": self.container_status, "host": self.host}
        return doc

    def unreadable(self) -> GpuctlError | None:
        """The container not running, as the error gpuctl status exits with (after showing that)."""
        if self.container_status == "running":
            return None
        return GpuctlError(f"container {self.ctid}{self.ct_origin} on {self.host} is not running "
                           f"({self.container_status}; start it: pct start {self.ctid})", ExitCode.CONTAINER)


def prepare_status() -> None:
    """What status() needs of this machine ready before it runs: its script compiled (while connecting)."""
    scripts.compile_ahead("inspect.sh", "lib.sh")


def status(ct: Container, run_number: int = 0, last_line: bool = False) -> StatusReport:
    try:
        inspection = inspect(ct, run_number, gpus=True, history=LOSS_HISTORY_POINTS, tail_lines=int(last_line),
                             queue=True)
    except ContainerNotRunning:
        return StatusReport(ctid=ct.ctid, host=ct.host, container_status="stopped", run=None, gpus=[],
                            ct_origin=ct.address.remembered("ct"))
    run = inspection.runs[0] if inspection.runs else None
    history = parse_metrics_lines(inspection.histories.get(run.number, b"")) if run else []
    by_step = {r["step"]: r["loss"] for r in history if number(r.get("loss")) is not None}  # last line twice
    losses = [by_step[step] for step in sorted(by_step)]
    tail = inspection.tails.get(run.number, b"") if run else b""
    line = shown_line(tail.decode(errors="replace").strip(), cut=len(tail) >= TAIL_BYTES)
    return StatusReport(ctid=ct.ctid, host=ct.host, container_status="running", run=run,
                        gpus=parse_gpus(inspection.gpus_csv), losses=losses, last_line=line or None,
                        gpus_error=inspection.gpus_error, queue=inspection.queue)


def shown_line(tail: str, cut: bool) -> str:
    """A log's last line, exactly, when the container's bounded tail holds all of it; when the bound cut it (a
    trainer's progress bars and no newline for megabytes), what follows its last carriage return: the bar a
    terminal shows, not the bound's worth of bars before it."""
    if not cut:
        return tail
    bars = [bar for bar in tail.split("\r") if bar.strip()]
    return bars[-1].strip() if bars else ""


def list_runs(ct: Container) -> list[Run]:
    return inspect(ct, all_runs=True).runs


@dataclass
class ContainerRuns:
    """`gpuctl runs` of one container: every run, and where."""

    runs: list[Run]
    ctid: int
    host: str
    errors: list[GpuctlError] = field(default_factory=list)  # none: one container's failure is raised


@dataclass
class MetricsHistory:
    """A run's metrics records, with those of the runs it resumed (oldest run first)."""

    runs: list[Run]
    records: list[dict[str, Any]]  # by step; a resumed run's records replace its predecessor's from its first step
    resumed_at: list[float]  # where each resumed run took over: between its predecessor's last step and its first


def metrics_history(ct: Container, run_number: int = 0) -> MetricsHistory:
    chain = ct.call("metrics", MetricsChain, "reading the metrics", run_number=run_number).links
    records: list[dict] = []
    resumed_at = []
    for i, (_, lines) in enumerate(chain):
        steps = [r["step"] for r in lines]
        if i and steps:
            records = [r for r in records if r["step"] < min(steps)]
            before = max((r["step"] for r in records), default=min(steps) - 1)
            resumed_at.append((before + min(steps)) / 2)
        records += lines
    return MetricsHistory([run for run, _ in chain], records, resumed_at)

