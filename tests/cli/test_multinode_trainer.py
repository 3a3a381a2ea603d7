"""A multi-node run of the real trainer through gpuctl (issue 15): `launch --node` on two containers of the
stand-in host, and on two stand-in hosts (the second behind ProxyJump), trains what one container trains; a
node killed mid-run fails the run naming it; `kill` ends every node; other data on node 1 is refused.

Each node is a real `python -m training.train` in its own container (its own /tmp and /workspace), joined
through gloo on the loopback interface (the stand-in's containers share this machine's network). Losses are held
to the one-container run's within a relative 1e-5 (the nodes add the same gradients in another order)."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
from tenacity import retry, stop_after_delay, wait_fixed

from tests.cli.conftest import NodeSet, seed_tiny_cache
from training.target.tiny import synthetic_words

pytestmark = [pytest.mark.sshd, pytest.mark.e2e]
REL_TOL = 1e-5
# Tiny, four micro-batches a step (two a node), a record each step.
SMALL = ["num_threads=1", "eval_every=0", "batch_size=4", "micro_batch_size=1", "log_every=1", "max_steps=8",
         "save_every=4"]
LONG = ["num_threads=1", "eval_every=0", "batch_size=4", "micro_batch_size=1", "log_every=1",
        "max_steps=100000", "save_every=100000"]


def sets(values: list[str]) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


def losses(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r}


def assert_close(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want) and want
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=REL_TOL), f"step {step}: {got[step]} vs {loss}"


def wait_for_step(nodes, step: int, timeout: float = 180) -> dict:
    @retry(stop=stop_after_delay(timeout), wait=wait_fixed(0.5), reraise=True)
    def reached() -> dict:
        doc = nodes.gpuctl.status()
        assert doc["state"] == "running", doc
        assert all(n["progress"] and n["progress"]["step"] >= step for n in doc["nodes"]), doc
        return doc

    return reached()


# Every container of these tests starts with the tiny preset's cache (tests/cli/conftest.py): they test the
# nodes' training, not the world each would build first.
@pytest.fixture
def gpuctl(gpuctl, tiny_cache):
    return gpuctl


@pytest.fixture
def two_containers(two_containers, tiny_world):
    return seeded(two_containers, tiny_world)


@pytest.fixture
def two_hosts(two_hosts, tiny_world):
    return seeded(two_hosts, tiny_world)


def seeded(nodes: NodeSet, world) -> NodeSet:
    for host, ctid, _ in nodes.nodes:
        seed_tiny_cache(host, ctid, world)
    return nodes


@pytest.fixture(params=["two_containers", "two_hosts"])
def nodes(request):
    """Two containers of one stand-in host, or one container on each of two hosts (the second through
    ProxyJump)."""
    return request.getfixturevalue(request.param)


def test_two_nodes_train_what_one_container_trains(gpuctl, nodes):
    one = gpuctl("launch", "--config", "tiny", *sets(SMALL), "--follow", timeout=600)
    assert one.code == 0, one.stderr[-3000:]
    want = losses(gpuctl.path("/workspace/.gpuctl/tl1.metrics.jsonl"))

    two = nodes.gpuctl("launch", *nodes.node_args(), *nodes.rendezvous_args(), "--config", "tiny", *sets(SMALL),
                       "--follow", timeout=600)
    assert two.code == 0, two.stderr[-3000:]
    assert "step 8/8" in two.stdout  # node 0's log, followed to its end
    for k in (0, 1):
        assert_close(losses(nodes.path(k, "/workspace/.gpuctl/tl1.metrics.jsonl")), want)
    assert sorted(p.name for p in nodes.path(0, "/workspace/runs/tiny/tl1/checkpoints").iterdir()) == [
        "step_00000004", "step_00000008"]
    assert not nodes.path(1, "/workspace/runs/tiny/tl1/checkpoints").exists()  # node 0 alone writes them
    doc = nodes.gpuctl.status()
    assert (doc["state"], doc["exit_code"]) == ("succeeded", 0)
    assert [(n["state"], n["progress"]["step"]) for n in doc["nodes"]] == [("succeeded", 8)] * 2


def test_a_node_killed_mid_run_fails_the_run_naming_it_and_the_other_ends(two_containers):
    nodes = two_containers
    launched = nodes.gpuctl("launch", *nodes.node_args(), *nodes.rendezvous_args(), "--config", "tiny",
                            *sets(LONG), "--json")
    assert launched.code == 0, launched.stderr
    doc = wait_for_step(nodes, 2)
    os.kill(doc["nodes"][1]["pid"], signal.SIGKILL)  # node 1's trainer dies (no signal handler runs)

    @retry(stop=stop_after_delay(30), wait=wait_fixed(0.5), reraise=True)
    def node_0_ended() -> dict:  # its run recorded as ended, and no process of it left on either node
        doc = nodes.gpuctl.status()
        assert doc["nodes"][0]["state"] != "running", doc
        assert nodes.processes(0) == [] and nodes.processes(1) == []
        return doc

    doc = node_0_ended()
    assert doc["state"] == "failed" and doc["reason"].startswith(f"node 1 (CT {nodes.nodes[1][1]} on "), doc
    assert doc["nodes"][0]["exit_code"] == 6  # the trainer's NODE_LOST
    assert "node 1 stopped answering" in doc["nodes"][0]["last_line"]


def test_a_node_that_hangs_or_goes_off_the_network_ends_the_others_within_30_s(two_containers):
    """Node 1's trainer stopped (SIGSTOP: its sockets stay open, nothing closes, as when its host or network
    goes): node 0's trainer ends on the heartbeats and its wrapper with it, no process of the run left on node
    0 within 30 s; status names node 1 in node 0's line."""
    nodes = two_containers
    launched = nodes.gpuctl("launch", *nodes.node_args(), *nodes.rendezvous_args(), "--config", "tiny",
                            *sets(LONG), "--json")
    assert launched.code == 0, launched.stderr
    pid = wait_for_step(nodes, 2)["nodes"][1]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        @retry(stop=stop_after_delay(30), wait=wait_fixed(0.5), reraise=True)
        def node_0_ended() -> dict:
            assert nodes.processes(0) == []
            doc = nodes.gpuctl.status()
            assert doc["nodes"][0]["state"] != "running", doc
            return doc

        doc = node_0_ended()
    finally:
        os.kill(pid, signal.SIGKILL)
    assert doc["state"] == "failed" and doc["nodes"][0]["exit_code"] == 6, doc
    assert "node 1 stopped answering" in doc["reason"], doc


