"""What each gpuctl command does, below the CLI: no Typer, no Rich. Each function takes an open Container (one
SSH connection for the whole invocation) and returns a result object that render.py turns into text or JSON.
Every wait is a bounded tenacity retry.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import Any, Protocol, TypeVar

from tenacity import RetryError, retry, retry_if_result, stop_after_delay, wait_exponential

from gpuctl import __version__, scripts, ssh, transfer
from gpuctl.container import INTERPRETER_FILE, RECORDS_DIR, STAGE_DIR, Container, ContainerNotRunning
from gpuctl.errors import ExitCode, GpuctlError, usage_error
from gpuctl.protocol import (
    LAUNCH_ABORT,
    LAUNCH_WAITING,
    PULL_LOCATED,
    PULL_WAITING,
    FollowStart,
    Inspection,
    KillReply,
    LaunchReply,
    MetricsChain,
    PullReply,
    ScriptExit,
    launch_go,
    parse_follow_start,
    pull_request,
    stderr_messages,
)
from gpuctl.runs import LINUX_SIGNALS, Run, State, parse_metrics_lines
from gpuctl.ssh import ConnectionLost, RemoteCommand
from gpuctl.staging import (
    Package,
    PackageFile,
    StagePlan,
    build_package,
    file_from_bytes,
    plan_stage,
)
from gpuctl.target import Target

Notify = Callable[[str], None]
Write = Callable[[bytes], None]
T = TypeVar("T")


class Tracker(Protocol):
    """Hears of every chunk of a transfer (render.TransferProgress draws it); closed when the transfer ends."""

    def __call__(self, sent: int) -> None: ...

    def close(self) -> None: ...


def _seconds(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


START_TIMEOUT_S = _seconds("GPUCTL_START_TIMEOUT", 30)
# How long the container's side of a launch waits for gpuctl's reply while it holds the launch lock.
LOCK_REPLY_S = _seconds("GPUCTL_LOCK_REPLY_TIMEOUT", 120)
RECONNECT_S = _seconds("GPUCTL_RECONNECT_TIMEOUT", 60)  # a follower's time to get a lost connection back
HEARTBEAT_S = _seconds("GPUCTL_HEARTBEAT", 5)  # `logs --follow` hears from the container at least this often
KILL_VERIFY_S = 10.0  # after SIGKILL, how long the group may take to disappear
# How long pull.sh waits for gpuctl's request: gpuctl first hashes what it has of the files (GBs, maybe).
PULL_REQUEST_S = 600.0
LAUNCH_TAIL_LINES = 20
LOSS_HISTORY_POINTS = 60  # losses `status` fetches for its sparkline


@contextmanager
def connected(target: Target, stats: ssh.Stats | None = None) -> Iterator[Container]:
    """One SSH connection for the whole invocation (a follower may replace it after a drop); what it costs is
    counted in ct.session.stats (`stats`, when given)."""
    ct = Container(session=ssh.connect(target, stats), target=target)
    try:
        yield ct
    finally:
        ct.session.close()


def reconnecting(ct: Container, action: Callable[[], T], notify: Notify, within_s: float = RECONNECT_S) -> T:
    """Run action; when the connection drops, reconnect (with backoff, for up to within_s) and run it again."""
    while True:
        try:
            return action()
        except ConnectionLost as lost:
            notify(f"{lost}; reconnecting (for up to {within_s:g} s)")
            try:
                ct.reconnect(within_s)
            except GpuctlError as e:
                raise GpuctlError(f"{lost}, and no new connection within {within_s:g} s ({e})",
                                  ExitCode.HOST) from None
            notify(f"reconnected to {ct.session.endpoint.describe()}")


def inspect(ct: Container, run_number: int = 0, *, all_runs: bool = False, gpus: bool = False,
            tail_lines: int = 0, rest_from: int | None = None, history: int = 0) -> Inspection:
    result = ct.run("inspect", run_number=run_number, all_runs=all_runs, gpus=gpus, tail_lines=tail_lines,
                    rest_from=rest_from, history=history)
    if result.rc != 0:
        raise ct.failure(result, "reading the run records")
    return Inspection.parse(result.stdout)


# launch ---------------------------------------------------------------------------------------------------

# The interpreter is not among them: without --python, the container's side takes the one `gpuctl setup`
# recorded (INTERPRETER_FILE), else python3 (lib.sh's resolve_python).
DEFAULTS = {"workdir": "/workspace", "log_dir": "/workspace"}


class LaunchTask(str, Enum):
    """What `launch --task` runs (detached, as run.sh): the trainer, or the data regeneration."""

    TRAIN = "train"  # python -m training.train
    REGENERATE = "regenerate"  # python -m training.regenerate


TASK_MODULES = {LaunchTask.TRAIN: "training.train", LaunchTask.REGENERATE: "training.regenerate"}
TASK_CONFIGS = {LaunchTask.TRAIN: "tiny", LaunchTask.REGENERATE: "tiny-regenerate"}  # the default --config


@dataclass
class LaunchOptions:
    config: str | None = None  # None: the task's default (TASK_CONFIGS), or the resumed run's
    sets: list[str] = field(default_factory=list)
    python: str | None = None  # None: the container's (gpuctl setup's, else python3)
    workdir: str | None = None
    log_dir: str | None = None
    keep_compile_cache: bool = False
    replace: bool = False
    resume: int | None = None  # a run number to continue (0: the latest run)
    retry: int = 0  # restart a failed run with --resume up to this many times (the wrapper does, in the container)
    retry_delay: float = 10.0  # seconds before a retry; doubled for each attempt in a row that failed before a step
    task: LaunchTask | None = None  # None: the resumed run's task, else train
    env: list[str] = field(default_factory=list)  # KEY=VALUE: environment for the trainer (--env)
    node: NodeRole | None = None  # one node of a multi-node run (gpuctl/cluster.py); None: a run of its own


# torch.distributed's env:// variables: gpuctl sets them for a multi-node run, --env may not.
RENDEZVOUS_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class NodeRole:
    """One container's place in a multi-node run (launch --node): what its trainer is told through
    torch.distributed's env:// variables, and what its run record says of the run's nodes."""

    rank: int  # the node's index, 0 = the first
    nodes: tuple[str, ...]  # every node's target, node 0 first
    master_port: int
    master_addr: str | None = None  # None: node 0's own address, which its launch script finds

    def rendezvous(self) -> list[tuple[str, str]]:
        values = (self.rank, len(self.nodes), self.master_addr, self.master_port)
        return [(key, str(value)) for key, value in zip(RENDEZVOUS_KEYS, values)]

    def record_fields(self) -> dict[str, Any]:
        return {"node": self.rank, "nodes": list(self.nodes), "master_port": self.master_port}


@dataclass
class LaunchResult:
    run: Run
    package: Package
    plan: StagePlan
    sent_file_bytes: int  # what the SSH layer wrote of the changed files' archive
    tail: bytes = b""  # the log's last lines when the run ended during the start check
    replaced: list[KillResult] = field(default_factory=list)
    resumed_from: int | None = None
    python: str | None = None  # the interpreter the run uses, as the container resolved it
    python_from: str | None = None  # "option" (--python), "recorded" (gpuctl setup's), "default" (python3)

    def staging_json(self) -> dict[str, Any]:
        return {"files": len(self.package.files), "bytes": self.package.size, "digest": self.package.digest,
                "sent_files": self.plan.changed, "sent_bytes": self.sent_file_bytes}


def _remote_dir(value: str, option: str) -> str:
    if not value.startswith("/"):
        raise usage_error(f"{option} must be an absolute path in the container, got {value!r}")
    if "\0" in value or "\n" in value:
        raise usage_error(f"{option} must not contain NUL or newline characters")
    return str(PurePosixPath(value))


def check_launch_options(opts: LaunchOptions) -> tuple[LaunchOptions, Path | None]:
    """Validate; fill what is not given from the defaults. Returns the options and the local config file."""
    for item in opts.sets:
        key, eq, _ = item.partition("=")
        if not eq or not key.strip():
            raise usage_error(f"--set takes KEY=VALUE, got {item!r}")
        if "\n" in item or "\0" in item:
            raise usage_error(f"--set value must not contain NUL or newline characters: {item!r}")
    check_env(opts.env)
    if opts.retry < 0 or not 0 <= opts.retry_delay <= 86400:
        raise usage_error("--retry takes a count >= 0, --retry-delay seconds between 0 and 86400")
    task = LaunchTask(opts.task or LaunchTask.TRAIN)
    config, python = opts.config or TASK_CONFIGS[task], opts.python
    if opts.config == "" or opts.python == "":
        raise usage_error("--config and --python must not be empty")
    if python is not None:
        check_python(python)
    local = Path(config).expanduser()
    config_file = local if local.is_file() and not config.startswith(f"{STAGE_DIR}/") else None
    checked = replace(opts, task=task, config=f"{STAGE_DIR}/configs/{local.name}" if config_file else config,
                      python=python,
                      workdir=_remote_dir(opts.workdir or DEFAULTS["workdir"], "--workdir"),
                      log_dir=_remote_dir(opts.log_dir or DEFAULTS["log_dir"], "--log-dir"), sets=list(opts.sets),
                      env=list(opts.env))
    return checked, config_file


def check_env(items: list[str]) -> list[tuple[str, str]]:
    """--env KEY=VALUE items as (KEY, VALUE): KEY a shell identifier that is not gpuctl's own."""
    pairs = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not ENV_KEY.match(key):
            raise usage_error(f"--env takes KEY=VALUE with KEY a shell identifier (letters, digits, _), got {item!r}")
        if key in RENDEZVOUS_KEYS or key.startswith("GPUCTL_"):
            raise usage_error(f"--env cannot set {key}: gpuctl sets it (the rendezvous: --master-addr, "
                              "--master-port)")
        if "\n" in value or "\0" in value:
            raise usage_error(f"--env value must not contain NUL or newline characters: {item!r}")
        pairs.append((key, value))
    return pairs


