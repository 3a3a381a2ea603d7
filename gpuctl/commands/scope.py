"""What a command acts on, resolved once: one container, or the nodes of a multi-node run (ARCHITECTURE §8).

Both scopes answer the same calls (launch, status, runs, kill, the log to read), so a command makes one call
whatever the scope: the choice between one and many is made here, in `resolve`, and nowhere above.

What only some commands use (a multi-node run's modules, a launch's, a kill's) is imported by the call that uses
it: `gpuctl status` of one container imports none of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpuctl.address import Address, AddressFlags, remember, remembered_nodes, resolve_nodes
from gpuctl.address import resolve as resolve_address
from gpuctl.commands.options import LaunchOptions, check_launch_options
from gpuctl.commands.session import Notify, Progress, connected, reconnecting
from gpuctl.commands.status import ContainerRuns, StatusReport, list_runs, status
from gpuctl.errors import ExitCode, GpuctlError, usage_error
from gpuctl.runs import RunRef

if TYPE_CHECKING:
    from gpuctl.commands import nodes as multi
    from gpuctl.commands.detached import LaunchResult
    from gpuctl.commands.fanout import Node
    from gpuctl.commands.kill import Killed
    from gpuctl.commands.remove import Removed
    from gpuctl.remote import ssh
    from gpuctl.remote.container import Container


@dataclass
class One:
    """One container: the address of the options, the environment, the last launch or config.toml."""

    address: Address
    ct: Container | None = None  # while connected

    def checked(self, opts: LaunchOptions) -> LaunchOptions:
        return check_launch_options(opts)

    def plan_launch(self, opts: LaunchOptions) -> str:
        from gpuctl.commands.launch import plan_launch

        return plan_launch(self.address, opts)

    @contextmanager
    def connected(self, stats: ssh.Stats | None, bound_s: float | None = None,
                  meanwhile: Callable[[], object] | None = None) -> Iterator[One]:
        with connected(self.address, stats, bound_s, meanwhile) as self.ct:
            yield self

    @property
    def first(self) -> Container:
        """The container a follower reads (a multi-node run's: node 0's)."""
        return self.ct

    def launch(self, opts: LaunchOptions, notify: Notify, progress: Progress | None) -> LaunchResult:
        from gpuctl.commands.detached import nothing_started
        from gpuctl.commands.launch import launch

        try:
            return launch(self.ct, self.address, opts, notify=notify, progress=progress)
        except KeyboardInterrupt:  # before the container's lock (reading a resumed run): nothing was sent to start
            raise nothing_started(self.ct) from None

    def remember(self, result: LaunchResult, warn: Notify) -> None:
        """Keep this target for the next command (after the launch is shown: a failure here is a warning)."""
        kept(lambda: remember(self.address), warn)

    def status(self, number: int, reconnect: Notify | None = None) -> StatusReport:
        """reconnect: a watch's messages, when a dropped connection is to be made again."""
        if reconnect:
            return reconnecting(self.ct, lambda: status(self.ct, number), reconnect)
        return status(self.ct, number)

    def runs(self) -> ContainerRuns:
        return ContainerRuns(list_runs(self.ct), self.address.ct, self.address.host)

    def kill(self, number: int, signal_name: str, grace: float, notify: Notify) -> Killed:
        from gpuctl.commands.kill import Killed, kill

        return Killed([("", kill(self.ct, number, signal_name, grace, notify=notify))])

    def remove(self, refs: list[RunRef], keep: int | None, dry_run: bool) -> Removed:
        """runs rm (refs) or runs prune (keep)."""
        from gpuctl.commands.remove import remove

        return remove(self.ct, refs, keep, dry_run)

    def log_source(self, node: int | None, number: int) -> tuple[Address, int]:
        """The address and run number whose log `logs` reads (--node K is for a multi-node run)."""
        if node:
            raise usage_error("--node K is for the nodes of a multi-node run (the last launch was not one)")
        return self.address, number


