"""A connection that fails says at which stage, in one line, exit 3 (issue 39): the TCP connect, the SSH banner,
authentication, pct. Every server here is on loopback: a listener that accepts and never writes, one that writes
something that is not SSH, one that closes at once, a closed port, the stand-in with a key it does not know, and
a stand-in host whose pct is missing or failing."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gpuctl.address import Address
from gpuctl.remote import ssh
from tests.sandbox import StandInHost
from tests.sandbox.host import ALIAS

pytestmark = pytest.mark.sshd


@contextmanager
def listener(answer: bytes | None) -> Iterator[int]:
    """A TCP server on 127.0.0.1 that accepts and then writes `answer` and keeps the connection open (None: closes
    it at once); yields its port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # the test is over
            if answer is None:
                conn.close()
                continue
            conn.sendall(answer)
            held.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()
        for conn in held:
            conn.close()


def failed(result) -> str:
    """The one line of a failed connection, exit 3."""
    assert result.code == 3, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_host_that_accepts_and_never_answers_is_the_ssh_banner_within_connect_timeout(gpuctl):
    with listener(b"") as port:
        started = time.monotonic()
        line = failed(gpuctl("status", "--port", str(port), "--connect-timeout", "1"))
        took = time.monotonic() - started
    assert f"cannot connect to root@127.0.0.1:{port}: SSH banner failed" in line
    assert "accepted the TCP connection but sent no SSH banner within 1 s" in line
    assert "No existing session" not in line and "Error reading" not in line
    assert took < 8  # the option's second, not the default 10 s (and the start of Python)


def test_a_server_that_is_not_ssh_is_named_by_what_it_said(gpuctl):
    with listener(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n") as port:
        line = failed(gpuctl("status", "--port", str(port), "--connect-timeout", "1"))
    assert "SSH banner failed: answered 'HTTP/1.1 400 Bad Request', not an SSH banner" in line


def test_a_server_that_closes_at_once_is_the_ssh_banner(gpuctl):
    with listener(None) as port:
        line = failed(gpuctl("status", "--port", str(port), "--connect-timeout", "1"))
    assert "SSH banner failed: the server accepted the TCP connection and closed it without a word" in line


def test_a_closed_port_is_the_tcp_connect(gpuctl):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    line = failed(gpuctl("status", "--port", str(closed), "--connect-timeout", "1"))
    assert f"cannot connect to root@127.0.0.1:{closed}: TCP connect failed: connection refused" in line


def test_a_connection_nobody_answers_is_the_tcp_connect_within_connect_timeout(gpuctl):
    """A listener whose accept queue is full: the kernel drops further SYNs, as a firewall or an unroutable
    address does, so the TCP connect itself never completes."""
    with socket.socket() as server, socket.socket() as filler:
        server.bind(("127.0.0.1", 0))
        server.listen(0)  # one pending connection at most, never accepted
        port = server.getsockname()[1]
        filler.connect(("127.0.0.1", port))
        started = time.monotonic()
        line = failed(gpuctl("status", "--port", str(port), "--connect-timeout", "1"))
        took = time.monotonic() - started
    assert f"cannot connect to root@127.0.0.1:{port}: TCP connect failed: no answer within 1 s" in line
    assert "--connect-timeout" in line and took < 8


def test_a_key_the_host_does_not_know_is_authentication(gpuctl, standin, tmp_path):
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    config = tmp_path / "ssh_config"
    config.write_text(standin.ssh_config.read_text().replace(str(standin.client_key), str(stranger)))
    line = failed(gpuctl("status", env={"GPUCTL_SSH_CONFIG": str(config)}))
    assert f"cannot log in to root@127.0.0.1:{standin.port}: authentication failed: the host accepted none" in line
    assert str(stranger) in line and "--identity" in line


@pytest.fixture(scope="module")
def pct_host(tmp_path_factory) -> Iterator[StandInHost]:
    """A stand-in host of this module's own, whose pct the tests take away or break."""
    host = StandInHost(tmp_path_factory.mktemp("pct-host")).start()
    yield host
    host.stop()


def test_a_host_without_pct_is_the_pct_stage(gpuctl, pct_host):
    pct_host.add_container(gpuctl.ctid)
    (pct_host.root / "bin" / "pct").unlink()
    line = failed(gpuctl("status", env=pct_host.env(gpuctl.ctid)))
    assert "pct failed: the host has no `pct` command (is it a Proxmox VE host?)" in line


def test_a_failing_pct_is_the_pct_stage_not_the_script(gpuctl, pct_host):
    """pct itself fails (as it does without its cluster file system): its words, not 'reading the run records
    failed' with exit 1."""
    pct_host.add_container(gpuctl.ctid)
    pct = pct_host.root / "bin" / "pct"
    pct.write_text("#!/bin/sh\necho 'ipcc_send_rec[1] failed: Connection refused' >&2\nexit 255\n")
    pct.chmod(0o755)
    for command in (["status"], ["runs"], ["logs"]):
        line = failed(gpuctl(*command, env=pct_host.env(gpuctl.ctid)))
        assert (f"pct failed: `pct exec {gpuctl.ctid}` ended with exit 255 before running gpuctl's script: "
                "ipcc_send_rec[1] failed: Connection refused") in line, command


def test_a_command_that_ends_before_reading_its_input_is_its_exit_not_a_lost_connection(pct_host):
    """A command that ends before it has read what gpuctl writes (pct failing at once, on a loaded host before
    gpuctl's script is even sent: CI) is that command's exit code and stderr, not "connection lost: Socket is
    closed". 8 MiB is more than the channel's window, so the write is still going on when the command ends."""
    address = Address(host=ALIAS, ct=0, ssh_config=str(pct_host.ssh_config))
    with ssh.connect(address) as session:
        result = session.stream("echo 'pct said no' >&2; exit 255", b"x" * (8 << 20))
        assert (result.rc, result.stderr, result.started) == (255, b"pct said no\n", False)
        assert session.run("echo still connected").stdout == b"still connected\n"  # the connection was fine
