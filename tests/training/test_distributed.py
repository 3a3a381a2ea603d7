"""Multi-node runs (training/distributed/), as real trainer processes on this machine: gloo on loopback
(GLOO_SOCKET_IFNAME=lo), env:// variables, each node its own output directory (other hosts share no disk).

Equal losses are held to a relative tolerance of 1e-5: the nodes sum the same micro-batches' gradients as one
process does, in another order (float addition is not associative), nothing else differs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from training.config import ConfigError, load_config
from training.distributed import (
    default_micro_batch,
    fingerprint_difference,
    micro_batch_share,
    node_env,
    run_fingerprint,
    tensor_sums,
)

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
REL_TOL = 1e-5
SECRET = "0123456789abcdef-two-nodes-test-secret"  # every node's, unless a test gives another
# A step of 4 micro-batches of one sequence: 2 to each of 2 nodes; a metrics record and a loss every step.
SMALL = ["num_threads=1", "eval_every=0", "batch_size=4", "micro_batch_size=1", "log_every=1", "max_steps=8",
         "save_every=4", "keep_checkpoints=2"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def trainer_args(world, output_dir: Path, *overrides: str, resume: bool = False) -> list[str]:
    sets = [*world.overrides(output_dir), *SMALL, *overrides]
    return ["--config", "tiny", *[a for s in sets for a in ("--set", s)], *(["--resume"] if resume else [])]


def secret_file(path: Path, secret: str) -> Path:
    """The node secret in a file only its owner reads, as gpuctl writes it in each container."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(secret + "\n")
    return path


def start_node(args: list[str], rank: int, world_size: int, port: int, log: Path,
               interface: str = "lo", secret: str | None = SECRET, extra_env: dict[str, str] | None = None,
               module: str = "training.train") -> subprocess.Popen:
    """One trainer process (or another `module`) as node `rank`; with `secret`, the run's node secret in a file
    of its own."""
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": interface}
    for key in ("GPUCTL_METRICS", "GPUCTL_NODE_SECRET", "GPUCTL_NODE_SECRET_FILE", "GPUCTL_TRUSTED_NETWORK"):
        env.pop(key, None)
    env.update(extra_env or {})
    if secret is not None:
        env["GPUCTL_NODE_SECRET_FILE"] = str(secret_file(log.with_suffix(".secret"), secret))
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def start_nodes(tiny_world, tmp_path: Path, name: str, per_node: list[list[str]], resume: bool = False,
                world_size: int | None = None, interface: str = "lo", secrets: list[str | None] | None = None,
                port: int | None = None) -> tuple[list[subprocess.Popen], list[Path], list[Path]]:
    """One trainer process per entry of `per_node` (its own overrides), each with its own output dir and the
    run's node secret (or `secrets`, one per node)."""
    port = port or free_port()
    secrets = secrets or [SECRET] * len(per_node)
    outputs = [tmp_path / f"{name}-node{rank}" for rank in range(len(per_node))]
    logs = [tmp_path / f"{name}-node{rank}.log" for rank in range(len(per_node))]
    procs = [start_node(trainer_args(tiny_world, out, *sets, resume=resume), rank, world_size or len(per_node),
                        port, log, interface, secret)
             for rank, (out, sets, log, secret) in enumerate(zip(outputs, per_node, logs, secrets))]
    return procs, outputs, logs


def wait_all(procs: list[subprocess.Popen], timeout: float = 240) -> list[int]:
    deadline = time.monotonic() + timeout
    return [proc.wait(max(1.0, deadline - time.monotonic())) for proc in procs]


def losses(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r}


def records(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def wait_for_steps(proc: subprocess.Popen, metrics: Path, log: Path, steps: int, timeout: float = 120) -> None:
    """Until `metrics` holds `steps` losses (the node is training)."""
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and len(losses(metrics)) >= steps):
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)


def stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def error_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("error:")]


def assert_close(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want)
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=REL_TOL), f"step {step}: {got[step]} vs {loss}"


@pytest.fixture(scope="module")
def one_node(tiny_world, tmp_path_factory) -> Path:
    """The reference: the same config in one process (its output dir)."""
    out = tmp_path_factory.mktemp("one-node") / "run"
    done = subprocess.run([sys.executable, "-m", "training.train", *trainer_args(tiny_world, out)], cwd=REPO,
                          capture_output=True, text=True, timeout=240, check=False,
                          env={k: v for k, v in os.environ.items() if k != "GPUCTL_METRICS"})
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.fixture(scope="module")
def two_nodes(tiny_world, tmp_path_factory) -> list[Path]:
    """The same run on two nodes (their output dirs)."""
    tmp = tmp_path_factory.mktemp("two-nodes")
    procs, outputs, logs = start_nodes(tiny_world, tmp, "run", [[], []])
    codes = wait_all(procs)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    return outputs


