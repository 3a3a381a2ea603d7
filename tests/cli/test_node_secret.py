"""A multi-node run's node secret (issue 24): gpuctl makes one per launch and hands the same one to every node's
trainer as a 0600 file (GPUCTL_NODE_SECRET_FILE), never on a command line, in a script, a record or a log; the
file goes when the run ends. One container's run has none."""

from __future__ import annotations

import json
import stat

import pytest

from tests.cli.test_multinode import LONG, seen_env, status_until

pytestmark = pytest.mark.sshd

SECRET_FILE = "/workspace/.gpuctl/tl1.secret"


def everything_else(nodes, k: int) -> str:
    """What of node k a secret must never be in: every pct call's argv, the staged scripts, the records, logs."""
    host, ctid, _ = nodes.nodes[k]
    texts = [json.dumps(host.pct_calls(ctid))]
    for directory in ("/root/gpuctl/current", "/workspace/.gpuctl", "/workspace"):
        for path in nodes.path(k, directory).iterdir():
            if path.is_file() and path.suffix != ".secret":
                texts.append(path.read_text(errors="replace"))
    return "\n".join(texts)


def test_every_node_gets_the_same_secret_file_and_nothing_else_holds_it(two_containers):
    nodes = two_containers
    launched = nodes.launch_fake(*LONG, "env=GPUCTL_NODE_SECRET_FILE", extra=tuple(nodes.rendezvous_args()))
    assert launched.code == 0, launched.stderr
    status_until(nodes, state="running")
    secrets = []
    for k in (0, 1):
        assert seen_env(nodes, k)["GPUCTL_NODE_SECRET_FILE"] == SECRET_FILE
        path = nodes.path(k, SECRET_FILE)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        secrets.append(path.read_text().strip())
    assert secrets[0] == secrets[1] and len(secrets[0]) == 64 and int(secrets[0], 16) >= 0
    for k in (0, 1):
        assert "run.sh" in [p.name for p in nodes.path(k, "/root/gpuctl/current").iterdir()]
        assert secrets[0] not in everything_else(nodes, k)

    assert nodes.gpuctl("kill", "--grace", "5").code == 0
    assert not nodes.path(0, SECRET_FILE).exists() and not nodes.path(1, SECRET_FILE).exists()  # the run ended


def test_one_container_has_no_node_secret(gpuctl):
    launched = gpuctl.launch_fake("steps=1", "env=GPUCTL_NODE_SECRET_FILE")
    assert launched.code == 0, launched.stderr
    assert gpuctl("logs", "-f").code == 0
    log = gpuctl.path("/workspace/train_tl1.log").read_text()
    assert '"GPUCTL_NODE_SECRET_FILE": null' in log
    assert list(gpuctl.path("/workspace/.gpuctl").glob("*.secret")) == []
