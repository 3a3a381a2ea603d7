"""What gpuctl's container-side scripts (templates/*.sh.j2) say back, decoded in one place.

A script reports through `emit NAME VALUE` (templates/lib.sh.j2): one length-prefixed section on stdout,
`@@NAME LENGTH\\nVALUE\\n`, so a value may hold any bytes; each script's sections are read into one typed
reply here (LaunchReply, Inspection, KillReply, MetricsChain, PullReply). Its exit code is 0, or one of ScriptExit, which
the templates receive as `exits` (scripts.render): the numbers are written here and nowhere else. Lines on
stderr that start with `@@` are markers (logs.sh's follow header and heartbeat), never messages.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

from gpuctl.runs import Run, parse_metrics_lines, parse_progress, remote_json
from gpuctl.staging import parse_manifest


class ScriptExit(IntEnum):
    """The exit codes of gpuctl's own scripts, beside 0."""

    FAILED = 1  # the script could not do its job: its last line on stderr says why
    LOCKED = 75  # another launch holds the container's launch lock
    ACTIVE = 76  # at gpuctl's go, a run is active after all (one started since the report)
    NO_PYTHON = 77  # the launch's --python is not in the container
    NO_RUN = 78  # no such run (or no run at all) in the container: its stderr line says which
    NOTHING = 79  # pull.sh: the run has nothing of what was asked (no export nor checkpoint): its stderr line says what


# What a script sends of a file's end: a log's last lines come from its last TAIL_BYTES (a line longer than that,
# say progress bars joined by carriage returns, arrives cut to its end); a metrics line from LINE_BYTES.
TAIL_BYTES = 16 * 1024
LINE_BYTES = 256 * 1024


def parse_sections(data: bytes) -> list[tuple[str, bytes]]:
    """Read back what the scripts' `emit NAME VALUE` wrote: `@@NAME LENGTH\\nVALUE\\n`, in order."""
    sections, pos = [], 0
    while True:
        start = data.find(b"@@", pos)
        if start < 0:
            return sections
        header_end = data.index(b"\n", start)
        name, length = data[start + 2:header_end].decode(errors="replace").split(" ")
        value_start = header_end + 1
        sections.append((name, data[value_start:value_start + int(length)]))
        pos = value_start + int(length) + 1


def section(name: str, value: bytes) -> bytes:
    """What `emit NAME VALUE` writes."""
    return b"@@%s %d\n%s\n" % (name.encode(), len(value), value)


def stderr_messages(stderr: bytes) -> list[str]:
    """A script's own lines on stderr, without its markers there (the heartbeat, the follow header)."""
    return [line for line in stderr.decode(errors="replace").strip().splitlines() if not line.startswith("@@")]


# launch.sh: a conversation. Under the launch lock it reports (LaunchReply) up to LAUNCH_WAITING, then reads
# gpuctl's answer: LAUNCH_ABORT, or launch_go() followed by the archive of the files the container lacks.
LAUNCH_WAITING = section("waiting", b"")
LAUNCH_ABORT = b"abort\n"


def launch_go(archive_bytes: int, manifest: bytes, number: int | None = None, secret: str | None = None,
              queue: bool = False) -> bytes:
    """`go BYTES [NUMBER [SECRET]]`, the new package's manifest, an empty line: the archive's BYTES follow.
    NUMBER: the run number to take (a multi-node run's, the same on every node); without it the script picks the
    next one. SECRET: a multi-node run's node secret (hex), which the script writes to tlN.secret (0600) for the
    trainer: on stdin, so it is on no command line and in no script text. queue: `queue BYTES` (launch --queue
    with a run active): the run waits its turn in the container."""
    if secret is not None and (number is None or not re.fullmatch(r"[0-9a-f]{32,}", secret)):
        raise ValueError("a node secret is hex, at least 32 digits, and goes with a run number")
    if queue and number is not None:
        raise ValueError("a queued run takes the next number there")
    fields = "".join(f" {value}" for value in (number, secret) if value is not None)
    return f"{'queue' if queue else 'go'} {archive_bytes}{fields}\n".encode() + manifest + b"\n"


