"""A launch's options: what the command line may ask for, checked once, and a multi-node run's part of them
(NodeRole). No connection here, nothing heavy imported: the command line's
help is built from these.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import Any

from gpuctl.config_schema import check_config
from gpuctl.errors import usage_error
from gpuctl.paths import STAGE_DIR
from gpuctl.runs import RunRef, check_run_name

# The interpreter is not among them: without --python, the container's side takes the one `gpuctl setup`
# recorded (INTERPRETER_FILE), else python3 (lib.sh's resolve_python).
DEFAULTS = {"workdir": "/workspace", "log_dir": "/workspace"}


class LaunchTask(str, Enum):
    """What `launch --task` runs (detached, as run.sh): the trainer, or the data regeneration."""

    TRAIN = "train"  # python -m training.train
    REGENERATE = "regenerate"  # python -m training.regenerate


TASK_MODULES = {LaunchTask.TRAIN: "training.train", LaunchTask.REGENERATE: "training.regenerate"}
TASK_CONFIGS = {LaunchTask.TRAIN: "tiny", LaunchTask.REGENERATE: "tiny-regenerate"}  # the default --config


@dataclass
class LaunchOptions:
    config: str | None = None  # None: the task's default (TASK_CONFIGS), or the resumed run's
    sets: list[str] = field(default_factory=list)
    python: str | None = None  # None: the container's (gpuctl setup's, else python3)
    workdir: str | None = None
    log_dir: str | None = None
    keep_compile_cache: bool = False
    replace: bool = False
    queue: bool = False  # with a run active, wait in the container's queue (its wrapper waits there) instead of exit 5
    name: str | None = None  # launch --name: unique among the container's runs (launch.sh checks, under its lock)
    resume: RunRef | None = None  # a run number or name to continue (0: the latest run); once read, its number
    retry: int = 0  # restart a failed run with --resume up to this many times (the wrapper does, in the container)
    retry_delay: float = 10.0  # seconds before a retry; doubled for each attempt in a row that failed before a step
    task: LaunchTask | None = None  # None: the resumed run's task, else train
    env: list[str] = field(default_factory=list)  # KEY=VALUE: environment for the trainer (--env)
    node: NodeRole | None = None  # one node of a multi-node run (gpuctl.commands.nodes); None: a run of its own
    # A multi-node run's --master-addr/--master-port; None: the resumed run's (its record's), else node 0's
    # address and 29500.
    master_addr: str | None = None
    master_port: int | None = None
    # The run whose directory the trainer writes in (<runs_dir>/<home>): a resumed run's home (its first run's),
    # None for a fresh run (its own number, tlN).
    home: str | None = None


# torch.distributed's env:// variables: gpuctl sets them for a multi-node run, --env may not.
RENDEZVOUS_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class NodeRole:
    """One container's place in a multi-node run (launch --node): what its trainer is told through
    torch.distributed's env:// variables, and what its run record says of the run's nodes."""

    rank: int  # the node's index, 0 = the first
    nodes: tuple[str, ...]  # every node's address (as a TARGET), node 0 first
    master_port: int
    master_addr: str | None = None  # None: node 0's own address, which its launch script finds

    def rendezvous(self) -> list[tuple[str, str]]:
        values = (self.rank, len(self.nodes), self.master_addr, self.master_port)
        return [(key, str(value)) for key, value in zip(RENDEZVOUS_KEYS, values)]

    def record_fields(self) -> dict[str, Any]:
        """A --master-addr given (or resumed) is recorded too, so a --resume keeps it; node 0's own address is
        found again."""
        fields = {"node": self.rank, "nodes": list(self.nodes), "master_port": self.master_port}
        return fields | ({"master_addr": self.master_addr} if self.master_addr else {})


def _remote_dir(value: str, option: str) -> str:
    if not value.startswith("/"):
        raise usage_error(f"{option} must be an absolute path in the container, got {value!r}")
    if "\0" in value or "\n" in value:
        raise usage_error(f"{option} must not contain NUL or newline characters")
    return str(PurePosixPath(value))


def check_launch_options(opts: LaunchOptions) -> LaunchOptions:
    """What the command line gave, checked once per launch before any connection (a --resume's run adds only
    values its own launch checked); the directories given made canonical. `completed` fills in the rest."""
    for item in opts.sets:
        key, eq, _ = item.partition("=")
        if not eq or not key.strip():
            raise usage_error(f"--set takes KEY=VALUE, got {item!r} (see gpuctl launch --help)")
        if "\n" in item or "\0" in item:
            raise usage_error(f"--set value must not contain NUL or newline characters: {item!r}")
    check_env(opts.env)
    if opts.queue and opts.replace:
        raise usage_error("--queue waits for the active run, --replace kills it: choose one")
    if opts.retry < 0 or not 0 <= opts.retry_delay <= 86400:
        raise usage_error("--retry takes a count >= 0, --retry-delay seconds between 0 and 86400")
    if opts.config == "" or opts.python == "":
        raise usage_error("--config and --python must not be empty")
    if opts.python is not None:
        check_python(opts.python)
    if opts.name is not None:
        check_run_name(opts.name)
    if opts.resume is None:  # a resumed run's config and sets are checked once its record is read (resume.py)
        check_trainer_config(opts)
    return replace(opts, workdir=opts.workdir and _remote_dir(opts.workdir, "--workdir"),
                   log_dir=opts.log_dir and _remote_dir(opts.log_dir, "--log-dir"), sets=list(opts.sets),
                   env=list(opts.env))


def completed(opts: LaunchOptions) -> tuple[LaunchOptions, Path | None]:
    """Checked options (a resumed run's merged in) with what is not given filled from the defaults; and the local
    config file to stage, when the config names one."""
    task = LaunchTask(opts.task or LaunchTask.TRAIN)
    config = opts.config or TASK_CONFIGS[task]
    local = Path(config).expanduser()
    config_file = local if local.is_file() and not config.startswith(f"{STAGE_DIR}/") else None
    return replace(opts, task=task, config=f"{STAGE_DIR}/configs/{local.name}" if config_file else config,
                   workdir=opts.workdir or DEFAULTS["workdir"], log_dir=opts.log_dir or DEFAULTS["log_dir"]), \
        config_file


def check_trainer_config(opts: LaunchOptions) -> None:
    """The preset or local config file and the --set values, against the trainer's schema (gpuctl.config_schema),
    before anything is sent: a typo is exit 2 here, not a run number used up in the container. A resumed run's
    staged config file is the container's copy: its --set values are checked, not the file."""
    task = LaunchTask(opts.task or LaunchTask.TRAIN)
    config = opts.config or TASK_CONFIGS[task]
    check_config(task.value, None if config.startswith(f"{STAGE_DIR}/") else config, opts.sets)


def check_env(items: list[str]) -> list[tuple[str, str]]:
    """--env KEY=VALUE items as (KEY, VALUE): KEY a shell identifier that is not gpuctl's own."""
    pairs = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not ENV_KEY.fullmatch(key):
            raise usage_error(f"--env takes KEY=VALUE with KEY a shell identifier (letters, digits, _), got {item!r}")
        if key in RENDEZVOUS_KEYS or key.startswith("GPUCTL_"):
            raise usage_error(f"--env cannot set {key}: gpuctl sets it (the rendezvous: --master-addr, "
                              "--master-port)")
        if "\n" in value or "\0" in value:
            raise usage_error(f"--env value must not contain NUL or newline characters: {item!r}")
        pairs.append((key, value))
    return pairs


def check_python(python: str) -> str:
    if any(ord(c) < 32 for c in python):
        raise usage_error(f"--python must not contain control characters: {python!r}")
    return python

