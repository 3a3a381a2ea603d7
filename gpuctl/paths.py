"""Where gpuctl keeps things: the XDG state and config dirs, and the bundled templates and trainer."""

from __future__ import annotations

import os
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parent.parent


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
    """The trainer's config schema (training/config_schema.json, generated from its config dataclasses);
    GPUCTL_CONFIG_SCHEMA names another (a trainer of one's own, or the tests' stand-in trainer)."""
    return Path(os.environ.get("GPUCTL_CONFIG_SCHEMA") or training_dir() / "config_schema.json")


def presets_dir() -> Path:
    return training_dir() / "presets"
