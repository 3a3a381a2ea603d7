"""One run across several containers (nodes), on one or several hosts (ARCHITECTURE §8): the all-or-nothing
launch, and status, kill and runs over every node. No Typer, no Rich: each node is an ordinary Container with
its own SSH connection (gpuctl.commands.fanout), and each node's run an ordinary run of that container (its
wrapper, process group and record), so every single-node command stays exact on it.

Node k's trainer is told RANK=k, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torch.distributed's env://), beside
the user's --env; node 0 is the first node given.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpuctl.address import Address
from gpuctl.commands import detached
from gpuctl.commands.detached import LaunchResult, PendingStart
from gpuctl.commands.fanout import Node, first_problem, on_each, on_nodes, settled
from gpuctl.commands.kill import Killed, KillResult
from gpuctl.commands.kill import kill as kill_run
from gpuctl.commands.launch import launch_package, launch_values
from gpuctl.commands.launch import plan_launch as plan_one
from gpuctl.commands.options import LaunchOptions, LaunchTask, NodeRole, completed
from gpuctl.commands.remove import Removed
from gpuctl.commands.remove import remove as remove_one
from gpuctl.commands.resume import Finished, resuming
from gpuctl.commands.session import Notify
from gpuctl.commands.status import StatusReport
from gpuctl.commands.status import list_runs as list_one
from gpuctl.commands.status import status as status_one
from gpuctl.errors import ExitCode, GpuctlError, usage_error
from gpuctl.runs import Run, RunRef, State

DEFAULT_MASTER_PORT = 29500
UNDO_GRACE_S = 10.0  # a launch that failed on one node: how long the runs it started elsewhere get to stop


# launch ---------------------------------------------------------------------------------------------------

@dataclass
class ClusterLaunch:
    number: int
    master_addr: str
    master_port: int
    nodes: list[Node]
    results: list[LaunchResult]  # node order

    @property
    def run_id(self) -> str:
        return f"tl{self.number}"

    @property
    def failed(self) -> bool:
        """Some node's run ended during its start (its trainer failed, was killed or lost)."""
        return any(r.run.state in (State.FAILED, State.KILLED, State.LOST) for r in self.results)


def check_cluster_options(addresses: list[Address], opts: LaunchOptions, master_addr: str | None,
                          master_port: int | None) -> None:
    """What a multi-node launch adds to a launch's checks (check_launch_options), before any connection (and
    what it cannot do yet)."""
    check_master_addr(master_addr)
    if master_port is not None:
        check_master_port(master_port)
    if len(addresses) < 2:
        raise usage_error("a multi-node run needs at least two nodes (one container is a plain launch)")
    if opts.queue:
        raise usage_error("--queue is for one container: each node's queue would start its part on its own, and the "
                          "nodes would not meet; launch the run when the nodes are free")
    if opts.retry:
        raise usage_error("--retry is not supported for multi-node runs yet: one node's restart cannot rejoin the "
                          "others (it needs a whole-run restart); launch again with --resume when it fails")
    if opts.task is LaunchTask.REGENERATE:
        raise usage_error("--task regenerate runs in one container (a thread per GPU there); for several, split the "
                          "prompts and launch one regeneration per container")


def check_master_port(port: int) -> None:
    if not 1 <= port <= 65535:
        raise usage_error(f"--master-port must be a number from 1 to 65535, got {port}")


def check_master_addr(addr: str | None) -> None:
    if addr is not None and (not addr.strip() or any(c.isspace() or ord(c) < 32 for c in addr)):
        raise usage_error(f"--master-addr takes an address or host name, got {addr!r}")