def check_python(python: str) -> str:
    if any(ord(c) < 32 for c in python):
        raise usage_error(f"--python must not contain control characters: {python!r}")
    return python


def resume_options(opts: LaunchOptions, record: dict[str, Any]) -> LaunchOptions:
    """A resumed run: the run's own task, config, sets, interpreter, directories; what the command line gives
    wins, and its --set values come after the run's (so they override them)."""
    log_path = record.get("log_path") or ""
    return replace(opts, task=LaunchTask(record.get("task") or LaunchTask.TRAIN),
                   config=opts.config or record.get("config"),
                   sets=[*record.get("sets", []), *opts.sets], python=opts.python or record.get("python"),
                   env=[*record.get("env", []), *opts.env],
                   workdir=opts.workdir or record.get("workdir"),
                   log_dir=opts.log_dir or (str(PurePosixPath(log_path).parent) if log_path else None))


def _holder() -> str:
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    return f"{who} (gpuctl pid {os.getpid()}, since {datetime.now(timezone.utc).isoformat(timespec='seconds')})"


def detached_values(target: Target, task: str, fields: dict[str, Any], *, python: str | None,
                    use_recorded_python: bool, log_dir: str, workdir: str, keep_compile_cache: bool,
                    replacing: bool, find_address: bool = False) -> dict[str, Any]:
    """launch.sh's values for a detached task: "train" and "regenerate" run the staged run.sh (a training run, a
    data regeneration), "setup" the staged setup.sh (gpuctl setup's installation); each has its own numbered log
    (<task>_tlN.log) and a record that names the task. find_address: the script reports the container's address
    (a multi-node run's node 0, for MASTER_ADDR)."""
    record_fields = {
        "task": task, "host": target.host, "container": target.ct, **fields,
        "launched_by": f"{getpass.getuser()}@{socket.gethostname()}", "gpuctl_version": __version__,
    }
    reply_timeout = LOCK_REPLY_S + (2 * 30.0 + KILL_VERIFY_S if replacing else 0)
    log_stem = f"{task}_tl"
    return {
        "stage_dir": STAGE_DIR, "log_dir": log_dir, "workdir": workdir, "python": python or "",
        "interpreter_file": INTERPRETER_FILE if use_recorded_python else "", "entry": TASK_ENTRIES[task],
        "keep_compile_cache": keep_compile_cache, "holder": _holder(), "reply_timeout": int(reply_timeout),
        "find_address": find_address,
        "log_stem": log_stem, "log_prefix": json.dumps(f"{log_dir.rstrip('/')}/{log_stem}")[:-1],
        "record_fields": json.dumps(record_fields)[1:-1],
    }


