"""`gpuctl kill`: signal a run's whole process group, escalate to SIGKILL after the grace, check that nothing of
it is left (ARCHITECTURE §3: checked against the recorded kernel start time, never by name)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tenacity import RetryError, retry, retry_if_result, stop_after_delay, wait_exponential

from gpuctl.commands.session import Notify
from gpuctl.errors import ExitCode, GpuctlError
from gpuctl.remote.container import Container
from gpuctl.remote.protocol import KillReply
from gpuctl.runs import LINUX_SIGNALS, Run

KILL_VERIFY_S = 10.0  # after SIGKILL, how long the group may take to disappear


@dataclass
class KillResult:
    run: Run | None  # None: there is no run at all
    signalled: bool  # False: nothing of the run was alive
    escalated: bool = False
    seconds: float = 0.0


@dataclass
class Killed:
    """kill over one container or every node: each result with where it was ("" for one container, else the
    node), and the nodes that could not be reached or killed (the others were)."""

    results: list[tuple[str, KillResult]]
    errors: list[GpuctlError] = field(default_factory=list)


def _kill_step(ct: Container, run_number: int, action: str, signal_name: str) -> KillReply:
    return ct.call("kill", KillReply, "kill", run_number=run_number, action=action, signal_name=signal_name,
                   signal_number=LINUX_SIGNALS[signal_name])


def kill(ct: Container, run_number: int, signal_name: str, grace: float, notify: Notify) -> KillResult:
    signalled = _kill_step(ct, run_number, "signal", signal_name)
    started = time.monotonic()  # the grace, and the time the result says, count from the signal
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

