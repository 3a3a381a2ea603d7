"""Between nodes (issue 24, DESIGN §11): nothing a peer sends is unpickled, a per-run secret proves every node
before the process group forms, and what a peer names is checked. A stranger here is a real process joining
node 0's rendezvous with plain torch.distributed (stranger_node.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_distributed import (
    REPO,
    error_lines,
    free_port,
    start_node,
    start_nodes,
    stop_all,
    trainer_args,
    wait_all,
)

from training.config import ConfigError
from training.distributed import NodeLost, Nodes
from training.distributed.secret import NO_SECRET_LINE, TRUSTED_LINE, read_node_secret
from training.output.checkpoint import FILES

QUICK = ["node_start_timeout_s=5", "node_sync_timeout_s=15", "node_timeout_s=15"]
SECRET = "the run's secret, 32 bytes long.."


def start_stranger(port: int, marker: Path, log: Path, forge: bool = False, listing: bool = False) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, str(REPO / "tests" / "training" / "stranger_node.py"), str(port),
                                 str(marker), *(["--forge-proof"] if forge else []),
                                 *(["--list-keys"] if listing else [])], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)


def wait_for_line(proc: subprocess.Popen, log: Path, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)


def joining_at(proc: subprocess.Popen, log: Path, timeout: float = 120) -> float:
    """When node 0 began to wait for the others (its 'joining' line)."""
    deadline = time.monotonic() + timeout
    while "joining node 0" not in log.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)
    return time.monotonic()


def node_0_with_a_stranger(tiny_world, tmp_path: Path, secret: str | None, forge: bool = False,
                           settings: list[str] = QUICK, extra_env: dict[str, str] | None = None):
    """Node 0 of 2 and a stranger as node 1: node 0's exit code, its log, how long it waited after it began to
    join, and the stranger's log. The marker file must never appear."""
    port, marker = free_port(), tmp_path / "code-ran-in-node-0"
    log = tmp_path / "node0.log"
    node0 = start_node(trainer_args(tiny_world, tmp_path / "node0", *settings), 0, 2, port, log, secret=secret,
                       extra_env=extra_env)
    stranger = start_stranger(port, marker, tmp_path / "stranger.log", forge)
    try:
        began = joining_at(node0, log)
        code = node0.wait(120)
        waited = time.monotonic() - began
    finally:
        stop_all([node0, stranger])
    assert not marker.exists(), "the stranger's pickle ran code in node 0"
    return code, log, waited, (tmp_path / "stranger.log").read_text()


def test_a_stranger_without_the_secret_is_refused_within_the_start_timeout_and_runs_no_code(tiny_world, tmp_path):
    code, log, waited, _ = node_0_with_a_stranger(tiny_world, tmp_path, SECRET)
    assert code == 6 and waited < 5 + 5, (code, waited)
    (line,) = error_lines(log)
    assert "not every node joined within 5 s" in line and "node 1 has not proven the run's node secret" in line


def test_a_stranger_forging_a_proof_is_dropped_and_node_0_waits_out_its_start_timeout(tiny_world, tmp_path):
    code, log, waited, _ = node_0_with_a_stranger(tiny_world, tmp_path, SECRET, forge=True)
    assert code == 6 and 5 - 1 < waited < 5 + 5, (code, waited)  # not ended by the forged hello
    (line,) = error_lines(log)
    assert "node 1 has not proven the run's node secret" in line and "1 hello(s) as node 1 did not prove it" in line
    (dropped,) = [x for x in log.read_text().splitlines() if x.startswith("warning: dropped a hello as node 1")]
    assert "connected to this store: 127.0.0.1:" in dropped, dropped


def test_a_secret_less_node_0_refuses_to_form_a_group_with_a_peer(tiny_world, tmp_path):
    port, log, stranger_log = free_port(), tmp_path / "node0.log", tmp_path / "stranger.log"
    node0 = start_node(trainer_args(tiny_world, tmp_path / "node0", *QUICK), 0, 2, port, log, secret=None)
    stranger = start_stranger(port, tmp_path / "marker", stranger_log)
    try:
        code = node0.wait(120)
    finally:
        stop_all([node0, stranger])
    assert code == 2 and "in the process group" not in stranger_log.read_text()
    assert error_lines(log) == [f"error: {NO_SECRET_LINE}"]
    assert "joining node 0" not in log.read_text()  # refused before it listens
    assert "GPUCTL_NODE_SECRET_FILE" in NO_SECRET_LINE and "GPUCTL_TRUSTED_NETWORK=1" in NO_SECRET_LINE


