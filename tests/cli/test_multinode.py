"""One run across several containers (launch --node): the rendezvous each trainer is told, one run id, status
and kill over every node, all or nothing at launch; two containers of one host, and a second host behind
ProxyJump."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
from tenacity import retry, stop_after_delay, wait_fixed

from tests.cli.test_launch_lock import lock_held

pytestmark = pytest.mark.sshd

LONG = ("steps=100000", "step_s=0.2")


def seen_env(nodes, k: int, run: str = "tl1") -> dict:
    """What node k's fake trainer printed of its environment (fake.env)."""
    log = nodes.path(k, f"/workspace/train_{run}.log").read_text()
    return json.loads(re.search(r"^env: (.*)$", log, re.MULTILINE)[1])


@retry(stop=stop_after_delay(30), wait=wait_fixed(0.2), reraise=True)
def status_until(nodes, **expected) -> dict:
    doc = nodes.gpuctl.status()
    assert {k: doc.get(k) for k in expected} == expected, doc
    return doc


def test_two_nodes_share_a_run_id_and_a_rendezvous(two_containers):
    nodes = two_containers
    launched = nodes.launch_fake(*LONG, "env=NCCL_DEBUG,GLOO_SOCKET_IFNAME", extra=(
        "--master-addr", "127.0.0.1", "--master-port", "29611", "--env", "NCCL_DEBUG=INFO",
        "--env", "GLOO_SOCKET_IFNAME=lo"))
    assert launched.code == 0, launched.stderr
    doc = launched.json()
    assert doc["run_id"] == "tl1" and doc["world_size"] == 2
    assert (doc["master_addr"], doc["master_port"]) == ("127.0.0.1", 29611)
    assert [n["target"] for n in doc["nodes"]] == [spec for _, _, spec in nodes.nodes]
    assert [n["run_id"] for n in doc["nodes"]] == ["tl1", "tl1"]
    for k in (0, 1):
        assert seen_env(nodes, k) == {"RANK": str(k), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                      "MASTER_PORT": "29611", "NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "lo"}

    status = status_until(nodes, state="running")  # no options: the remembered nodes
    assert status["run_id"] == "tl1" and status["reason"] is None
    assert [(n["node"], n["state"], n["target"]) for n in status["nodes"]] == [
        (k, "running", spec) for k, (_, _, spec) in enumerate(nodes.nodes)]
    assert all(n["pid"] and n["gpus"] for n in status["nodes"])
    human = nodes.gpuctl("status")
    assert human.code == 0 and "on 2 nodes" in human.stdout and str(nodes.nodes[1][1]) in human.stdout

    killed = nodes.gpuctl("kill", "--grace", "5")
    assert killed.code == 0, killed.stderr
    assert killed.stdout.count("killed tl1") == 2
    assert nodes.processes(0) == [] and nodes.processes(1) == []
    assert nodes.gpuctl.status()["state"] == "killed"


def test_node_1_failing_fails_the_run_naming_it(two_containers):
    nodes = two_containers
    launched = nodes.launch_fake(*LONG, "fail_rank=1", extra=("--master-addr", "127.0.0.1"))
    assert launched.code == 0, launched.stderr
    doc = status_until(nodes, state="failed")
    assert doc["reason"].startswith(f"node 1 (CT {nodes.nodes[1][1]} on ") and "failed (exit 1)" in doc["reason"]
    assert [n["state"] for n in doc["nodes"]] == ["running", "failed"]
    assert doc["exit_code"] == 1
    assert "error: fake failure on node 1" in nodes.gpuctl("logs", "--node", "1").stdout
    assert nodes.gpuctl("kill", "--grace", "5").code == 0
    assert nodes.processes(0) == []


def test_a_lock_held_on_node_1_starts_nothing_anywhere(two_containers):
    nodes = two_containers
    host, ctid, _ = nodes.nodes[1]
    nodes.path(1, "/workspace/.gpuctl").mkdir(parents=True)
    holder = host.start_detached(ctid, "flock /workspace/.gpuctl/launch.lock sleep 300")
    lock_held(nodes.path(1, "/workspace/.gpuctl/launch.lock"))
    refused = nodes.launch_fake("steps=1", extra=("--master-addr", "127.0.0.1"))
    assert refused.code == 5, refused.stderr
    assert "node 1" in refused.stderr and "another launch holds" in refused.stderr
    assert "nothing was started on any node" in refused.stderr
    assert not list(nodes.path(0, "/workspace/.gpuctl").glob("tl*.json"))
    assert not list(nodes.path(0, "/workspace").glob("train_tl*.log"))
    assert nodes.processes(0) == []
    # node 0's launch lock is free again: a launch there goes through at once
    single = nodes.gpuctl("launch", "--python", "fake-trainer", "--set", "fake.steps=1", nodes.nodes[0][2])
    assert single.code == 0, single.stderr
    os.killpg(holder, signal.SIGKILL)


def test_a_stopped_container_on_node_1_starts_nothing(two_containers):
    nodes = two_containers
    host, ctid, _ = nodes.nodes[1]
    host.pct("stop", str(ctid))
    refused = nodes.launch_fake("steps=1", extra=("--master-addr", "127.0.0.1"))
    assert refused.code == 4, refused.stderr
    assert "node 1" in refused.stderr and "not running" in refused.stderr
    assert not list(nodes.path(0, "/workspace/.gpuctl").glob("tl*.json"))
    assert nodes.processes(0) == []


def test_retry_is_refused_for_several_nodes(two_containers):
    refused = two_containers.launch_fake("steps=1", extra=("--retry", "2"))
    assert refused.code == 2
    assert "--retry is not supported for multi-node runs yet" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_a_cluster_of_config_toml_across_two_hosts_through_proxyjump(two_hosts):
    nodes = two_hosts
    config_dir = nodes.gpuctl.home / "config" / "gpuctl"
    config_dir.mkdir(parents=True)
    (config_dir / "config.toml").write_text(
        f'[clusters.big]\nnodes = [{", ".join(json.dumps(spec) for _, _, spec in nodes.nodes)}]\n')
    launched = nodes.gpuctl("launch", "--cluster", "big", "--python", "fake-trainer", "--json", "--set",
                            "fake.env=", "--set", "fake.steps=2", "--master-addr", "127.0.0.1")
    assert launched.code == 0, launched.stderr
    assert seen_env(nodes, 1)["RANK"] == "1" and seen_env(nodes, 0)["WORLD_SIZE"] == "2"
    doc = status_until(nodes, state="succeeded")
    assert [n["state"] for n in doc["nodes"]] == ["succeeded", "succeeded"]
    runs = nodes.gpuctl("runs", "--json")
    assert runs.code == 0, runs.stderr
    assert [(r["run_id"], len(r["nodes"])) for r in runs.json()] == [("tl1", 2)]
