"""Limits (ARCHITECTURE §2, "Time"): nothing waits forever, nothing grows without bound. A hung
nvidia-smi, a frozen sshd and a refused login end in bounded time with their exit codes; a log of progress bars
with no newline costs `status` a few KiB, not its size."""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import threading
import time

import pytest
from tenacity import retry, stop_after_delay, wait_fixed

from gpuctl.address import Address, remember
from gpuctl.remote import ssh
from tests.cli.conftest import timeouts_config
from tests.sandbox.host import StandInHost

pytestmark = pytest.mark.sshd

QUICK = {"probe": 1, "heartbeat": 0.3, "idle": 2}  # config.toml's [timeouts] for these tests


def quick(tmp_path, **limits: float) -> dict[str, str]:
    return timeouts_config(tmp_path / "config", **(QUICK | limits))


def smi_processes(standin, ctid) -> list[int]:
    found = []
    for pid in standin.container_processes(ctid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"nvidia-smi" in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


@retry(stop=stop_after_delay(20), wait=wait_fixed(0.1), reraise=True)
def smi_running(standin, ctid) -> None:
    assert smi_processes(standin, ctid), "nvidia-smi not started yet"


def test_a_hung_nvidia_smi_is_a_row_and_leaves_nothing_behind(gpuctl, standin, ctid, tmp_path):
    standin.hang_gpus(ctid)
    started = time.monotonic()
    result = gpuctl("status", "--json", env=quick(tmp_path), timeout=30)
    assert result.code == 0, result.stderr
    doc = result.json()
    assert doc["gpus"] == [] and doc["gpus_error"] == "nvidia-smi did not answer in 1 s"
    assert doc["container"]["status"] == "running"
    human = gpuctl("status", env=quick(tmp_path), timeout=30)
    assert "GPUs: unknown (nvidia-smi did not answer in 1 s)" in human.stdout, human.stdout
    assert time.monotonic() - started < 20  # two statuses, each bounded by the probe's second
    assert smi_processes(standin, ctid) == []  # timeout stopped it: nothing stays in the container


def test_a_hung_probe_is_cut_by_the_commands_bound(gpuctl, standin, ctid, tmp_path):
    """A probe slower than the command's own bound: `status` ends there (exit 3, one line), heartbeats or not."""
    standin.hang_gpus(ctid)
    started = time.monotonic()
    result = gpuctl("status", env=quick(tmp_path, probe=60, command_bound=2), timeout=30)
    assert result.code == 3, result.stderr
    assert "did not finish within 2 s" in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - started < 15


def test_a_frozen_sshd_ends_status_with_exit_3(gpuctl, standin, ctid, tmp_path):
    """The host's sshd stops mid-command (SIGSTOP: the TCP connection stays open and silent): status ends with
    exit 3 once nothing was heard for the idle deadline. Until the freeze the heartbeats keep the slow command
    alive far past that deadline."""
    standin.hang_gpus(ctid)
    proc = gpuctl.popen("status", env=quick(tmp_path, probe=60))
    frozen = []
    try:
        smi_running(standin, ctid)
        time.sleep(3)  # longer than the idle deadline (2 s): only the heartbeats keep the command alive
        assert proc.poll() is None, proc.stderr.read()
        frozen = standin.connection_processes(proc.pid)
        assert frozen, "no sshd process serves the status"
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 3, err
        assert time.monotonic() - started < 15
        assert "nothing heard for 2 s" in err and "Traceback" not in err
    finally:
        proc.kill()
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


class PamHost(StandInHost):
    """A stand-in host whose sshd asks PAM, as a stock one does: `nobody` (no password, shell nologin) passes the
    key check and is then refused by its shell."""

    def _sshd_config(self) -> str:
        return super()._sshd_config().replace("UsePAM no", "UsePAM yes")


@pytest.fixture(scope="module")
def pam_host():
    """Its state in a directory `nobody` can read (sshd reads authorized_keys as the user logging in)."""
    with tempfile.TemporaryDirectory(prefix="gpuctl-pam-") as root:
        os.chmod(root, 0o755)
        host = PamHost(root).start()
        yield host
        host.stop()


def test_a_refused_login_is_exit_3_with_sshds_reason(gpuctl, pam_host):
    """The key is accepted but the account may not log in (nologin): exit 3 with what the host said, not a
    failed read of the run records."""
    pam_host.add_container(gpuctl.ctid)
    env = pam_host.env(gpuctl.ctid)
    result = gpuctl("status", "--user", "nobody", env=env, timeout=30)
    assert result.code == 3, result.stderr
    assert "refused the login" in result.stderr and "This account is currently not available" in result.stderr
    assert "run records" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("user", ["nobody", "sync"])  # shells: nologin (says why), /bin/sync (runs nothing)
def test_a_refused_login_is_exit_3_on_every_command_the_streaming_ones_too(gpuctl, pam_host, tmp_path, user):
    """The login shell never runs gpuctl's command, so the marker the command echoes first never comes: exit 3
    with the one line, before any byte of what the shell said is passed on as a log's or a reply's (issue 38)."""
    pam_host.add_container(gpuctl.ctid)
    env = pam_host.env(gpuctl.ctid)
    for args in (["logs"], ["logs", "-f"], ["pull", str(tmp_path / "pulled")], ["status"], ["kill"],
                 ["launch", "--python", "fake-trainer"]):
        result = gpuctl(*args, "--user", user, env=env, timeout=60)
        assert result.code == 3, (args, result.stderr)
        assert result.stdout == "" and "refused the login" in result.stderr, (args, result.stdout, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
        if user == "nobody":
            assert "This account is currently not available" in result.stderr


def test_a_log_of_progress_bars_costs_status_a_bounded_transfer(two_containers):
    """A node's log of 50 MB of carriage-return progress and no newline: the multi-node status that shows its
    last line fetches a few KiB of it, and shows the last bar."""
    nodes = two_containers
    assert nodes.launch_fake("steps=1", extra=tuple(nodes.rendezvous_args())).code == 0
    wait_until_ended(nodes.gpuctl)
    log = nodes.path(0, "/workspace/train_tl1.log")
    bar = b"step 1/1 [#########################] 100%\r"
    with open(log, "ab") as f:
        f.write(b"\r" + bar * (50 * 2**20 // len(bar)) + b"the last bar 99%\r")
    assert log.stat().st_size > 50 * 10**6
    result = nodes.gpuctl("status", "--json", env={"GPUCTL_TRACE": "1"}, timeout=60)
    assert result.code == 0, result.stderr
    received = int(re.search(r"received (\d+) B", result.stderr).group(1))
    assert received < 256 * 1024, received  # the log's size was 50 MB
    assert result.json()["nodes"][0]["last_line"] == "the last bar 99%"


@retry(stop=stop_after_delay(30), wait=wait_fixed(0.2), reraise=True)
def wait_until_ended(gpuctl) -> None:
    doc = gpuctl("status", "--json").json()
    assert doc["state"] == "succeeded", doc


def test_two_gpuctl_remembering_at_once_both_end_cleanly(tmp_path, monkeypatch):
    """Each remember writes a temp file of its own and replaces target.json whole: no writer fails, the file
    is always one writer's whole document, and no temp file is left."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    addresses = [Address(host=f"host{k}", ct=200 + k) for k in range(2)]
    failures = []

    def remember_often(address: Address) -> None:
        for _ in range(300):
            try:
                remember(address)
            except OSError as e:  # the old fixed .tmp name: FileNotFoundError now and then
                failures.append(e)

    threads = [threading.Thread(target=remember_often, args=(a,)) for a in addresses]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    state = tmp_path / "gpuctl"
    doc = json.loads((state / "target.json").read_text())
    assert (doc["host"], doc["ct"]) in {("host0", 200), ("host1", 201)}
    assert sorted(p.name for p in state.iterdir()) == ["target.json"]


def test_a_state_dir_that_cannot_be_written_is_a_warning_after_the_run_is_shown(gpuctl, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    result = gpuctl("launch", "--python", "fake-trainer", "--json", "--set", "fake.steps=1",
                    env={"XDG_STATE_HOME": str(blocked)})
    assert result.code == 0, result.stderr
    assert result.json()["run_id"] == "tl1"
    assert "warning: the target is not remembered for the next command" in result.stderr


def test_doctor_with_a_hung_nvidia_smi_ends_and_says_so(gpuctl, standin, ctid, tmp_path):
    standin.hang_gpus(ctid)
    started = time.monotonic()
    result = gpuctl("doctor", "--json", env=quick(tmp_path), timeout=60)
    assert time.monotonic() - started < 30  # the probe's second, once, and the interpreter's own checks
    checks = {c["name"]: c for c in result.json()["checks"]}
    assert "nvidia-smi did not answer in 1 s" in checks["gpus"]["detail"], checks["gpus"]
    assert smi_processes(standin, ctid) == []


class SlowChannel:
    """A channel whose window stays full for `stalls` of paramiko's timeouts, then takes everything."""

    def __init__(self, stalls: int):
        self.stalls, self.got = stalls, bytearray()

    def send(self, data: bytes) -> int:
        if self.stalls:
            self.stalls -= 1
            raise TimeoutError
        self.got += data
        return len(data)

    sendall = send  # what the old code called


class QuietSession:
    idle_s, bound_s, endpoint = 0.3, None, "host"

    def __init__(self):
        self.stats = ssh.Stats()

    def lost(self, why: str) -> ssh.ConnectionLost:
        return ssh.ConnectionLost(why)


def test_a_full_window_is_waited_out_up_to_the_idle_deadline():
    """Writing to a remote command: a full window (a slow far end) for less than the idle deadline is waited
    out; one that stays full ends the command as a lost connection."""
    channel = SlowChannel(stalls=3)
    assert ssh.RemoteCommand(channel, QuietSession()).send(b"x" * 100_000) == 100_000
    assert bytes(channel.got) == b"x" * 100_000
    started = time.monotonic()
    with pytest.raises(ssh.ConnectionLost, match="nothing could be written for 0.3 s"):
        ssh.RemoteCommand(SlowChannel(stalls=10**9), QuietSession()).send(b"x")
    assert time.monotonic() - started < 5