def test_two_nodes_train_what_one_process_trains(one_node, two_nodes):
    node0, node1 = two_nodes
    want = losses(one_node / "metrics.jsonl")
    assert len(want) == 8
    assert_close(losses(node0 / "metrics.jsonl"), want)
    # Node 1 writes its own progress (the run's loss) for gpuctl status, and nothing of node 0's.
    assert_close(losses(node1 / "metrics.node1.jsonl"), want)
    assert not (node1 / "checkpoints").exists() and not (node1 / "export").exists()
    assert sorted(p.name for p in (node0 / "checkpoints").iterdir()) == ["step_00000004", "step_00000008"]
    assert (node0 / "export" / "model.safetensors").is_file()
    # Node 0's records count both nodes: the run's tokens/s is the sum of each node's.
    last = records(node0 / "metrics.jsonl")[-1]
    assert [n["node"] for n in last["nodes"]] == [0, 1]
    assert last["tokens_per_s"] == pytest.approx(sum(n["tokens_per_s"] for n in last["nodes"]))
    assert all(n["busy"] and n["all_reduce_ms"] > 0 for n in last["nodes"])


def test_a_one_node_checkpoint_resumes_on_two_nodes_sent_by_node_0_and_continues_exactly(tiny_world, tmp_path,
                                                                                       one_node):
    # Node 0 has only step 4's checkpoint, from the one-node run; node 1 nothing at all (another host's disk).
    shutil.copytree(one_node / "checkpoints" / "step_00000004",
                    tmp_path / "resumed-node0" / "checkpoints" / "step_00000004")
    procs, outputs, logs = start_nodes(tiny_world, tmp_path, "resumed", [[], []], resume=True)
    codes = wait_all(procs)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    assert "resumed from" in logs[1].read_text() and "step 4" in logs[1].read_text()
    want = {step: loss for step, loss in losses(one_node / "metrics.jsonl").items() if step > 4}
    assert_close(losses(outputs[0] / "metrics.jsonl"), want)
    assert_close(losses(outputs[1] / "metrics.node1.jsonl"), want)
    assert not (outputs[1] / ".from-node0").exists()  # the received copy is gone once loaded


def test_a_two_node_checkpoint_resumes_on_one_node_to_the_same_losses(tiny_world, tmp_path, one_node, two_nodes):
    out = tmp_path / "one"
    shutil.copytree(two_nodes[0] / "checkpoints" / "step_00000004", out / "checkpoints" / "step_00000004")
    done = subprocess.run([sys.executable, "-m", "training.train", *trainer_args(tiny_world, out, resume=True)],
                          cwd=REPO, capture_output=True, text=True, timeout=240, check=False,
                          env={k: v for k, v in os.environ.items() if k != "GPUCTL_METRICS"})
    assert done.returncode == 0, done.stdout + done.stderr
    want = {step: loss for step, loss in losses(one_node / "metrics.jsonl").items() if step > 4}
    assert_close(losses(out / "metrics.jsonl"), want)


def test_other_data_on_node_1_is_refused_at_start_on_every_node(tiny_world, tmp_path):
    other = tmp_path / "other.jsonl"
    lines = tiny_world.train.read_text().splitlines()
    other.write_text("\n".join(lines[1:]) + "\n")  # one conversation fewer
    procs, _, logs = start_nodes(tiny_world, tmp_path, "data", [[], [f"data_path={other}"]])
    assert wait_all(procs) == [2, 2]
    for log in logs:
        (line,) = error_lines(log)
        assert line.startswith("error: node 1 reads other training data than node 0 (data_sha256: "), line
        assert "step 1/" not in log.read_text()  # refused before any training


def test_a_node_killed_mid_run_stops_the_others_within_30_s_naming_it(tiny_world, tmp_path):
    procs, outputs, logs = start_nodes(tiny_world, tmp_path, "killed", [["max_steps=100000", "save_every=100000"]] * 2)
    try:
        wait_for_steps(procs[0], outputs[0] / "metrics.jsonl", logs[0], 2)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        code = procs[0].wait(60)
        assert time.monotonic() - killed_at < 30
    finally:
        stop_all(procs)
    assert code == 6  # TrainExit.NODE_LOST
    (line,) = error_lines(logs[0])
    assert "node 1 stopped answering" in line, line


def test_a_hung_node_stops_the_others_after_node_timeout_s(tiny_world, tmp_path):
    sets = ["max_steps=100000", "save_every=100000", "node_timeout_s=4"]
    procs, outputs, logs = start_nodes(tiny_world, tmp_path, "hung", [sets, sets])
    try:
        wait_for_steps(procs[0], outputs[0] / "metrics.jsonl", logs[0], 2)
        procs[1].send_signal(signal.SIGSTOP)  # alive, holding its sockets open, doing nothing
        code = procs[0].wait(60)
    finally:
        stop_all(procs)
    assert code == 6
    (line,) = error_lines(logs[0])
    assert "node 1 stopped answering" in line, line


