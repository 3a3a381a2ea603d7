"""`gpuctl shell` (issue 39): a shell in the container through the same SSH and `pct exec`, driven here as a user
drives it, from a terminal (a pty whose far side gpuctl sees as its terminal), and from pipes."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

pytestmark = pytest.mark.sshd


def set_size(fd: int, rows: int, columns: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))


class Terminal:
    """gpuctl on a terminal of its own: a pty that is its controlling terminal (so a resize signals it)."""

    def __init__(self, gpuctl, *args: str):
        self.master, self.slave = os.openpty()
        set_size(self.slave, 33, 101)
        self.settings = termios.tcgetattr(self.slave)

        def own_terminal() -> None:  # a session of its own, the pty its controlling terminal, as in a shell
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen([sys.executable, "-m", "gpuctl", "shell", *args], cwd=gpuctl.source,
                                     env=gpuctl.env | {"TERM": "xterm"}, stdin=self.slave, stdout=self.slave,
                                     stderr=self.slave, preexec_fn=own_terminal)  # noqa: PLW1509
        self.seen = b""

    def read_until(self, needle: bytes, timeout: float = 30) -> bytes:
        deadline = time.monotonic() + timeout
        while needle not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"never saw {needle!r} on the terminal: {self.seen[-2000:]!r}"
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # EIO: gpuctl and everything it started closed the terminal
                    data = b""
                assert data or needle in self.seen, f"the terminal closed before {needle!r}: {self.seen[-2000:]!r}"
                self.seen += data
        return self.seen

    def type(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\r")  # Enter, as a keyboard sends it

    def close(self) -> tuple[int, list]:
        """gpuctl's exit code, and the terminal's settings it left."""
        code = self.proc.wait(timeout=30)
        left = termios.tcgetattr(self.slave)
        os.close(self.master)
        os.close(self.slave)
        return code, left


def test_a_shell_on_a_terminal_runs_in_the_container_and_exits_with_its_status(gpuctl):
    term = Terminal(gpuctl)
    term.read_until(b"#")  # the container's shell prompts: it is up
    term.type("stty size; echo shell-was-here > /workspace/shell.txt; echo hi-$((6*7))")
    term.read_until(b"hi-42")  # its output (the echoed line shows "$((6*7))")
    assert b"33 101" in term.seen  # the remote pty has the terminal's size
    set_size(term.slave, 40, 120)  # the window is resized: the remote pty follows
    term.type("stty size; exit 7")
    term.read_until(b"40 120")
    code, left = term.close()
    assert code == 7
    assert left == term.settings  # the terminal is given back as it was (gpuctl made it raw meanwhile)
    assert gpuctl.path("/workspace/shell.txt").read_text() == "shell-was-here\n"  # in the container's root


def test_one_command_on_a_terminal_has_a_tty_and_its_status(gpuctl):
    term = Terminal(gpuctl, "--", "sh", "-c", "test -t 0 && echo on-a-tty; read line; echo got-$line; exit 3")
    term.read_until(b"on-a-tty")
    raw = termios.tcgetattr(term.slave)  # meanwhile keys go to the container as they are (Ctrl-C too)
    assert not raw[3] & (termios.ECHO | termios.ICANON | termios.ISIG)
    term.type("it")
    term.read_until(b"got-it")
    code, left = term.close()
    assert (code, left) == (3, term.settings)


def test_without_a_terminal_stdin_is_the_shell_s_and_the_streams_stay_apart(gpuctl):
    piped = subprocess.run([sys.executable, "-m", "gpuctl", "shell"], cwd=gpuctl.source, env=gpuctl.env,
                           input="echo piped-$((6*7)); echo to-stderr >&2; exit 5\n", capture_output=True, text=True,
                           timeout=60, check=False)
    assert piped.returncode == 5, piped.stderr
    assert piped.stdout == "piped-42\n" and "to-stderr" in piped.stderr

    one = gpuctl("shell", "--", "sh", "-c", "echo out; echo err >&2; test -t 0 || echo no-tty; exit 3")
    assert (one.code, one.stdout) == (3, "out\nno-tty\n") and "err" in one.stderr


def test_shell_errors_are_one_line(gpuctl):
    missing = gpuctl("shell", "--ct", "999")
    assert missing.code == 4 and "container 999 does not exist" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    empty = gpuctl("shell", "--")
    assert empty.code == 2 and "must be followed by a command" in empty.stderr


def test_shell_goes_to_the_remembered_target(gpuctl):
    assert gpuctl.launch_fake("steps=1").code == 0  # the last launch's target is remembered
    env = {k: v for k, v in gpuctl.env.items() if k not in ("GPUCTL_HOST", "GPUCTL_CT")}
    done = subprocess.run([sys.executable, "-m", "gpuctl", "shell", "--", "cat", "/workspace/.gpuctl/tl1.json"],
                          cwd=gpuctl.source, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and '"id": "tl1"' in done.stdout, done.stderr
