"""Ctrl-C during `launch` tells the truth (issue 48): a Ctrl-C before gpuctl's go starts nothing and says so;
one after it says which run was started and how to kill it. Typer would have turned the interrupt into a silent
exit 130 with the run going on.

Each stage is caught by what the container shows of it (the launch lock taken; the run's record written): the
test freezes gpuctl there (SIGSTOP), sends the Ctrl-C (SIGINT) and lets it go on (SIGCONT), so the interrupt
lands at that stage however fast the rest would have gone. Whatever gpuctl says must be what the container
holds."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

pytestmark = pytest.mark.sshd

LAUNCH = ("launch", "--python", "fake-trainer", "--set", "fake.steps=100000", "--set", "fake.step_s=0.5")


def runs_in(gpuctl) -> dict[str, str]:
    result = gpuctl("runs", "--json")
    assert result.code == 0, result.stderr
    return {run["run_id"]: run["state"] for run in json.loads(result.stdout)}


def interrupt_when(gpuctl, seen) -> tuple[int, str, bool]:
    """Launch; freeze it as soon as seen() holds, Ctrl-C it, let it go on: its exit code, its stderr, and whether
    the stage was reached before the launch had ended by itself."""
    proc = gpuctl.popen(*LAUNCH)
    deadline, reached = time.monotonic() + 60, False
    while proc.poll() is None and time.monotonic() < deadline:
        if seen(proc.pid):
            os.kill(proc.pid, signal.SIGSTOP)
            os.kill(proc.pid, signal.SIGINT)
            os.kill(proc.pid, signal.SIGCONT)
            reached = True
            break
        time.sleep(0.002)
    _, stderr = proc.communicate(timeout=60)
    return proc.returncode, stderr, reached


def has_socket(pid: int) -> bool:
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:") for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:  # an fd closed while it was read
        return False


@pytest.mark.parametrize("stage", ["connecting", "locked", "started"])
def test_ctrl_c_at_each_stage_of_a_launch_says_what_the_container_holds(gpuctl, stage):
    records = gpuctl.path("/workspace/.gpuctl")
    seen = {"connecting": has_socket,  # its first socket: the connection to the host is coming up
            "locked": lambda pid: (records / "launch.holder").exists(),
            "started": lambda pid: any(records.glob("tl*.json"))}[stage]
    for _ in range(3):  # the launch may end by itself before the stage shows: then again (a new run number)
        before = runs_in(gpuctl)
        code, stderr, reached = interrupt_when(gpuctl, seen)
        if reached:
            break
        gpuctl("kill")
    else:
        pytest.fail(f"the {stage} stage never showed before the launch ended")
    said = stderr.strip().splitlines()[-1]
    assert code == 130 and said.startswith("gpuctl: interrupted") and "Traceback" not in stderr, stderr
    started = re.search(r"tl(\d+) was started .* gpuctl kill --run (\d+) stops it$", said)
    now = runs_in(gpuctl)
    if started:  # its number, and the kill that stops it: the run is there, and it runs
        assert started[1] == started[2] and now[f"tl{started[1]}"] == "running", (said, now)
        assert gpuctl("kill", "--run", started[1]).code == 0
    else:  # nothing started, and said so where gpuctl knew how far it got
        assert now == before, (said, now)
    if stage == "started":
        assert started, said  # past the go: the run exists whatever gpuctl was doing
    if stage == "locked" and not started:
        assert said == f"gpuctl: interrupted before the start: nothing was started in CT {gpuctl.ctid}"
