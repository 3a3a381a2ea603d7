"""One container's connection for a whole invocation, and what survives its drop. Below every command: no
Typer, no Rich. (The run records read through it: gpuctl/commands/records.py.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

from gpuctl.address import Address
from gpuctl.errors import ExitCode, GpuctlError
from gpuctl.remote import ssh
from gpuctl.remote.container import Container
from gpuctl.remote.ssh import ConnectionLost
from gpuctl.timeouts import timeouts

Notify = Callable[[str], None]
Write = Callable[[bytes], None]
T = TypeVar("T")


class Tracker(Protocol):
    """Hears of every chunk of a transfer (render.TransferProgress draws it); closed when the transfer ends."""

    def __call__(self, sent: int) -> None: ...

    def close(self) -> None: ...


Progress = Callable[[int], Tracker]  # progress(total bytes): the tracker of one transfer




@contextmanager
def alongside(work: Callable[[], object] | None) -> Iterator[None]:
    """Run work in a thread while the body runs, and wait for it at the body's end. For a body that mostly waits
    (for the host, while a connection is made): work that needs the CPU (imports, compiling) fits in that wait.
    Work only gets ready what is used later, so its failure is left for that use to meet and report (a failed
    import or template is not cached)."""
    if work is None:
        yield
        return

    def quietly() -> None:
        with contextlib.suppress(Exception):
            work()

    thread = threading.Thread(target=quietly, name="gpuctl-meanwhile", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()


@contextmanager
def connected(address: Address, stats: ssh.Stats | None = None, bound_s: float | None = None,
              meanwhile: Callable[[], object] | None = None) -> Iterator[Container]:
    """One SSH connection for the whole invocation (a follower may replace it after a drop); what it costs is
    counted in ct.session.stats (`stats`, when given); `bound_s`: the bound of each of its remote commands;
    `meanwhile`: what the command needs once connected, got ready while the connection is made (alongside)."""
    with alongside(meanwhile):
        session = ssh.connect(address, stats, bound_s)
    ct = Container(session=session, address=address)
    try:
        yield ct
    finally:
        ct.session.close()


def reconnecting(ct: Container, action: Callable[[], T], notify: Notify, within_s: float | None = None) -> T:
    """Run action; when the connection drops, reconnect (with backoff, for up to within_s: by default the
    [timeouts] reconnect) and run it again."""
    within_s = timeouts().reconnect if within_s is None else within_s
    while True:
        try:
            return action()
        except ConnectionLost as lost:
            notify(f"{lost}; reconnecting (for up to {within_s:g} s)")
            try:
                ct.reconnect(within_s)
            except GpuctlError as e:
                raise GpuctlError(f"{lost}, and no new connection within {within_s:g} s ({e})",
                                  ExitCode.HOST) from None
            notify(f"reconnected to {ct.session.endpoint.describe()}")
