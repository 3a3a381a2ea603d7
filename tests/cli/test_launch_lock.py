"""The container's launch lock: two launches at once start exactly one run; a launcher that died frees the lock;
a lock held past its holder's deadline is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from tenacity import retry, stop_after_delay, wait_fixed

from tests.cli.test_lifecycle import LONG, alive

pytestmark = pytest.mark.sshd


def records(gpuctl) -> list[str]:
    """The run records (tlN.json), not what lives beside them (tlN.info.json, the metrics)."""
    return sorted(p.name for p in gpuctl.path("/workspace/.gpuctl").glob("tl*.json") if p.stem[2:].isdigit())


def proc_start(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def test_two_simultaneous_launches_start_exactly_one_run(gpuctl):
    for round_ in range(2):
        args = ["launch", "--python", "fake-trainer", "--json", "--set", "fake.steps=100000"]
        first, second = gpuctl.popen(*args), gpuctl.popen(*args)
        results = sorted((p.wait(timeout=60), p.communicate()[1]) for p in (first, second))
        (ok, _), (refused, message) = results
        assert (ok, refused) == (0, 5), results
        # The loser either met the lock (naming its holder) or, a moment later, the winner's run.
        assert "another launch holds" in message or f"tl{round_ + 1} is active" in message, message
        assert records(gpuctl) == [f"tl{n}.json" for n in range(1, round_ + 2)]
        assert gpuctl.status()["state"] == "running"
        assert gpuctl("kill", "--grace", "5").code == 0


def test_a_launcher_that_dies_holding_the_lock_frees_it(gpuctl):
    """The lock is held by the launch's own process in the container: when the workstation's gpuctl dies
    mid-launch (here while --replace waits for a run that ignores SIGTERM), the lock goes with it."""
    first = gpuctl.launch_fake(*LONG, "ignore_term=1").json()
    replacer = gpuctl.popen("launch", "--python", "fake-trainer", "--set", "fake.steps=1", "--replace")
    assert "--replace: killing tl1 first" in replacer.stderr.readline()
    while_held = gpuctl.launch_fake("steps=1")
    assert while_held.code == 5
    assert "another launch holds" in while_held.stderr and f"gpuctl pid {replacer.pid}" in while_held.stderr
    replacer.kill()  # the workstation's side dies; the container's side reads end-of-file and exits
    replacer.wait()
    assert alive(first["pid"])  # --replace never got further than its SIGTERM
    assert gpuctl("kill", "--grace", "0.5").code == 0
    after = gpuctl.launch_fake("steps=1")
    assert after.code == 0, after.stderr
    assert after.json()["run_id"] == "tl2"


@retry(stop=stop_after_delay(20), wait=wait_fixed(0.05), reraise=True)
def lock_held(path) -> None:
    assert subprocess.run(["flock", "-n", str(path), "true"], check=False).returncode != 0, f"{path} is free"


def test_stale_lock_is_taken_over(gpuctl, standin, ctid):
    """A holder that overran its own deadline (its workstation gone, its side in the container stuck) is ended
    and its lock taken over; one within its deadline is respected, and named."""
    lock_dir = gpuctl.path("/workspace/.gpuctl")
    lock_dir.mkdir(parents=True)
    stuck = standin.start_detached(ctid, "flock --close /workspace/.gpuctl/launch.lock sleep 300")
    lock_held(lock_dir / "launch.lock")  # flock has the lock and runs sleep
    holder = "ada@workstation-2 (gpuctl pid 4242, since 2026-11-30T10:00:00+00:00)"
    line = f"{{deadline}} {stuck} {proc_start(stuck)} {holder}\n"

    (lock_dir / "launch.holder").write_text(line.format(deadline=int(time.time()) + 300))
    respected = gpuctl.launch_fake("steps=1")
    assert respected.code == 5 and holder in respected.stderr
    assert alive(stuck)

    (lock_dir / "launch.holder").write_text(line.format(deadline=int(time.time()) - 1))
    taken = gpuctl.launch_fake("steps=1")
    assert taken.code == 0, taken.stderr
    assert "took over" in taken.stderr and "ada@workstation-2" in taken.stderr
    assert not alive(stuck)
    assert taken.json()["run_id"] == "tl1"
    assert not (lock_dir / "launch.holder").exists()  # a finished launch leaves no holder behind
    os.killpg(stuck, signal.SIGKILL)  # flock's child, sleep
