"""`gpuctl pull`: a run's export, newest checkpoint, metrics or data to DEST, every file checked by sha256
(pull.sh's conversation here, the receiving end in gpuctl.remote.transfer)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from gpuctl.commands.session import Notify, Tracker
from gpuctl.errors import ExitCode, GpuctlError, usage_error
from gpuctl.paths import STAGE_DIR
from gpuctl.remote import transfer
from gpuctl.remote.container import Container
from gpuctl.remote.protocol import (
    PULL_LOCATED,
    PULL_WAITING,
    PullReply,
    ScriptExit,
    pull_request,
    stderr_messages,
)
from gpuctl.remote.ssh import ConnectionLost, RemoteCommand
from gpuctl.runs import PullWhat, Run

# How long pull.sh waits for gpuctl's request: gpuctl first hashes what it has of the files (GBs, maybe).
PULL_REQUEST_S = 600.0


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
    reply = PullReply.parse(said + result.stdout)
    if result.rc == ScriptExit.NOTHING:
        lines = stderr_messages(result.stderr)
        failed = reply.run.failure if reply.run else None  # why the run ended, when it failed
        why = f" ({reply.run.run_id}: {failed})" if failed else ""
        return GpuctlError(f"nothing to pull: {lines[-1] if lines else 'no such file'}{why} (CT {ct.ctid})",
                           ExitCode.RUN_FAILED)
    if reply.export_from:
        return ct.failure(result, f"making the export of {PurePosixPath(reply.export_from).name}")
    return ct.failure(result, what)


def _receive(ct: Container, remote: RemoteCommand, plan: transfer.PullPlan,
             progress: Callable[[int], Tracker] | None) -> transfer.Receiver:
    """Ask for what must travel and take it in; every file arrived, checked and staged."""
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
    if not receiver.complete or receiver.extra:
        raise GpuctlError(f"the container sent {'less' if not receiver.complete else 'more'} than it announced; "
                          "run the pull again", ExitCode.RUN_FAILED)
    return receiver


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
    files = reply.files
    if what == PullWhat.METRICS and len(files) > 1 and not dest.in_directory:
        notify(f"{reply.run.run_id}'s TensorBoard event files stay in CT {ct.ctid}: pull the metrics into a "
               "directory (DEST/) to bring them along")
        files = files[:1]  # the JSON lines, first in pull.sh's manifest
    try:
        plan = transfer.plan(dest, files)
    except GpuctlError:
        remote.send(pull_request([]), kind="request")
        remote.close_stdin()
        ct.finish(remote)
        raise
    try:
        receiver = _receive(ct, remote, plan, progress)
        transfer.commit(plan)
    finally:
        plan.release()  # the staging directory's lock: another pull to DEST may go on
    return PullResult(run=reply.run, what=what, source=reply.source or "", export_from=reply.export_from,
                      dest=dest.path, outcome=transfer.outcome(plan, receiver),
                      received_bytes=ct.session.stats.received)