# What the wrapper runs, in the staged package; a task's log is <task>_tlN.log.
TASK_ENTRIES = {"train": "run.sh", "regenerate": "run.sh", "setup": "setup.sh"}


def launch_values(target: Target, opts: LaunchOptions) -> dict[str, Any]:
    fields: dict[str, Any] = {"config": opts.config, "sets": opts.sets, "workdir": opts.workdir}
    if opts.resume:
        fields.update(resumed_from=opts.resume)
    if opts.retry:
        fields.update(retries=opts.retry, retry_delay=opts.retry_delay)
    if opts.env:
        fields.update(env=opts.env)  # a --resume of the run sets them again
    if opts.node:
        fields.update(opts.node.record_fields())
    return detached_values(target, opts.task.value, fields, python=opts.python, use_recorded_python=True,
                           log_dir=opts.log_dir, workdir=opts.workdir, keep_compile_cache=opts.keep_compile_cache,
                           replacing=opts.replace,
                           find_address=bool(opts.node and opts.node.rank == 0 and not opts.node.master_addr))


def _package(config_file: Path | None, opts: LaunchOptions) -> Package:
    """The trainer (and local config), this launch's run.sh, and the wrapper."""
    # A regenerate run resumes by running again: the module itself skips every record already written.
    run_sh = scripts.render("run.sh", stage_dir=STAGE_DIR, workdir=opts.workdir, python=opts.python,
                            module=TASK_MODULES[opts.task], config=opts.config, sets=opts.sets,
                            resume=opts.resume is not None and opts.task == LaunchTask.TRAIN,
                            takes_resume=opts.task == LaunchTask.TRAIN,  # a --retry attempt's --resume
                            env=check_env(opts.env), rendezvous=opts.node.rendezvous() if opts.node else [])
    return build_package(config_file).with_files([file_from_bytes("run.sh", run_sh.encode(), 0o755), wrapper_file()])


