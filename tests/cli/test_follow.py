"""`logs --follow` on a bad link: dropped connections are reconnected and the stream resumes at the byte offset
already written (every line exactly once, in order); a link gone for good ends it with exit 3."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from tenacity import retry, stop_after_delay, wait_fixed

from tests.cli.conftest import Output, timeouts_config
from tests.sandbox.forwarder import Forwarder

pytestmark = pytest.mark.sshd

# About 4 s of log lines: long enough to drop the connection twice while they stream.
STREAMING = ("steps=200", "step_s=0.02")


@retry(stop=stop_after_delay(20), wait=wait_fixed(0.05), reraise=True)
def connected_to(standin, pid: int) -> list[int]:
    """The sshd processes of gpuctl's connection, once it has (re)connected."""
    found = standin.connection_processes(pid)
    assert found, f"gpuctl (pid {pid}) has no connection to the stand-in sshd"
    return found


@retry(stop=stop_after_delay(20), wait=wait_fixed(0.05), reraise=True)
def accepted(forwarder: Forwarder, connections: int) -> None:
    assert forwarder.accepted == connections


def test_follow_survives_two_dropped_connections(gpuctl, standin):
    assert gpuctl.launch_fake(*STREAMING).code == 0
    follower = gpuctl.popen("logs", "--follow")
    output = Output(follower)
    for _ in range(2):
        connected_to(standin, follower.pid)
        output.wait_for_more(len(output.text))  # some lines more on this connection
        assert standin.drop_connections(follower.pid), "no sshd process to kill"
    out, err = output.finish(timeout=60)
    log = gpuctl.path("/workspace/train_tl1.log").read_text()
    assert follower.returncode == 0, err
    assert err.count("reconnected to") == 2, err
    assert log.rstrip().endswith("done, exit 0")
    assert out == log  # every line exactly once, in order


@pytest.fixture
def link(gpuctl, standin, tmp_path):
    """The stand-in host reached through a Forwarder (a link the test can break), and a long run to follow."""
    forwarder = Forwarder(standin.port)
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(standin.known_hosts_line(forwarder.port))
    config = tmp_path / "ssh_config"
    config.write_text(standin.ssh_config_entry("through-forwarder", known_hosts, forwarder.port))
    assert gpuctl.launch_fake("steps=100000", "step_s=0.05").code == 0
    yield forwarder, {"GPUCTL_SSH_CONFIG": str(config), "GPUCTL_HOST": "through-forwarder"}
    forwarder.close()
    assert gpuctl("kill", "--grace", "5").code == 0


def follow_through(gpuctl, link, **env: str) -> subprocess.Popen:
    forwarder, through = link
    follower = gpuctl.popen("logs", "--follow", env=through | env)
    accepted(forwarder, 1)
    time.sleep(1.0)  # streaming
    return follower


def test_follow_hears_a_silent_link_and_gives_up_on_a_gone_host(gpuctl, link, tmp_path):
    """A link that goes silent (no FIN, no RST) is noticed by the missing heartbeat; a host that stays
    unreachable longer than the reconnect bound ends the follow with exit 3."""
    forwarder, _ = link
    follower = follow_through(gpuctl, link, **timeouts_config(tmp_path / "config", heartbeat=0.3, reconnect=2))
    forwarder.freeze()  # the open connection hears nothing more; new ones work
    accepted(forwarder, 2)  # heard nothing, reconnected
    time.sleep(0.5)
    forwarder.down()
    forwarder.cut()
    started = time.monotonic()
    out, err = follower.communicate(timeout=30)
    assert follower.returncode == 3, err
    assert time.monotonic() - started < 10
    assert "nothing heard for" in err and "no new connection within 2 s" in err
    assert out.startswith("argv: ") and out.count("\n") > 5
    assert gpuctl.path("/workspace/train_tl1.log").read_text().startswith(out)  # in order, none twice


def test_follow_ctrl_c_while_reconnecting_is_clean(gpuctl, link):
    """Ctrl-C during the backoff detaches like any Ctrl-C: exit 130, no traceback, the run goes on."""
    forwarder, _ = link
    follower = follow_through(gpuctl, link)
    forwarder.down()
    forwarder.cut()
    time.sleep(1.0)  # reconnecting, with backoff
    follower.send_signal(signal.SIGINT)
    _, err = follower.communicate(timeout=20)
    assert follower.returncode == 130 and "Traceback" not in err, err
    assert gpuctl.status()["state"] == "running"
