"""The remembered target (the last launch's) named as the source of what it supplied, and forgotten on request
(issue 39): `gpuctl target` shows it, `gpuctl target --forget` clears it."""

from __future__ import annotations

import socket

import pytest

from tests.sandbox import ALIAS

pytestmark = pytest.mark.sshd

# No host, container or ssh_config of the environment: every setting comes from the remembered target.
ALONE = {"GPUCTL_HOST": "", "GPUCTL_CT": "", "GPUCTL_SSH_CONFIG": ""}
FROM_REMEMBERED = "(from the remembered target; gpuctl target --forget clears it)"


def one_line(result, code: int) -> str:
    assert result.code == code, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_setting_from_the_remembered_target_names_it_and_forget_clears_it(gpuctl, standin, tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(standin.ssh_config.read_text())
    launched = gpuctl("launch", "--python", "fake-trainer", "--json", "--set", "fake.steps=1",
                      env={"GPUCTL_SSH_CONFIG": str(config)})
    assert launched.code == 0, launched.stderr
    assert gpuctl("status", env=ALONE).code == 0  # all of it remembered

    shown = gpuctl("target", env=ALONE)
    assert shown.code == 0, shown.stderr
    assert shown.stdout.startswith(f"{ALIAS}/{gpuctl.ctid}  (the last launch's") and str(config) in shown.stdout
    assert gpuctl("target", "--json").json()["target"]["ssh_config"] == str(config)

    # The remembered container was stopped: its number is named as the remembered target's.
    assert gpuctl.host.pct("stop", str(gpuctl.ctid)).returncode == 0
    for command in (["status"], ["logs"]):
        line = one_line(gpuctl(*command, env=ALONE), 4)
        assert f"container {gpuctl.ctid} {FROM_REMEMBERED} on {ALIAS} is not running" in line, command
    assert gpuctl.host.pct("start", str(gpuctl.ctid)).returncode == 0

    # The stand-in moved to a port where nothing listens: the connection's error says where the host came from.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    config.write_text(standin.ssh_config.read_text().replace(f"Port {standin.port}", f"Port {closed}"))
    line = one_line(gpuctl("status", "--connect-timeout", "2", env=ALONE), 3)
    assert "TCP connect failed: connection refused" in line and line.endswith(FROM_REMEMBERED)

    # The stand-in was taken down, its ssh_config with it: the user never passed --ssh-config.
    config.unlink()
    line = one_line(gpuctl("status", env=ALONE), 2)
    assert line == f"gpuctl: error: --ssh-config {FROM_REMEMBERED}: no such file: {config}"
    # Given in the environment, the same error names the variable.
    line = one_line(gpuctl("status", env={"GPUCTL_SSH_CONFIG": str(config)}), 2)
    assert line == f"gpuctl: error: --ssh-config (from GPUCTL_SSH_CONFIG): no such file: {config}"

    forgot = gpuctl("target", "--forget", "--json", env=ALONE)
    assert forgot.code == 0 and f"forgot the remembered target {ALIAS}/{gpuctl.ctid}" in forgot.stderr
    assert forgot.json()["forgot"]["ct"] == gpuctl.ctid
    assert "no host" in one_line(gpuctl("status", env=ALONE), 2)
    assert "no remembered target" in gpuctl("target", env=ALONE).stderr
    assert "no remembered target to forget" in gpuctl("target", "--forget", env=ALONE).stderr
