"""What each gpuctl command does, below the CLI: no Typer, no Rich (pipx's commands/). Each command takes its
scope (gpuctl.commands.scope: one container or a node set, resolved once) or an open Container, and returns a
result object that gpuctl.ui.render turns into text or JSON. Every wait is a bounded tenacity retry.

The modules, top to bottom: `scope` (one or many), `nodes` (a multi-node run) over `fanout` (every node at
once); `launch`, `doctor` (and setup) and `remove` (runs rm, runs prune) over `detached` (the one way to start
something that outlives the connection); `resume`, `options` (a launch's); `status`, `kill`, `logs`, `pull`,
`shell`; `records` (the run records read through the connection); `session` (the connection).

The names below are imported when first used (PEP 562), so a command that needs one module (the command line's
help needs only `options`) does not import them all, and paramiko with them. (A pull is
gpuctl.commands.pull.pull: once that module is imported, `commands.pull` names the module.)
"""

from __future__ import annotations

import importlib

# Each name once, under the module it lives in (its home): `commands.X` imports X's home when first used.
_EXPORTS = {
    "detached": ("LaunchResult",),
    "launch": ("plan_launch",),
    "logs": ("follow_exit_code", "follow_log", "print_log"),
    "options": ("LaunchOptions", "LaunchTask", "check_python"),
    "resume": ("Finished",),
    "pull": ("pull_destination",),
    "scope": ("NodeSet", "One", "Scope", "kept", "resolve", "resolve_launch"),
    "session": ("connected", "reconnecting"),
    "status": ("metrics_history", "prepare_status"),
}
_HOMES = {name: home for home, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once
    return value