def wrapper_file() -> PackageFile:
    """gpuctl-wrapper.sh, which runs a detached task and records how it ended."""
    return file_from_bytes("gpuctl-wrapper.sh", scripts.render("wrapper.sh", records_dir=RECORDS_DIR).encode(), 0o755)


def _kept_config(package: Package, opts: LaunchOptions, remote: dict[str, str]) -> Package:
    """A resumed run whose config is a staged file: keep the container's copy (it is not on this machine)."""
    name = opts.config.removeprefix(f"{STAGE_DIR}/")
    if opts.resume is None or name == opts.config or name in package.files:
        return package
    return package.with_files([PackageFile(name, remote.get(name, ""), None)])


def plan_launch(target: Target, opts: LaunchOptions) -> str:
    """What `launch --dry-run` shows: the command, the script, and the package it would stage."""
    opts, config_file = check_launch_options(opts)
    interpreter = opts.python or f"the one gpuctl setup recorded in {INTERPRETER_FILE}, else python3"
    package = _package(config_file, replace(opts, python=opts.python or "<interpreter>"))
    command = scripts.render("pct_exec", ctid=target.ct).strip()
    script = scripts.render("launch.sh", records_dir=RECORDS_DIR, **launch_values(target, opts))
    files = package.files
    return (f"# on {target.host}: {command}   (script on stdin)\n{script}\n"
            f"# then, only the files the container lacks of the package ({len(files)} files, {package.size} bytes, "
            f"sha256 {package.digest[:12]}); {STAGE_DIR}/run.sh will be (<interpreter>: {interpreter}):\n"
            f"{files['run.sh'].data.decode()}")


def _active_conflict(ct: Container, active: Run) -> GpuctlError:
    number, launched_by = active.number, active.record.get("launched_by")
    by = f" (launched by {launched_by})" if launched_by else ""
    return GpuctlError(f"run tl{number} is active in CT {ct.ctid}{by}: stop it (gpuctl kill --run {number}) "
                       "or launch with --replace", ExitCode.CONFLICT)


def _resumable(ct: Container, number: int, task: LaunchTask | None) -> Run:
    """The run `launch --resume [N]` continues: run N, or the latest run of `task` (any task but a gpuctl setup
    when None)."""
    tasks = {task.value} if task else {t.value for t in LaunchTask}
    found = inspect(ct, number).runs
    if found and found[0].task not in tasks and number == 0:
        found = [run for run in inspect(ct, all_runs=True).runs if run.task in tasks][-1:]
    if not found:
        raise usage_error(f"no {task.value + ' ' if task else ''}runs in CT {ct.ctid} to resume")
    if found[0].task not in {t.value for t in LaunchTask}:
        raise usage_error(f"{found[0].run_id} is a gpuctl {found[0].task}, not a training run: nothing to resume")
    if found[0].task not in tasks:
        raise usage_error(f"{found[0].run_id} is a {found[0].task} run, not {task.value}: leave out --task")
    return found[0]


