"""`gpuctl launch --retry N`: the wrapper restarts a failed run with --resume, each attempt a new run number and
log; a deterministic failure, `gpuctl kill` (the delay included) and `logs -f` across attempts."""

from __future__ import annotations

import json

import pytest
from tenacity import retry, stop_after_delay, wait_fixed

from tests.cli.conftest import Output

pytestmark = pytest.mark.sshd

DATA = "/workspace/data.jsonl"


@retry(stop=stop_after_delay(30), wait=wait_fixed(0.1), reraise=True)
def wait_for(gpuctl, run: str, **expected) -> dict:
    doc = gpuctl.status("--run", run)
    assert {k: doc.get(k) for k in expected} == expected, doc
    return doc


def record(gpuctl, n: int) -> dict:
    return json.loads(gpuctl.path(f"/workspace/.gpuctl/tl{n}.json").read_text())


def test_retry_succeeds_once_the_data_is_there_and_status_says_which_attempt(gpuctl):
    launched = gpuctl.launch_fake("steps=3", f"require={DATA}", extra=("--retry", "2", "--retry-delay", "5"))
    assert launched.code == 0, launched.stderr
    assert launched.json()["run_id"] == "tl1"
    retrying = wait_for(gpuctl, "tl2", state="retrying")
    assert retrying["attempt"] == 2 and retrying["attempts_left"] == 1 and retrying["attempts"] == ["tl1"]
    assert retrying["retry_of"] == "tl1" and retrying["resumed_from"] == "tl1"
    assert retrying["last_failure"].startswith("exit 3, no step logged: error: /workspace/data.jsonl not found")
    gpuctl.path(DATA).write_text("{}\n")  # within the delay (a few seconds: each gpuctl call takes one here)
    done = wait_for(gpuctl, "tl2", state="succeeded")
    assert done["exit_code"] == 0 and done["attempt"] == 2 and done["progress"]["step"] == 3
    first = gpuctl.status("--run", "tl1")
    assert first["state"] == "failed" and first["exit_code"] == 3 and first["retried_as"] == "tl2"
    log2 = gpuctl("logs", "--run", "tl2").stdout
    assert "attempt 2 of 3 (retrying tl1" in log2 and '"--resume"' in log2
    assert "attempt 2 of 3 is tl2" in gpuctl("logs", "--run", "tl1").stdout
    human = gpuctl("status")
    assert "attempt" in human.stdout and "after tl1" in human.stdout
    assert [r["run_id"] for r in gpuctl("runs", "--json").json()] == ["tl1", "tl2"]
    assert "failed (exit 3), retried as tl2" in gpuctl("runs").stdout
    # The attempt continues its first run's directory: its record and what its trainer wrote say tl1's home.
    assert record(gpuctl, 1)["home"] == record(gpuctl, 2)["home"] == "tl1"
    written = json.loads(gpuctl.path("/workspace/runs/fake/checkpoints/step_00000003/config.json").read_text())
    assert written["run"] == {"id": "tl2", "home": "tl1"}


def test_failing_the_same_way_twice_stops_retrying(gpuctl):
    launched = gpuctl.launch_fake("steps=2", "exit=4", extra=("--retry", "5", "--retry-delay", "0.2"))
    assert launched.code == 0, launched.stderr
    done = wait_for(gpuctl, "tl2", state="failed")
    assert done["exit_code"] == 4 and done["attempt"] == 2 and done["attempts_left"] == 4
    assert done["retry_stopped"].startswith("deterministic failure: tl2 failed like the attempt before it "
                                            "(exit 4, last step 2)")
    assert "deterministic failure" in gpuctl("logs", "--run", "tl2").stdout
    assert not gpuctl.path("/workspace/.gpuctl/tl3.json").exists()  # no third attempt
    assert gpuctl("logs", "--follow").code == 1


def test_kill_during_the_retry_delay_ends_everything(gpuctl, standin, ctid):
    launched = gpuctl.launch_fake("steps=1", f"require={DATA}", extra=("--retry", "3", "--retry-delay", "30"))
    assert launched.code == 0, launched.stderr
    wait_for(gpuctl, "tl2", state="retrying")
    refused = gpuctl.launch_fake("steps=1")  # while it waits the run is active: a new launch is refused
    assert refused.code == 5, refused.stderr
    assert "tl2 is active" in refused.stderr
    killed = gpuctl("kill", "--run", "tl1", "--grace", "10")  # an earlier attempt: the kill is for the run's last
    assert killed.code == 0, killed.stderr
    assert "tl2" in killed.stdout
    doc = gpuctl.status()
    assert doc["run_id"] == "tl2" and doc["state"] == "killed" and doc["killed_signal"] == "TERM"
    assert doc["exit_code"] == 143 and "pid" not in record(gpuctl, 2)  # no trainer ever started for it
    assert standin.container_processes(ctid) == []
    gpuctl.path(DATA).write_text("{}\n")  # had an attempt been left waiting, it would now succeed
    assert not gpuctl.path("/workspace/.gpuctl/tl3.json").exists()
    assert "no attempt follows" in gpuctl("logs").stdout


def test_logs_follow_across_a_retry_exits_with_the_final_result(gpuctl):
    launched = gpuctl.launch_fake("steps=2", f"require={DATA}", extra=("--retry", "1", "--retry-delay", "5"))
    assert launched.code == 0, launched.stderr
    follower = gpuctl.popen("logs", "--follow", "--run", "tl1")
    output = Output(follower)
    output.wait_for("attempt 2 of 2 is tl2")  # the first attempt failed; the delay runs
    gpuctl.path(DATA).write_text("{}\n")
    out, err = output.finish(timeout=60)
    assert follower.returncode == 0, err
    assert "error: /workspace/data.jsonl not found" in out  # the first attempt's log
    assert "attempt 2 of 2 is tl2" in out
    assert out.rstrip().endswith("done, exit 0")  # then the second attempt's, to its end
    assert out.count("done, exit 0") == 1


def test_delay_doubles_while_attempts_fail_before_a_step_and_retries_run_out(gpuctl):
    launched = gpuctl.launch_fake("exit_seq=3,4,5", extra=("--retry", "3", "--retry-delay", "0.5"))
    assert launched.code == 0, launched.stderr  # the first attempt failed in the start check: retried, not failed
    done = wait_for(gpuctl, "tl4", state="failed")
    assert done["exit_code"] == 5 and done["attempt"] == 4 and done["attempts_left"] == 0
    assert done["attempts"] == ["tl1", "tl2", "tl3"] and done["retry_stopped"] is None  # out of retries
    waits = [round(record(gpuctl, n)["retry_at"] - record(gpuctl, n)["launched_at"], 1) for n in (2, 3, 4)]
    assert waits == [0.5, 1.0, 2.0]
    for n in (2, 3, 4):
        rec = record(gpuctl, n)
        assert rec["started_at"] >= rec["retry_at"] and rec["resumed_from"] == n - 1
    assert [record(gpuctl, n)["exit_code"] for n in (1, 2, 3, 4)] == [3, 4, 5, 5]
    assert not gpuctl.path("/workspace/.gpuctl/tl5.json").exists()
