"""Train a DFlash drafter against a frozen target, through the threaded pipeline (training/pipeline/).

    python -m training.train --config PRESET|PATH [--set KEY=VALUE]... [--resume]

The trainer itself is training/trainer/ (`Trainer.run`: build the world, resume, loop, finish; ARCHITECTURE
§5, "The trainer's lifecycle"); this module parses the arguments, runs it and decides the exit code. One
process: a target thread per `target_devices` entry, a drafter thread (one drafter replica) per
`drafter_devices` entry; a one-device run is one of each on the same device. A bad configuration prints one
line and exits 2. SIGTERM (and Ctrl-C) stop at a step boundary, save a checkpoint and exit (0 for SIGTERM, 130
for Ctrl-C); a second one aborts at once (130, no checkpoint). A failing thread stops them all: its traceback,
then exit 1. A step whose loss or summed gradient is not finite is skipped (no optimizer or LR-schedule step;
the data moves on) and counted; `max_bad_steps` of them in a row stop the run: one line naming the step and
what was not finite, exit 3. A checkpoint that cannot be written (disk full, read-only, over quota) leaves the
earlier ones intact and stops the run: one line naming its path and the cause, exit 4; with
on_checkpoint_error=warn a periodic one is a warning instead, and the run goes on. Out of memory in a role
(target or drafter; the line says "the target stage", as it always has) stops every thread: one line naming
it, the device, shapes and the keys that lower memory, exit 5. `main` alone turns how the run ended into the
exit code, one of TrainExit:

    0 done, or stopped by SIGTERM     3 max_bad_steps non-finite steps in a row   130 Ctrl-C, or a 2nd signal
    1 a thread failed (traceback)     4 a checkpoint could not be written
    2 bad configuration or data       5 out of memory in a role
                                      6 another node of a multi-node run was lost (one line naming it)
With RANK, WORLD_SIZE > 1, MASTER_ADDR and MASTER_PORT set, this process is one node of a multi-node run
(training/distributed/): node 0 checkpoints, writes the run's metrics and exports; a stop signal on any node
stops every node at the same step.
"""

from __future__ import annotations

import argparse
import platform
import re
import signal
import sys
from enum import IntEnum

import torch

from training.config import ConfigError, TrainConfig, load_config
from training.console import say
from training.data.chat import Batch, DataError
from training.distributed import NodeLost
from training.entry import OneLineArgumentParser, end_process, run_entry_point
from training.output.checkpoint import CheckpointWriteError
from training.pipeline import PipelineError
from training.trainer import DrafterReplica, NonFiniteSteps, StopRequest, TargetReplica, train

