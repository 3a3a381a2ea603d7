"""One run across several containers (launch --node): the rendezvous each trainer is told, one run id, status
and kill over every node, all or nothing at launch; two containers of one host, and a second host behind
ProxyJump."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from tenacity import retry, stop_after_delay, wait_fixed

from tests.cli.conftest import Output
from tests.cli.test_launch_lock import lock_held
from tests.cli.test_status_and_plot import TERMINAL
from tests.sandbox.host import free_port

pytestmark = pytest.mark.sshd

LONG = ("steps=100000", "step_s=0.2")


@retry(stop=stop_after_delay(30), wait=wait_fixed(0.2), reraise=True)
def seen_env(nodes, k: int, run: str = "tl1") -> dict:
    """What node k's fake trainer printed of its environment (fake.env), waited for: a run that is "running"
    has its trainer started, not necessarily its first lines printed."""
    log = nodes.path(k, f"/workspace/train_{run}.log").read_text()
    found = re.search(r"^env: (.*)$", log, re.MULTILINE)
    assert found, f"node {k} has not printed its environment yet"
    return json.loads(found[1])


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
    launched = nodes.launch_fake(*LONG, "fail_rank=1", extra=tuple(nodes.rendezvous_args()))
    assert launched.code == 0, launched.stderr
    doc = status_until(nodes, state="failed")
    assert doc["reason"].startswith(f"node 1 (CT {nodes.nodes[1][1]} on ")
    assert doc["reason"].endswith("failed (exit 1): error: fake failure on node 1")
    assert doc["nodes"][1]["last_line"] == "error: fake failure on node 1" and doc["nodes"][0]["last_line"] is None
    assert [n["state"] for n in doc["nodes"]] == ["running", "failed"]
    assert doc["exit_code"] == 1
    assert "error: fake failure on node 1" in nodes.gpuctl("logs", "--node", "1").stdout
    assert nodes.gpuctl("kill", "--grace", "5").code == 0
    assert nodes.processes(0) == []


def test_a_failed_runs_exit_code_is_the_node_that_ended_first(two_containers):
    """Node 1 fails first (exit 1), node 0 later with another code (exit 7): the reason and the exit code are
    both node 1's, in status and in runs."""
    nodes = two_containers
    launched = nodes.launch_fake("steps=6", "step_s=0.5", "exit=7", "fail_rank=1",
                                 extra=tuple(nodes.rendezvous_args()))
    assert launched.code == 0, launched.stderr
    doc = wait_for_node_states(nodes, ["failed", "failed"])
    assert [n["exit_code"] for n in doc["nodes"]] == [7, 1]
    assert doc["reason"].startswith(f"node 1 (CT {nodes.nodes[1][1]} on ") and "(exit 1)" in doc["reason"]
    assert doc["exit_code"] == 1
    runs = nodes.gpuctl("runs", "--json")
    assert runs.code == 0, runs.stderr
    [run] = runs.json()
    assert run["reason"].startswith(f"node 1 (CT {nodes.nodes[1][1]} on ") and run["exit_code"] == 1


@retry(stop=stop_after_delay(30), wait=wait_fixed(0.2), reraise=True)
def wait_for_node_states(nodes, states: list[str]) -> dict:
    doc = nodes.gpuctl.status()
    assert [n["state"] for n in doc["nodes"]] == states, doc
    return doc


def test_a_lock_held_on_node_1_starts_nothing_anywhere(two_containers):
    nodes = two_containers
    host, ctid, _ = nodes.nodes[1]
    nodes.path(1, "/workspace/.gpuctl").mkdir(parents=True)
    holder = host.start_detached(ctid, "flock /workspace/.gpuctl/launch.lock sleep 300")
    lock_held(nodes.path(1, "/workspace/.gpuctl/launch.lock"))
    refused = nodes.launch_fake("steps=1", extra=tuple(nodes.rendezvous_args()))
    assert refused.code == 5, refused.stderr
    assert "node 1" in refused.stderr and "another launch holds" in refused.stderr
    assert "nothing was started on any node" in refused.stderr
    assert not list(nodes.path(0, "/workspace/.gpuctl").glob("tl*.json"))
    assert not list(nodes.path(0, "/workspace").glob("train_tl*.log"))
    assert nodes.processes(0) == []
    free = subprocess.run(["flock", "-n", str(nodes.path(0, "/workspace/.gpuctl/launch.lock")), "true"], check=False)
    assert free.returncode == 0  # node 0's launch lock was given back
    assert not nodes.path(0, "/workspace/.gpuctl/launch.holder").exists()
    # and a launch there goes through at once
    single = nodes.gpuctl("launch", "--python", "fake-trainer", "--set", "fake.steps=1", nodes.nodes[0][2])
    assert single.code == 0, single.stderr
    os.killpg(holder, signal.SIGKILL)