def test_opted_out_of_the_secret_a_stranger_still_runs_no_code_and_node_0_stops_with_a_line(tiny_world, tmp_path):
    # Time enough for a loaded machine to bring the stranger into the group: joining is not what is tested.
    patient = ["node_start_timeout_s=60", "node_sync_timeout_s=60", "node_timeout_s=60"]
    code, log, _, stranger = node_0_with_a_stranger(tiny_world, tmp_path, None, settings=patient,
                                                    extra_env={"GPUCTL_TRUSTED_NETWORK": "1"})
    assert "in the process group" in stranger  # it joined: only the secret keeps it out
    assert TRUSTED_LINE in log.read_text()
    assert code == 6
    (line,) = error_lines(log)
    assert "node 1 sent a malformed fingerprint" in line, line


def test_nodes_with_different_secrets_are_refused_at_start(tiny_world, tmp_path):
    procs, _, logs = start_nodes(tiny_world, tmp_path, "secrets", [QUICK, QUICK],
                                 secrets=["one secret, long enough to use", "another secret, long enough too"])
    try:
        codes = wait_all(procs, 120)
    finally:
        stop_all(procs)
    assert codes == [6, 6], "\n".join(log.read_text()[-3000:] for log in logs)
    (line0,) = error_lines(logs[0])
    assert "node 1 has not proven the run's node secret" in line0, line0
    (line1,) = error_lines(logs[1])
    assert "node 0 at 127.0.0.1" in line1 and "did not prove the run's node secret" in line1, line1
    assert "warning: ignored a challenge" in logs[1].read_text()


# Two stand-in nodes (sum_node.py: the real Nodes, summing rank + 1 a step) and a stranger (issue 38).

def sum_nodes_with_a_stranger(tmp_path: Path, forge: bool, listing: bool) -> tuple[list[str], str, str]:
    """Node 0, the stranger, then node 1 (once the stranger did its first move); they sum until 10 steps after
    the stranger tried to join: node 0's sums, node 0's log and the stranger's."""
    port, marker, stop = free_port(), tmp_path / "code-ran-in-node-0", tmp_path / "stop"
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    node0 = start_node([str(stop), "60"], 0, 2, port, logs[0], secret=SECRET, module="tests.training.sum_node")
    stranger_log = tmp_path / "stranger.log"
    stranger = start_stranger(port, marker, stranger_log, forge, listing)
    procs = [node0, stranger]
    try:
        wait_for_line(stranger, stranger_log, "forged a hello" if forge else "connected")
        procs.append(start_node([str(stop), "60"], 1, 2, port, logs[1], secret=SECRET,
                                module="tests.training.sum_node"))
        if listing:
            wait_for_line(stranger, stranger_log, "listed the keys")
        tried = len(logs[0].read_text().splitlines())
        while len(logs[0].read_text().splitlines()) < tried + 10:
            assert node0.poll() is None and procs[2].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.05)
        stop.touch()
        codes = [node0.wait(120), procs[2].wait(120)]
        assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in [*logs, stranger_log])
    finally:
        stop_all(procs)
    assert not marker.exists(), "the stranger's pickle ran code in node 0"
    sums = [line for line in logs[0].read_text().splitlines() if line.startswith("sum ")]
    return sums, logs[0].read_text(), stranger_log.read_text()


def test_a_stranger_listing_the_keys_and_joining_through_a_prefix_store_neither_joins_nor_ends_the_run(tmp_path):
    sums, log0, stranger = sum_nodes_with_a_stranger(tmp_path, forge=False, listing=True)
    assert len(sums) >= 10 and set(sums) == {"sum 3.0"}, log0  # 1 + 2: node 1's, never the stranger's
    assert "in the process group" not in stranger, stranger


def test_a_hello_signed_with_another_secret_is_dropped_and_node_1_still_joins(tmp_path):
    sums, log0, _ = sum_nodes_with_a_stranger(tmp_path, forge=True, listing=False)
    assert len(sums) >= 10 and set(sums) == {"sum 3.0"}, log0
    dropped = [line for line in log0.splitlines() if line.startswith("warning: dropped a hello as node 1")]
    assert len(dropped) == 1 and "connected to this store: 127.0.0.1:" in dropped[0], log0


