"""gpuctl with the real trainer (training/, tiny preset, CPU) in a stand-in container: the demo's path."""

from __future__ import annotations

import json

import pytest
from tenacity import retry, stop_after_delay, wait_fixed

pytestmark = [pytest.mark.sshd, pytest.mark.e2e]


def test_tiny_preset_end_to_end(gpuctl, tiny_run, tmp_path):
    result = tiny_run.launched  # the session's `launch --config tiny --follow`, in the container this one clones
    assert result.code == 0, result.stderr[-3000:]
    assert "started tl1" in result.stderr and "tl1 ended: succeeded, exit 0" in result.stderr
    assert "step 60/60" in result.stdout
    assert result.stdout == gpuctl.path("/workspace/train_tl1.log").read_text()
    doc = gpuctl.status()
    assert (doc["state"], doc["exit_code"]) == ("succeeded", 0)
    assert (doc["progress"]["step"], doc["progress"]["total_steps"]) == (60, 60)
    assert doc["progress"]["loss"] > 0
    assert gpuctl.path("/workspace/runs/tiny/tl1").is_dir()  # the trainer ran in --workdir, in tl1's own directory
    pulled = gpuctl("pull", str(tmp_path / "drafter"), "--json")  # the export the run wrote at its end
    assert pulled.code == 0, pulled.stderr
    assert (pulled.json()["source"], pulled.json()["export_made_from"]) == ("/workspace/runs/tiny/tl1/export", None)
    assert sorted(p.name for p in (tmp_path / "drafter").iterdir()) == ["config.json", "model.safetensors"]


def launch_and_train_to_step_4(gpuctl) -> None:
    """Launch a long tiny run and wait until its progress reaches step 4."""
    launched = gpuctl("launch", "--config", "tiny", "--set", "max_steps=100000", "--set", "eval_every=0",
                      "--set", "log_every=2", "--json")
    assert launched.code == 0, launched.stderr

    # A bound, not a pace: the tiny run is at step 4 in ~15 s on an idle box, but its start (torch, the tiny
    # world) took over 120 s on a 2-core box running two test suites at once.
    @retry(stop=stop_after_delay(300), wait=wait_fixed(0.5), reraise=True)
    def training() -> None:
        progress = gpuctl.status()["progress"]
        assert progress and progress["step"] >= 4

    training()


def test_kill_lets_the_trainer_checkpoint_and_exit(gpuctl, tiny_cache):
    """SIGTERM reaches the trainer once: it finishes its step, saves a checkpoint and exits 0."""
    launch_and_train_to_step_4(gpuctl)
    killed = gpuctl("kill", "--grace", "60")
    assert killed.code == 0, killed.stderr
    assert "SIGKILL" not in killed.stdout
    doc = gpuctl.status()
    assert (doc["state"], doc["exit_code"]) == ("killed", 0)
    assert "checkpoint" in gpuctl("logs", "-n", "3").stdout
    assert list(gpuctl.path("/workspace/runs/tiny/tl1/checkpoints").iterdir()), "no checkpoint written"