def launch(nodes: list[Node], opts: LaunchOptions, master_addr: str | None, master_port: int | None,
           notify: Notify) -> ClusterLaunch:
    """One run on every node, all or nothing, with checked options: every node's launch lock is taken and its
    state read (in parallel) before any node is told to start; a node that refuses (unreachable, container
    stopped, locked, an active run) makes every other give its lock back with nothing started. The run number is
    the next one free on every node. Should a node fail to start after that, or the launch be interrupted
    (Ctrl-C) while the nodes start, the runs started are killed. With --resume, every node continues its own run
    of one number (0: the latest, which must be the same run everywhere), with its master address and port
    unless given now."""
    specs = tuple(node.address.spec() for node in nodes)
    roles = [NodeRole(rank=node.index, nodes=specs, master_port=DEFAULT_MASTER_PORT) for node in nodes]
    opts = replace(opts, master_addr=master_addr, master_port=master_port)
    pending, checked = _begin_every(nodes, opts, roles, notify)
    number = max(p.report.last_number or 0 for p in pending) + 1
    first = checked[0][0]  # node 0's options: the rendezvous given, or its resumed run's
    master_port = first.master_port or DEFAULT_MASTER_PORT
    addr = first.master_addr or pending[0].report.address
    if not addr:
        addr = "127.0.0.1"
        notify(f"node 0 ({nodes[0].address.describe()}) has no address of its own (hostname -I says none): "
               "MASTER_ADDR=127.0.0.1, which only the nodes on its host can reach; pass --master-addr")
    roles = [replace(role, master_addr=addr, master_port=master_port) for role in roles]

    secret = secrets.token_hex(32)  # the run's node secret (a resume's too: a new one), the same on every node

    def start(node: Node) -> LaunchResult:
        node_opts, config_file = checked[node.index]
        node_opts = replace(node_opts, node=roles[node.index])
        result = pending[node.index].finish(launch_package(node_opts, config_file), opts.replace,
                                            node.say(notify), number=number, secret=secret)
        return replace(result, resumed_from=node_opts.resume)

    def interrupted() -> None:
        notify(f"interrupted: waiting for every node's start to end, then killing tl{number} on every node")

    try:
        outcomes = on_nodes(nodes, start, interrupted)
    except BaseException:  # Ctrl-C while the nodes start: all or nothing still (on_each waited for every start)
        _undo(nodes, number, notify)
        raise
    problem = first_problem(outcomes)
    if problem is not None:
        _undo(nodes, number, notify)
        if isinstance(problem, GpuctlError):
            raise GpuctlError(f"{problem}; the run was killed on the nodes where it had started", problem.code)
        raise problem
    return ClusterLaunch(number=number, master_addr=addr, master_port=master_port, nodes=nodes,
                         results=[o.value for o in outcomes])


def _begin_every(nodes: list[Node], opts: LaunchOptions, roles: list[NodeRole],
                 notify: Notify) -> tuple[list[PendingStart], list[tuple[LaunchOptions, Path | None]]]:
    """Every node under its launch lock, its report read; or, should any refuse, every lock given back and the
    first refusal raised. Each node's options, its --resume's read in its own thread."""
    checked: list[tuple[LaunchOptions, Path | None]] = [(opts, None)] * len(nodes)
    finished: list[Finished] = []  # the nodes whose resumed run did all its steps

    def begin(node: Node) -> PendingStart:
        try:
            checked[node.index] = completed(resuming(node.ct, opts))
        except Finished as done:  # said only once every node's run is found finished (below)
            finished.append(done)
            checked[node.index] = completed(done.opts)
        given = checked[node.index][0]
        node_opts = replace(given, node=replace(roles[node.index], master_addr=given.master_addr,
                                                 master_port=given.master_port or DEFAULT_MASTER_PORT))
        return detached.begin(node.ct, launch_values(node.address, node_opts), node_opts.task.value,
                              node.say(notify))

    outcomes = on_nodes(nodes, begin)
    pending = [o.value for o in outcomes if o.error is None]
    problem = first_problem(outcomes)
    resumed = {node_opts.resume for node_opts, _ in checked}
    if problem is None and len(resumed) > 1:
        runs = ", ".join(f"node {k} tl{node_opts.resume}" for k, (node_opts, _) in enumerate(checked))
        problem = usage_error(f"--resume: the nodes' latest runs differ ({runs}): pass --resume N")
    if problem is None and len(finished) == len(nodes):  # the run did all its steps on every node: nothing to do
        on_each(pending, PendingStart.abort)
        raise finished[0]
    if problem is None and not opts.replace:
        busy = [(node, p) for node, p in zip(nodes, pending) if p.report.active]
        problem = busy[0][0].failed(busy[0][1].conflict()) if busy else None
    if problem is not None:
        on_each(pending, PendingStart.abort)  # every lock goes; nothing was started anywhere
        if isinstance(problem, GpuctlError):
            raise GpuctlError(f"{problem}; nothing was started on any node", problem.code)
        raise problem
    return pending, checked