@dataclass(frozen=True)
class LaunchReply:
    """What launch.sh said: its report under the lock (up to LAUNCH_WAITING), or what it said after the answer."""

    holder: str | None = None  # who holds the launch lock (exit LOCKED)
    python: str | None = None  # the interpreter the run will use (exit NO_PYTHON: the one not found)
    python_from: str | None = None  # where that came from: "option" (--python), "recorded" (gpuctl setup's), "default"
    recovered: str | None = None  # the holder this launch took the lock over from (it overran its deadline)
    active: list[Run] = field(default_factory=list)  # the runs alive in the container (exit ACTIVE after go)
    manifest: dict[str, str] = field(default_factory=dict)  # the staged package's files: {name: sha256}
    record: dict[str, Any] | None = None  # the record of the run it started
    last_number: int | None = None  # the largest run number the container has (under the lock)
    address: str | None = None  # the container's first address (asked for: a multi-node run's node 0); "" none
    name_taken: int | None = None  # the run that already has launch --name's name

    @classmethod
    def parse(cls, data: bytes) -> LaunchReply:
        found: dict[str, Any] = {}
        numbers, records = [], []  # report_active emits each active run as `active N` and `active_record`
        for name, value in parse_sections(data):
            if name == "active":
                numbers.append(int(value))
            elif name == "active_record":
                records.append(value or b"{}")
            elif name in ("holder", "recovered", "python", "python_from", "address"):
                found[name] = value.decode(errors="replace")
            elif name == "manifest":
                found[name] = parse_manifest(value)
            elif name == "record":
                found[name] = remote_json(value)
            elif name in ("last_number", "name_taken"):
                found[name] = int(value)
        active = [Run.remote(n, record, alive=True) for n, record in zip(numbers, records)]
        return cls(active=active, **found)


@dataclass
class Inspection:
    """What inspect.sh reported: the runs, and what was asked beside them."""

    runs: list[Run]
    tails: dict[int, bytes]  # run number -> the log's last lines
    rests: dict[int, bytes]  # run number -> the log from the asked byte offset on
    histories: dict[int, bytes]  # run number -> a sample of its metrics lines that have a loss
    gpus_csv: bytes | None
    gpus_error: str | None = None  # nvidia-smi did not answer in time: the line that says so
    queue: list[int] = field(default_factory=list)  # launch --queue's runs waiting their turn (asked for), in order

    @classmethod
    def parse(cls, data: bytes) -> Inspection:
        facts_by_run: list[dict[str, Any]] = []
        top: dict[str, bytes] = {}
        for name, value in parse_sections(data):
            if name == "run":
                facts_by_run.append({"number": int(value)})
            elif facts_by_run and name not in ("gpus", "gpus_error", "queue"):
                facts_by_run[-1][name] = value
            else:
                top[name] = value
        now = float(top["now"]) if top.get("now") else None
        runs, tails, rests, histories = [], {}, {}, {}
        for facts in facts_by_run:
            alive = facts.get("alive") == b"1"
            runs.append(Run.remote(
                facts["number"],
                facts["record"],
                alive=alive,
                log_size=int(facts["log_size"]) if "log_size" in facts else None,
                progress=parse_progress(facts.get("metrics_first"), facts.get("metrics_last"), alive),
                now=now,
            ))
            if "tail" in facts:
                tails[facts["number"]] = facts["tail"]
            if "rest" in facts:
                rests[facts["number"]] = facts["rest"].removesuffix(b"x")  # the script's guard for trailing newlines
            if "metrics_history" in facts:
                histories[facts["number"]] = facts["metrics_history"]
        error = top["gpus_error"].decode(errors="replace") if top.get("gpus_error") else None
        queue = [int(n) for n in top.get("queue", b"").split()]
        return cls(runs=runs, tails=tails, rests=rests, histories=histories, gpus_csv=top.get("gpus"),
                   gpus_error=error, queue=queue)


@dataclass(frozen=True)
class KillReply:
    """What kill.sh said: the run it acted on (None: there is no run at all) and its processes still alive."""

    run: Run | None
    pids: list[int]

    @classmethod
    def parse(cls, data: bytes) -> KillReply:
        sections = dict(parse_sections(data))
        if "run" not in sections:
            return cls(run=None, pids=[])
        pids = [int(p) for p in sections.get("pids", b"").split()]
        return cls(run=Run.remote(int(sections["run"]), sections["record"], alive=bool(pids)), pids=pids)


