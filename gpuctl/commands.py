"""What each gpuctl command does, below the CLI: no Typer, no Rich. Each function takes an open Container (one
SSH connection for the whole invocation) and returns a result object that render.py turns into text or JSON.
Every wait is a bounded tenacity retry.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath

from tenacity import RetryError, retry, retry_if_result, stop_after_delay, wait_exponential

from gpuctl import __version__, scripts, ssh
from gpuctl.container import (
    RECORDS_DIR,
    SCRIPT_ACTIVE,
    SCRIPT_LOCKED,
    SCRIPT_NO_PYTHON,
    STAGE_DIR,
    Container,
    parse_sections,
)
from gpuctl.errors import ExitCode, GpuctlError, usage_error
from gpuctl.runs import LINUX_SIGNALS, Inspection, Run, State, parse_inspection
from gpuctl.staging import Package, build_package
from gpuctl.target import Target

Notify = Callable[[str], None]
Write = Callable[[bytes], None]
START_TIMEOUT_S = float(os.environ.get("GPUCTL_START_TIMEOUT", "30"))
KILL_VERIFY_S = 10.0  # after SIGKILL, how long the group may take to disappear
LAUNCH_TAIL_LINES = 20


@contextmanager
def connected(target: Target) -> Iterator[Container]:
    """One SSH connection for the whole invocation."""
    with ssh.connect(target) as session:
        yield Container(session=session, ctid=target.ct, host=target.host)


def inspect(ct: Container, run_number: int = 0, *, all_runs: bool = False, gpus: bool = False,
            tail_lines: int = 0, rest_from: int | None = None) -> Inspection:
    result = ct.run("inspect", run_number=run_number, all_runs=all_runs, gpus=gpus, tail_lines=tail_lines,
                    rest_from=rest_from)
    if result.rc != 0:
        raise ct.failure(result, "reading the run records")
    return parse_inspection(parse_sections(result.stdout))


# launch ---------------------------------------------------------------------------------------------------

@dataclass
class LaunchOptions:
    config: str = "tiny"
    sets: list[str] = field(default_factory=list)
    python: str = "python3"
    workdir: str = "/workspace"
    log_dir: str = "/workspace"
    keep_compile_cache: bool = False
    replace: bool = False


@dataclass
class LaunchResult:
    run: Run
    package: Package
    tail: bytes = b""  # the log's last lines when the run ended during the start check
    replaced: KillResult | None = None


def _remote_dir(value: str, option: str) -> str:
    if not value.startswith("/"):
        raise usage_error(f"{option} must be an absolute path in the container, got {value!r}")
    if "\0" in value or "\n" in value:
        raise usage_error(f"{option} must not contain NUL or newline characters")
    return str(PurePosixPath(value))


def _check_launch_options(opts: LaunchOptions) -> tuple[LaunchOptions, Path | None]:
    for item in opts.sets:
        key, eq, _ = item.partition("=")
        if not eq or not key.strip():
            raise usage_error(f"--set takes KEY=VALUE, got {item!r}")
        if "\n" in item or "\0" in item:
            raise usage_error(f"--set value must not contain NUL or newline characters: {item!r}")
    if not opts.config or not opts.python:
        raise usage_error("--config and --python must not be empty")
    local = Path(opts.config).expanduser()
    config_file = local if local.is_file() else None
    config = f"{STAGE_DIR}/configs/{local.name}" if config_file else opts.config
    checked = LaunchOptions(config=config, sets=list(opts.sets), python=opts.python,
                            workdir=_remote_dir(opts.workdir, "--workdir"),
                            log_dir=_remote_dir(opts.log_dir, "--log-dir"),
                            keep_compile_cache=opts.keep_compile_cache, replace=opts.replace)
    return checked, config_file


def _launch_values(target: Target, opts: LaunchOptions, package: Package) -> dict:
    record_fields = {
        "host": target.host, "container": target.ct, "config": opts.config, "sets": opts.sets,
        "python": opts.python, "workdir": opts.workdir, "package_digest": package.digest,
        "launched_by": f"{getpass.getuser()}@{socket.gethostname()}", "gpuctl_version": __version__,
    }
    holder = (f"{record_fields['launched_by']} (gpuctl pid {os.getpid()}, since "
              f"{datetime.now(timezone.utc).isoformat(timespec='seconds')})")
    run_sh = _render_run_sh(opts)
    return {
        "stage_dir": STAGE_DIR, "log_dir": opts.log_dir, "workdir": opts.workdir, "python": opts.python,
        "keep_compile_cache": opts.keep_compile_cache, "holder": holder, "payload": package.payload_b64,
        "run_sh": run_sh, "wrapper_sh": scripts.render("wrapper.sh", records_dir=RECORDS_DIR),
        "log_prefix": json.dumps(f"{opts.log_dir.rstrip('/')}/train_tl")[:-1],
        "record_fields": json.dumps(record_fields)[1:-1],
    }


def _render_run_sh(opts: LaunchOptions) -> str:
    return scripts.render("run.sh", stage_dir=STAGE_DIR, workdir=opts.workdir, python=opts.python,
                          config=opts.config, sets=opts.sets)


def plan_launch(target: Target, opts: LaunchOptions) -> str:
    """What `launch --dry-run` shows: the command and the script, with the package summarised."""
    opts, config_file = _check_launch_options(opts)
    package = build_package(config_file)
    values = _launch_values(target, opts, package)
    values["payload"] = f"<{len(package.files)} files, {package.size} bytes, sha256 {package.digest[:12]}>"
    values["wrapper_sh"] = "<templates/wrapper.sh.j2>"
    command = scripts.render("pct_exec", ctid=target.ct).strip()
    script = scripts.render("launch.sh", records_dir=RECORDS_DIR, **values)
    return (f"# on {target.host}: {command}   (script on stdin)\n{script}\n"
            f"# {STAGE_DIR}/run.sh will be:\n{values['run_sh']}")


def launch(ct: Container, target: Target, opts: LaunchOptions, notify: Notify) -> LaunchResult:
    opts, config_file = _check_launch_options(opts)
    package = build_package(config_file)
    values = _launch_values(target, opts, package)
    replaced = None
    result = ct.run("launch", **values)
    if result.rc == SCRIPT_ACTIVE and opts.replace:
        active = int(dict(parse_sections(result.stdout))["active"])
        notify(f"--replace: killing tl{active} first")
        replaced = kill(ct, active, "TERM", grace=30.0, notify=notify)
        result = ct.run("launch", **values)
    sections = dict(parse_sections(result.stdout))
    if result.rc == SCRIPT_LOCKED:
        holder = sections.get("holder", b"").decode(errors="replace").strip() or "unknown"
        raise GpuctlError(f"another launch holds CT {ct.ctid}'s launch lock: {holder}", ExitCode.CONFLICT)
    if result.rc == SCRIPT_ACTIVE:
        active = sections["active"].decode()
        raise GpuctlError(f"run tl{active} is active in CT {ct.ctid}: stop it (gpuctl kill --run {active}) "
                          "or launch with --replace", ExitCode.CONFLICT)
    if result.rc == SCRIPT_NO_PYTHON:
        raise usage_error(f"{opts.python!r} not found in CT {ct.ctid}: pass --python PATH")
    if result.rc != 0 or "record" not in sections:
        raise ct.failure(result, "launch")
    number = json.loads(sections["record"])["number"]
    run, tail = wait_until_started(ct, number)
    return LaunchResult(run=run, package=package, tail=tail, replaced=replaced)


def wait_until_started(ct: Container, number: int) -> tuple[Run, bytes]:
    """Poll until the run's process is alive and its log exists, or it already ended (then with its tail)."""

    def pending(inspection: Inspection) -> bool:
        run = inspection.runs[0]
        return run.state == State.STARTING or (run.state == State.RUNNING and (run.log_size or -1) < 0)

    @retry(stop=stop_after_delay(START_TIMEOUT_S), wait=wait_exponential(multiplier=0.02, max=0.5),
           retry=retry_if_result(pending))
    def probe() -> Inspection:
        return inspect(ct, number, tail_lines=LAUNCH_TAIL_LINES)

    try:
        inspection = probe()
    except RetryError:
        raise GpuctlError(f"tl{number} did not start within {START_TIMEOUT_S:g} s (see gpuctl logs --run "
                          f"{number})", ExitCode.RUN_FAILED) from None
    run = inspection.runs[0]
    return run, b"" if run.state.active else inspection.tails.get(number, b"")


