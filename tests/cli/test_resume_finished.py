"""`launch --resume` of a run that finished all its steps says so and does nothing: exit 0, no run number used,
nothing staged, until `--set max_steps=M` raises it above the steps done (issue 39)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sshd


def test_resuming_a_finished_run_does_nothing_unless_max_steps_is_raised(gpuctl):
    assert gpuctl.launch_fake("steps=3").code == 0
    assert gpuctl("logs", "--follow").code == 0  # tl1: 3 of 3 steps, succeeded
    calls = len(gpuctl.host.pct_calls(gpuctl.ctid))

    for extra in ([], ["--set", "max_steps=3"], ["--set", "max_steps=2"]):
        again = gpuctl("launch", "--resume", *extra)
        assert again.code == 0, again.stderr
        assert again.stderr == ("gpuctl: tl1 finished: 3 of 3 steps done; nothing to resume, nothing sent "
                                "(--set max_steps=M with M above 3 trains it on)\n")
    as_json = gpuctl("launch", "--resume", "1", "--json")
    assert as_json.code == 0 and as_json.json() == {"run_id": None, "finished": "tl1", "step": 3}
    # Only the run records were read: no launch script, nothing pushed, no new log or record.
    assert len(gpuctl.host.pct_calls(gpuctl.ctid)) == calls + 4
    assert not gpuctl.path("/workspace/train_tl2.log").exists()
    assert [run["run_id"] for run in gpuctl("runs", "--json").json()] == ["tl1"]

    raised = gpuctl("launch", "--resume", "--set", "max_steps=8", "--json")
    assert raised.code == 0, raised.stderr
    assert (raised.json()["run_id"], raised.json()["resumed_from"]) == ("tl2", "tl1")


def test_a_failed_or_killed_run_resumes_as_before(gpuctl):
    assert gpuctl.launch_fake("steps=3", "exit=1", "hold=/workspace/release").code == 0  # ends when told: after launch
    gpuctl.path("/workspace/release").touch()
    assert gpuctl("logs", "--follow").code == 1  # failed after its 3 steps
    resumed = gpuctl("launch", "--resume", "--json")
    assert resumed.code == 0 and resumed.json()["resumed_from"] == "tl1", resumed.stderr