def test_kill_stops_every_node_at_one_step_and_leaves_no_process(two_containers):
    nodes = two_containers
    launched = nodes.gpuctl("launch", *nodes.node_args(), *nodes.rendezvous_args(), "--config", "tiny",
                            *sets(LONG), "--json")
    assert launched.code == 0, launched.stderr
    wait_for_step(nodes, 2)
    killed = nodes.gpuctl("kill", "--grace", "60")
    assert killed.code == 0, killed.stderr
    assert nodes.processes(0) == [] and nodes.processes(1) == []
    doc = nodes.gpuctl.status()
    assert doc["state"] == "killed" and [n["exit_code"] for n in doc["nodes"]] == [0, 0], doc
    stopped = [[line for line in nodes.path(k, "/workspace/train_tl1.log").read_text().splitlines()
                if line.startswith("stopped at step")] for k in (0, 1)]
    assert len(stopped[0]) == 1 and stopped[0][0].split(";")[0] == stopped[1][0].split(";")[0]
    assert list(nodes.path(0, "/workspace/runs/tiny/tl1/checkpoints").iterdir())  # node 0 saved the stop's step


def conversations(count: int) -> list[str]:
    """Conversations in the tiny tokenizer's words, long enough for the recipe (over 2 blocks of loss tokens)."""
    rng = random.Random(0)
    words = synthetic_words(300)
    lines = []
    for _ in range(count):
        messages = [{"role": "user", "content": " ".join(rng.choices(words, k=8))},
                    {"role": "assistant", "content": " ".join(rng.choices(words, k=40))}]
        lines.append(json.dumps({"messages": messages}))
    return lines


def test_other_data_on_node_1_is_refused_at_start_on_every_node(two_containers):
    nodes = two_containers
    data = conversations(40)
    nodes.path(0, "/workspace/data.jsonl").write_text("\n".join(data) + "\n")
    nodes.path(1, "/workspace/data.jsonl").write_text("\n".join(data[1:]) + "\n")
    launched = nodes.gpuctl("launch", *nodes.node_args(), *nodes.rendezvous_args(), "--config", "tiny",
                            *sets([*SMALL, "data_path=/workspace/data.jsonl", "eval_data_path="]), "--follow",
                            timeout=600)
    assert launched.code != 0
    doc = nodes.gpuctl.status()
    assert doc["state"] == "failed" and [n["exit_code"] for n in doc["nodes"]] == [2, 2], doc
    for node in doc["nodes"]:
        assert node["last_line"].startswith("error: node 1 reads other training data than node 0"), node