def test_a_stop_signal_on_one_node_stops_every_node_at_the_same_step(tiny_world, tmp_path):
    procs, outputs, logs = start_nodes(tiny_world, tmp_path, "stop", [["max_steps=100000", "save_every=100000"]] * 2)
    try:
        wait_for_steps(procs[1], outputs[1] / "metrics.node1.jsonl", logs[1], 2)
        procs[1].send_signal(signal.SIGTERM)
        codes = wait_all(procs, 60)
    finally:
        stop_all(procs)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    saved = [p.name for p in (outputs[0] / "checkpoints").iterdir()]
    stopped = [int(line.split()[3].rstrip(";")) for log in logs for line in log.read_text().splitlines()
               if line.startswith("stopped at step")]
    assert len(stopped) == 2 and stopped[0] == stopped[1] and saved == [f"step_{stopped[0]:08d}"]


def test_a_node_that_never_starts_fails_the_run_within_node_start_timeout_s(tiny_world, tmp_path):
    began = time.monotonic()
    procs, _, logs = start_nodes(tiny_world, tmp_path, "alone", [["node_start_timeout_s=3"]], world_size=2)
    assert wait_all(procs, 120) == [6]
    assert time.monotonic() - began < 60
    (line,) = error_lines(logs[0])
    assert "not every node joined within 3 s" in line, line


def test_an_interface_the_nodes_cannot_use_is_one_line_naming_the_variable(tiny_world, tmp_path):
    procs, _, logs = start_nodes(tiny_world, tmp_path, "interface", [[], []], interface="no-such-interface")
    assert wait_all(procs, 120) == [6, 6]
    for log in logs:
        (line,) = error_lines(log)
        assert "process group could not be formed" in line and "GLOO_SOCKET_IFNAME" in line, line


# The pieces.

def test_every_micro_batch_goes_to_exactly_one_node():
    for micro_batches, nodes in [(4, 2), (5, 2), (7, 3), (8, 8)]:
        shares = [micro_batch_share(micro_batches, rank, nodes) for rank in range(nodes)]
        assert sorted(i for share in shares for i in share) == list(range(micro_batches))
    with pytest.raises(ConfigError, match="2 micro-batch"):
        micro_batch_share(2, 0, 3)


def test_node_env_reads_the_env_variables_and_refuses_bad_ones():
    assert node_env({}) is None and node_env({"WORLD_SIZE": "1"}) is None
    env = node_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert (env.rank, env.world_size, env.master_port) == (1, 2, 29500)
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        node_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"})
    with pytest.raises(ConfigError, match="outside"):
        node_env({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})


def test_fingerprints_name_the_first_difference():
    data = {"data_sha256": "aa", "sequences kept": 10}
    weights = tensor_sums([("w", torch.arange(4.0))])
    base = run_fingerprint({"lr": 1e-3, "devices": "cpu"}, data, {"layers": 2}, weights, weights)
    assert fingerprint_difference(base, base) is None
    # Devices are each node's own; the rest must agree.
    assert fingerprint_difference(base, run_fingerprint({"lr": 1e-3, "devices": [0, 1]}, data, {"layers": 2},
                                                        weights, weights)) is None
    other_lr = run_fingerprint({"lr": 2e-3, "devices": "cpu"}, data, {"layers": 2}, weights, weights)
    assert "lr=0.002" in fingerprint_difference(base, other_lr)
    other_data = run_fingerprint({"lr": 1e-3}, {**data, "data_sha256": "bb"}, {"layers": 2}, weights, weights)
    assert "data_sha256: 'bb' vs 'aa'" in fingerprint_difference(base, other_data)
    other_weights = run_fingerprint({"lr": 1e-3}, data, {"layers": 2}, tensor_sums([("w", torch.arange(4.0) + 1e-3)]),
                                    weights)
    assert "target weights" in fingerprint_difference(base, other_weights)


def test_equal_weights_summed_in_another_order_are_the_same_weights():
    """bf16 values summed in two orders: the float64 sums agree within the bound, one changed value does not."""
    values = torch.randn(4096 * 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    shuffled = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(1))]
    changed = values.clone()
    changed[7] += 0.5
    base = run_fingerprint({}, {}, {}, tensor_sums([("w", values)]), {})
    assert fingerprint_difference(base, run_fingerprint({}, {}, {}, tensor_sums([("w", shuffled)]), {})) is None
    assert "target weights" in fingerprint_difference(base, run_fingerprint({}, {}, {}, tensor_sums([("w", changed)]),
                                                                            {}))