# status and runs ------------------------------------------------------------------------------------------

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
    run: Run | None
    gpus: list[Gpu]

    def to_json(self) -> dict:
        keys = ("run_id", "state", "exit_code", "pid", "pgid", "started_at", "ended_at", "elapsed_s", "log_path",
                "log_size", "progress", "config", "killed_signal")
        doc = self.run.to_json() if self.run else dict.fromkeys(keys)
        doc["gpus"] = [g.to_json() for g in self.gpus]
        doc["container"] = {"ctid": self.ctid, "status": "running", "host": self.host}
        return doc


def status(ct: Container, run_number: int = 0) -> StatusReport:
    inspection = inspect(ct, run_number, gpus=True)
    return StatusReport(ctid=ct.ctid, host=ct.host, run=inspection.runs[0] if inspection.runs else None,
                        gpus=parse_gpus(inspection.gpus_csv))


def list_runs(ct: Container) -> list[Run]:
    return inspect(ct, all_runs=True).runs


# kill -----------------------------------------------------------------------------------------------------

@dataclass
class KillResult:
    run: Run | None  # None: there is no run at all
    signalled: bool  # False: nothing of the run was alive
    escalated: bool = False
    seconds: float = 0.0


def _kill_step(ct: Container, run_number: int, action: str, signal_name: str) -> tuple[Run | None, list[int]]:
    result = ct.run("kill", run_number=run_number, action=action, signal_name=signal_name,
                    signal_number=LINUX_SIGNALS[signal_name])
    if result.rc != 0:
        raise ct.failure(result, "kill")
    sections = dict(parse_sections(result.stdout))
    if "run" not in sections:
        return None, []
    pids = [int(p) for p in sections.get("pids", b"").split()]
    run = Run(number=int(sections["run"]), record=json.loads(sections["record"]), alive=bool(pids))
    return run, pids


