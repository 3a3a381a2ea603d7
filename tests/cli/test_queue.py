"""`launch --queue` (issue 39): with a run active, a launch waits its turn in the container, detached (nothing of it
on the workstation), first in first out; `runs` and `status` show the queue; `kill --run N` takes a run out of it.
The active run is the fake trainer held until the test creates a file in the container (fake.hold)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

pytestmark = pytest.mark.sshd

RELEASE = "/workspace/release"  # the held run ends once this exists


def record(gpuctl, number: int) -> dict:
    return json.loads(gpuctl.path(f"/workspace/.gpuctl/tl{number}.json").read_text())


def session_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[3])


def runs_by_id(gpuctl) -> dict[str, dict]:
    listed = gpuctl("runs", "--json")
    assert listed.code == 0, listed.stderr
    return {run["run_id"]: run for run in listed.json()}


def test_queued_runs_start_in_order_once_the_active_run_ends(gpuctl, tmp_path):
    first = gpuctl.launch_fake(f"hold={RELEASE}")
    assert first.code == 0 and first.json()["state"] == "running", first.stderr
    stage = gpuctl.path("/root/gpuctl")
    active_package = os.readlink(stage / "current")
    cache = gpuctl.path("/tmp/torchinductor_root")
    (cache / "compiled").mkdir(parents=True)  # the active run's compile cache
    config = tmp_path / "queued.toml"
    config.write_text("max_steps = 7\nrandom_target = \"qwen3-8b-narrow\"\n")  # a package unlike the active run's
    second = gpuctl.launch_fake("steps=2", extra=("--queue", "--config", str(config)))
    third = gpuctl.launch_fake("steps=2", extra=("--queue",))
    # Queuing touched nothing of the active run: its package is `current` as it was, its compile cache is there.
    assert os.readlink(stage / "current") == active_package and not (stage / "configs").exists()
    assert (cache / "compiled").is_dir()
    for launched, behind in ((second, ["tl1"]), (third, ["tl1", "tl2"])):
        assert launched.code == 0, launched.stderr  # it returned: the gpuctl that queued it is gone
        doc = launched.json()
        assert (doc["state"], doc["pid"], doc["started_at"], doc["queued_behind"]) == ("queued", None, None, behind)
        assert "takes it out of the queue" in launched.stderr
    # Each waits in the container, detached: its wrapper leads a session of its own (what a pct exec session
    # leaves behind is killed when it returns), with nothing of it on the workstation.
    for number in (2, 3):
        pgid = record(gpuctl, number)["pgid"]
        assert session_of(pgid) == pgid

    runs = runs_by_id(gpuctl)
    assert [runs[f"tl{n}"]["state"] for n in (1, 2, 3)] == ["running", "queued", "queued"]
    status = gpuctl.status()
    assert (status["run_id"], status["state"], status["queue"]) == ("tl1", "running", ["tl2", "tl3"])
    refused = gpuctl.launch_fake("steps=1")  # a plain launch still refuses, and says how to queue
    assert refused.code == 5 and "--queue" in refused.stderr and "tl2, tl3 queued" in refused.stderr

    gpuctl.path(RELEASE).touch()
    followed = gpuctl("logs", "-f", "--run", "3")  # waits through the queue, then follows tl3 to its end
    assert followed.code == 0, followed.stderr
    assert "tl3's turn: starting" in followed.stdout and "done, exit 0" in followed.stdout
    recs = [record(gpuctl, n) for n in (1, 2, 3)]
    assert [r["exit_code"] for r in recs] == [0, 0, 0]
    assert '"--config", "/root/gpuctl/configs/queued.toml"' in gpuctl.path("/workspace/train_tl2.log").read_text()
    assert not cache.exists()  # removed when a queued run started (no --keep-compile-cache)
    assert recs[0]["ended_at"] <= recs[1]["started_at"] and recs[1]["ended_at"] <= recs[2]["started_at"]
    assert gpuctl.status()["queue"] == []


def test_a_run_taken_out_of_the_queue_never_starts(gpuctl):
    assert gpuctl.launch_fake(f"hold={RELEASE}").code == 0
    for _ in range(3):
        assert gpuctl.launch_fake("steps=2", extra=("--queue",)).json()["state"] == "queued"

    killed = gpuctl("kill", "--run", "2")
    assert killed.code == 0 and "took tl2 out of the queue: it never started" in killed.stdout, killed.stderr
    os.kill(record(gpuctl, 3)["pgid"], 9)  # tl3's waiter dies without a word (SIGKILL): lost, never started
    runs = runs_by_id(gpuctl)
    assert [runs[f"tl{n}"]["state"] for n in (1, 2, 3, 4)] == ["running", "killed", "lost", "queued"]
    assert (runs["tl2"]["exit_code"], runs["tl2"]["started_at"]) == (143, None)

    gpuctl.path(RELEASE).touch()
    assert gpuctl("logs", "-f", "--run", "4").code == 0  # the one left in the queue goes on
    for number in (2, 3):
        rec = record(gpuctl, number)
        assert "pid" not in rec and "started_at" not in rec
        assert "argv:" not in gpuctl.path(f"/workspace/train_tl{number}.log").read_text()  # no trainer ever ran
    assert "tl2 left the queue (SIGTERM): it never started" in gpuctl.path("/workspace/train_tl2.log").read_text()
    assert runs_by_id(gpuctl)["tl4"]["state"] == "succeeded"

    at_once = gpuctl.launch_fake("steps=1", extra=("--queue",))  # nothing active: --queue starts at once
    assert at_once.code == 0 and at_once.json()["state"] in ("running", "succeeded"), at_once.stderr


def test_queue_usage_errors(gpuctl):
    both = gpuctl.launch_fake("steps=1", extra=("--queue", "--replace"))
    assert both.code == 2 and "choose one" in both.stderr
    nodes = gpuctl("launch", "--node", "root@127.0.0.1/200", "--node", "root@127.0.0.1/201", "--queue")
    assert nodes.code == 2 and "--queue is for one container" in nodes.stderr


def test_no_queue_behind_a_setup_that_has_not_chosen_the_interpreter_yet(gpuctl):
    """gpuctl setup records the interpreter it made at its end; a queued launch's run.sh names one now."""
    records = gpuctl.path("/workspace/.gpuctl")
    records.mkdir(parents=True)
    (records / "tl1.json").write_text(json.dumps({"id": "tl1", "number": 1, "task": "setup",
                                                  "log_path": "/workspace/setup_tl1.log", "launched_at": 1.0}))
    holder = subprocess.Popen(["flock", str(records / "tl1.lock"), "sleep", "120"])  # setup's lock, held: active
    try:
        refused = gpuctl("launch", "--queue", "--set", "fake.steps=1")
        assert refused.code == 5 and "gpuctl setup (tl1) is still making" in refused.stderr, refused.stderr
        assert not (records / "tl2.json").exists()  # refused before a number was taken
        given = gpuctl.launch_fake("steps=1", extra=("--queue",))  # --python given: nothing to wait for
        assert given.code == 0 and given.json()["state"] == "queued", given.stderr
    finally:
        holder.kill()
        holder.wait()
