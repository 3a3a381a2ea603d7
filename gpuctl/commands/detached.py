"""The one way gpuctl starts something that outlives the connection (ARCHITECTURE §3, "Detaching"): launch.sh's
conversation under the container's launch lock, the staged package, the wrapper, and the wait until the task
runs. A training run, a regeneration, `gpuctl setup`'s installation and each node of a multi-node run all
start here; launch.sh's conversation is split at its waiting point (begin, then PendingStart.finish) so a
multi-node launch can hear every node before any starts.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from tenacity import RetryError, retry, retry_if_result, stop_after_delay, wait_exponential

from gpuctl import __version__
from gpuctl.address import Address
from gpuctl.commands.kill import KILL_VERIFY_S, KillResult, kill
from gpuctl.commands.records import inspect
from gpuctl.commands.session import Notify, Progress
from gpuctl.errors import ExitCode, GpuctlError, usage_error
from gpuctl.paths import INTERPRETER_FILE, RECORDS_DIR, STAGE_DIR
from gpuctl.remote import scripts
from gpuctl.remote.container import Container
from gpuctl.remote.protocol import (
    LAUNCH_ABORT,
    LAUNCH_WAITING,
    Inspection,
    LaunchReply,
    ScriptExit,
    launch_go,
)
from gpuctl.remote.ssh import RemoteCommand
from gpuctl.runs import Run, State
from gpuctl.staging import Package, PackageFile, StagePlan, file_from_bytes, plan_stage
from gpuctl.timeouts import timeouts

LAUNCH_TAIL_LINES = 20
PackageFor = Callable[[LaunchReply], Package]  # the package to stage, once the container's report is in


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
    queued_behind: list[int] = field(default_factory=list)  # launch --queue: the runs active when it queued

    @property
    def number(self) -> int:
        return self.run.number

    @property
    def failed(self) -> bool:
        """The run ended during its start; a failed first attempt that --retry restarts is no failure yet."""
        return self.run.state in (State.FAILED, State.KILLED, State.LOST) and not self.run.record.get("retried_as")

    def staging_json(self) -> dict[str, Any]:
        return {"files": len(self.package.files), "bytes": self.package.size, "digest": self.package.digest,
                "sent_files": self.plan.changed, "sent_bytes": self.sent_file_bytes}


def _holder() -> str:
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    return f"{who} (gpuctl pid {os.getpid()}, since {datetime.now(timezone.utc).isoformat(timespec='seconds')})"


def values(address: Address, task: str, fields: dict[str, Any], *, python: str | None,
           use_recorded_python: bool, log_dir: str, workdir: str, keep_compile_cache: bool,
           replacing: bool, find_address: bool = False, run_home: str = "", name: str | None = None) -> dict[str, Any]:
    """launch.sh's values for a detached task: "train" and "regenerate" run the staged run.sh (a training run, a
    data regeneration), "setup" the staged setup.sh (gpuctl setup's installation); each has its own numbered log
    (<task>_tlN.log) and a record that names the task. find_address: the script reports the container's address
    (a multi-node run's node 0, for MASTER_ADDR). run_home: the run whose directory the trainer writes (a resumed
    run's home, `tlK`); "" = the new run's own number. name: launch --name's, which launch.sh refuses when a run
    has it."""
    record_fields = {
        "task": task, "host": address.host, "container": address.ct, **fields,
        "launched_by": f"{getpass.getuser()}@{socket.gethostname()}", "gpuctl_version": __version__,
    }
    reply_timeout = timeouts().lock_reply + (2 * 30.0 + KILL_VERIFY_S if replacing else 0)
    log_stem = f"{task}_tl"
    return {
        "stage_dir": STAGE_DIR, "log_dir": log_dir, "workdir": workdir, "python": python or "",
        "interpreter_file": INTERPRETER_FILE if use_recorded_python else "", "entry": TASK_ENTRIES[task],
        "keep_compile_cache": keep_compile_cache, "holder": _holder(), "reply_timeout": int(reply_timeout),
        "find_address": find_address, "run_home": run_home, "run_name": name or "",
        "log_stem": log_stem, "log_prefix": json.dumps(f"{log_dir.rstrip('/')}/{log_stem}")[:-1],
        "record_fields": json.dumps(record_fields)[1:-1],
    }


# What the wrapper runs, in the staged package; a task's log is <task>_tlN.log.
TASK_ENTRIES = {"train": "run.sh", "regenerate": "run.sh", "setup": "setup.sh"}


def wrapper_file() -> PackageFile:
    """gpuctl-wrapper.sh, which runs a detached task and records how it ended."""
    wrapper = scripts.render("wrapper.sh", records_dir=RECORDS_DIR, stage_dir=STAGE_DIR)  # a queued run's switch
    return file_from_bytes("gpuctl-wrapper.sh", wrapper.encode(), 0o755)


def shown(address: Address, values: dict[str, Any]) -> str:
    """What a --dry-run shows of a start: the command on the host and the launch script it is sent."""
    command = scripts.render("pct_exec", ctid=address.ct).strip()
    script = scripts.render("launch.sh", records_dir=RECORDS_DIR, **values)
    return f"# on {address.host}: {command}   (script on stdin)\n{script}\n"


def _active_conflict(ct: Container, active: list[Run]) -> GpuctlError:
    """The run at work named (else the first queued one), and the runs queued behind it."""
    runs = sorted(active, key=lambda run: (run.never_started, run.number))
    first, queued = runs[0], [run.run_id for run in runs if run.never_started and run is not runs[0]]
    launched_by = first.record.get("launched_by")
    by = f" (launched by {launched_by})" if launched_by else ""
    what = "queued" if first.never_started else "active"
    behind = f", {', '.join(queued)} queued behind it" if queued else ""
    return GpuctlError(f"run {first.label} is {what} in CT {ct.ctid}{by}{behind}: launch with --queue to start after "
                       f"{'them' if queued else 'it'}, stop it (gpuctl kill --run {first.number}), or launch with "
                       "--replace", ExitCode.CONFLICT)


def _no_python(ct: Container, reply: LaunchReply, task: str) -> GpuctlError:
    python = reply.python or "python3"
    if reply.python_from == "option":
        return usage_error(f"{python!r} not found in CT {ct.ctid}: pass --python PATH")
    if reply.python_from == "recorded":
        return GpuctlError(f"{python}, the interpreter gpuctl setup recorded in {INTERPRETER_FILE}, is gone from CT "
                           f"{ct.ctid}: run gpuctl setup again (or pass --python PATH)", ExitCode.ENV_NOT_READY)
    fix = "install Python >= 3.10 in it" if task == "setup" else "gpuctl setup prepares one"
    return GpuctlError(f"no {python} in CT {ct.ctid}: {fix} (or pass --python PATH)", ExitCode.ENV_NOT_READY)


def start(ct: Container, values: dict[str, Any], package_for: PackageFor, task: str, replace_active: bool,
          notify: Notify, progress: Progress | None = None, queue: bool = False) -> LaunchResult:
    """launch.sh's conversation: under the container's launch lock, stage package_for(its report) and start the
    task detached; wait until it runs. queue: with a run active, the task waits its turn (launch --queue)."""
    return begin(ct, values, task, notify).finish(package_for, replace_active, notify, progress, queue=queue)


def nothing_started(ct: Container, replaced: list[KillResult] = ()) -> GpuctlError:
    """Ctrl-C before gpuctl said go: launch.sh reads no answer (its stdin ends with gpuctl) and starts nothing."""
    killed = f" ({', '.join(r.run.run_id for r in replaced if r.run)} was killed first: --replace)" if replaced else ""
    return GpuctlError(f"interrupted before the start: nothing was started in CT {ct.ctid}{killed}",
                       ExitCode.INTERRUPTED)


def started_anyway(number: int) -> GpuctlError:
    return GpuctlError(f"interrupted: tl{number} was started (the start was sent before the Ctrl-C) and runs on; "
                       f"gpuctl kill --run {number} stops it", ExitCode.INTERRUPTED)


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[list[int]]:
    """From gpuctl's go to the container's answer, a first Ctrl-C is remembered (the list it yields), not raised:
    the container is starting the run, and gpuctl must learn its number to say so. A second one interrupts at once.
    The handler only records (it may run inside a print of the main thread). Signals reach the main thread only:
    elsewhere (a node's start in a multi-node launch, which has its own) nothing changes."""
    asked: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield asked
        return

    def remember(signum: int, frame: Any) -> None:
        if asked:
            raise KeyboardInterrupt
        asked.append(signum)

    previous = signal.signal(signal.SIGINT, remember)
    try:
        yield asked
    finally:
        signal.signal(signal.SIGINT, previous)


def begin(ct: Container, values: dict[str, Any], task: str, notify: Notify) -> PendingStart:
    """The first half of launch.sh's conversation: the lock taken, the container's report read."""
    try:
        return _begin(ct, values, task, notify)
    except KeyboardInterrupt:
        raise nothing_started(ct) from None


def _begin(ct: Container, values: dict[str, Any], task: str, notify: Notify) -> PendingStart:
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
    pending = PendingStart(ct, remote, report)
    if report.name_taken is not None:
        pending.abort()
        raise usage_error(f"--name {values['run_name']} is taken in CT {ct.ctid} by tl{report.name_taken}: choose "
                          "another (gpuctl runs shows the names)")
    return pending


@dataclass
class PendingStart:
    """launch.sh under the container's launch lock, its report made, waiting for gpuctl's answer."""

    ct: Container
    remote: RemoteCommand
    report: LaunchReply

    def abort(self) -> None:
        """Answer "abort": the script ends and the lock goes with it."""
        self.remote.send(LAUNCH_ABORT)
        self.remote.close_stdin()
        self.ct.finish(self.remote)

    def conflict(self) -> GpuctlError:
        """The error for the container's active run."""
        return _active_conflict(self.ct, self.report.active)

    def finish(self, package_for: PackageFor, replace_active: bool, notify: Notify, progress: Progress | None = None,
               number: int | None = None, secret: str | None = None, queue: bool = False) -> LaunchResult:
        """The second half: (with --replace, the active runs killed) stage package_for(the report), start the task
        as run `number` (None: the next one there), wait until it runs. secret: a multi-node run's node secret,
        which the container keeps for the run in tlN.secret (launch_go). queue: with runs active, the task is
        queued behind them instead (its wrapper waits in the container; the result's run is `queued`)."""
        replaced: list[KillResult] = []
        try:
            plan, package, queue = self._before_go(package_for, replace_active, notify, queue, replaced)
        except KeyboardInterrupt:
            raise nothing_started(self.ct, replaced) from None
        try:
            with deferred_interrupt() as asked:
                reply, sent_file_bytes = self._go(plan, package, number, secret, queue, progress)
        except KeyboardInterrupt:  # a second Ctrl-C while the start was under way
            raise GpuctlError(f"interrupted while CT {self.ct.ctid} was starting the run: it may have started "
                              "(gpuctl status shows it; gpuctl kill stops it)", ExitCode.INTERRUPTED) from None
        number = reply.record["number"]
        if asked:
            raise started_anyway(number)
        try:
            run, tail = wait_until_started(self.ct, number)
        except KeyboardInterrupt:
            raise started_anyway(number) from None
        behind = sorted(r.number for r in self.report.active) if run.record.get("queued") else []
        return LaunchResult(run=run, package=package, plan=plan, sent_file_bytes=sent_file_bytes, tail=tail,
                            replaced=replaced, python=self.report.python, python_from=self.report.python_from,
                            queued_behind=behind)

    def _before_go(self, package_for: PackageFor, replace_active: bool, notify: Notify, queue: bool,
                   replaced: list[KillResult]) -> tuple[StagePlan, Package, bool]:
        """What comes before gpuctl's go: the conflicts, --replace's kills (into `replaced`), the staging plan."""
        ct, report = self.ct, self.report
        queue = queue and bool(report.active)
        setup = next((run for run in report.active if run.task == "setup"), None)
        if queue and setup and report.python_from != "option":
            # run.sh names the interpreter the container has now, and gpuctl setup records its own at its end.
            self.abort()
            raise GpuctlError(f"gpuctl setup ({setup.run_id}) is still making CT {ct.ctid}'s environment, and a "
                              "queued run's interpreter is chosen now: launch once setup has ended (gpuctl logs -f "
                              f"--run {setup.number} follows it), or pass --python PATH", ExitCode.CONFLICT)
        if report.active and not queue:
            if not replace_active:
                self.abort()
                raise self.conflict()
            # The queued runs first, the last queued first: none of them wakes to find the runs ahead gone.
            for active in sorted(report.active, key=lambda run: (not run.never_started, -run.number)):
                notify(f"--replace: killing tl{active.number} first")
                replaced.append(kill(ct, active.number, "TERM", grace=30.0, notify=notify))
        package = package_for(report)
        return plan_stage(package, report.manifest), package, queue

    def _go(self, plan: StagePlan, package: Package, number: int | None, secret: str | None, queue: bool,
            progress: Progress | None) -> tuple[LaunchReply, int]:
        """gpuctl's go and the package, then the container's answer: the run started (or queued)."""
        ct, remote = self.ct, self.remote
        remote.send(launch_go(plan.changed_bytes, package.manifest(), number, secret, queue=queue))
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
            raise _active_conflict(ct, reply.active)
        if result.rc != 0 or reply.record is None:
            raise ct.failure(result, "launch")
        return reply, sent_file_bytes


def wait_until_started(ct: Container, number: int) -> tuple[Run, bytes]:
    """Poll until the run's process is alive and its log exists, or it already ended (then with its tail)."""

    def pending(inspection: Inspection) -> bool:
        run = inspection.runs[0]
        return run.state == State.STARTING or (run.state == State.RUNNING and (run.log_size or -1) < 0)

    start_s = timeouts().start

    @retry(stop=stop_after_delay(start_s), wait=wait_exponential(multiplier=0.02, max=0.5),
           retry=retry_if_result(pending))
    def probe() -> Inspection:
        return inspect(ct, number, tail_lines=LAUNCH_TAIL_LINES)

    try:
        inspection = probe()
    except RetryError:
        raise GpuctlError(f"tl{number} did not start within {start_s:g} s (see gpuctl logs --run "
                          f"{number})", ExitCode.RUN_FAILED) from None
    run = inspection.runs[0]
    return run, b"" if run.state.active else inspection.tails.get(number, b"")