def _no_python(ct: Container, reply: LaunchReply, task: str) -> GpuctlError:
    python = reply.python or "python3"
    if reply.python_from == "option":
        return usage_error(f"{python!r} not found in CT {ct.ctid}: pass --python PATH")
    if reply.python_from == "recorded":
        return GpuctlError(f"{python}, the interpreter gpuctl setup recorded in {INTERPRETER_FILE}, is gone from CT "
                           f"{ct.ctid}: run gpuctl setup again (or pass --python PATH)", ExitCode.ENV_NOT_READY)
    fix = "install Python >= 3.10 in it" if task == "setup" else "gpuctl setup prepares one"
    return GpuctlError(f"no {python} in CT {ct.ctid}: {fix} (or pass --python PATH)", ExitCode.ENV_NOT_READY)


def launch(ct: Container, target: Target, opts: LaunchOptions, notify: Notify,
           progress: Callable[[int], Tracker] | None = None) -> LaunchResult:
    """Start a run. progress(total bytes) gives the tracker of the changed files' transfer."""
    opts, config_file = check_launch_options(resuming(ct, opts))
    result = start_detached(ct, launch_values(target, opts), launch_package(opts, config_file), opts.task.value,
                            opts.replace, notify, progress)
    return replace(result, resumed_from=opts.resume)


def resuming(ct: Container, opts: LaunchOptions) -> LaunchOptions:
    """With --resume, the options of the run it continues (its number in opts.resume; 0 asked for the latest);
    without, opts as they are."""
    if opts.resume is None:
        return opts
    resumed = _resumable(ct, opts.resume, opts.task)
    return resume_options(replace(opts, resume=resumed.number), resumed.record)


def launch_package(opts: LaunchOptions, config_file: Path | None) -> Callable[[LaunchReply], Package]:
    """The package a launch stages, once the container's report says which interpreter run.sh names."""

    def package(report: LaunchReply) -> Package:
        ran = replace(opts, python=report.python)
        return _kept_config(_package(config_file, ran), ran, report.manifest)

    return package


def start_detached(ct: Container, values: dict[str, Any], package_for: Callable[[LaunchReply], Package],
                   task: str, replace_active: bool, notify: Notify,
                   progress: Callable[[int], Tracker] | None = None) -> LaunchResult:
    """launch.sh's conversation: under the container's launch lock, stage package_for(its report) and start the
    task detached; wait until it runs. The one way gpuctl starts something that outlives the connection."""
    return finish_launch(begin_launch(ct, values, task, notify), package_for, replace_active, notify, progress)


@dataclass
class PendingLaunch:
    """launch.sh under the container's launch lock, its report made, waiting for gpuctl's answer."""

    ct: Container
    remote: RemoteCommand
    report: LaunchReply

    def abort(self) -> None:
        """Answer "abort": the script ends and the lock goes with it."""
        self.remote.send(LAUNCH_ABORT)
        self.remote.close_stdin()
        self.ct.finish(self.remote)


def begin_launch(ct: Container, values: dict[str, Any], task: str, notify: Notify) -> PendingLaunch:
    """The first half of launch.sh's conversation: the lock taken, the container's report read."""
    remote = ct.start("launch", **values)
    head, waiting = remote.read_until(LAUNCH_WAITING)
    if not waiting:  # the script ended before it could stage
        result = ct.finish(remote)
        early = LaunchReply.parse(head + result.stdout)
        if result.rc == ScriptExit.LOCKED:
            holder = (early.holder or "").strip() or "unknown"
            raise GpuctlError(f"another launch holds CT {ct.ctid}'s launch lock: {holder}", ExitCode.CONFLICT)
        if result.rc == ScriptExit.NO_PYTHON:
            raise _no_python(ct, early, task)
        raise ct.failure(result, "launch")
    report = LaunchReply.parse(head)  # under the lock, before our answer
    if report.recovered is not None:
        notify(f"took over CT {ct.ctid}'s launch lock from a launch that overran its deadline: {report.recovered}")
    return PendingLaunch(ct, remote, report)


def active_conflict(pending: PendingLaunch) -> GpuctlError:
    return _active_conflict(pending.ct, pending.report.active[0])


