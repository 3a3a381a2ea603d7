"""`gpuctl shell`: a shell (or one command) in the container for a person at a terminal, through the same SSH
connection and `pct exec` as every other command (ARCHITECTURE §2).

With stdin and stdout terminals, the remote command gets a pty of the workstation terminal's TERM and size (a
resize follows), the terminal is put in raw mode (every key, Ctrl-C and Ctrl-D included, goes to the container;
its settings are put back however the shell ends) and the bytes go both ways as they are, as `ssh -t` does.
Otherwise plain streams: stdin forwarded until its end, stdout and stderr apart. Either way the exit status is
the remote command's.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Iterator

from gpuctl.remote.container import Container

# The container's shell when no command is given: a login shell, so the container's profile sets it up.
LOGIN_SHELL = ["/bin/bash", "-l"]
CHUNK = 32768


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@contextlib.contextmanager
def _raw(fd: int) -> Iterator[None]:
    """The terminal on fd in raw mode, its settings restored at the end (an error or Ctrl-C included)."""
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    tty.setraw(fd, termios.TCSADRAIN)  # TCSADRAIN: keys typed ahead reach the shell
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def _resizes(fd: int) -> Iterator[int]:
    """A pipe that becomes readable when the terminal is resized (SIGWINCH): the loop, not the signal handler,
    talks to paramiko (a handler could interrupt a send that holds the transport's lock)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)

    def on_resize(signum, frame) -> None:
        with contextlib.suppress(OSError):  # a full pipe: a wake-up is pending already
            os.write(wake_w, b"w")

    previous = signal.signal(signal.SIGWINCH, on_resize)
    try:
        yield wake_r
    finally:
        signal.signal(signal.SIGWINCH, previous)
        os.close(wake_r)
        os.close(wake_w)


def shell(ct: Container, argv: list[str] | None, stdin: int = 0, stdout: int = 1, stderr: int = 2) -> int:
    """Run argv (None: a login shell) in the container on the open connection, with the workstation's
    terminal when stdin and stdout are one; the remote command's exit status."""
    ct.check()
    command = ct.command(argv or LOGIN_SHELL)
    if not (os.isatty(stdin) and os.isatty(stdout)):
        chan = ct.session.open_terminal(command, pty=None)
        return _pump(ct, chan, stdin, stdout, stderr, wake=None)
    size = os.get_terminal_size(stdin)
    chan = ct.session.open_terminal(command, pty=(os.environ.get("TERM") or "vt100", *size))
    with _resizes(stdin) as wake, _raw(stdin):
        return _pump(ct, chan, stdin, stdout, stderr, wake, size)


def _pump(ct: Container, chan, stdin: int, stdout: int, stderr: int, wake: int | None,
          size: os.terminal_size | None = None) -> int:
    """Pass stdin to the channel and its output to stdout and stderr until the remote command ends; on a
    terminal, its size too."""
    inputs = [chan, stdin] + ([wake] if wake is not None else [])

    def follow_size() -> None:
        # Asked at every wake-up of the loop, not only on SIGWINCH: the signal may reach another thread
        # (paramiko's) after the keys typed in the resized window, and the container must get the size first.
        nonlocal size
        now = os.get_terminal_size(stdin)
        if now != size:
            chan.resize_pty(*now)
            size = now

    try:
        while True:
            ready, _, _ = select.select(inputs, [], [])
            if wake in ready:
                os.read(wake, 64)
            if size is not None:
                follow_size()
            if stdin in ready:
                data = os.read(stdin, CHUNK)
                try:
                    if data:
                        chan.sendall(data)
                    else:  # the end of stdin: the remote command reads its end too
                        chan.shutdown_write()
                        inputs.remove(stdin)
                except OSError:  # the channel closed under the write: its end and exit status are read below
                    inputs.remove(stdin)
            if chan in ready:
                while chan.recv_stderr_ready():
                    _write_all(stderr, chan.recv_stderr(CHUNK))
                if chan.recv_ready():
                    data = chan.recv(CHUNK)
                    ct.session.stats.received += len(data)
                    _write_all(stdout, data)
                elif chan.eof_received or chan.closed:
                    break
        chan.status_event.wait()
        code = chan.recv_exit_status()
    finally:
        chan.close()
    if code == -1:  # no exit status: the connection went, not the command
        raise ct.session.lost("the connection dropped")
    return code
