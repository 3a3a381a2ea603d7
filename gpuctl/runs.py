"""Run records and what follows from them: run ids, states, progress (ARCHITECTURE §2-3).

A run record is the JSON file /workspace/.gpuctl/tlN.json written by the launch script and completed by the
run's wrapper (pid, process group, start time, exit code) and by `gpuctl kill` (killed_signal). Whether the run
still lives is read from its lock, which the launch passes on to the wrapper and the trainer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from typing import Any

from gpuctl.errors import usage_error

# Linux's numbers, not the workstation's (macOS numbers USR1 differently): the run is on Linux.
LINUX_SIGNALS = {"HUP": 1, "INT": 2, "QUIT": 3, "KILL": 9, "USR1": 10, "USR2": 12, "TERM": 15}
RUN_REF = re.compile(r"^(?:tl)?(\d+)$")


class State(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    KILLED = "killed"
    LOST = "lost"  # the process is gone and left no exit record

    @property
    def active(self) -> bool:
        return self in (State.STARTING, State.RUNNING)


def parse_run_ref(text: str | None) -> int:
    """`7` or `tl7` -> 7; None -> 0, meaning the latest run."""
    if text is None:
        return 0
    m = RUN_REF.match(text.strip())
    if not m or int(m[1]) == 0:
        raise usage_error(f"--run takes a run number like 7 or tl7, got {text!r}")
    return int(m[1])


def parse_signal(name: str) -> str:
    """`TERM`, `SIGTERM`, `term` or `15` -> `TERM`."""
    text = name.strip().upper().removeprefix("SIG")
    by_number = {str(v): k for k, v in LINUX_SIGNALS.items()}
    text = by_number.get(text, text)
    if text not in LINUX_SIGNALS:
        raise usage_error(f"--signal must be one of {', '.join(LINUX_SIGNALS)}, got {name!r}")
    return text


def iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, tz=timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Progress:
    step: int
    total_steps: int | None
    loss: float | None
    tokens_per_s: float | None
    eta_s: float | None

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "total_steps": self.total_steps, "loss": self.loss,
                "tokens_per_s": self.tokens_per_s, "eta_s": self.eta_s}


def parse_metrics_lines(text: bytes) -> list[dict[str, Any]]:
    """The records of a metrics file (JSON lines); a line being written as it was read is left out."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def parse_progress(first: bytes | None, last: bytes | None, active: bool) -> Progress | None:
    """Progress from the first and last lines of the run's metrics file (one JSON object per logged step).

    The ETA uses the rate between the two lines, so it holds whether `time` is elapsed or wall-clock seconds.
    """
    try:
        head, tail = json.loads(first or b"null"), json.loads(last or b"null")
    except ValueError:
        return None  # a line being written as we read it
    if not isinstance(tail, dict) or not isinstance(tail.get("step"), int):
        return None
    step, total = tail["step"], tail.get("total_steps")
    eta = None
    if active and isinstance(total, int) and isinstance(head, dict):
        steps = step - head.get("step", step)
        seconds = (tail.get("time") or 0) - (head.get("time") or 0)
        if steps > 0 and seconds > 0:
            eta = round(max(total - step, 0) * seconds / steps, 1)
    return Progress(step=step, total_steps=total, loss=tail.get("loss"), tokens_per_s=tail.get("tokens_per_s"),
                    eta_s=eta)


@dataclass(frozen=True)
class Run:
    number: int
    record: dict[str, Any]
    alive: bool
    log_size: int | None = None  # None: not asked; -1 in the remote output means the log is gone
    progress: Progress | None = None
    now: float | None = None  # the container's clock when it was asked

    @property
    def run_id(self) -> str:
        return f"tl{self.number}"

    @property
    def task(self) -> str:
        """What the run does: "train" (a training run), or "setup" (gpuctl setup's installation)."""
        return self.record.get("task") or "train"

    @property
    def exit_code(self) -> int | None:
        return self.record.get("exit_code")

    @property
    def state(self) -> State:
        if self.exit_code is not None:
            if self.record.get("killed_signal"):
                return State.KILLED
            return State.SUCCEEDED if self.exit_code == 0 else State.FAILED
        if self.alive:
            return State.RUNNING if "pid" in self.record else State.STARTING
        return State.KILLED if self.record.get("killed_signal") else State.LOST

    @property
    def started_at(self) -> float | None:
        return self.record.get("started_at", self.record.get("launched_at"))

    @property
    def elapsed_s(self) -> float | None:
        end = self.record.get("ended_at", self.now)
        if self.started_at is None or end is None:
            return None
        return round(max(end - self.started_at, 0.0), 1)

    @property
    def log_path(self) -> str | None:
        return self.record.get("log_path")

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "state": self.state.value,
            "exit_code": self.exit_code,
            "pid": self.record.get("pid"),
            "pgid": self.record.get("pgid"),
            "started_at": iso(self.started_at),
            "ended_at": iso(self.record.get("ended_at")),
            "elapsed_s": self.elapsed_s,
            "log_path": self.log_path,
            "log_size": self.log_size if self.log_size is None or self.log_size >= 0 else None,
            "progress": self.progress.to_json() if self.progress else None,
            "config": self.record.get("config"),
            "killed_signal": self.record.get("killed_signal"),
            "resumed_from": f"tl{self.record['resumed_from']}" if self.record.get("resumed_from") else None,
            "task": self.task,
            "python": self.record.get("python"),
        }