def kill(ct: Container, run_number: int, signal_name: str, grace: float, notify: Notify) -> KillResult:
    started = time.monotonic()
    run, pids = _kill_step(ct, run_number, "signal", signal_name)
    if run is None or not pids:
        return KillResult(run=run, signalled=False)
    notify(f"sent SIG{signal_name} to tl{run.number} ({len(pids)} processes); waiting up to {grace:g} s")

    def gone_within(seconds: float, sent: str) -> tuple[Run, list[int]]:
        @retry(stop=stop_after_delay(seconds), wait=wait_exponential(multiplier=0.02, max=0.5),
               retry=retry_if_result(lambda found: bool(found[1])))
        def check() -> tuple[Run, list[int]]:
            found_run, found_pids = _kill_step(ct, run.number, "check", sent)
            return found_run or run, found_pids

        try:
            return check()
        except RetryError as e:
            return e.last_attempt.result()

    run, pids = gone_within(grace, signal_name)
    escalated = False
    if pids:
        notify(f"tl{run.number} still has {len(pids)} processes after {grace:g} s: sending SIGKILL")
        escalated = True
        _kill_step(ct, run.number, "signal", "KILL")
        run, pids = gone_within(KILL_VERIFY_S, "KILL")
        if pids:
            raise GpuctlError(f"processes {' '.join(map(str, pids))} of tl{run.number} survived SIGKILL",
                              ExitCode.RUN_FAILED)
    return KillResult(run=run, signalled=True, escalated=escalated, seconds=time.monotonic() - started)


# logs -----------------------------------------------------------------------------------------------------

def print_log(ct: Container, run_number: int, lines: int | None, write: Write) -> None:
    result = ct.stream("logs", on_stdout=write, run_number=run_number, follow=False, lines=lines, offset=0)
    if result.rc != 0:
        raise ct.failure(result, "reading the log")


def follow_log(ct: Container, run_number: int, lines: int | None, write: Write,
               offset: int | None = None) -> Run:
    """Stream the run's log until the run ends; every byte exactly once. Returns the ended run."""
    received = 0

    def counting(data: bytes) -> None:
        nonlocal received
        received += len(data)
        write(data)

    position = offset
    number = run_number
    while True:
        received = 0
        result = ct.stream("logs", on_stdout=counting, run_number=number, follow=True,
                           lines=lines if position is None else None, offset=position or 0)
        if result.rc != 0:
            raise ct.failure(result, "following the log")
        header = next((line for line in result.stderr.decode(errors="replace").splitlines()
                       if line.startswith("@@follow ")), None)
        if header is None:
            raise ct.failure(result, "following the log")
        _, run_text, start_text = header.split()
        number, position = int(run_text), int(start_text) + received
        # tail may not have read the last bytes before the run's end stopped it: fetch them from the offset.
        inspection = inspect(ct, number, rest_from=position)
        rest = inspection.rests.get(number, b"")
        if rest:
            write(rest)
            position += len(rest)
        run = inspection.runs[0]
        if not run.state.active:
            return run


def follow_exit_code(run: Run) -> ExitCode:
    return ExitCode.OK if run.state == State.SUCCEEDED else ExitCode.RUN_FAILED

