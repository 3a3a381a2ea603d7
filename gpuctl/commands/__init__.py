"""What each gpuctl command does, below the CLI: no Typer, no Rich (pipx's commands/). Each command takes its
scope (gpuctl.commands.scope: one container or a node set, resolved once) or an open Container, and returns a
result object that gpuctl.ui.render turns into text or JSON. Every wait is a bounded tenacity retry.

The modules, top to bottom: `scope` (one or many), `nodes` (a multi-node run) over `fanout` (every node at
once); `launch`, `doctor` (and setup) over `detached` (the one way to start something that outlives the
connection); `resume`, `options` (a launch's); `status`, `kill`, `logs`, `pull`; `session` (the connection).

The names below are imported when first used (PEP 562), so a command that needs one module (the command line's
help needs only `options`) does not import them all, and paramiko with them. (A pull is
gpuctl.commands.pull.pull: once that module is imported, `commands.pull` names the module.)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what __getattr__ gives, spelt out for readers and the layering test
    from gpuctl.commands.detached import LaunchResult
    from gpuctl.commands.launch import plan_launch
    from gpuctl.commands.logs import follow_exit_code, follow_log, print_log
    from gpuctl.commands.options import LaunchOptions, LaunchTask, PullWhat, check_python
    from gpuctl.commands.pull import pull_destination
    from gpuctl.commands.scope import Nodes, One, Scope, kept, resolve, resolve_launch
    from gpuctl.commands.session import BOUND_S, connected, reconnecting
    from gpuctl.commands.status import metrics_history, prepare_status

_HOMES = {
    "LaunchResult": "detached", "plan_launch": "launch", "follow_exit_code": "logs", "follow_log": "logs",
    "print_log": "logs", "LaunchOptions": "options", "LaunchTask": "options", "PullWhat": "options",
    "check_python": "options", "pull_destination": "pull", "Nodes": "scope", "One": "scope",
    "Scope": "scope", "kept": "scope", "resolve": "scope", "resolve_launch": "scope", "BOUND_S": "session",
    "connected": "session", "reconnecting": "session", "metrics_history": "status", "prepare_status": "status",
}
__all__ = [
    "BOUND_S", "LaunchOptions", "LaunchResult", "LaunchTask", "Nodes", "One", "PullWhat", "Scope", "check_python",
    "connected", "follow_exit_code", "follow_log", "kept", "metrics_history", "plan_launch", "prepare_status",
    "print_log", "pull_destination", "reconnecting", "resolve", "resolve_launch",
]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once
    return value
