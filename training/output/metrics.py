"""Metrics: one JSON object per line for machines (gpuctl status reads it), one text line for people.

The JSON goes to $GPUCTL_METRICS when set, else <output_dir>/metrics.jsonl. At its start a run also says where
its output goes, into $GPUCTL_RUN_INFO when set (announce_output). Every record has `step`,
`total_steps` and `time` (Unix seconds) and `elapsed_s`; training records add `loss`, `lr`, `tokens_per_s`
(real target tokens per second over the logging window; the first window starts when every thread has warmed
up), `tflops_per_s` (counted matrix FLOPs of the target forward and drafter step per second, training/layout/flops.py:
divided by the devices' matrix rate it is the MFU), `accuracy` (top-1 over positions with loss; for DFlash2 the
selector's, teacher-forced: training/model/selector_loss.py), `grad_norm`, `skipped_steps` (steps of the
window whose update was skipped for a non-finite loss or gradient; `loss` and `accuracy` average the others and
are left out when there are none, `grad_norm` when the window's last step was skipped), `skipped_steps_total`
(since the process started), `layout` (its name, e.g. "colocated" or "1:1"), `peak_memory_gib` (per device:
torch's peak allocation on a GPU, the process's peak RSS for "cpu"), and from the pipeline `busy` (each thread's
busy fraction of the window) and `queue_depth` (`mean`, `max`, `bound`). The first training record adds
`layout_detail` (every role's devices) and, with topology "auto", `layout_auto` (the trial's times per sequence
and every candidate's prediction and memory), and every record `predicted_tokens_per_s`. Evaluations add
`acceptance_length`. In a multi-node run (training/distributed/) node 0's records count every node:
`tokens_per_s` and `tflops_per_s` are the run's, and `nodes` lists each node's own (`node`, `tokens_per_s`,
`tflops_per_s`, `busy`, and `all_reduce_ms`: its gradient all-reduce's mean time a step over the window); each other node writes the same records with its own figures (and `node`), for gpuctl
status, and no evaluation.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from training.console import say, warn
from training.durable import write_whole


def announce_output(key: str, output: str | Path) -> None:
    """Tell gpuctl where this run's output goes: {KEY: ABSOLUTE_PATH} into $GPUCTL_RUN_INFO when it is set
    (gpuctl's wrapper sets it; `gpuctl pull` reads it), written whole and renamed into place. A training run
    says its "output_dir", a regeneration its "output_path" (the data file)."""
    path = os.environ.get("GPUCTL_RUN_INFO")
    if not path:
        return
    info = json.dumps({key: str(Path(output).expanduser().resolve())}, ensure_ascii=False)
    try:
        write_whole(Path(path), info + "\n")
    except OSError as err:  # gpuctl pull will say it cannot find the output; the run itself goes on
        say(f"warning: cannot write {path}: {err}")


def metrics_path(output_dir: str | Path, node: int = 0) -> Path:
    """Where a run's records go: $GPUCTL_METRICS, else its output_dir's metrics.jsonl; in a multi-node run, a
    node other than 0 writes its own progress to its $GPUCTL_METRICS, else metrics.node<N>.jsonl."""
    name = "metrics.jsonl" if node == 0 else f"metrics.node{node}.jsonl"
    return Path(os.environ.get("GPUCTL_METRICS") or Path(output_dir).expanduser() / name)


class MetricsLog:
    def __init__(self, path: Path, total_steps: int, start_time: float | None = None):
        self.path = path
        self.total_steps = total_steps
        self.start = time.time() if start_time is None else start_time
        self.left_out = 0  # records not written since the last one that was (disk full, quota)
        with contextlib.suppress(OSError):  # else the first record says why it cannot be written
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, **values) -> dict:
        """Append one record and print its human-readable form."""
        now = time.time()
        record = {"step": step, "total_steps": self.total_steps, "time": round(now, 3),
                  "elapsed_s": round(now - self.start, 3), **values}
        self._append((json.dumps(record) + "\n").encode())
        print(format_progress(record), flush=True)
        return record

    def _append(self, line: bytes) -> None:
        """A record that cannot be written (disk full, over quota) is left out whole and the run goes on: the
        checkpoints decide whether a full disk ends it, and every record's line is in the log anyway. The first
        one left out is said, and so is the first written again."""
        try:
            with open(self.path, "ab", buffering=0) as file:
                end = file.seek(0, os.SEEK_END)
                try:
                    rest = memoryview(line)
                    while rest:  # a full disk can take part of a write before it refuses the rest
                        rest = rest[file.write(rest):]
                except OSError:
                    with contextlib.suppress(OSError):
                        file.truncate(end)  # no half record for the next one to run into
                    raise
        except OSError as err:
            if not self.left_out:
                warn(f"cannot write {self.path}: {err.strerror or err}; the run goes on, its records are left out "
                     "until there is room (each still prints in the log)")
            self.left_out += 1
            return
        if self.left_out:
            say(f"{self.path} is written again; {self.left_out} record(s) were left out")
            self.left_out = 0


def format_progress(record: dict) -> str:
    parts = [f"step {record['step']}/{record['total_steps']}"]
    formats = {"loss": "loss {:.4f}", "accuracy": "acc {:.3f}", "lr": "lr {:.2e}", "grad_norm": "grad {:.3f}",
               "tokens_per_s": "tok/s {:.0f}", "acceptance_length": "tau {:.3f}"}
    parts += [fmt.format(record[key]) for key, fmt in formats.items() if record.get(key) is not None]
    if record.get("skipped_steps"):
        parts.append(f"skipped {record['skipped_steps']}")
    if record.get("busy"):  # the pipeline's threads: busy fraction of the window, and the queue between them
        busy = " ".join(f"{name} {fraction:.0%}" for name, fraction in record["busy"].items())
        parts.append(f"busy {busy}")
    if record.get("queue_depth"):
        parts.append("queue {mean:.1f}/{bound} max {max}".format(**record["queue_depth"]))
    if record.get("layout"):
        parts.append(f"layout {record['layout']}")
    if record.get("peak_memory_gib"):
        parts.append(f"mem {max(record['peak_memory_gib'].values()):.1f} GiB")
    parts.append(f"{record['elapsed_s']:.1f}s")
    return "  ".join(parts)