@dataclass
class NodeSet:
    """The nodes of a multi-node run, node 0 first: `launch --node`/`--cluster`'s, or the last launch's (with its
    run number, which `run` is then)."""

    addresses: list[Address]
    run: int = 0  # the remembered run's number; 0: none (a new launch)
    master_addr: str | None = None  # None: a resumed run's, else node 0's own address
    master_port: int | None = None  # None: a resumed run's, else multi.DEFAULT_MASTER_PORT
    nodes: list[Node] = field(default_factory=list)  # while connected

    def checked(self, opts: LaunchOptions) -> LaunchOptions:
        from gpuctl.commands import nodes as multi

        opts = check_launch_options(opts)
        multi.check_cluster_options(self.addresses, opts, self.master_addr, self.master_port)
        return opts

    def plan_launch(self, opts: LaunchOptions) -> str:
        from gpuctl.commands import nodes as multi

        return multi.plan_launch(self.addresses, opts, self.master_addr, self.master_port)

    @contextmanager
    def connected(self, stats: ssh.Stats | None, bound_s: float | None = None,
                  meanwhile: Callable[[], object] | None = None) -> Iterator[NodeSet]:
        from gpuctl.commands.fanout import connected as connected_nodes

        with connected_nodes(self.addresses, stats, bound_s, meanwhile) as self.nodes:
            yield self

    @property
    def first(self) -> Container:
        return self.nodes[0].ct

    def launch(self, opts: LaunchOptions, notify: Notify, progress: Progress | None) -> multi.ClusterLaunch:
        from gpuctl.commands import nodes as multi

        try:
            return multi.launch(self.nodes, opts, self.master_addr, self.master_port, notify=notify)
        except KeyboardInterrupt:  # multi.launch undid every node's start before it let this through
            raise GpuctlError("interrupted: the run was started on no node, or killed on every node where it had "
                              "started (all or nothing)", ExitCode.INTERRUPTED) from None

    def remember(self, result: multi.ClusterLaunch, warn: Notify) -> None:
        kept(lambda: remember(self.addresses[0], nodes=self.addresses, run=result.number), warn)

    def status(self, number: int, reconnect: Notify | None = None) -> multi.ClusterStatus:
        from gpuctl.commands import nodes as multi

        return multi.status(self.nodes, number or self.run)

    def runs(self) -> multi.ClusterRuns:
        from gpuctl.commands import nodes as multi

        return multi.list_runs(self.nodes)

    def kill(self, number: int, signal_name: str, grace: float, notify: Notify) -> Killed:
        from gpuctl.commands import nodes as multi

        return multi.kill(self.nodes, number or self.run, signal_name, grace, notify=notify)

    def remove(self, refs: list[RunRef], keep: int | None, dry_run: bool) -> multi.NodesRemoved:
        from gpuctl.commands import nodes as multi

        return multi.remove(self.nodes, refs, keep, dry_run)

    def log_source(self, node: int | None, number: int) -> tuple[Address, int]:
        if (node or 0) >= len(self.addresses):
            raise usage_error(f"--node {node}: the run has nodes 0 to {len(self.addresses) - 1}")
        return self.addresses[node or 0], number or self.run


Scope = One | NodeSet


def kept(remembering: Callable[[], None], warn: Notify) -> None:
    """Remember a target; the launch it follows has happened, so a state dir that cannot be written only warns."""
    try:
        remembering()
    except OSError as e:
        warn(f"warning: the target is not remembered for the next command ({e.strerror or e}: "
             f"{e.filename or 'the state dir'})")


def resolve(flags: AddressFlags) -> Scope:
    """The last launch's nodes, when it was a multi-node run and no host, container or profile is asked for;
    else the one address."""
    remembered = remembered_nodes(flags)
    return NodeSet(*remembered) if remembered else One(resolve_address(flags))


def resolve_launch(flags: AddressFlags, node: list[str] | None, cluster: str | None, resume: int | None,
                   master_addr: str | None, master_port: int | None) -> tuple[Scope, int | None]:
    """A launch's scope (--node/--cluster, else as `resolve`, one --node being one container) and the run it
    resumes (a bare --resume after a multi-node run: that run)."""
    if node or cluster:
        scope: Scope = NodeSet(resolve_nodes(flags, node, cluster))
    else:
        scope = resolve(flags)
        if isinstance(scope, NodeSet) and resume == 0:
            resume = scope.run
    if isinstance(scope, NodeSet) and len(scope.addresses) > 1:
        return NodeSet(scope.addresses, scope.run, master_addr, master_port), resume
    if master_addr is not None or master_port is not None:
        raise usage_error("--master-addr and --master-port are for a multi-node run (two --node or more)")
    return (One(scope.addresses[0]) if isinstance(scope, NodeSet) else scope), resume