def _undo(nodes: list[Node], number: int, notify: Notify) -> None:
    """Kill run `number` wherever it started (a node where it did not start has no such run: nothing to do)."""

    def undo(node: Node) -> None:
        try:
            kill_run(node.ct, number, "TERM", UNDO_GRACE_S, notify=lambda _: None)
        except GpuctlError as e:
            if e.code != ExitCode.USAGE:  # USAGE: no run tlN there, it never started
                notify(f"{node.describe()}: could not kill tl{number}: {e}")

    on_each(nodes, undo)


# status ---------------------------------------------------------------------------------------------------

@dataclass
class NodeStatus:
    node: Node
    report: StatusReport | None  # None: the node could not be read (error says why)
    error: GpuctlError | None = None

    @property
    def run(self) -> Run | None:
        return self.report.run if self.report else None

    def problem(self) -> str | None:
        """Why this node has no run to show: unreachable, its container stopped, no such run."""
        if self.error:
            return str(self.error)
        if self.report.container_status != "running":
            return f"container {self.report.ctid} is {self.report.container_status}"
        return None if self.run else "no such run"

    def to_json(self) -> dict[str, Any]:
        run = self.run.to_json() if self.run else {}
        return {"node": self.node.index, "target": self.node.address.spec(), "run_id": run.get("run_id"),
                "state": run.get("state"), "exit_code": run.get("exit_code"), "pid": run.get("pid"),
                "started_at": run.get("started_at"), "log_path": run.get("log_path"), "progress": run.get("progress"),
                "gpus": [g.to_json() for g in self.report.gpus] if self.report else [],
                "container": ({"ctid": self.report.ctid, "status": self.report.container_status,
                               "host": self.report.host} if self.report else
                              {"ctid": self.node.address.ct, "status": None, "host": self.node.address.host}),
                "last_line": self.last_line(), "error": self.problem()}

    def last_line(self) -> str | None:
        """The log's last line once the node's run ended (a trainer that fails says why there)."""
        return self.report.last_line if self.run and not self.run.state.active else None


@dataclass(frozen=True)
class Verdict:
    """A multi-node run's one state, why, and the node's run that decided it (None where no one node's run did):
    its exit code is the run's."""

    state: State | None
    reason: str | None = None
    run: Run | None = None  # the run of the node that `reason` names (killed or failed), when it has one

    def exit_code(self, runs: list[Run | None]) -> int | None:
        """The deciding node's exit code; once every node (runs: each node's, None where it has none) ended
        well, 0; else None."""
        if self.run is not None:
            return self.run.exit_code
        return 0 if runs and all(r is not None and r.exit_code == 0 for r in runs) else None


