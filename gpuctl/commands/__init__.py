"""What each gpuctl command does, below the CLI: no Typer, no Rich (pipx's commands/). Each command takes its
scope (gpuctl.commands.scope: one container or a node set, resolved once) or an open Container, and returns a
result object that gpuctl.ui.render turns into text or JSON. Every wait is a bounded tenacity retry.

The modules, top to bottom: `scope` (one or many), `nodes` (a multi-node run) over `fanout` (every node at
once); `launch`, `doctor` (and setup) over `detached` (the one way to start something that outlives the
connection); `resume`, `options` (a launch's); `status`, `kill`, `logs`, `pull`; `session` (the connection).
"""

from gpuctl.commands.detached import LaunchResult
from gpuctl.commands.launch import plan_launch
from gpuctl.commands.logs import follow_exit_code, follow_log, print_log
from gpuctl.commands.options import LaunchOptions, LaunchTask, check_python
from gpuctl.commands.pull import PullWhat, pull, pull_destination
from gpuctl.commands.scope import Nodes, One, Scope, kept, resolve, resolve_launch
from gpuctl.commands.session import BOUND_S, connected, reconnecting
from gpuctl.commands.status import metrics_history

__all__ = [
    "BOUND_S", "LaunchOptions", "LaunchResult", "LaunchTask", "Nodes", "One", "PullWhat", "Scope", "check_python",
    "connected", "follow_exit_code", "follow_log", "kept", "metrics_history", "plan_launch", "print_log", "pull",
    "pull_destination", "reconnecting", "resolve", "resolve_launch",
]