def test_a_stopped_container_on_node_1_starts_nothing(two_containers):
    nodes = two_containers
    host, ctid, _ = nodes.nodes[1]
    host.pct("stop", str(ctid))
    refused = nodes.launch_fake("steps=1", extra=tuple(nodes.rendezvous_args()))
    assert refused.code == 4, refused.stderr
    assert "node 1" in refused.stderr and "not running" in refused.stderr
    assert not list(nodes.path(0, "/workspace/.gpuctl").glob("tl*.json"))
    assert nodes.processes(0) == []


def test_retry_and_regenerate_are_refused_for_several_nodes(two_containers):
    refused = two_containers.launch_fake("steps=1", extra=("--retry", "2"))
    assert refused.code == 2
    assert "--retry is not supported for multi-node runs yet" in refused.stderr
    assert "Traceback" not in refused.stderr
    regenerate = two_containers.gpuctl("launch", *two_containers.node_args(), "--task", "regenerate")
    assert regenerate.code == 2 and "--task regenerate runs in one container" in regenerate.stderr
    assert two_containers.processes(0) == [] and two_containers.processes(1) == []


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


def test_an_unreachable_node_is_shown_and_kill_still_ends_the_others(two_hosts, second_host):
    nodes = two_hosts
    launched = nodes.launch_fake(*LONG, extra=tuple(nodes.rendezvous_args()))
    assert launched.code == 0, launched.stderr
    status_until(nodes, state="running")
    config = Path(nodes.gpuctl.env["GPUCTL_SSH_CONFIG"])
    reachable = config.read_text()
    # node 1's host goes away: nothing listens where the ssh_config sends it
    config.write_text(reachable.replace(f"Port {second_host.port}", "Port 9"))
    result = nodes.gpuctl("status", "--json")
    assert result.code == 3, result.stderr
    doc = result.json()
    assert doc["state"] == "failed" and doc["reason"].startswith(f"node 1 (CT {nodes.nodes[1][1]} on pve2) is lost")
    assert [n["state"] for n in doc["nodes"]] == ["running", None]
    assert "TCP connect failed: the jump host could not reach 127.0.0.1:9" in doc["nodes"][1]["error"]
    killed = nodes.gpuctl("kill", "--grace", "5")
    assert killed.code == 3 and "node 1" in killed.stderr
    assert "node 0" in killed.stdout and "killed tl1" in killed.stdout
    assert nodes.processes(0) == [] and nodes.processes(1) != []
    config.write_text(reachable)  # back: the kill reaches node 1 too
    assert nodes.gpuctl("kill", "--grace", "5").code == 0
    assert nodes.processes(1) == []
    assert nodes.gpuctl.status()["state"] == "killed"


def test_master_addr_defaults_to_node_0s_address_and_an_explicit_target_is_one_container(two_containers):
    nodes = two_containers
    launched = nodes.launch_fake("steps=1", "env=")
    assert launched.code == 0, launched.stderr
    addr = launched.json()["master_addr"]
    addresses = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False).stdout.split()
    assert addr == (addresses[0] if addresses else "127.0.0.1")
    assert seen_env(nodes, 0)["MASTER_ADDR"] == seen_env(nodes, 1)["MASTER_ADDR"] == addr
    assert seen_env(nodes, 1)["MASTER_PORT"] == "29500"
    assert "gpuctl: node 0 of 2" in nodes.gpuctl("logs").stdout  # node 0's log by default
    one = nodes.gpuctl("status", "--json", nodes.nodes[1][2])  # an explicit target: that container, as before
    assert one.code == 0 and "nodes" not in one.json() and one.json()["container"]["ctid"] == nodes.nodes[1][1]
    again = nodes.gpuctl("launch", "--python", "fake-trainer", "--json", "--set", "fake.steps=1", "--master-addr", "127.0.0.1")
    assert again.code == 0, again.stderr  # no options: the remembered nodes again
    assert [n["run_id"] for n in again.json()["nodes"]] == ["tl2", "tl2"]


def test_env_for_a_single_container_and_bad_env_is_one_line(gpuctl):
    launched = gpuctl.launch_fake("steps=1", "env=HF_HOME", extra=("--env", "HF_HOME=/data/hf cache"))
    assert launched.code == 0, launched.stderr
    log = gpuctl.path("/workspace/train_tl1.log").read_text()
    assert 'env: {"RANK": null, "WORLD_SIZE": null, "MASTER_ADDR": null, "MASTER_PORT": null, ' \
           '"HF_HOME": "/data/hf cache"}' in log
    for bad in ("1X=2", "NOEQUALS", "RANK=3", "A-B=1"):
        refused = gpuctl("launch", "--python", "fake-trainer", "--env", bad)
        assert refused.code == 2, (bad, refused.stderr)
        assert refused.stderr.count("\n") == 1 and "--env" in refused.stderr
    refused = gpuctl("launch", "--master-port", "29501")
    assert refused.code == 2 and "multi-node" in refused.stderr


