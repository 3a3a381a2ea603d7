"""The trainer end to end on the tiny preset: it learns, it resumes exactly, it stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from training.output.checkpoint import latest_checkpoint, list_checkpoints
from training.train import main

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_command(world, output_dir: Path, *overrides: str) -> list[str]:
    sets = [*world.overrides(output_dir), "num_threads=1", *overrides]
    return [sys.executable, "-m", "training.train", "--config", "tiny"] + [a for s in sets for a in ("--set", s)]


def test_tiny_run_learns_and_beats_the_untrained_drafter(tiny_world, tmp_path):
    env = {**os.environ, "GPUCTL_METRICS": str(tmp_path / "gpuctl-metrics.jsonl")}
    result = subprocess.run(train_command(tiny_world, tmp_path / "run", "max_steps=40", "eval_every=40"),
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step 40/40" in result.stdout and "loss" in result.stdout
    records = read_metrics(tmp_path / "gpuctl-metrics.jsonl")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # $GPUCTL_METRICS wins
    losses = [r["loss"] for r in records if "loss" in r]
    taus = [r["acceptance_length"] for r in records if "acceptance_length" in r]
    assert records[0]["step"] == 0 and records[-1]["step"] == 40
    assert all({"step", "total_steps", "time", "lr", "tokens_per_s"} <= r.keys() for r in records if "loss" in r)
    assert losses[-1] < 0.6 * losses[0], losses
    assert len(taus) == 2 and taus[1] > taus[0] + 1.0, taus  # untrained (step 0) vs trained
    assert latest_checkpoint(tmp_path / "run").name == "step_00000040"
    assert "exported step_00000040 to" in result.stdout  # a run that ends normally exports itself for serving
    assert sorted(p.name for p in (tmp_path / "run" / "export").iterdir()) == ["config.json", "model.safetensors"]
    assert result.stdout.rstrip().endswith("done: 40 steps")


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tiny_world, tmp_path):
    """2N steps straight, then the same run resumed from its step-N checkpoint in a fresh start."""
    out = tmp_path / "run"
    sets = [*tiny_world.overrides(out), "num_threads=1", "max_steps=12", "save_every=6", "log_every=1",
            "eval_every=0", "keep_checkpoints=5"]
    args = ["--config", "tiny"] + [a for s in sets for a in ("--set", s)]
    assert main(args) == 0
    straight = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl")}
    assert [p.name for p in list_checkpoints(out)] == ["step_00000006", "step_00000012"]

    shutil.rmtree(out / "checkpoints" / "step_00000012")
    (out / "metrics.jsonl").unlink()
    assert main(args + ["--resume"]) == 0
    resumed = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl")}
    assert sorted(resumed) == list(range(7, 13))
    assert resumed == {step: straight[step] for step in range(7, 13)}


def test_a_fresh_run_refuses_to_mix_with_old_checkpoints(tiny_world, tmp_path, capsys):
    sets = [*tiny_world.overrides(tmp_path), "num_threads=1", "max_steps=2", "eval_every=0"]
    args = ["--config", "tiny"] + [a for s in sets for a in ("--set", s)]
    assert main(args) == 0
    assert main(args + ["--set", "overwrite_output=false"]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tiny_world, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    process = subprocess.Popen(
        train_command(tiny_world, tmp_path, "max_steps=100000", "log_every=1", "eval_every=0", "save_every=100000"),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    last_step = read_metrics(metrics)[-1]["step"]
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint is not None and int(checkpoint.name.split("_")[1]) >= last_step
    assert "stopped at step" in output
    assert not (tmp_path / "export").exists()  # only a run that ends normally exports itself


def _break_config_field(target: Path) -> None:
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "hidden_size": "wide"}))


@pytest.mark.parametrize("damage,message", [
    (_break_config_field, "cannot load the target's config and tokenizer from"),
    (lambda target: (target / "config.json").write_text("{not json"), "cannot load the target's config and tokenizer"),
    (lambda target: (target / "tokenizer.json").unlink(), "cannot load the target's config and tokenizer"),
    (lambda target: (target / "model.safetensors").write_bytes((target / "model.safetensors").read_bytes()[:4096]),
     "cannot load the target's weights from"),
])
def test_a_broken_target_is_one_line_and_exit_2(tiny_world, tmp_path, capsys, damage, message):
    target = tmp_path / "target"
    shutil.copytree(tiny_world.target, target)
    damage(target)
    sets = [*tiny_world.overrides(tmp_path / "run"), f"target_path={target}", "num_threads=1", "max_steps=1"]
    assert main(["--config", "tiny"] + [a for s in sets for a in ("--set", s)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1 and str(target) in err, err
