"""Run records and what follows from them: run ids, states, progress (ARCHITECTURE §2-3).

A run record is the JSON file /workspace/.gpuctl/tlN.json written by the launch script and completed by the
run's wrapper (pid, process group, start time, exit code) and by `gpuctl kill` (killed_signal). Whether the run
still lives is read from its lock, which the launch passes on to the wrapper and the trainer.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from typing import Any

from gpuctl.errors import usage_error
from gpuctl.paths import RECORDS_DIR

# Linux's numbers, not the workstation's (macOS numbers USR1 differently): the run is on Linux.
LINUX_SIGNALS = {"HUP": 1, "INT": 2, "QUIT": 3, "KILL": 9, "USR1": 10, "USR2": 12, "TERM": 15}
RUN_REF = re.compile(r"^(?:tl)?(\d+)$")
# A run's name (launch --name): a short slug that cannot be read as a run number or an option, and that the
# container's scripts match in a record's JSON text as it is (no character JSON or a shell pattern escapes).
RUN_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
RunRef = int | str  # a run number (0: the latest run), or a run's name


class PullWhat(str, Enum):
    """What of a run `gpuctl pull` brings."""

    EXPORT = "export"
    CHECKPOINT = "checkpoint"
    METRICS = "metrics"
    DATA = "data"  # a regenerate run's output file


class State(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    KILLED = "killed"
    LOST = "lost"  # the process is gone and left no exit record
    RETRYING = "retrying"  # `launch --retry`: an attempt failed; the wrapper waits out the delay before the next
    QUEUED = "queued"  # `launch --queue`: its wrapper waits in the container for the runs ahead of it to end

    @property
    def active(self) -> bool:
        return self in (State.STARTING, State.RUNNING, State.RETRYING, State.QUEUED)


def parse_run_ref(text: str | None, option: str = "--run") -> RunRef:
    """`7` or `tl7` -> 7; a run's name as it is (the container looks it up: lib.sh's select_run); None -> 0,
    meaning the latest run."""
    if text is None:
        return 0
    m = RUN_REF.fullmatch(text.strip())
    if m and int(m[1]) > 0:
        return int(m[1])
    if not m and RUN_NAME.fullmatch(text.strip()):
        return text.strip()
    raise usage_error(f"{option} takes a run number like 7 or tl7, or a run's name (launch --name), got {text!r}")


def is_run_ref(text: str) -> bool:
    """Whether text names a run (a number or a name), so `launch --resume TEXT` continues it."""
    return bool(RUN_REF.fullmatch(text) or RUN_NAME.fullmatch(text))


def check_run_name(name: str) -> str:
    """launch --name: a slug (a lowercase letter, then up to 31 of a-z, 0-9, '_', '-') that no run id shadows."""
    if not RUN_NAME.fullmatch(name) or RUN_REF.fullmatch(name):
        raise usage_error(f"--name takes a short slug (a lowercase letter, then up to 31 of a-z 0-9 _ -, not tlN), "
                          f"got {name!r}")
    return name


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


# What a run's record (`.gpuctl/tlN.json`, written in the container) may hold, field by field: a record is checked
# against this where gpuctl reads it (`checked_record`); a field of another kind is left out and named in the run's
# `problem`, so a record a container garbled (or forged) shows as such and never reaches arithmetic or formatting.
TEXT, WHOLE, TIME, FLAG, TEXTS = "a string", "an integer", "a time in seconds", "true or false", "a list of strings"
RECORD_SCHEMA = {
    **dict.fromkeys(("name", "task", "config", "log_path", "killed_signal", "failure", "python", "venv", "home",
                     "workdir", "launched_by", "last_failure", "retry_stopped", "retry_of", "master_addr"), TEXT),
    **dict.fromkeys(("number", "exit_code", "pid", "pgid", "resumed_from", "retried_as", "attempt", "retries",
                     "retries_left", "master_port"), WHOLE),
    **dict.fromkeys(("launched_at", "started_at", "ended_at"), TIME),
    "queued": FLAG,
    **dict.fromkeys(("sets", "attempts", "env"), TEXTS),
}
LATEST_TIME = 1e11  # seconds since 1970: the year 5138, past any clock (and within what datetime can show)


def _fits(value: Any, kind: str) -> bool:
    if kind == TEXT:
        return isinstance(value, str)
    if kind == WHOLE:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == TIME:
        return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and 0 <= value < LATEST_TIME)
    if kind == FLAG:
        return isinstance(value, bool)
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def checked_record(value: Any) -> tuple[dict[str, Any], str | None]:
    """A record as read from the container: the fields that have their kind (RECORD_SCHEMA; others pass as they
    are), and what was wrong, in one line (None when nothing was)."""
    if not isinstance(value, dict):
        return {}, f"the record is not a JSON object but {type(value).__name__}"
    bad = [key for key, kind in RECORD_SCHEMA.items() if value.get(key) is not None and not _fits(value[key], kind)]
    if not bad:
        return value, None
    why = "; ".join(f"{key} is {json.dumps(value[key], ensure_ascii=True)[:40]}, not {RECORD_SCHEMA[key]}"
                    for key in bad)
    return {key: item for key, item in value.items() if key not in bad}, why


def remote_json(data: bytes) -> Any:
    """A JSON document from the container, decoded as UTF-8 with replacement, never strictly: one byte that is not
    UTF-8 in a record (a log's last line carried into it) shows as U+FFFD instead of failing every command."""
    return json.loads(data.decode(errors="replace"))


def parse_metrics_lines(text: bytes) -> list[dict[str, Any]]:
    """The records of a metrics file (JSON lines); a line being written as it was read is left out."""
    records = []
    for line in text.splitlines():
        try:
            record = remote_json(line)
        except ValueError:
            continue
        if isinstance(record, dict) and _fits(record.get("step"), WHOLE):
            records.append(record)
    return records


def parse_progress(first: bytes | None, last: bytes | None, active: bool) -> Progress | None:
    """Progress from the first and last lines of the run's metrics file (one JSON object per logged step).

    The ETA uses the rate between the two lines, so it holds whether `time` is elapsed or wall-clock seconds.
    """
    try:
        head, tail = remote_json(first or b"null"), remote_json(last or b"null")
    except ValueError:
        return None  # a line being written as we read it
    if not isinstance(tail, dict) or not _fits(tail.get("step"), WHOLE) or tail["step"] < 0:
        return None
    step = tail["step"]
    total = tail.get("total_steps") if _fits(tail.get("total_steps"), WHOLE) and tail["total_steps"] > 0 else None
    loss, rate = (number(tail.get(key)) for key in ("loss", "tokens_per_s"))
    eta = None
    if active and total is not None and isinstance(head, dict) and _fits(head.get("step", step), WHOLE):
        steps = step - head.get("step", step)
        seconds = (number(tail.get("time")) or 0) - (number(head.get("time")) or 0)
        if steps > 0 and seconds > 0:
            eta = round(max(total - step, 0) * seconds / steps, 1)
    return Progress(step=step, total_steps=total, loss=loss, tokens_per_s=rate, eta_s=eta)


def number(value: Any) -> float | None:
    """A metrics line's figure when it is one: a finite number (a string, NaN or a list is no figure)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None


@dataclass(frozen=True)
class Run:
    number: int
    record: dict[str, Any]
    alive: bool
    log_size: int | None = None  # None: not asked; -1 in the remote output means the log is gone
    progress: Progress | None = None
    now: float | None = None  # the container's clock when it was asked
    problem: str | None = None  # what was wrong with the record as read (its bad fields are left out)

    @classmethod
    def remote(cls, number: int, record: bytes | Any, alive: bool, **facts: Any) -> Run:
        """A run from what the container said: its record (the file's bytes, or its JSON already decoded) checked
        against RECORD_SCHEMA."""
        if isinstance(record, bytes):
            try:
                record = remote_json(record)
            except ValueError:
                return cls(number=number, record={}, alive=alive, problem="the record is not JSON", **facts)
        checked, problem = checked_record(record)
        return cls(number=number, record=checked, alive=alive, problem=problem, **facts)

    @property
    def run_id(self) -> str:
        return f"tl{self.number}"

    @property
    def name(self) -> str | None:
        """launch --name's (a --retry attempt carries its launch's)."""
        return self.record.get("name")

    @property
    def label(self) -> str:
        """The run as people name it: tl7, or tl7 (exp1)."""
        return f"{self.run_id} ({self.name})" if self.name else self.run_id

    @property
    def sets(self) -> list[str]:
        """The launch's --set values, as given (a resumed run's: its run's, then its own); [] in an older record."""
        sets = self.record.get("sets")
        return [str(item) for item in sets] if isinstance(sets, list) else []

    @property
    def resumed_from(self) -> int | None:
        """The run this one continues (launch --resume, or the attempt a --retry attempt follows)."""
        number = self.record.get("resumed_from")
        return number if isinstance(number, int) and number > 0 else None

    @property
    def failure(self) -> str | None:
        """Why a failed run ended, as its wrapper recorded it: the exit code, the last step logged and the log's
        last line ("exit 2, no step logged: error: ..."); None for a run that did not fail, or an older record."""
        failure = self.record.get("failure")
        return failure if isinstance(failure, str) and self.state == State.FAILED else None

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
            if "pid" in self.record:
                return State.RUNNING
            if self.never_started:
                return State.QUEUED
            return State.RETRYING if self.record.get("retry_of") else State.STARTING
        return State.KILLED if self.record.get("killed_signal") else State.LOST

    @property
    def never_started(self) -> bool:
        """A `launch --queue` run that has not started (still queued, or it left the queue): lib.sh's never_started."""
        return self.record.get("queued") is True and "started_at" not in self.record

    @property
    def started_at(self) -> float | None:
        if self.never_started:
            return None
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
            "name": self.name,
            "state": self.state.value,
            "exit_code": self.exit_code,
            "pid": self.record.get("pid"),
            "pgid": self.record.get("pgid"),
            "started_at": iso(self.started_at),
            "queued_at": iso(self.record.get("launched_at")) if self.record.get("queued") else None,
            "ended_at": iso(self.record.get("ended_at")),
            "elapsed_s": self.elapsed_s,
            "log_path": self.log_path,
            "log_size": self.log_size if self.log_size is None or self.log_size >= 0 else None,
            "progress": self.progress.to_json() if self.progress else None,
            "config": self.record.get("config"),
            "sets": self.sets,
            "killed_signal": self.record.get("killed_signal"),
            "failure": self.failure,
            "resumed_from": f"tl{self.resumed_from}" if self.resumed_from else None,
            "task": self.task,
            "python": self.record.get("python"),
            **self.retry_json(),
            "record_problem": self.problem,
        }

    @property
    def problem_line(self) -> str | None:
        """The run's malformed record, in one line: which file, what is wrong."""
        if self.problem is None:
            return None
        return f"{self.run_id}: its record {RECORDS_DIR}/{self.run_id}.json is malformed: {self.problem}"

    def retry_json(self) -> dict[str, Any]:
        """`launch --retry`: which attempt this run is (1: the launched one), the retries left after it, the
        attempts before it (oldest first), how the last of them failed, the attempt that retried this one, and why
        retrying stopped here (a deterministic failure), if it did."""
        rec = self.record
        return {
            "attempt": rec.get("attempt", 1),
            "attempts_left": rec.get("retries_left", rec.get("retries", 0)),
            "retry_of": rec.get("retry_of"),
            "attempts": rec.get("attempts", []),
            "last_failure": rec.get("last_failure"),
            "retried_as": f"tl{rec['retried_as']}" if rec.get("retried_as") else None,
            "retry_stopped": rec.get("retry_stopped"),
        }