def test_a_node_that_fails_to_start_has_the_others_killed(two_containers):
    """Every node said yes, then node 1's staging failed (its package cannot be switched in): the run that
    started on node 0 is killed, and the launch fails saying so."""
    nodes = two_containers
    stuck = nodes.path(1, "/root/gpuctl/current")
    stuck.mkdir(parents=True)
    (stuck / "in-the-way").write_text("a directory where the package link goes\n")
    failed = nodes.launch_fake(*LONG, extra=tuple(nodes.rendezvous_args()))
    assert failed.code == 1, failed.stderr
    assert "node 1" in failed.stderr and "cannot switch" in failed.stderr
    assert "the run was killed on the nodes where it had started" in failed.stderr and failed.stdout == ""
    assert nodes.processes(0) == [] and nodes.processes(1) == []
    one = nodes.gpuctl("status", "--json", nodes.nodes[0][2])  # every node's start is over before the undo
    assert (one.json()["run_id"], one.json()["state"]) == ("tl1", "killed"), one.stdout


def test_ctrl_c_while_the_nodes_start_kills_the_run_on_every_node(two_containers):
    """Every node said yes; node 0's run started while node 1's start waits (its run lock held by hand): a
    Ctrl-C there waits for node 1's start to end, then kills the run on both nodes. Exit 130, no traceback."""
    nodes = two_containers
    host, ctid, _ = nodes.nodes[1]
    nodes.path(1, "/workspace/.gpuctl").mkdir(parents=True)
    holder = host.start_detached(ctid, "flock /workspace/.gpuctl/tl1.lock sleep 300")
    lock_held(nodes.path(1, "/workspace/.gpuctl/tl1.lock"))
    launch = nodes.gpuctl.popen("launch", *nodes.node_args(), *nodes.rendezvous_args(), "--python", "fake-trainer",
                                *(f"--set=fake.{s}" for s in LONG))
    errors = Output(SimpleNamespace(stdout=launch.stderr))  # Output reads a process's stdout: here its stderr
    try:
        started_on_node_0_only(nodes)
        assert launch.poll() is None
        launch.send_signal(signal.SIGINT)
        errors.wait_for("gpuctl: interrupted: waiting for every node's start")
    finally:
        os.killpg(holder, signal.SIGKILL)  # node 1's start goes on
    launch.wait(timeout=60)
    err = errors.wait_for("on every node\n")  # (the cli ends quietly on Ctrl-C: exit 130)
    assert launch.returncode == 130 and "Traceback" not in err, err
    assert nodes.processes(0) == [] and nodes.processes(1) == []
    for k in (0, 1):
        one = nodes.gpuctl("status", "--json", nodes.nodes[k][2])
        assert (one.json()["run_id"], one.json()["state"]) == ("tl1", "killed"), one.stdout


@retry(stop=stop_after_delay(30), wait=wait_fixed(0.1), reraise=True)
def started_on_node_0_only(nodes) -> None:
    """Node 0's run has its process; node 1's launch wrote its record and waits on the run lock."""
    record = json.loads(nodes.path(0, "/workspace/.gpuctl/tl1.json").read_text())
    assert record.get("pid") and nodes.processes(0), record
    assert nodes.path(1, "/workspace/.gpuctl/tl1.json").exists()


def test_launch_follow_streams_node_0s_log_to_the_end(two_containers):
    nodes = two_containers
    followed = nodes.gpuctl("launch", *nodes.node_args(), *nodes.rendezvous_args(), "--python", "fake-trainer",
                            "--set", "fake.steps=2", "--follow")
    assert followed.code == 0, followed.stderr
    assert followed.stdout.startswith("gpuctl: node 0 of 2, master 127.0.0.1:")
    assert followed.stdout.splitlines()[-1] == "done, exit 0"
    assert "started tl1 on 2 nodes" in followed.stderr
    one = nodes.gpuctl("logs", "--node", "1")
    assert one.code == 0 and one.stdout.startswith("gpuctl: node 1 of 2")
    assert nodes.gpuctl("logs", "--node", "2").code == 2