def finish_launch(pending: PendingLaunch, package_for: Callable[[LaunchReply], Package], replace_active: bool,
                  notify: Notify, progress: Callable[[int], Tracker] | None = None,
                  number: int | None = None) -> LaunchResult:
    """The second half: (with --replace, the active runs killed) stage package_for(the report), start the task as
    run `number` (None: the next one there), wait until it runs."""
    ct, remote, report = pending.ct, pending.remote, pending.report
    replaced = []
    if report.active:
        if not replace_active:
            pending.abort()
            raise active_conflict(pending)
        for active in report.active:
            notify(f"--replace: killing tl{active.number} first")
            replaced.append(kill(ct, active.number, "TERM", grace=30.0, notify=notify))
    package = package_for(report)
    plan = plan_stage(package, report.manifest)
    remote.send(launch_go(plan.changed_bytes, package.manifest(), number))
    tracker = progress(plan.changed_bytes) if progress and plan.archive else None
    try:
        sent_file_bytes = remote.send(plan.archive, kind="files", progress=tracker)
    finally:
        if tracker:
            tracker.close()
    remote.close_stdin()
    result = ct.finish(remote)
    reply = LaunchReply.parse(result.stdout)
    if result.rc == ScriptExit.ACTIVE:
        raise _active_conflict(ct, reply.active[0])
    if result.rc != 0 or reply.record is None:
        raise ct.failure(result, "launch")
    run, tail = wait_until_started(ct, reply.record["number"])
    return LaunchResult(run=run, package=package, plan=plan, sent_file_bytes=sent_file_bytes, tail=tail,
                        replaced=replaced, python=report.python, python_from=report.python_from)


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
    container_status: str  # "running", or "stopped" (then nothing inside it could be read)
    run: Run | None
    gpus: list[Gpu]
    losses: list[float] = field(default_factory=list)  # a sample of the run's losses, oldest first
    last_line: str | None = None  # the log's last line (asked for: a multi-node run's node)

    def to_json(self) -> dict:
        keys = ("run_id", "state", "exit_code", "pid", "pgid", "started_at", "ended_at", "elapsed_s", "log_path",
                "log_size", "progress", "config", "killed_signal", "resumed_from", "task", "python", "attempt",
                "attempts_left", "retry_of", "attempts", "last_failure", "retried_as", "retry_stopped")
        doc = self.run.to_json() if self.run else dict.fromkeys(keys)
        doc["gpus"] = [g.to_json() for g in self.gpus]
        doc["container"] = {"ctid": self.ctid, "status": self.container_status, "host": self.host}
        return doc


def status(ct: Container, run_number: int = 0, last_line: bool = False) -> StatusReport:
    try:
        inspection = inspect(ct, run_number, gpus=True, history=LOSS_HISTORY_POINTS, tail_lines=int(last_line))
    except ContainerNotRunning:
        return StatusReport(ctid=ct.ctid, host=ct.host, container_status="stopped", run=None, gpus=[])
    run = inspection.runs[0] if inspection.runs else None
    history = parse_metrics_lines(inspection.histories.get(run.number, b"")) if run else []
    by_step = {r["step"]: r["loss"] for r in history if isinstance(r.get("loss"), (int, float))}  # last line twice
    losses = [by_step[step] for step in sorted(by_step)]
    tail = inspection.tails.get(run.number, b"").decode(errors="replace").strip() if run else ""
    return StatusReport(ctid=ct.ctid, host=ct.host, container_status="running", run=run,
                        gpus=parse_gpus(inspection.gpus_csv), losses=losses, last_line=tail or None)


def list_runs(ct: Container) -> list[Run]:
    return inspect(ct, all_runs=True).runs


@dataclass
class MetricsHistory:
    """A run's metrics records, with those of the runs it resumed (oldest run first)."""

    runs: list[Run]
    records: list[dict[str, Any]]  # by step; a resumed run's records replace its predecessor's from its first step
    resumed_at: list[float]  # where each resumed run took over: between its predecessor's last step and its first


def metrics_history(ct: Container, run_number: int = 0) -> MetricsHistory:
    result = ct.run("metrics", run_number=run_number)
    if result.rc != 0:
        raise ct.failure(result, "reading the metrics")
    chain = MetricsChain.parse(result.stdout).links
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


# kill -----------------------------------------------------------------------------------------------------

@dataclass
class KillResult:
    run: Run | None  # None: there is no run at all
    signalled: bool  # False: nothing of the run was alive
    escalated: bool = False
    seconds: float = 0.0


