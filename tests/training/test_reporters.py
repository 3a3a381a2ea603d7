"""report_to: the run's loss and tokens/s where ML users look (TensorBoard, W&B, MLflow), beside the JSON lines;
a reporter whose package is missing is one line and exit 2 before anything is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.output import reporters
from training.train import main

pytestmark = pytest.mark.e2e


def run_args(world, out: Path, *sets: str) -> list[str]:
    every = [*world.overrides(out), "num_threads=1", "max_steps=6", "log_every=2", "eval_every=0", *sets]
    return ["--config", "tiny"] + [a for s in every for a in ("--set", s)]


def records(out: Path, key: str) -> dict[int, float]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in lines if key in r}


def test_tensorboard_events_hold_the_logged_loss_and_tokens_per_s(tiny_world, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (scripts/install.sh installs it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert main(run_args(tiny_world, out, 'report_to=["tensorboard"]')) == 0
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()  # TensorBoard's own reader, as its dashboard reads the directory
    for tag, key in (("train/loss", "loss"), ("train/tokens_per_s", "tokens_per_s")):
        logged = records(out, key)
        assert sorted(logged) == [2, 4, 6]
        shown = {e.step: e.value for e in events.Scalars(tag)}
        assert shown == pytest.approx(logged, rel=1e-6), tag  # float32 in the event file


def test_a_reporter_without_its_package_is_one_line_and_exit_2(tiny_world, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(reporters, "installed", lambda package: package != "wandb")
    out = tmp_path / "run"
    assert main(run_args(tiny_world, out, 'report_to=["tensorboard", "wandb"]')) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: report_to has 'wandb', but ") and \
        "pip install wandb (or take 'wandb' out of report_to)" in err, err
    assert not out.exists()  # said before the run's directory, the target or the data were made

    assert main(run_args(tiny_world, out, 'report_to=["tensorbord"]')) == 2
    assert "report_to takes tensorboard, wandb, mlflow, got 'tensorbord'" in capsys.readouterr().err


def test_wandb_writes_an_offline_run_in_the_output_dir(tiny_world, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (the shared sandbox's environment does not get it: "
                        "pip install --target DIR wandb, then PYTHONPATH=DIR runs this)")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = tmp_path / "run"
    assert main(run_args(tiny_world, out, 'report_to=["wandb"]')) == 0
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb")), "no offline W&B run where `wandb sync` reads"


def test_mlflow_writes_a_local_run_in_the_output_dir(tiny_world, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed (the shared sandbox's environment does "
                                 "not get it: pip install --target DIR mlflow, then PYTHONPATH=DIR runs this)")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    assert main(run_args(tiny_world, out, 'report_to=["mlflow"]')) == 0
    client = mlflow.tracking.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")  # where `mlflow ui` reads
    [run] = client.search_runs([client.get_experiment_by_name("gpuctl").experiment_id])
    assert (run.info.run_name, run.info.status) == ("run", "FINISHED")
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train_loss")}
    assert history == pytest.approx(records(out, "loss"))