@dataclass(frozen=True)
class MetricsChain:
    """What metrics.sh said: the run and the runs it resumed, each with its metrics records, the oldest run first."""

    links: list[tuple[Run, list[dict[str, Any]]]]

    @classmethod
    def parse(cls, data: bytes) -> MetricsChain:
        links = []
        number, record = 0, b"{}"
        for name, value in parse_sections(data):
            if name == "run":
                number = int(value)
            elif name == "record":
                record = value
            elif name == "metrics":
                links.append((Run.remote(number, record, alive=False), parse_metrics_lines(value)))
        links.reverse()  # the script walks from the run back to the one it resumed
        return cls(links)


@dataclass(frozen=True)
class Removal:
    """One run of remove.sh's report: its paths removed (or, with --dry-run, that would be), and what of it stays
    and why (a directory another run uses too)."""

    run: Run
    paths: list[str]
    kept: list[tuple[str, str]]


@dataclass(frozen=True)
class RemoveReply:
    """What remove.sh said (`gpuctl runs rm`, `runs prune`): each run removed, in number order; or the active runs
    that refused it (exit ACTIVE), or the launch lock's holder (exit LOCKED)."""

    removals: list[Removal]
    active: list[Run]
    holder: str | None = None

    @classmethod
    def parse(cls, data: bytes) -> RemoveReply:
        removals: list[Removal] = []
        active: list[Run] = []
        number, holder, kept_path = 0, None, ""
        for name, value in parse_sections(data):
            text = value.decode(errors="replace")
            if name in ("remove", "active"):
                number = int(value)
            elif name == "record":
                removals.append(Removal(Run.remote(number, value, alive=False), [], []))
            elif name == "active_record":
                active.append(Run.remote(number, value, alive=True))
            elif name == "path" and removals:
                removals[-1].paths.append(text)
            elif name == "kept":
                kept_path = text
            elif name == "kept_why" and removals:
                removals[-1].kept.append((kept_path, text))
            elif name == "holder":
                holder = text
        return cls(removals, active, holder)


class FollowStart(NamedTuple):
    """The header `logs.sh` (following) writes on stderr before the log: the run, and the byte offset it starts at."""

    run: int
    offset: int


FOLLOW_HEADER = re.compile(rb"@@follow (\d+) (\d+)\n")


def parse_follow_start(stderr: bytes) -> FollowStart | None:
    """The header, once stderr holds it."""
    m = FOLLOW_HEADER.search(stderr)
    return FollowStart(int(m[1]), int(m[2])) if m else None


# pull.sh: a conversation. It says where the run's files are (PullReply) up to PULL_LOCATED, and when it must make
# the export first, from which checkpoint (then it runs training.export); then the files' manifest up to
# PULL_WAITING. It reads gpuctl's request (pull_request) and sends the asked files' bytes back to back, in the order
# asked, from each one's offset to the size it reported: gpuctl frames them by those sizes.
PULL_LOCATED = section("located", b"")
PULL_WAITING = section("waiting", b"")


class RemoteFile(NamedTuple):
    """A file pull.sh offers: its name under the source directory, its size and sha256 when it was opened."""

    name: str
    size: int
    sha256: str


def pull_request(wanted: list[tuple[int, int]]) -> bytes:
    """`INDEX OFFSET` for each file wanted (its index in the manifest, the first byte to send), an empty line."""
    return b"".join(f"{index} {offset}\n".encode() for index, offset in wanted) + b"\n"


@dataclass(frozen=True)
class PullReply:
    """What pull.sh said: the run, where its files come from, and (once it reached PULL_WAITING) the manifest."""

    run: Run | None = None
    output_dir: str | None = None  # what the run's trainer said at its start (not for metrics)
    source: str | None = None  # the directory the files are in (the metrics file itself for metrics)
    export_from: str | None = None  # the checkpoint an export is being made from for this pull, if one is
    files: list[RemoteFile] = field(default_factory=list)

    @classmethod
    def parse(cls, data: bytes) -> PullReply:
        sections = dict(parse_sections(data))
        run = None
        if "run" in sections:
            run = Run.remote(int(sections["run"]), sections.get("record") or b"{}", alive=False)
        files = []
        for line in sections.get("manifest", b"").decode(errors="surrogateescape").splitlines():
            size, sha256, name = line.split(" ", 2)
            files.append(RemoteFile(name, int(size), sha256))
        text = {name: sections[name].decode(errors="surrogateescape") for name in ("output_dir", "source",
                                                                                  "export_from") if name in sections}
        return cls(run=run, files=files, **text)


