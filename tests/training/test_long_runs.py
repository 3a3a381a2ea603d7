"""Long runs that survive (issue 14), end to end on the tiny preset: non-finite steps skipped and counted, or
stopping the run; checkpoints on a full disk; bad data skipped and counted; out of memory in a stage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.train import TrainExit, cosine_schedule, main

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
SMALL = ["num_threads=1", "eval_every=0"]


def tiny_args(world, output_dir: Path, *overrides: str) -> list[str]:
    sets = [*world.overrides(output_dir), *SMALL, *overrides]
    return ["--config", "tiny"] + [a for s in sets for a in ("--set", s)]


def run_trainer(args: list[str], timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "training.train", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, check=False)


def read_metrics(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


# Non-finite steps.


def test_a_nan_step_is_skipped_and_counted_and_the_run_succeeds(tiny_world, tmp_path, capsys):
    args = tiny_args(tiny_world, tmp_path, "max_steps=6", "log_every=1", "debug_nan_steps=[3]")
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=3e-3)  # the tiny preset's lr
    schedule = cosine_schedule(optimizer, max_steps=6, warmup_ratio=0.05)
    rates = []
    for _ in range(5):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert main(args) == TrainExit.OK
    err = capsys.readouterr().err
    assert "warning: step 3: non-finite loss (nan): update skipped (1 in a row, max_bad_steps=20)" in err
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert sorted(records) == [1, 2, 3, 4, 5, 6]
    assert "loss" not in records[3] and "grad_norm" not in records[3]  # JSON has no NaN
    assert [records[s]["skipped_steps"] for s in range(1, 7)] == [0, 0, 1, 0, 0, 0]
    assert [records[s]["skipped_steps_total"] for s in range(1, 7)] == [0, 0, 1, 1, 1, 1]
    # Neither did the LR schedule step: the 5 updates took its first 5 rates (a skipped step shows the last one).
    assert [records[s]["lr"] for s in (1, 2, 3, 4, 5, 6)] == [rates[0], rates[1], rates[1], *rates[2:]]
    assert all(records[s]["loss"] > 0 for s in (1, 2, 4, 5, 6))


def test_nan_forever_stops_the_run_with_its_exit_code_and_one_line(tiny_world, tmp_path):
    result = run_trainer(tiny_args(tiny_world, tmp_path, "max_steps=50", "log_every=1", "max_bad_steps=3",
                                   f"debug_nan_steps={list(range(4, 51))}"))
    assert result.returncode == TrainExit.NON_FINITE == 3, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [("error: step 6: non-finite loss (nan); 3 steps in a row skipped (max_bad_steps=3); the "
                       "weights are those after step 3, the latest checkpoint is intact")]
    assert "Traceback" not in result.stderr
    assert max(read_metrics(tmp_path / "metrics.jsonl")) == 6
    assert "done:" not in result.stdout
