"""Exit codes and messages at the edges: containers, host keys, bad input, shell metacharacters, --json."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from tests.sandbox import ALIAS

pytestmark = pytest.mark.sshd


def one_line_error(result) -> str:
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gpuctl: error: ")
    return lines[0]


def test_missing_container_exits_4_naming_it(gpuctl):
    for command in (["status"], ["launch", "--python", "fake-trainer"], ["logs"], ["kill"], ["runs"]):
        result = gpuctl(*command, "--ct", "999")
        assert result.code == 4, (command, result.stderr)
        assert "container 999 does not exist" in one_line_error(result)


def test_stopped_container_exits_4_naming_it(gpuctl, standin):
    assert standin.pct("stop", str(gpuctl.ctid)).returncode == 0
    for command in (["status"], ["launch", "--python", "fake-trainer"], ["logs", "-f"]):
        result = gpuctl(*command)
        assert result.code == 4
        assert f"container {gpuctl.ctid} on {ALIAS} is not running" in one_line_error(result)
    # status still shows what it knows: the container and its state (a table, or the JSON document).
    human = gpuctl("status")
    assert human.stdout.splitlines()[0] == f"CT {gpuctl.ctid} on {ALIAS}: stopped"
    doc = gpuctl("status", "--json")
    assert doc.code == 4 and doc.json()["container"]["status"] == "stopped"
    assert (doc.json()["run_id"], doc.json()["state"], doc.json()["gpus"]) == (None, None, [])
    standin.pct("start", str(gpuctl.ctid))
    assert gpuctl("status").code == 0


def test_unknown_host_key_is_refused_then_accepted_on_request(gpuctl, standin, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    config = standin.write_ssh_config(tmp_path / "ssh_config", known_hosts=known_hosts)
    env = {"GPUCTL_SSH_CONFIG": str(config)}

    refused = gpuctl("status", env=env)
    assert refused.code == 3
    message = one_line_error(refused)
    assert "unknown host key" in message and "--accept-new-host-key" in message
    assert not known_hosts.exists()

    accepted = gpuctl("status", "--accept-new-host-key", env=env)
    assert accepted.code == 0, accepted.stderr
    assert known_hosts.read_text() == standin.known_hosts_line()
    assert gpuctl("status", env=env).code == 0  # known from now on, no flag needed


def test_changed_host_key_is_always_refused(gpuctl, standin, tmp_path):
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    known_hosts = tmp_path / "known_hosts"
    key_type, key = other.with_suffix(".pub").read_text().split()[:2]
    known_hosts.write_text(f"[127.0.0.1]:{standin.port} {key_type} {key}\n")
    config = standin.write_ssh_config(tmp_path / "ssh_config", known_hosts=known_hosts)
    for extra in ([], ["--accept-new-host-key"]):
        result = gpuctl("status", *extra, env={"GPUCTL_SSH_CONFIG": str(config)})
        assert result.code == 3
        assert "CHANGED" in one_line_error(result)
    assert known_hosts.read_text() == f"[127.0.0.1]:{standin.port} {key_type} {key}\n"


def test_target_given_without_ssh_config(gpuctl, standin):
    """--host/--port/--identity and the default ~/.ssh/known_hosts (under the test's HOME)."""
    env = {"GPUCTL_SSH_CONFIG": "", "GPUCTL_HOST": ""}
    args = ["status", "--host", "127.0.0.1", "--port", str(standin.port), "--identity", str(standin.client_key)]
    assert gpuctl(*args, env=env).code == 3  # HOME's known_hosts does not know the stand-in yet
    assert gpuctl(*args, "--accept-new-host-key", env=env).code == 0
    assert (gpuctl.home / ".ssh" / "known_hosts").read_text() == standin.known_hosts_line()
    positional = gpuctl("status", f"root@127.0.0.1:{standin.port}/{gpuctl.ctid}", "--identity",
                        str(standin.client_key), env=env | {"GPUCTL_CT": ""})
    assert positional.code == 0, positional.stderr


def test_no_key_at_all_says_how_to_give_one(gpuctl, standin):
    """No --identity, no agent, no ~/.ssh/id_*, no ssh config: exit 3 with the ways to give a key, not
    paramiko's 'No authentication methods available'."""
    env = {"GPUCTL_SSH_CONFIG": "", "GPUCTL_HOST": ""}
    result = gpuctl("status", "--host", "127.0.0.1", "--port", str(standin.port), "--accept-new-host-key", env=env)
    assert result.code == 3, result.stderr
    assert "has no SSH key to offer" in result.stderr and "--identity KEY" in result.stderr
    assert "ssh-add" in result.stderr and "No authentication methods" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_unreachable_host_and_bad_login_exit_3(gpuctl, standin, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    unreachable = gpuctl("status", "--port", str(closed_port), "--connect-timeout", "2")
    assert unreachable.code == 3 and "cannot connect" in one_line_error(unreachable)

    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    config = tmp_path / "ssh_config"
    config.write_text(standin.ssh_config.read_text().replace(str(standin.client_key), str(stranger)))
    denied = gpuctl("status", env={"GPUCTL_SSH_CONFIG": str(config)})
    assert denied.code == 3 and "authentication failed" in one_line_error(denied)


@pytest.mark.parametrize("args, expected", [
    (["status", "--ct", "abc"], "Invalid value for '--ct'"),
    (["status", "--ct", "12"], "container id must be a number from 100"),
    (["status", "--port", "99999"], "port must be a number from 1 to 65535"),
    (["status", "--run", "x 7"], "--run takes a run number like 7 or tl7, or a run's name"),
    (["launch", "--set", "novalue"], "--set takes KEY=VALUE, got 'novalue' (see gpuctl launch --help)"),
    (["launch", "--set"], "Option '--set' requires an argument. (see gpuctl launch --help)"),  # no context given
    (["doctor", "--python"], "(see gpuctl doctor --help)"),
    (["launch", "--workdir", "relative/dir"], "--workdir must be an absolute path"),
    (["launch", "--json", "--follow"], "--json and --follow cannot be combined"),
    (["kill", "--signal", "FOO"], "--signal must be one of"),
    (["status", "--bogus"], "No such option"),
    (["frobnicate"], "No such command"),
    (["status", "not a target!"], "TARGET must look like"),
    (["status", "--identity", "/nonexistent/key"], "no such key file"),
])
def test_bad_input_is_one_line_and_exit_2(gpuctl, args, expected):
    result = gpuctl(*args)
    assert result.code == 2, result.stderr
    assert expected in one_line_error(result)
    assert result.stdout == ""


def test_no_target_at_all_is_a_usage_error(gpuctl):
    result = gpuctl("status", env={"GPUCTL_HOST": "", "GPUCTL_CT": ""})
    assert result.code == 2 and "no host" in one_line_error(result)


def test_missing_python_in_container(gpuctl):
    result = gpuctl("launch", "--python", "/opt/no/python")
    assert result.code == 2 and "'/opt/no/python' not found in CT" in one_line_error(result)


def test_shell_metacharacters_in_every_value_are_inert(gpuctl, tmp_path):
    pwned = ["/tmp/pwned", "/tmp/pwned2", "/tmp/pwned3", "/tmp/pwned4", "/root/pwned5", "/workspace/pwned5"]
    # string keys the fake trainer ignores (gpuctl refuses unknown keys before sending anything)
    sets = ["target_path=$(touch /tmp/pwned);rm -rf", "data_path=`touch /tmp/pwned2`",
            "eval_data_path='; touch /tmp/pwned3; '", 'init_from="$HOME" \\ *', "fake.steps=2"]
    workdir = "/workspace/odd dir $(touch /tmp/pwned4) ;'\"`x`"
    log_dir = "/workspace/logs; touch /tmp/pwned #"
    local = tmp_path / "run $(touch pwned5);'x`y`.toml"  # a local file is staged as configs/NAME
    local.write_text("max_steps = 2\n")
    config = f"/root/gpuctl/configs/{local.name}"
    args = ["launch", "--python", "fake-trainer", "--config", str(local), "--workdir", workdir, "--log-dir", log_dir,
            "--follow"]
    for item in sets:
        args += ["--set", item]
    result = gpuctl(*args)
    assert result.code == 0, result.stderr
    argv = json.loads(result.stdout.splitlines()[0].removeprefix("argv: "))
    expected = ["-m", "training.train", "--config", config]
    for item in sets:
        expected += ["--set", item]
    assert argv == expected  # every value arrived verbatim, as one argument
    for path in pwned:
        assert not gpuctl.path(path).exists() and not Path(path).exists()
    assert gpuctl.path(workdir).is_dir()
    assert gpuctl.path(f"{log_dir}/train_tl1.log").read_text() == result.stdout
    doc = gpuctl.status()
    assert doc["log_path"] == f"{log_dir}/train_tl1.log" and doc["config"] == config
    assert gpuctl("logs", "-n", "1").stdout == "done, exit 0\n"


def test_json_outputs_are_json_only(gpuctl):
    empty = gpuctl("status", "--json")
    doc = json.loads(empty.stdout)
    assert doc["run_id"] is None and doc["state"] is None and doc["progress"] is None
    assert doc["container"]["status"] == "running" and len(doc["gpus"]) == 2
    assert json.loads(gpuctl("runs", "--json").stdout) == []

    launched = gpuctl("launch", "--python", "fake-trainer", "--set", "fake.steps=100000", "--json")
    assert json.loads(launched.stdout)["state"] == "running"
    assert "started tl1" in launched.stderr  # human text went to stderr
    runs = json.loads(gpuctl("runs", "--json").stdout)
    assert len(runs) == 1 and runs[0]["run_id"] == "tl1" and "gpus" not in runs[0]
    status = json.loads(gpuctl("status", "--json", "--run", "tl1").stdout)
    expected_keys = {"run_id", "state", "exit_code", "pid", "started_at", "log_path", "progress", "gpus",
                     "container"}
    assert expected_keys <= status.keys()
    assert status["started_at"].endswith("+00:00")
    assert gpuctl("kill", "--grace", "5").code == 0


def test_no_gpus_visible(gpuctl, standin):
    standin.set_gpus(gpuctl.ctid, [])
    assert gpuctl.status()["gpus"] == []
    human = gpuctl("status")
    assert human.code == 0 and "no GPUs visible" in human.stdout