def _kill_step(ct: Container, run_number: int, action: str, signal_name: str) -> KillReply:
    result = ct.run("kill", run_number=run_number, action=action, signal_name=signal_name,
                    signal_number=LINUX_SIGNALS[signal_name])
    if result.rc != 0:
        raise ct.failure(result, "kill")
    return KillReply.parse(result.stdout)


def kill(ct: Container, run_number: int, signal_name: str, grace: float, notify: Notify) -> KillResult:
    started = time.monotonic()
    signalled = _kill_step(ct, run_number, "signal", signal_name)
    run = signalled.run
    if run is None or not signalled.pids:
        return KillResult(run=run, signalled=False)
    notify(f"sent SIG{signal_name} to tl{run.number} ({len(signalled.pids)} processes); waiting up to {grace:g} s")

    def gone_within(seconds: float, sent: str) -> KillReply:
        @retry(stop=stop_after_delay(seconds), wait=wait_exponential(multiplier=0.02, max=0.5),
               retry=retry_if_result(lambda found: bool(found.pids)))
        def check() -> KillReply:
            found = _kill_step(ct, run.number, "check", sent)
            return found if found.run else KillReply(run=run, pids=found.pids)

        try:
            return check()
        except RetryError as e:
            return e.last_attempt.result()

    left = gone_within(grace, signal_name)
    escalated = False
    if left.pids:
        notify(f"tl{run.number} still has {len(left.pids)} processes after {grace:g} s: sending SIGKILL")
        escalated = True
        _kill_step(ct, run.number, "signal", "KILL")
        left = gone_within(KILL_VERIFY_S, "KILL")
        if left.pids:
            raise GpuctlError(f"processes {' '.join(map(str, left.pids))} of tl{run.number} survived SIGKILL",
                              ExitCode.RUN_FAILED)
    return KillResult(run=left.run, signalled=True, escalated=escalated, seconds=time.monotonic() - started)


# logs -----------------------------------------------------------------------------------------------------

def print_log(ct: Container, run_number: int, lines: int | None, write: Write) -> None:
    result = ct.stream("logs", on_stdout=write, run_number=run_number, follow=False, lines=lines, offset=0,
                       heartbeat_s=HEARTBEAT_S)
    if result.rc != 0:
        raise ct.failure(result, "reading the log")


def follow_log(ct: Container, run_number: int, lines: int | None, write: Write, offset: int | None = None,
               notify: Notify = lambda _: None, reconnect_s: float = RECONNECT_S) -> Run:
    """Stream the run's log until the run ends; every byte exactly once, across dropped connections (which are
    reconnected, and the stream resumed at the byte offset already written). Returns the ended run."""
    position, number = offset, run_number

    def follow_once() -> Run:
        nonlocal position, number
        received, stderr = 0, bytearray()
        start: FollowStart | None = None

        def on_stdout(data: bytes) -> None:
            nonlocal received
            write(data)
            received += len(data)

        def on_stderr(data: bytes) -> None:
            nonlocal start
            stderr.extend(data)
            start = start or parse_follow_start(stderr)

        try:
            result = ct.stream("logs", on_stdout=on_stdout, on_stderr=on_stderr, idle_timeout=4 * HEARTBEAT_S,
                               run_number=number, follow=True, lines=lines if position is None else None,
                               offset=position or 0, heartbeat_s=HEARTBEAT_S)
        finally:  # what was written counts, even when the connection dropped half-way
            if start:
                number, position = start.run, start.offset + received
        if result.rc != 0 or not start:
            raise ct.failure(result, "following the log")
        # tail may not have read the last bytes before the run's end stopped it: fetch them from the offset.
        inspection = inspect(ct, number, rest_from=position)
        rest = inspection.rests.get(number, b"")
        if rest:
            write(rest)
            position += len(rest)
        return inspection.runs[0]

    while True:
        run = reconnecting(ct, follow_once, notify, reconnect_s)
        if run.record.get("retried_as") and not run.state.active:  # launch --retry: on to the next attempt's log
            number, position = run.record["retried_as"], 0
            continue
        if not run.state.active:
            return run


def follow_exit_code(run: Run) -> ExitCode:
    return ExitCode.OK if run.state == State.SUCCEEDED else ExitCode.RUN_FAILED


# pull -----------------------------------------------------------------------------------------------------

class PullWhat(str, Enum):
    EXPORT = "export"
    CHECKPOINT = "checkpoint"
    METRICS = "metrics"
    DATA = "data"  # a regenerate run's output file


