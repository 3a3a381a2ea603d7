"""One action on every node of a multi-node run at once (a thread and an SSH connection each), and what each
node answered: its value, or its error, said with its node. The one place per-node outcomes are folded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from gpuctl.address import Address
from gpuctl.commands.session import Notify, alongside
from gpuctl.errors import GpuctlError
from gpuctl.remote import ssh
from gpuctl.remote.container import Container

T = TypeVar("T")
U = TypeVar("U")


@dataclass
class Node:
    """One node of the set: its index (its RANK), its address, and its connection, or why there is none."""

    index: int
    address: Address
    ct: Container | None = None
    error: GpuctlError | None = None

    def describe(self) -> str:
        return f"node {self.index} ({self.address.describe()})"

    def failed(self, error: GpuctlError) -> GpuctlError:
        """The error, saying which node it happened on."""
        return GpuctlError(f"{self.describe()}: {error}", error.code)

    def say(self, notify: Notify) -> Notify:
        """notify, with this node's name first."""
        return lambda text: notify(f"node {self.index}: {text}")


def on_each(items: Sequence[T], action: Callable[[T], U],
            interrupted: Callable[[], None] | None = None) -> list[U | BaseException]:
    """action on every item at once (a thread each: one SSH session per node); its result or what it raised.
    Interrupted (Ctrl-C), it calls `interrupted` at once, then still waits for every item's action to end before
    the interrupt goes on (a second Ctrl-C stops that wait)."""
    if not items:
        return []

    def attempt(item: T) -> U | BaseException:
        try:
            return action(item)
        except Exception as e:  # noqa: BLE001 - handed back: the caller decides once every node has answered
            return e

    with ThreadPoolExecutor(max_workers=len(items)) as pool:  # its end waits for every thread
        try:
            return list(pool.map(attempt, items))
        except BaseException:
            if interrupted:
                interrupted()
            raise


@dataclass
class Outcome(Generic[U]):
    """What one node answered: its value, or what it raised (a GpuctlError as it was, not yet said with its
    node; a bug of ours, which `settled` raises)."""

    node: Node
    value: U | None = None
    error: BaseException | None = None

    def problem(self) -> BaseException | None:
        """The error said with its node; a bug as it was."""
        return self.node.failed(self.error) if isinstance(self.error, GpuctlError) else self.error


def on_nodes(nodes: list[Node], action: Callable[[Node], U],
             interrupted: Callable[[], None] | None = None) -> list[Outcome[U]]:
    """action on every node at once; a node that could not be reached answers with why."""

    def reached(node: Node) -> U:
        if node.error:
            raise node.error
        return action(node)

    found = on_each(nodes, reached, interrupted)
    return [Outcome(node, error=f) if isinstance(f, BaseException) else Outcome(node, f) for node, f in zip(nodes, found)]


def first_problem(outcomes: list[Outcome]) -> BaseException | None:
    """The first node's error (node order), said with its node; a bug of ours as it was."""
    return next((o.problem() for o in outcomes if o.error is not None), None)


def settled(outcomes: list[Outcome[U]]) -> list[Outcome[U]]:
    """The outcomes, once no node's is a bug of ours (the first is raised)."""
    for o in outcomes:
        if o.error is not None and not isinstance(o.error, GpuctlError):
            raise o.error
    return outcomes


@contextmanager
def connected(addresses: Sequence[Address], stats: ssh.Stats | None = None, bound_s: float | None = None,
              meanwhile: Callable[[], object] | None = None) -> Iterator[list[Node]]:
    """A connection to every node at once; a node that cannot be reached has its error instead. Node 0's
    connection counts into `stats` (GPUCTL_TRACE); `bound_s`: the bound of each remote command; `meanwhile`:
    work done while the connections are made (session.alongside)."""
    nodes = [Node(i, t) for i, t in enumerate(addresses)]

    def connect(node: Node) -> Container:
        session = ssh.connect(node.address, stats if node.index == 0 else None, bound_s)
        return Container(session=session, address=node.address)

    try:
        with alongside(meanwhile):
            opened = on_nodes(nodes, connect)
        for o in opened:
            if isinstance(o.error, GpuctlError):
                o.node.error = o.error
            elif o.error is not None:
                raise o.error
            o.node.ct = o.value
        yield nodes
    finally:
        for node in nodes:
            if node.ct:
                node.ct.session.close()
