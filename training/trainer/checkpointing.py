"""The run on disk: its output dir made ready, the checkpoint it resumes from, and when it checkpoints."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from training.config import ConfigError, TrainConfig
from training.console import say, warn
from training.data.chat import BatchStream
from training.output.checkpoint import (
    CheckpointWriteError,
    check_checkpoint,
    checkpoint_train_config,
    checkpoints_dir,
    latest_checkpoint,
    load_checkpoint,
    recover_checkpoints,
    save_checkpoint,
)
from training.output.metrics import metrics_path
from training.serve.export import recover_export
from training.trainer.batches import StepBatches
from training.trainer.replicas import DrafterReplica


def prepare_output_dir(config: TrainConfig, resume: bool, per_run: bool = False) -> None:
    """The output dir, made and writable before any slow work; a fresh run may not silently mix with an earlier
    run's checkpoints. A run's own directory under runs_dir (`per_run`) is never emptied: a fresh run that finds
    checkpoints there is refused. An explicit output_dir with overwrite_output: the earlier run's checkpoints,
    metrics and export are deleted (nothing of it is left to be taken for this run's)."""
    output_dir = Path(config.output_dir).expanduser()
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create output_dir {output_dir}: {err.strerror or err}") from None
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write in output_dir {output_dir}: permission denied")
    recover_checkpoints(output_dir)  # a save killed mid-write: its step put back, its leftovers gone
    recover_export(output_dir / "export")  # the same for an export killed mid-write
    if resume and latest_checkpoint(config.output_dir) is not None:
        # E.g. a pre-<|MASK|> one, or another architecture than this run's: refused before any work.
        saved = check_checkpoint(latest_checkpoint(config.output_dir))
        if saved.architecture != config.architecture:
            raise ConfigError(f"{latest_checkpoint(config.output_dir)} is a {saved.architecture} drafter; this run "
                              f"says architecture={config.architecture!r}")
    if resume or latest_checkpoint(config.output_dir) is None:
        return
    if per_run:
        raise ConfigError(f"{config.output_dir} already holds checkpoints of an earlier run with this run home: "
                          "pass --resume to continue it (a run never deletes another run's files)")
    if not config.overwrite_output:
        raise ConfigError(f"{config.output_dir} already holds checkpoints: pass --resume, or set "
                          "overwrite_output=true, or choose another output_dir")
    shutil.rmtree(checkpoints_dir(config.output_dir))
    shutil.rmtree(output_dir / "export", ignore_errors=True)
    metrics_path(config.output_dir).unlink(missing_ok=True)


def restore_checkpoint(config: TrainConfig, checkpoint: Path | None, replicas: list[DrafterReplica],
                       stream: BatchStream) -> int:
    """The step to go on from: `checkpoint`'s (the latest one), loaded into every replica and the data stream;
    0 when there is none. With another max_steps than the checkpoint's, the learning rate continues from the
    checkpoint's to 0 at the new end (CosineSchedule)."""
    if checkpoint is None:
        say(f"no checkpoint in {checkpoints_dir(config.output_dir)}: starting at step 0")
        return 0
    trained = checkpoint_train_config(checkpoint)
    for replica in replicas:
        # The checkpoint's own schedule (from its config; its scheduler state, when it has one, restores it
        # exactly, continuations included).
        replica.schedule.plan(trained.get("max_steps", config.max_steps),
                              trained.get("warmup_ratio", config.warmup_ratio))
        restored = load_checkpoint(checkpoint, replica.drafter, replica.optimizer, replica.scheduler)
        ended = replica.schedule.max_steps
        rescheduled = ended != config.max_steps and config.max_steps > restored["step"]
        if rescheduled:
            replica.continue_schedule(restored["step"], config.max_steps)
    stream.load_state_dict(restored["data"])
    say(f"resumed from {checkpoint} at step {restored['step']}")
    if rescheduled:
        leader = replicas[0]
        say(f"max_steps {ended} -> {config.max_steps}: the learning rate decays from "
            f"{leader.optimizer.param_groups[0]['lr']:.3e} at step {restored['step'] + 1} to 0 at step "
            f"{config.max_steps}")
    return restored["step"]


class CheckpointPolicy:
    """When the run goes to disk. Built once; `after_step` after every step (in the leader drafter thread)
    saves every `save_every`-th step and the last; `close` at the end saves the final step unless it is saved
    already (a stop). A checkpoint holds the leader replica (the replicas are identical) and the data
    position of its own step. One that cannot be written raises CheckpointWriteError (exit 4), or with
    on_checkpoint_error=warn, for any but the run's last, is a warning, and the run goes on. In a multi-node
    run only node 0 writes (`writes`); the others' replicas are the same."""

    def __init__(self, config: TrainConfig, leader: DrafterReplica, batches: StepBatches, step: int,
                 writes: bool = True, run: dict | None = None):
        self.config, self.leader, self.batches, self.writes = config, leader, batches, writes
        self.run = run  # the run that writes: recorded in every checkpoint's config.json
        self.saved_step = step  # where the run starts is on disk already (or step 0: nothing to keep)

    def due(self, step: int) -> bool:
        return step % self.config.save_every == 0 or step == self.config.max_steps

    def after_step(self, step: int) -> None:
        if self.writes and self.due(step):
            self.save(step, last=step == self.config.max_steps)

    def close(self, step: int) -> None:
        if self.writes and step != self.saved_step:
            self.save(step, last=True)

    def save(self, step: int, last: bool = False) -> None:
        """Write step's checkpoint; `last`: the run ends with it, so it cannot be skipped with a warning."""
        leader = self.leader
        try:
            save_checkpoint(self.config.output_dir, step, leader.drafter, leader.optimizer, leader.scheduler,
                            self.batches.state_before(step), self.config.to_dict(), self.config.keep_checkpoints,
                            run=self.run)
        except CheckpointWriteError as err:
            if last or self.config.on_checkpoint_error != "warn":
                raise
            warn(f"{err}; the run goes on (on_checkpoint_error=warn), the next save tries again")
            return
        self.saved_step = step
