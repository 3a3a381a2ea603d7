"""A run that failed says why in `status` and `pull` (issue 39): its wrapper records the exit code, the last step
logged and the log's last line; a run that failed before its trainer said where its output goes is named as
such by pull, not as "not started, or launched by an older gpuctl"."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sshd


def test_a_run_that_failed_at_start_says_why_in_pull_and_status(gpuctl):
    # The wrong interpreter: /bin/sh cannot run `-m training.train`, and says so in the log, before any step.
    launched = gpuctl("launch", "--python", "/bin/sh")
    assert launched.code == 1, launched.stderr
    last = gpuctl.path("/workspace/train_tl1.log").read_text().strip().splitlines()[-1]
    assert "training.train" in last
    code = gpuctl.status()["exit_code"]
    why = f"exit {code}, no step logged: {last}"

    doc = gpuctl.status("--run", "1")
    assert (doc["state"], doc["failure"]) == ("failed", why)
    assert f"failure   {why}" in gpuctl("status").stdout
    assert gpuctl("runs", "--json").json()[0]["failure"] == why

    pulled = gpuctl("pull", "--run", "1", str(gpuctl.home / "drafter"))
    assert pulled.code == 1 and pulled.stdout == ""
    assert pulled.stderr == (f"gpuctl: error: nothing to pull: tl1 failed at its start, before its train process "
                             f"said where its output goes: it has none (tl1: {why}) (CT {gpuctl.ctid})\n")
    assert "older gpuctl" not in pulled.stderr


def test_a_run_that_failed_later_says_why_and_one_that_succeeded_has_no_failure(gpuctl):
    # Steps of 1.5 s: the run fails after the launch has returned (a faster one could fail before, exit 1).
    assert gpuctl.launch_fake("steps=2", "step_s=1.5", "exit=3", "say=6572726f723a206f7574206f66206d656d6f7279").code == 0
    assert gpuctl("logs", "--follow").code == 1
    assert gpuctl.status()["failure"] == "exit 3, last step 2: error: out of memory"
    assert gpuctl.launch_fake("steps=1").code == 0
    assert gpuctl("logs", "--follow").code == 0
    assert gpuctl.status()["failure"] is None and "failure" not in gpuctl("status").stdout
