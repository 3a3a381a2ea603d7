"""Where a run writes: each run its own directory, `<runs_dir>/<run home>`, unless output_dir names one.

The run home is $GPUCTL_RUN_HOME when set (gpuctl sets it: `tlN` for a fresh launch; for `launch --resume` and
a `--retry` attempt, the home of the run they continue). Started by hand, without it, a fresh run takes the next
free `run<N>` under runs_dir (N = 1 + the largest existing, compared as numbers) and `--resume` continues the
newest existing one (the largest N; `run1` when there is none). The trainer resolves it once, at its start, and
says it in one line. Every node of a multi-node run resolves it from its own environment and its own disk
(before any node creates it). An explicit output_dir keeps its own meaning (overwrite_output included); its
home is its directory's name. `run_record` is what every checkpoint records of the run that wrote it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from training.config import ConfigError, TrainConfig

RUN_HOME_ENV = "GPUCTL_RUN_HOME"
RUN_ID_ENV = "GPUCTL_RUN_ID"
BY_HAND = re.compile(r"^run(\d+)$")
HOME_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class RunDir:
    config: TrainConfig  # with output_dir the run's own directory
    home: str  # the directory's name: tl4, run2, or an explicit output_dir's last part
    per_run: bool  # under runs_dir (never deletes anything); False: output_dir set explicitly
    line: str  # what the log says about it


def hand_homes(runs_dir: str | Path) -> list[int]:
    """The N of every run<N> under runs_dir, smallest first."""
    base = Path(runs_dir).expanduser()
    if not base.is_dir():
        return []
    return sorted(int(m[1]) for m in map(BY_HAND.fullmatch, os.listdir(base)) if m)


def resolve_run_dir(config: TrainConfig, resume: bool, environ: dict[str, str] | None = None) -> RunDir:
    """The run's directory (see the module doc): a copy of `config` with output_dir set, and its home."""
    environ = os.environ if environ is None else environ
    if config.output_dir:
        out = config.output_dir
        return RunDir(config, Path(out).expanduser().resolve().name, False,
                      f"output_dir {out} (set explicitly: no per-run directory; overwrite_output={config.overwrite_output})")
    home = environ.get(RUN_HOME_ENV, "")
    if home:
        if not HOME_NAME.fullmatch(home) or home in (".", ".."):
            raise ConfigError(f"{RUN_HOME_ENV}={home!r} is not a directory name (letters, digits, '.', '_', '-')")
        why = f"${RUN_HOME_ENV}"
    else:
        numbers = hand_homes(config.runs_dir)
        if resume:
            home = f"run{numbers[-1] if numbers else 1}"
            why = f"--resume: the newest run<N> under {config.runs_dir}" if numbers else "--resume: no run<N> yet"
        else:
            home = f"run{numbers[-1] + 1 if numbers else 1}"
            why = f"the next free run<N> under {config.runs_dir}; ${RUN_HOME_ENV} or output_dir choose another"
    out = str(Path(config.runs_dir) / home)
    return RunDir(dataclasses.replace(config, output_dir=out), home, True, f"run home {home} ({why}): "
                  f"this run writes {out}")


def run_record(home: str, environ: dict[str, str] | None = None) -> dict:
    """What a checkpoint records of the run that wrote it: gpuctl's run id (None by hand) and the home."""
    environ = os.environ if environ is None else environ
    return {"id": environ.get(RUN_ID_ENV) or None, "home": home}
