"""How long gpuctl waits for what: each limit's default, or the `[timeouts]` table of the user's config.toml
(docs/ARCHITECTURE.md §2, "Time"). A slow link or a loaded host may want longer ones; the tests write short
ones into the config file of the HOME they give gpuctl. Read once per process."""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, fields, replace

from gpuctl import address, paths
from gpuctl.errors import usage_error


@dataclass(frozen=True)
class Timeouts:
    """Seconds. A remote command that sends no byte (output or heartbeat) for `idle` means the host or the link
    is dead (exit 3); gpuctl's scripts send a heartbeat every `heartbeat` seconds so that a slow step is not
    taken for that."""

    heartbeat: float = 5.0  # a script gpuctl talks to says it is alive this often (templates/lib.sh.j2)
    idle: float = 30.0  # nothing heard from a remote command for this long: exit 3
    probe: float = 10.0  # a container-side probe (nvidia-smi, du, df) answers within it or is killed
    start: float = 30.0  # a launched run has started (its trainer's pid recorded) within it, or launch fails
    lock_reply: float = 120.0  # the container's side of a launch waits this long for gpuctl while it holds the lock
    reconnect: float = 60.0  # `logs -f` gets a lost connection back within it, or exit 3
    command_bound: float = 120.0  # status, runs, kill and doctor: each remote command ends within it, or exit 3


NAMES = tuple(f.name for f in fields(Timeouts))


def from_table(table: object, where: str) -> Timeouts:
    """The limits a `[timeouts]` table gives, the rest their defaults; one line naming the key for a mistake.
    `idle` not given is at least 4 heartbeats (a link is not taken for dead between two of them)."""
    if not isinstance(table, dict):
        raise usage_error(f"{where}: [timeouts] must be a table of seconds, got {table!r}")
    given: dict[str, float] = {}
    for key, value in table.items():
        if key not in NAMES:
            near = difflib.get_close_matches(key, NAMES, n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"known: {', '.join(NAMES)}"
            raise usage_error(f"{where}: unknown key timeouts.{key} ({hint})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
            raise usage_error(f"{where}: timeouts.{key} must be seconds in (0, 86400], got {value!r}")
        given[key] = float(value)
    limits = replace(Timeouts(), **given)
    if "idle" not in given:
        limits = replace(limits, idle=max(limits.idle, 4 * limits.heartbeat))
    return limits


@functools.cache
def timeouts() -> Timeouts:
    """This process's limits: config.toml's `[timeouts]`, else the defaults."""
    return from_table(address.read_config().get("timeouts", {}), str(paths.config_file()))
