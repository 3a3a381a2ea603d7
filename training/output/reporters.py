"""The run's numbers where ML users look, beside the JSON lines gpuctl status reads: `report_to` (the Hugging
Face Trainer's convention) names them. "tensorboard": event files in <output_dir>/tensorboard/ (offline, nothing
to sign up for); "wandb": a W&B run in <output_dir>/wandb/, offline unless WANDB_MODE says otherwise; "mlflow":
an MLflow run in <output_dir>/mlflow.db (experiment "gpuctl") unless MLFLOW_TRACKING_URI names a server.

Each is checked at the start (check_installed): a package that is missing is one line and exit 2 before any
model is loaded, not a failure at the first record. Built once on the node that writes the run's files, given
every metrics record (its scalars), closed at the end.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from training.config import ConfigError, TrainConfig

# report_to's names and the package each needs (what `pip install` takes).
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
# The numbers of a record that are plotted, under these names (train/..., as the Hugging Face Trainer does).
SCALARS = ("loss", "accuracy", "lr", "grad_norm", "tokens_per_s", "tflops_per_s", "skipped_steps",
           "acceptance_length")


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_installed(report_to: list[str]) -> None:
    """Every reporter asked for can start here: its package is importable by this interpreter."""
    for name in report_to:
        if not installed(PACKAGES[name]):
            raise ConfigError(f"report_to has {name!r}, but {sys.executable} has no {PACKAGES[name]} package: "
                              f"pip install {PACKAGES[name]} (or take {name!r} out of report_to)")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    return {f"train/{key}": float(record[key]) for key in SCALARS
            if isinstance(record.get(key), (int, float)) and not isinstance(record.get(key), bool)}


class TensorBoard:
    def __init__(self, config: TrainConfig):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(config.output_dir).expanduser() / "tensorboard"))

    def write(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()  # a record is rare (log_every steps): on disk at once, for a TensorBoard watching

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, config: TrainConfig):
        import wandb

        out = Path(config.output_dir).expanduser()
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "gpuctl"), name=out.name, dir=str(out),
                              mode=os.environ.get("WANDB_MODE", "offline"), config=config.to_dict())

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    def __init__(self, config: TrainConfig):
        import mlflow

        out = Path(config.output_dir).expanduser().resolve()
        out.mkdir(parents=True, exist_ok=True)
        # A local SQLite store (MLflow's file store is deprecated), its artifacts beside it: nothing outside the
        # run's directory unless MLFLOW_TRACKING_URI names a server.
        mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{out / 'mlflow.db'}")
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "gpuctl")
        if mlflow.get_experiment_by_name(name) is None:
            mlflow.create_experiment(name, artifact_location=(out / "mlruns").as_uri())
        mlflow.set_experiment(name)
        self.mlflow, self.run = mlflow, mlflow.start_run(run_name=out.name)
        mlflow.log_params({k: str(v)[:500] for k, v in config.to_dict().items()})

    def write(self, step: int, values: dict[str, float]) -> None:
        # By its id: the records come from the leader drafter's thread, and MLflow's active run is per thread.
        self.mlflow.log_metrics({k.replace("/", "_"): v for k, v in values.items()}, step=step,
                                run_id=self.run.info.run_id)

    def close(self) -> None:
        self.mlflow.end_run()


KINDS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


class Reporters:
    """The reporters config.report_to names (none on a node that does not write the run's files)."""

    def __init__(self, config: TrainConfig, writes: bool):
        self.sinks = [KINDS[name](config) for name in dict.fromkeys(config.report_to)] if writes else []

    def write(self, step: int, record: dict[str, Any]) -> None:
        values = scalars(record)
        for sink in self.sinks if values else ():
            sink.write(step, values)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