def test_a_bad_node_env_is_one_line_and_exit_2(tiny_world, tmp_path):
    env = {**os.environ, "RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    done = subprocess.run([sys.executable, "-m", "training.train", *trainer_args(tiny_world, tmp_path / "out")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "error: RANK=5 is outside 0..1 (WORLD_SIZE=2)"


def test_default_micro_batch_shares_the_batch_among_the_nodes_or_refuses_in_one_line():
    config = load_config("tiny", ["batch_size=8"])
    assert default_micro_batch(config, 1) == (config, "")
    shared, words = default_micro_batch(config, 2)
    assert (shared.micro_batch_size, shared.micro_batches_per_step(), config.micro_batch_size) == (4, 2, 0)
    assert words == " (micro_batch_size unset: batch_size 8 shared among 2 nodes)"
    with pytest.raises(ConfigError, match=r"^batch_size \(8\) cannot be shared evenly among 3 nodes"):
        default_micro_batch(config, 3)
    explicit = load_config("tiny", ["batch_size=8", "micro_batch_size=8"])
    assert default_micro_batch(explicit, 2) == (explicit, "")  # and micro_batch_share refuses it, as before
    with pytest.raises(ConfigError, match="a step has 1 micro-batch"):
        micro_batch_share(explicit.micro_batches_per_step(), 0, 2)


def test_two_nodes_with_micro_batch_size_unset_train_what_one_node_trains_in_each_runs_own_home(
        tiny_world, tmp_path, monkeypatch):
    """The tiny preset's micro_batch_size (unset) on two nodes: batch_size 4 is two micro-batches of 2, one to
    each node, the losses those of one node with micro_batch_size=2; every node writes under its runs_dir's
    $GPUCTL_RUN_HOME."""
    one = tmp_path / "one"
    done = subprocess.run([sys.executable, "-m", "training.train",
                           *trainer_args(tiny_world, one, "micro_batch_size=2", "max_steps=4")], cwd=REPO,
                          capture_output=True, text=True, timeout=240, check=False,
                          env={k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")})
    assert done.returncode == 0, done.stdout + done.stderr
    monkeypatch.delenv("GPUCTL_RUN_ID", raising=False)
    monkeypatch.setenv("GPUCTL_RUN_HOME", "tl7")
    runs = [tmp_path / f"runs-node{rank}" for rank in range(2)]
    procs, _, logs = start_nodes(tiny_world, tmp_path, "shared",
                                 [["micro_batch_size=0", "max_steps=4", "output_dir=", f"runs_dir={r}"] for r in runs])
    assert wait_all(procs) == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    assert "a step is 2 micro-batches of 2 sequences (micro_batch_size unset: batch_size 4 shared among 2 nodes)" \
        in logs[0].read_text()
    assert_close(losses(runs[0] / "tl7" / "metrics.jsonl"), losses(one / "metrics.jsonl"))
    assert_close(losses(runs[1] / "tl7" / "metrics.node1.jsonl"), losses(one / "metrics.jsonl"))
    assert json.loads((runs[0] / "tl7" / "export" / "config.json").read_text())["gpuctl"]["home"] == "tl7"
    assert [p.name for p in runs[1].iterdir()] == ["tl7"]


def grad_norms(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in records(metrics) if "grad_norm" in r}


def test_the_step_loss_is_one_weighted_mean_however_the_step_is_split(one_node, two_nodes, tiny_world, tmp_path):
    """A step of 4 sequences as 1 micro-batch of 4, 2 of 2, 4 of 1 (one_node), and on 2 nodes 2 x 1 each: the
    same losses and gradient norms (sum of w * CE over the step's total weight, summed over replicas and
    nodes), where averaging each micro-batch's own mean made them differ."""
    runs = {}
    for rows in (4, 2):
        out = tmp_path / f"mb{rows}"
        done = subprocess.run([sys.executable, "-m", "training.train",
                               *trainer_args(tiny_world, out, f"micro_batch_size={rows}")], cwd=REPO,
                              capture_output=True, text=True, timeout=240, check=False,
                              env={k: v for k, v in os.environ.items() if k != "GPUCTL_METRICS"})
        assert done.returncode == 0, done.stdout + done.stderr
        runs[rows] = out / "metrics.jsonl"
    want_loss, want_norm = losses(runs[4]), grad_norms(runs[4])
    assert len(want_loss) == 8 and len(want_norm) == 8
    for metrics in (runs[2], one_node / "metrics.jsonl", two_nodes[0] / "metrics.jsonl"):
        assert_close(losses(metrics), want_loss)
        assert_close(grad_norms(metrics), want_norm)