@dataclass
class PullResult:
    run: Run
    what: PullWhat
    source: str  # where the files are in the container
    export_from: str | None  # the checkpoint this pull made the export from (None: the export was there)
    dest: Path
    outcome: transfer.Outcome
    received_bytes: int  # what the SSH layer read in this invocation, all of it

    def to_json(self) -> dict[str, Any]:
        o = self.outcome
        return {"run_id": self.run.run_id, "what": self.what.value, "source": self.source,
                "export_made_from": self.export_from, "dest": str(self.dest),
                "files": [f.to_json() for f in o.files],
                "bytes": {"total": o.total, "sent": o.sent, "resumed": o.resumed, "skipped": o.skipped},
                "received_bytes": self.received_bytes}


def _pull_ended_early(ct: Container, remote: RemoteCommand, said: bytes, what: str) -> GpuctlError:
    result = ct.finish(remote)  # pct's errors and an unknown run (exit 2) raise here
    if result.rc == ScriptExit.NOTHING:
        lines = stderr_messages(result.stderr)
        return GpuctlError(f"nothing to pull: {lines[-1] if lines else 'no such file'} (CT {ct.ctid})",
                           ExitCode.RUN_FAILED)
    reply = PullReply.parse(said + result.stdout)
    if reply.export_from:
        return ct.failure(result, f"making the export of {PurePosixPath(reply.export_from).name}")
    return ct.failure(result, what)


def pull_destination(dest: str, what: PullWhat, with_optimizer: bool) -> transfer.Destination:
    """The options of a pull, checked before connecting: a bad DEST or combination is a usage error."""
    if with_optimizer and what != PullWhat.CHECKPOINT:
        raise usage_error("--with-optimizer is for --what checkpoint")
    return transfer.destination(dest, directory=what not in (PullWhat.METRICS, PullWhat.DATA))


def pull(ct: Container, run_number: int, what: PullWhat, dest: transfer.Destination, with_optimizer: bool,
         notify: Notify, progress: Callable[[int], Tracker] | None = None) -> PullResult:
    """Bring a run's export (made from its newest checkpoint when it has none that is current), newest checkpoint,
    metrics file or (a regenerate run's) data file to dest (from pull_destination), every file checked against the container's sha256
    (transfer.py says how)."""
    skip = "state.pt" if what == PullWhat.CHECKPOINT and not with_optimizer else ""
    remote = ct.start("pull", stage_dir=STAGE_DIR, what=what.value, skip=skip, run_number=run_number,
                      reply_timeout=int(PULL_REQUEST_S))
    said, located = remote.read_until(PULL_LOCATED)
    if not located:
        raise _pull_ended_early(ct, remote, said, "pull")
    where = PullReply.parse(said)
    if where.export_from:
        notify(f"{where.run.run_id} has no export as new as its checkpoints: making one from "
               f"{PurePosixPath(where.export_from).name} in CT {ct.ctid} (python -m training.export)")
    rest, waiting = remote.read_until(PULL_WAITING)
    if not waiting:
        raise _pull_ended_early(ct, remote, said + rest, "pull")
    reply = PullReply.parse(said + rest)
    try:
        plan = transfer.plan(dest, reply.files)
    except GpuctlError:
        remote.send(pull_request([]), kind="request")
        remote.close_stdin()
        ct.finish(remote)
        raise
    remote.send(pull_request(plan.wanted), kind="request")
    remote.close_stdin()
    tracker = progress(plan.to_send) if progress and plan.to_send else None
    receiver = transfer.Receiver(plan, tracker)
    try:
        result = ct.finish(remote, on_stdout=receiver)
    except ConnectionLost as lost:
        receiver.close()
        raise ConnectionLost(f"{lost}; {receiver.kept} bytes of it are kept in {plan.staging}: the same pull "
                             "continues from there") from None
    finally:
        receiver.close()
        if tracker:
            tracker.close()
    if result.rc != 0:
        raise ct.failure(result, "pull")
    if not receiver.complete or receiver.trailer:
        raise GpuctlError(f"the container sent {'less' if not receiver.complete else 'more'} than it announced; "
                          "run the pull again", ExitCode.RUN_FAILED)
    transfer.commit(plan)
    return PullResult(run=reply.run, what=what, source=reply.source or "", export_from=reply.export_from,
                      dest=dest.path, outcome=transfer.outcome(plan, receiver),
                      received_bytes=ct.session.stats.received)
