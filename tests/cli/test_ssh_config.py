"""Targets through ~/.ssh/config: an alias reached through a ProxyJump host (a second stand-in sshd), host keys
checked on both hops, and config.toml profiles."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

from tests.sandbox import StandInHost

pytestmark = pytest.mark.sshd

BEHIND = "pve-behind"


@pytest.fixture(scope="module")
def jump(tmp_path_factory) -> StandInHost:
    """A second sshd on 127.0.0.1 (another port): the jump host. DEBUG1 logs every forwarded connection."""
    host = StandInHost(tmp_path_factory.mktemp("jump"), log_level="DEBUG1").start()
    yield host
    host.stop()


def jump_config(tmp_path, standin, jump, known: str) -> dict[str, str]:
    """An ssh_config where the container host is only an alias behind `ProxyJump jumpbox`; the environment
    that names nothing but that alias."""
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(known)
    config = tmp_path / "ssh_config"
    config.write_text(jump.ssh_config_entry("jumpbox", known_hosts)
                      + standin.ssh_config_entry(BEHIND, known_hosts, extra=("ProxyJump jumpbox",)))
    return {"GPUCTL_SSH_CONFIG": str(config), "GPUCTL_HOST": BEHIND}


def forwarded_to(jump: StandInHost, port: int) -> int:
    return jump.log.read_text().count(f"server_request_direct_tcpip: originator 127.0.0.1 port 0, target "
                                      f"127.0.0.1 port {port}")


def test_alias_with_proxyjump_through_a_second_sshd(gpuctl, standin, jump, tmp_path):
    env = jump_config(tmp_path, standin, jump, standin.known_hosts_line() + jump.known_hosts_line())
    before = forwarded_to(jump, standin.port)
    result = gpuctl("launch", "--python", "fake-trainer", "--set", "fake.steps=2", "--follow", env=env)
    assert result.code == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "done, exit 0"
    assert forwarded_to(jump, standin.port) == before + 1  # one connection, through the jump host
    # The remembered target (the alias and its ssh_config) needs no flags and still goes through the jump.
    bare = {"GPUCTL_HOST": "", "GPUCTL_CT": "", "GPUCTL_SSH_CONFIG": ""}
    doc = gpuctl("status", "--json", env=bare).json()
    assert (doc["run_id"], doc["state"], doc["container"]["host"]) == ("tl1", "succeeded", BEHIND)
    assert forwarded_to(jump, standin.port) == before + 2


def test_host_keys_are_checked_on_both_hops(gpuctl, standin, jump, tmp_path):
    only_final = jump_config(tmp_path, standin, jump, standin.known_hosts_line())
    refused = gpuctl("status", env=only_final)
    assert refused.code == 3
    assert f"unknown host key for [127.0.0.1]:{jump.port}" in refused.stderr

    only_jump = jump_config(tmp_path, standin, jump, jump.known_hosts_line())
    refused = gpuctl("status", env=only_jump)
    assert refused.code == 3
    assert f"unknown host key for [127.0.0.1]:{standin.port}" in refused.stderr

    accepted = gpuctl("status", "--accept-new-host-key", env=jump_config(tmp_path, standin, jump, ""))
    assert accepted.code == 0, accepted.stderr
    assert sorted((tmp_path / "known_hosts").read_text().splitlines()) == sorted(
        (standin.known_hosts_line() + jump.known_hosts_line()).splitlines())


def test_profiles_of_config_toml(gpuctl, standin, tmp_path):
    config_dir = gpuctl.home / "config" / "gpuctl"
    config_dir.mkdir(parents=True)
    (config_dir / "config.toml").write_text(
        f'ssh_config = "{standin.ssh_config}"\n'
        f'[profiles.lab]\nhost = "gpuctl-standin"\nct = {gpuctl.ctid}\n'
        '[profiles.other]\nhost = "gpuctl-standin"\nct = 99999\n')
    bare = {"GPUCTL_HOST": "", "GPUCTL_CT": "", "GPUCTL_SSH_CONFIG": ""}
    doc = gpuctl("status", "--json", "--profile", "lab", env=bare).json()
    assert doc["container"]["ctid"] == gpuctl.ctid
    assert gpuctl("status", "--json", env=bare | {"GPUCTL_PROFILE": "lab"}).code == 0
    assert gpuctl("status", "--profile", "other", env=bare | {"GPUCTL_PROFILE": "lab"}).code == 4  # flag wins
    assert gpuctl("status", "--profile", "lab", "--ct", "99999", env=bare).code == 4  # an option beats its profile
    unknown = gpuctl("status", "--profile", "nope", env=bare)
    assert unknown.code == 2 and "no profile 'nope'" in unknown.stderr and "lab, other" in unknown.stderr


def test_key_from_the_agent(gpuctl, standin, tmp_path):
    """No IdentityFile, no key in ~/.ssh: the agent's key logs in."""
    started = subprocess.run(["ssh-agent", "-s"], capture_output=True, text=True, check=True).stdout
    agent = dict(re.findall(r"(SSH_AUTH_SOCK|SSH_AGENT_PID)=([^;]+);", started))
    try:
        subprocess.run(["ssh-add", "-q", str(standin.client_key)], env={**os.environ, **agent}, check=True,
                       capture_output=True)
        config = tmp_path / "ssh_config"
        config.write_text("".join(line + "\n" for line in standin.ssh_config_entry().splitlines()
                                  if "IdentityFile" not in line))
        env = {"GPUCTL_SSH_CONFIG": str(config)}
        assert gpuctl("status", env=env).code == 3  # no key anywhere
        with_agent = gpuctl("status", env=env | {"SSH_AUTH_SOCK": agent["SSH_AUTH_SOCK"]})
        assert with_agent.code == 0, with_agent.stderr
    finally:
        os.kill(int(agent["SSH_AGENT_PID"]), signal.SIGTERM)
