"""`launch --resume [N]`: which run is continued, and the options it is continued with (its own task, config,
sets, interpreter and directories, under what the command line gives)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import PurePosixPath
from typing import Any

from gpuctl.commands.options import LaunchOptions, LaunchTask, check_trainer_config
from gpuctl.commands.records import inspect
from gpuctl.config_schema import parse_override
from gpuctl.errors import ExitCode, GpuctlError, usage_error
from gpuctl.remote.container import Container
from gpuctl.runs import Run, State

RUN_HOME = re.compile(r"^tl[1-9][0-9]*$")


def resuming(ct: Container, opts: LaunchOptions) -> LaunchOptions:
    """With --resume, the options of the run it continues (its number in opts.resume; 0 asked for the latest);
    without, opts as they are. A run that did all its steps raises Finished (which carries those options)."""
    if opts.resume is None:
        return opts
    resumed = _resumable(ct, opts.resume, opts.task)
    opts = resume_options(replace(opts, resume=resumed.number), resumed.record)
    check_trainer_config(opts)  # the run's own config and sets, with the command line's, before anything is sent
    _check_unfinished(resumed, opts)
    return opts


class Finished(GpuctlError):
    """`launch --resume` of a training run that did all its steps, with max_steps not raised above them: nothing
    to do, so nothing is staged and no run number is used (exit 0: what was asked for is done)."""

    def __init__(self, run: Run, step: int, opts: LaunchOptions):
        self.run, self.step, self.opts = run, step, opts  # opts: the resume's, as if it went on
        super().__init__(f"{run.label} finished: {step} of {step} steps done; nothing to resume, nothing sent "
                         f"(--set max_steps=M with M above {step} trains it on)", ExitCode.OK)


def _check_unfinished(run: Run, opts: LaunchOptions) -> None:
    """Raise Finished when the run succeeded at its last step and the resume's max_steps (its --set values, the
    command line's last) is not above it. A run whose metrics do not say (none, or no total) resumes as asked."""
    progress = run.progress
    if (run.state != State.SUCCEEDED or opts.task != LaunchTask.TRAIN or progress is None
            or progress.total_steps is None or progress.step < progress.total_steps):
        return
    max_steps = progress.total_steps
    for text in opts.sets:
        key, value = parse_override(text)
        if key == "max_steps" and isinstance(value, int):
            max_steps = value
    if max_steps <= progress.step:
        raise Finished(run, progress.step, opts)


def _resumable(ct: Container, number: int, task: LaunchTask | None) -> Run:
    """The run `launch --resume [N]` continues: run N, or the latest run of `task` (any task but a gpuctl setup
    when None)."""
    tasks = {task.value} if task else {t.value for t in LaunchTask}
    found = inspect(ct, number).runs
    if found and found[0].task not in tasks and number == 0:
        found = [run for run in inspect(ct, all_runs=True).runs if run.task in tasks][-1:]
    if not found:
        raise usage_error(f"no {task.value + ' ' if task else ''}runs in CT {ct.ctid} to resume")
    if found[0].task not in {t.value for t in LaunchTask}:
        raise usage_error(f"{found[0].run_id} is a gpuctl {found[0].task}, not a training run: nothing to resume")
    if found[0].task not in tasks:
        raise usage_error(f"{found[0].run_id} is a {found[0].task} run, not {task.value}: leave out --task")
    return found[0]


def resume_options(opts: LaunchOptions, record: dict[str, Any]) -> LaunchOptions:
    """A resumed run: the run's own task, config, sets, interpreter, directories, --env values and (a
    multi-node run's) rendezvous; what the command line gives wins, and its --set values come after the run's (so
    they override them)."""
    log_path = record.get("log_path") or ""
    return replace(opts, task=LaunchTask(record.get("task") or LaunchTask.TRAIN),
                   config=opts.config or record.get("config"),
                   sets=[*record.get("sets", []), *opts.sets], python=opts.python or record.get("python"),
                   env=[*record.get("env", []), *opts.env],
                   workdir=opts.workdir or record.get("workdir"),
                   master_addr=opts.master_addr or record.get("master_addr"),
                   master_port=opts.master_port or record.get("master_port"),
                   log_dir=opts.log_dir or (str(PurePosixPath(log_path).parent) if log_path else None),
                   home=run_home(record))


def run_home(record: dict[str, Any]) -> str:
    """The run a resume continues in: the resumed run's own home (a resume of a resume keeps the first run's),
    else its id (a run launched before runs had homes)."""
    home = record.get("home")
    if isinstance(home, str) and RUN_HOME.fullmatch(home):
        return home
    return f"tl{int(record.get('number') or 0)}"