# What a peer names.

class FakeLeader:
    """Node 0 at the collective level, as node 1's Nodes sees it: it broadcasts `listing` (the checkpoint's
    name and files), then zeros for each file's chunks."""

    def __init__(self, listing: dict):
        self.payload = json.dumps(listing).encode()
        self.sent_size = False

    def __call__(self, what, op, *args, **kwargs):
        if op is torch.distributed.broadcast_object_list:  # the code before issue 24
            args[0][0] = json.loads(self.payload)
            return
        tensor = args[0]
        if tensor.dtype == torch.int64 and not self.sent_size:
            tensor.fill_(len(self.payload))
            self.sent_size = True
        elif tensor.numel() == len(self.payload) and tensor.dtype == torch.uint8 and not hasattr(self, "done"):
            tensor.copy_(torch.frombuffer(bytearray(self.payload), dtype=torch.uint8))
            self.done = True
        else:
            tensor.zero_()


def receiving_node(listing: dict) -> Nodes:
    nodes = object.__new__(Nodes)
    nodes.rank, nodes.world_size, nodes.backend = 1, 2, "gloo"
    nodes.device, nodes._sync_group = torch.device("cpu"), None
    nodes._collective = FakeLeader(listing)
    return nodes


@pytest.mark.parametrize("listing", [
    {"name": "../../escaped", "files": [["state.pt", 4]]},
    {"name": "step_00000004", "files": [["../../escaped.pt", 4]]},
    {"name": "/tmp/absolute-escape", "files": [["state.pt", 4]]},
    {"name": "step_00000004", "files": [["/tmp/absolute-escape.pt", 4]]},
    {"name": "step_00000004", "files": [["state.pt\0", 4]]},
    {"name": "step_00000004", "files": [["run_me.py", 4]]},
    {"name": "step_00000004", "files": [["state.pt", -1]]},
], ids=["dotdot-dir", "dotdot-file", "absolute-dir", "absolute-file", "nul", "unexpected", "negative"])
def test_a_peer_sent_checkpoint_name_outside_the_expected_set_is_refused(tmp_path, listing):
    into = tmp_path / "a" / "b" / ".from-node0" / "node1"
    into.mkdir(parents=True)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(NodeLost, match="node 0 sent a malformed checkpoint listing") as refused:
        receiving_node(listing).share_checkpoint(None, into)
    assert "\n" not in str(refused.value)
    assert sorted(tmp_path.rglob("*")) == before
    assert not Path("/tmp/absolute-escape").exists() and not Path("/tmp/absolute-escape.pt").exists()


def test_a_well_formed_listing_is_received_inside_into(tmp_path):
    into = tmp_path / "node1"
    copy = receiving_node({"name": "step_00000004", "files": [[name, 3] for name in FILES]}).share_checkpoint(
        None, into)
    assert copy == into / "step_00000004" and sorted(p.name for p in copy.iterdir()) == sorted(FILES)


# Where the secret comes from.

def test_the_node_secret_comes_from_a_private_file_or_a_variable(tmp_path):
    path = tmp_path / "secret"
    path.write_text("s" * 40 + "\n")
    path.chmod(0o600)
    assert read_node_secret({"GPUCTL_NODE_SECRET_FILE": str(path)}) == b"s" * 40
    environ = {"GPUCTL_NODE_SECRET": "v" * 20}
    assert read_node_secret(environ) == b"v" * 20 and "GPUCTL_NODE_SECRET" not in environ  # not inherited
    assert read_node_secret({}) is None
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="open to other users"):
        read_node_secret({"GPUCTL_NODE_SECRET_FILE": str(path)})
    with pytest.raises(ConfigError, match="both"):
        read_node_secret({"GPUCTL_NODE_SECRET_FILE": str(path), "GPUCTL_NODE_SECRET": "v" * 20})
    with pytest.raises(ConfigError, match="at least 16"):
        read_node_secret({"GPUCTL_NODE_SECRET": "short"})
    with pytest.raises(ConfigError, match="cannot read"):
        read_node_secret({"GPUCTL_NODE_SECRET_FILE": str(tmp_path / "missing")})


def test_no_object_collective_in_training():
    found = [f"{p}:{n}" for p in (REPO / "training").rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if "_object(" in line or "_object_list(" in line]
    assert not found, found
