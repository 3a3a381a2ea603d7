"""The trainer as objects with a lifecycle (ARCHITECTURE §5, "The trainer's lifecycle"): `Trainer.run` builds
the world (world.py), resumes (checkpointing.py), runs the pipeline's loop with its components (components.py,
checkpointing.py) and finishes. `python -m training.train` (training/train.py) parses, runs it and decides the
exit code."""

from training.trainer.components import BadStepGuard, EndOfRunExport, Evaluation, NonFiniteSteps, StepLog
from training.trainer.replicas import DrafterReplica, TargetReplica
from training.trainer.schedule import CosineSchedule, cosine_schedule
from training.trainer.trainer import StopRequest, Trainer, train

__all__ = ["BadStepGuard", "CosineSchedule", "DrafterReplica", "EndOfRunExport", "Evaluation", "NonFiniteSteps",
           "StepLog", "StopRequest", "TargetReplica", "Trainer", "cosine_schedule", "train"]