def verdict(nodes: list[tuple[Node, Run | None, str | None]],
            last_lines: dict[int, str | None] | None = None) -> Verdict:
    """A multi-node run's one state from its nodes' (node, run, why there is no run): killed when any node was
    killed; failed when any failed or was lost (the reason: the one that ended first), or cannot be read while
    others run; succeeded when all did;
    running while every node runs (or some already finished well); and why, naming the node (with its log's
    last line, from last_lines by node index, when known)."""
    runs = [(node, run) for node, run, _ in nodes if run]
    missing = [(node, why) for node, run, why in nodes if not run]
    if not runs:
        return Verdict(None)
    killed = [(node, run) for node, run in runs if run.state == State.KILLED]
    if killed:  # by `gpuctl kill` of the run (every node), or one node's by hand (then say which)
        node, run = killed[0]
        return Verdict(State.KILLED, None if len(killed) == len(nodes) else
                       f"{node.describe()} was killed (SIG{run.record.get('killed_signal') or 'KILL'})", run)
    failed = [(node, run) for node, run in runs if run.state in (State.FAILED, State.LOST)]
    if failed:
        # The node that ended first is the cause; the others' trainers ended because they lost it. A lost run (no
        # exit recorded) comes first: its end was not even recorded.
        node, run = min(failed, key=lambda pair: pair[1].record.get("ended_at", float("-inf")))
        exit_code = f" (exit {run.exit_code})" if run.exit_code is not None else ""
        said = (last_lines or {}).get(node.index)
        return Verdict(State.FAILED, f"{node.describe()} {run.state.value}{exit_code}" + (f": {said}" if said else ""),
                       run)
    if missing:
        node, why = missing[0]
        if any(run.state.active for _, run in runs):
            return Verdict(State.FAILED, f"{node.describe()} is lost while the others run: {why}")
        return Verdict(runs[0][1].state, f"{node.describe()}: {why}")
    states = {run.state for _, run in runs}
    if states == {State.SUCCEEDED}:
        return Verdict(State.SUCCEEDED)
    if State.STARTING in states or State.RETRYING in states:
        return Verdict(State.STARTING)
    return Verdict(State.RUNNING)


def combined_state(nodes: list[tuple[Node, Run | None, str | None]],
                   last_lines: dict[int, str | None] | None = None) -> tuple[State | None, str | None]:
    """verdict's state and reason."""
    found = verdict(nodes, last_lines)
    return found.state, found.reason


@dataclass
class ClusterStatus:
    nodes: list[NodeStatus]
    number: RunRef  # a name only when no node has the run

    @property
    def run_id(self) -> str:
        return f"tl{self.number}" if isinstance(self.number, int) else self.number

    def verdict(self) -> Verdict:
        return verdict([(n.node, n.run, n.problem()) for n in self.nodes],
                       {n.node.index: n.last_line() for n in self.nodes})

    def state(self) -> tuple[State | None, str | None]:
        found = self.verdict()
        return found.state, found.reason

    def exit_code(self) -> int | None:
        """The exit code of the node the reason names (the failed node that ended first); once every node ended
        well, 0; else None."""
        return self.verdict().exit_code([n.run for n in self.nodes])

    def to_json(self) -> dict[str, Any]:
        """Node 0's status document, with the run's state over every node, why, and each node's own."""
        first = self.nodes[0]
        doc = first.report.to_json() if first.report else dict.fromkeys(("run_id", "pid", "started_at", "log_path",
                                                                         "progress", "container"))
        doc.setdefault("gpus", [])
        found = self.verdict()  # the state, why, and the exit code: one choice of node
        doc.update(run_id=self.run_id, state=found.state.value if found.state else None,
                   exit_code=found.exit_code([n.run for n in self.nodes]), reason=found.reason,
                   nodes=[n.to_json() for n in self.nodes])
        return doc

    def unreadable(self) -> GpuctlError | None:
        """The first node that could not be read, as the error gpuctl status exits with."""
        for n in self.nodes:
            if n.error and n.error.code != ExitCode.USAGE:  # USAGE: the node has no such run (its row says so)
                return n.node.failed(n.error)
            if n.report.container_status != "running":
                return n.node.failed(GpuctlError(n.problem(), ExitCode.CONTAINER))
        return None


def status(nodes: list[Node], number: RunRef) -> ClusterStatus:
    outcomes = settled(on_nodes(nodes, lambda node: status_one(node.ct, number, last_line=True)))
    found = [o.value.run.number for o in outcomes if o.value and o.value.run]  # a name's number
    return ClusterStatus([NodeStatus(o.node, o.value, o.error) for o in outcomes], found[0] if found else number)


# kill and runs --------------------------------------------------------------------------------------------