@dataclass(frozen=True)
class Probe:
    """What the interpreter said of itself in one start (templates/probe.py.j2)."""

    version: str  # Python's, e.g. "3.11.7"
    executable: str
    prefix: str  # a virtual environment's directory, or the installation's
    packages: dict[str, dict[str, str | None]]  # distribution -> {"version", "error"} (error: the import failed)
    torch: dict[str, Any] | None  # version, cuda (None: a CPU-only build), available, device_count; None: no torch
    output_dir: dict[str, Any] | None  # the last training run's: run, path, free, total (or error); None: no run

    @classmethod
    def parse(cls, data: bytes) -> Probe | None:
        """The report on the output's last line; None when the interpreter gave none."""
        lines = data.decode(errors="replace").strip().splitlines()
        try:
            doc = json.loads(lines[-1]) if lines else None
        except ValueError:
            return None
        if not isinstance(doc, dict) or "version" not in doc:
            return None
        return cls(version=doc["version"], executable=doc.get("executable", ""), prefix=doc.get("prefix", ""),
                   packages=doc.get("packages", {}), torch=doc.get("torch"), output_dir=doc.get("output_dir"))


@dataclass(frozen=True)
class DoctorReply:
    """What doctor.sh found in the container; gpuctl.commands.doctor makes the checks of it."""

    python: str  # the interpreter it checked
    python_from: str  # "option" (--python), "recorded" (gpuctl setup's), "default" (python3)
    python_found: bool
    probe: Probe | None  # None: the interpreter is missing, or gave no report (probe_error says what it said)
    probe_error: str
    active: list[Run]  # the runs alive in the container
    last_run: dict[str, Any] | None  # the record of the last training run
    workspace: tuple[int, int] | None  # /workspace's (free, total) bytes; None: no /workspace
    compile_cache_bytes: int | None  # /tmp/torchinductor_root's size; None: there is none (or du did not say)
    gpus_csv: bytes | None  # nvidia-smi's GPU table (commands.parse_gpus reads it); None: no nvidia-smi
    smi: str  # the start of nvidia-smi's own output: the driver's version, and the CUDA version it supports
    compile_cache_error: str = ""  # what du said instead of a size (it did not answer in time), else ""
    last_setup: dict[str, Any] | None = None  # the record of the last gpuctl setup (its options: torch, ...)

    @classmethod
    def parse(cls, data: bytes) -> DoctorReply:
        found: dict[str, bytes] = {}
        numbers, records = [], []
        for name, value in parse_sections(data):
            if name == "active":
                numbers.append(int(value))
            elif name == "active_record":
                records.append(value or b"{}")
            else:
                found[name] = value
        text = {k: v.decode(errors="replace") for k, v in found.items()}
        df = text.get("workspace", "").split()
        workspace = (int(df[3]), int(df[1])) if len(df) >= 4 and df[1].isdigit() and df[3].isdigit() else None
        cache = text.get("compile_cache", "").strip()
        python_found = text.get("python_found") == "1"
        probe = Probe.parse(found.get("probe", b"")) if python_found else None
        error = ""
        if python_found and probe is None:
            said = (text.get("probe_stderr", "").strip() or text.get("probe", "").strip()).splitlines()
            error = f"exit {text.get('probe_rc', '?')}" + (f": {said[-1]}" if said else "")
        return cls(python=text.get("python", ""), python_from=text.get("python_from", ""),
                   python_found=python_found, probe=probe, probe_error=error,
                   active=[Run.remote(n, r, alive=True) for n, r in zip(numbers, records)],
                   last_run=remote_json(found["last_run"]) if found.get("last_run") else None,
                   last_setup=remote_json(found["last_setup"]) if found.get("last_setup") else None,
                   workspace=workspace, compile_cache_bytes=int(cache) if cache.isdigit() else None,
                   compile_cache_error="" if cache.isdigit() else cache,
                   gpus_csv=found.get("gpus"), smi=text.get("smi", ""))