def test_an_active_run_on_node_1_starts_nothing(two_containers):
    nodes = two_containers
    busy = nodes.gpuctl("launch", nodes.nodes[1][2], "--python", "fake-trainer", *(f"--set=fake.{s}" for s in LONG))
    assert busy.code == 0, busy.stderr
    refused = nodes.launch_fake("steps=1", extra=tuple(nodes.rendezvous_args()))
    assert refused.code == 5, refused.stderr
    assert "node 1" in refused.stderr and "run tl1 is active" in refused.stderr
    assert not list(nodes.path(0, "/workspace/.gpuctl").glob("tl*.json")) and nodes.processes(0) == []
    assert nodes.gpuctl("kill", nodes.nodes[1][2], "--grace", "5").code == 0


def test_status_watch_over_the_nodes_until_ctrl_c(two_containers):
    nodes = two_containers
    assert nodes.launch_fake("steps=3", extra=tuple(nodes.rendezvous_args())).code == 0
    watcher = nodes.gpuctl.popen("status", "--watch", "--interval", "0.2", env=TERMINAL)
    screen = Output(watcher)
    screen.wait_for("on 2 nodes", timeout=60)
    screen.wait_for("succeeded", timeout=60)
    watcher.send_signal(signal.SIGINT)
    _, err = screen.finish()
    assert watcher.returncode == 130 and "stopped watching" in err and "Traceback" not in err


def test_resume_continues_every_nodes_run_of_the_remembered_run(two_containers):
    nodes = two_containers
    launched = nodes.launch_fake(*LONG, "env=HF_HOME", extra=(*nodes.rendezvous_args(), "--env", "HF_HOME=/hf"))
    assert launched.code == 0, launched.stderr
    assert nodes.gpuctl("kill", "--grace", "5").code == 0
    resumed = nodes.gpuctl("launch", "--resume", "--json", *nodes.rendezvous_args())  # the remembered nodes and run
    assert resumed.code == 0, resumed.stderr
    doc = resumed.json()
    assert [(n["run_id"], n["resumed_from"]) for n in doc["nodes"]] == [("tl2", "tl1"), ("tl2", "tl1")]
    for k in (0, 1):
        log = nodes.path(k, "/workspace/train_tl2.log").read_text()
        assert '"--resume"' in log.splitlines()[1]  # the trainer's own --resume, every node
        env = seen_env(nodes, k, "tl2")
        assert (env["RANK"], env["WORLD_SIZE"], env["HF_HOME"]) == (str(k), "2", "/hf")  # --env kept by the record
    assert "resuming tl1" in resumed.stderr
    assert nodes.gpuctl("kill", "--grace", "5").code == 0
    alone = nodes.gpuctl("launch", nodes.nodes[0][2], "--python", "fake-trainer", "--set", "fake.steps=1")
    assert alone.code == 0, alone.stderr  # tl3, on node 0 only
    differ = nodes.gpuctl("launch", *nodes.node_args(), "--resume", *nodes.rendezvous_args())
    assert differ.code == 2 and "the nodes' latest runs differ (node 0 tl3, node 1 tl2)" in differ.stderr
    assert not nodes.path(1, "/workspace/.gpuctl/tl3.json").exists()


def test_resume_keeps_the_runs_master_address_and_port_unless_given(two_containers):
    nodes = two_containers
    port = free_port()
    launched = nodes.launch_fake("steps=1", "env=GLOO_SOCKET_IFNAME", extra=(
        "--master-addr", "127.0.0.1", "--master-port", str(port), "--env", "GLOO_SOCKET_IFNAME=lo"))
    assert launched.code == 0, launched.stderr
    status_until(nodes, state="succeeded")
    finished = nodes.gpuctl("launch", "--resume", "--json")  # tl1 did all its steps on every node: nothing to do
    assert finished.code == 0 and finished.json() == {"run_id": None, "finished": "tl1", "step": 1}, finished.stderr
    assert not nodes.path(0, "/workspace/.gpuctl/tl2.json").exists()
    assert not nodes.path(1, "/workspace/.gpuctl/tl2.json").exists()
    # no rendezvous options: the run's own (max_steps raised above the steps done)
    resumed = nodes.gpuctl("launch", "--resume", "--set", "max_steps=50", "--json")
    assert resumed.code == 0, resumed.stderr
    assert (resumed.json()["master_addr"], resumed.json()["master_port"]) == ("127.0.0.1", port)
    for k in (0, 1):
        env = seen_env(nodes, k, "tl2")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["GLOO_SOCKET_IFNAME"]) == ("127.0.0.1", str(port), "lo")
    status_until(nodes, state="succeeded")
    other = free_port()
    again = nodes.gpuctl("launch", "--resume", "--json", "--master-port", str(other))  # a flag given now wins
    assert again.code == 0, again.stderr
    assert [seen_env(nodes, k, "tl3")["MASTER_PORT"] for k in (0, 1)] == [str(other)] * 2
    assert seen_env(nodes, 0, "tl3")["MASTER_ADDR"] == "127.0.0.1"