def kill(nodes: list[Node], number: int, signal_name: str, grace: float, notify: Notify) -> Killed:
    """Kill run `number` on every node at once; a node that cannot be reached is reported, the others killed."""

    def end(node: Node) -> KillResult:
        return kill_run(node.ct, number, signal_name, grace, notify=node.say(notify))

    outcomes = settled(on_nodes(nodes, end))
    return Killed([(o.node.describe(), o.value) for o in outcomes if o.value],
                  [o.problem() for o in outcomes if o.error])


@dataclass
class ClusterRun:
    """A run number across the nodes: each node's run of that number (None where the node has none)."""

    number: int
    runs: list[tuple[Node, Run | None]]

    @property
    def present(self) -> list[tuple[Node, Run]]:
        return [(node, run) for node, run in self.runs if run]

    def state(self) -> tuple[State | None, str | None]:
        return combined_state([(node, run, None) for node, run in self.present])

    def to_json(self) -> dict[str, Any]:
        found = verdict([(node, run, None) for node, run in self.present])
        return dict(self.present[0][1].to_json(), state=found.state.value if found.state else None,
                    reason=found.reason, exit_code=found.exit_code([run for _, run in self.present]),
                    nodes=[{"node": node.index, "target": node.address.spec(), "state": run.state.value,
                            "exit_code": run.exit_code, "pid": run.record.get("pid"), "log_path": run.log_path}
                           for node, run in self.present])


@dataclass
class ClusterRuns:
    """`gpuctl runs` over the nodes: every run number, each with its nodes' runs; the nodes not read."""

    runs: list[ClusterRun]
    errors: list[GpuctlError]


def list_runs(nodes: list[Node]) -> ClusterRuns:
    """Every run of every node, by run number (a multi-node run once, with its nodes); the nodes that could not
    be read."""

    outcomes = settled(on_nodes(nodes, lambda node: list_one(node.ct)))
    errors = [o.problem() for o in outcomes if o.error]
    by_node = {o.node.index: {run.number: run for run in o.value} for o in outcomes if not o.error}
    numbers = sorted({n for runs in by_node.values() for n in runs})
    return ClusterRuns([ClusterRun(n, [(node, by_node.get(node.index, {}).get(n)) for node in nodes])
                        for n in numbers], errors)


# runs rm, runs prune ------------------------------------------------------------------------------------------

@dataclass
class NodesRemoved:
    """runs rm / runs prune over the nodes: what each node removed, and the nodes that could not do it."""

    results: list[tuple[Node, Removed]]
    errors: list[GpuctlError]
    dry_run: bool

    def to_json(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "nodes": [dict(removed.to_json(), node=node.index,
                                                        target=node.address.spec()) for node, removed in self.results]}


def remove(nodes: list[Node], refs: list[RunRef], keep: int | None, dry_run: bool) -> NodesRemoved:
    """runs rm on every node, all or nothing: every node's removal is planned first (as --dry-run), and a run
    active, or unknown, on any node removes nothing anywhere. runs prune: each node its own finished runs."""
    if keep is None and not dry_run:
        problem = first_problem(settled(on_nodes(nodes, lambda node: remove_one(node.ct, refs, None, True))))
        if isinstance(problem, GpuctlError):
            raise GpuctlError(f"{problem}; nothing was removed on any node", problem.code)
    outcomes = settled(on_nodes(nodes, lambda node: remove_one(node.ct, refs, keep, dry_run)))
    return NodesRemoved([(o.node, o.value) for o in outcomes if o.value],
                        [o.problem() for o in outcomes if o.error], dry_run)


def plan_launch(addresses: list[Address], opts: LaunchOptions, master_addr: str | None,
                master_port: int | None) -> str:
    """What `launch --node ... --dry-run` shows (checked options): each node's launch, as `launch --dry-run`
    shows one."""
    specs = tuple(t.spec() for t in addresses)
    plans = []
    for rank, address in enumerate(addresses):
        role = NodeRole(rank=rank, nodes=specs, master_port=master_port or DEFAULT_MASTER_PORT,
                        master_addr=master_addr or "<node 0's address>")
        plans.append(f"# node {rank} of {len(addresses)}: {address.describe()}\n"
                     + plan_one(address, replace(opts, node=role)))
    return "\n".join(plans)