# The library face of `python -m training.train`: what a caller (or a test that injects a failure into its
# process) reaches through this module; the code is training/trainer/'s.
__all__ = ["DrafterReplica", "StopRequest", "TargetReplica", "TrainExit", "main", "train"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineArgumentParser(prog="python -m training.train", description="Train a DFlash drafter.")
    parser.add_argument("--config", required=True, help="preset name (training/presets/) or TOML path")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    return parser.parse_args(argv)


class TrainExit(IntEnum):
    """The trainer's exit codes, written here and nowhere else; `main` decides which, once."""

    OK = 0  # done, or stopped by SIGTERM with a checkpoint saved
    FAILED = 1  # a thread failed (its traceback is in the log)
    BAD_INPUT = 2  # a bad configuration or bad data: one line
    NON_FINITE = 3  # max_bad_steps steps in a row with a non-finite loss or gradient: one line (step, what)
    CHECKPOINT_WRITE = 4  # a checkpoint could not be written (disk full, read-only, quota): one line (path, why)
    OUT_OF_MEMORY = 5  # a role ran out of device memory: one line (role, device, shapes, the keys to lower)
    NODE_LOST = 6  # another node of a multi-node run died, hung or could not be reached: one line naming it
    INTERRUPTED = 130  # stopped by Ctrl-C (checkpoint saved), or aborted by a second signal (none)


def out_of_memory_line(err: PipelineError, config: TrainConfig) -> str:
    """Which role ran out of memory, where, on what shapes, and what lowers it."""
    role = err.thread.rstrip("0123456789")  # "target1" -> the target role
    batch = err.batch
    if isinstance(batch, Batch):
        rows, length = batch.input_ids.shape
        shapes = f"a micro-batch of {rows} rows x {length} tokens (length bucket), {batch.anchors.shape[1]} anchors"
    else:
        shapes = "no micro-batch (warm-up, or the step's update, evaluation or checkpoint)"
    tried = re.search(r"Tried to allocate [\d.]+ \w+", str(err.error))  # CUDA's message says how much
    keys = [f"micro_batch_size ({config.micro_batch_rows()})", f"max_length ({config.max_length}, and length_buckets)"]
    if role != "target":  # the target's memory does not depend on the drafter's blocks
        keys += [f"num_anchors ({config.num_anchors})", f"loss_chunk_size ({config.loss_chunk_size})"]
    return (f"out of memory in the {role} stage ({err.thread} on {err.device}) on {shapes}"
            f"{f' ({tried[0]})' if tried else ''}; lower {', '.join(keys[:-1])} or {keys[-1]}")


def thread_failure(err: PipelineError, config: TrainConfig) -> tuple[TrainExit, str]:
    """The exit code for a failed pipeline thread, and the line that says why."""
    if isinstance(err.error, NonFiniteSteps):
        return TrainExit.NON_FINITE, str(err.error)
    if isinstance(err.error, CheckpointWriteError):
        return TrainExit.CHECKPOINT_WRITE, str(err.error)
    if isinstance(err.error, torch.OutOfMemoryError):
        return TrainExit.OUT_OF_MEMORY, out_of_memory_line(err, config)
    if isinstance(err.error, NodeLost):
        return TrainExit.NODE_LOST, str(err.error)
    return TrainExit.INTERRUPTED if isinstance(err.error, KeyboardInterrupt) else TrainExit.FAILED, str(err)


def end_for_lost_node(line: str) -> None:
    """Another node hung or died: say which, and end this process now, from whichever thread (one stuck in a
    collective that will never complete cannot be joined)."""
    print(f"error: {line}", file=sys.stderr, flush=True)
    end_process(TrainExit.NODE_LOST)


def main(argv: list[str] | None = None) -> int:
    """The process: train, then the exit code (TrainExit), decided here and nowhere else."""
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.set)
        # Which interpreter and torch build run this: the log's first line answers "did it use the right one?"
        say(f"python {sys.executable} ({platform.python_version()}), torch {torch.__version__} "
            f"({f'CUDA {torch.version.cuda}' if torch.version.cuda else 'a CPU-only build'})")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # progress bars would fill the run's log file with carriage returns
        with StopRequest() as stop:
            result = train(config, resume=args.resume, stop=stop, on_node_lost=end_for_lost_node)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return TrainExit.BAD_INPUT
    except CheckpointWriteError as err:  # the run's last checkpoint, saved in this thread
        print(f"error: {err}", file=sys.stderr, flush=True)
        return TrainExit.CHECKPOINT_WRITE
    except NodeLost as err:  # joining, the start's checks, or the end's wait
        end_for_lost_node(str(err))
    except PipelineError as err:  # a thread failed: one line for a known cause, else its traceback and a line
        code, line = thread_failure(err, config)
        if code in (TrainExit.FAILED, TrainExit.INTERRUPTED):
            print(err.traceback_text, end="", file=sys.stderr)
        print(f"error: {line}", file=sys.stderr, flush=True)
        return code
    except KeyboardInterrupt as interrupt:  # a second signal outside the pipeline (loading, saving)
        print(f"error: {interrupt or 'interrupted'}", file=sys.stderr, flush=True)
        return TrainExit.INTERRUPTED
    return TrainExit.INTERRUPTED if result.stopped and stop.signal == signal.SIGINT else TrainExit.OK


if __name__ == "__main__":
    run_entry_point(main)
