"""Writes that survive a crash: the one fsync by path, for the files and directories the trainer renames
into place (checkpoints, exports, the tokenized cache)."""

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by its path (a directory's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
