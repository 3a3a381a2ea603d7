"""`gpuctl runs rm` and `gpuctl runs prune`: finished runs' files gone from the container, never an active run's.
remove.sh chooses and removes under the container's launch lock (ARCHITECTURE §2, "Removing runs"); here its
report becomes the result, and its refusals gpuctl's errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuctl.commands.detached import _holder
from gpuctl.errors import ExitCode, GpuctlError
from gpuctl.remote.container import Container
from gpuctl.remote.protocol import Removal, RemoveReply, ScriptExit
from gpuctl.runs import RunRef


@dataclass
class Removed:
    removals: list[Removal]  # in number order
    dry_run: bool
    ctid: int
    host: str
    keep: int | None = None  # prune's --keep
    errors: list[GpuctlError] = field(default_factory=list)  # none: one container's failure is raised

    def to_json(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "container": {"ctid": self.ctid, "host": self.host},
                "runs": [{"run_id": r.run.run_id, "name": r.run.name, "state": r.run.state.value, "paths": r.paths,
                          "kept": [{"path": path, "why": why} for path, why in r.kept]} for r in self.removals]}


def remove(ct: Container, refs: list[RunRef], keep: int | None, dry_run: bool) -> Removed:
    """runs rm (refs) or, with keep, runs prune."""
    return prune_runs(ct, keep, dry_run) if keep is not None else remove_runs(ct, refs, dry_run)


def remove_runs(ct: Container, refs: list[RunRef], dry_run: bool) -> Removed:
    """runs rm: these runs (numbers or names), all or none: an active one refuses the whole removal."""
    return _remove(ct, dry_run, refs=[str(ref) for ref in refs], keep="")


def prune_runs(ct: Container, keep: int, dry_run: bool) -> Removed:
    """runs prune: every finished run but the newest `keep` finished ones."""
    return _remove(ct, dry_run, refs=[], keep=str(keep))


def _remove(ct: Container, dry_run: bool, refs: list[str], keep: str) -> Removed:
    result = ct.run("remove", refs=refs, keep=keep, dry_run="1" if dry_run else "0", holder=_holder())
    reply = RemoveReply.parse(result.stdout)
    if result.rc == ScriptExit.ACTIVE:
        runs = ", ".join(f"{run.label}" for run in reply.active)
        verb = "is" if len(reply.active) == 1 else "are"
        raise GpuctlError(f"{runs} {verb} active in CT {ct.ctid}: a run is removed once it has ended (gpuctl kill "
                          f"--run {reply.active[0].number} stops it); nothing was removed", ExitCode.CONFLICT)
    if result.rc == ScriptExit.LOCKED:
        raise GpuctlError(f"a launch holds CT {ct.ctid}'s launch lock ({reply.holder}); nothing was removed: try "
                          "again in a moment", ExitCode.CONFLICT)
    if result.rc != 0:
        raise ct.failure(result, "removing runs")
    return Removed(reply.removals, dry_run, ct.ctid, ct.host, keep=int(keep) if keep else None)
