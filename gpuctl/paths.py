"""Where gpuctl keeps things: the XDG state and config dirs, the bundled templates and trainer, and the
container's layout (ARCHITECTURE §3), a few constants that the command line's help names too (so it needs no SSH
layer to show them)."""

from __future__ import annotations

import os
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parent.parent

# In the container.
RECORDS_DIR = "/workspace/.gpuctl"
STAGE_DIR = "/root/gpuctl"
# The interpreter `gpuctl setup` made (one line, its path): launch and doctor use it when --python is not given.
INTERPRETER_FILE = f"{STAGE_DIR}/interpreter"
DEFAULT_VENV = f"{STAGE_DIR}/venv"  # where `gpuctl setup` makes its virtual environment


def state_dir() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "gpuctl"


def config_file() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "gpuctl" / "config.toml"


def _bundled(name: str) -> Path:
    """templates/ or training/: inside the wheel as gpuctl/_bundle/NAME, else beside the source tree."""
    bundled = Path(__file__).resolve().parent / "_bundle" / name
    return bundled if bundled.is_dir() else SOURCE_ROOT / name


def templates_dir() -> Path:
    return _bundled("templates")


def training_dir() -> Path:
    return _bundled("training")


def config_schema_file() -> Path:
    """The trainer's config schema (training/config_schema.json, generated from its config dataclasses)."""
    return training_dir() / "config_schema.json"


def presets_dir() -> Path:
    return training_dir() / "presets"