def test_launch_resume_continues_from_the_checkpoint(gpuctl, tiny_cache, tmp_path):
    """A run of 6 steps, then `launch --resume` to 12: a new numbered log, the same config and output_dir,
    the trainer's --resume, and step numbers that go on from the checkpoint."""
    first = gpuctl("launch", "--config", "tiny", "--set", "max_steps=6", "--set", "log_every=1", "--set",
                   "eval_every=0", "--set", "save_every=3", "--follow", timeout=600)
    assert first.code == 0, first.stderr[-3000:]
    assert "step 6/6" in first.stdout

    resumed = gpuctl("launch", "--resume", "--set", "max_steps=12", "--follow", timeout=600)
    assert resumed.code == 0, resumed.stderr[-3000:]
    assert "started tl2" in resumed.stderr and "resuming tl1" in resumed.stderr
    assert "resumed from runs/tiny/tl1/checkpoints/step_00000006 at step 6" in resumed.stdout  # tl1's directory
    metrics = gpuctl.path("/workspace/.gpuctl/tl2.metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == list(range(7, 13))  # step numbers go on
    assert gpuctl.path("/workspace/train_tl1.log").read_text().rstrip().endswith("done: 6 steps")  # untouched
    record = json.loads(gpuctl.path("/workspace/.gpuctl/tl2.json").read_text())
    assert record["resumed_from"] == 1 and record["config"] == "tiny"
    assert record["sets"] == ["max_steps=6", "log_every=1", "eval_every=0", "save_every=3", "max_steps=12"]
    doc = gpuctl.status()
    assert (doc["run_id"], doc["resumed_from"], doc["state"]) == ("tl2", "tl1", "succeeded")
    assert (doc["progress"]["step"], doc["progress"]["total_steps"]) == (12, 12)

    image = tmp_path / "resumed.png"
    plotted = gpuctl("plot", "-o", str(image))
    assert plotted.code == 0 and "12 points of tl2" in plotted.stderr  # the whole chain: tl1's steps, tl2's


def test_pull_exports_a_killed_run_on_demand(gpuctl, tiny_cache, tmp_path):
    """The tiny preset killed after a checkpoint has no export of its own: `gpuctl pull` makes one in the container
    (the run's interpreter, the staged training.export) and brings config.json and model.safetensors."""
    launch_and_train_to_step_4(gpuctl)
    assert gpuctl("kill", "--grace", "60").code == 0
    assert not gpuctl.path("/workspace/runs/tiny/tl1/export").exists()

    dest = tmp_path / "drafter"
    pulled = gpuctl("pull", str(dest), "--json", timeout=600)
    assert pulled.code == 0, pulled.stderr[-3000:]
    doc = pulled.json()
    assert doc["export_made_from"].startswith("/workspace/runs/tiny/tl1/checkpoints/step_")
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((dest / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    made = gpuctl.path(doc["source"])
    assert (dest / "model.safetensors").read_bytes() == (made / "model.safetensors").read_bytes()


def test_two_runs_of_one_preset_each_pull_their_own_weights(gpuctl, tiny_cache, tmp_path):
    """Runs of one preset write their own directories (runs/tiny/tl1, runs/tiny/tl2): `pull --run 1` and
    `--run 2` give different weights, each what its own run wrote and recorded."""
    for seed in (0, 1):
        ran = gpuctl("launch", "--config", "tiny", "--set", "max_steps=2", "--set", "eval_every=0", "--set",
                     f"seed={seed}", "--follow", timeout=600)
        assert ran.code == 0, ran.stderr[-3000:]
    weights = {}
    for run in (1, 2):
        dest = tmp_path / f"drafter-tl{run}"
        pulled = gpuctl("pull", "--run", str(run), str(dest), "--json", timeout=600)
        assert pulled.code == 0, pulled.stderr[-3000:]
        assert pulled.json()["source"] == f"/workspace/runs/tiny/tl{run}/export"
        own = gpuctl.path(f"/workspace/runs/tiny/tl{run}/export/model.safetensors").read_bytes()
        weights[run] = (dest / "model.safetensors").read_bytes()
        assert weights[run] == own
        assert json.loads((dest / "config.json").read_text())["gpuctl"]["home"] == f"tl{run}"
    assert weights[1] != weights[2]



def test_a_run_with_its_own_output_dir_pulls_what_it_wrote(gpuctl, tiny_cache, tmp_path):
    """An explicit output_dir keeps its meaning (the trainer records the directory's name as the home): pull
    knows the run by the id its checkpoint and export record."""
    ran = gpuctl("launch", "--config", "tiny", "--set", "max_steps=2", "--set", "eval_every=0", "--set",
                 "output_dir=/workspace/mine", "--follow", timeout=600)
    assert ran.code == 0, ran.stderr[-3000:]
    pulled = gpuctl("pull", str(tmp_path / "drafter"), "--json", timeout=600)
    assert pulled.code == 0, pulled.stderr[-3000:]
    assert pulled.json()["source"] == "/workspace/mine/export"
    written = json.loads((tmp_path / "drafter" / "config.json").read_text())["gpuctl"]
    assert (written["run"], written["home"]) == ("tl1", "mine")
