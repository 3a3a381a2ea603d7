"""Writes that survive a crash: the one fsync by path, for the files and directories the trainer renames
into place (checkpoints, exports, the tokenized cache), and a directory built whole or not at all (the tiny
world, a target made from a GGUF file)."""

import os
import shutil
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by its path (a directory's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class staging_dir:
    """Build a directory under a temporary name and rename it into place, so a crash leaves nothing half-built."""

    def __init__(self, path: Path):
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")

    def __enter__(self) -> Path:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                os.replace(self.tmp, self.path)
            except OSError:
                if not self.path.is_dir():
                    raise
                # Another process built the same world first (same seed: same content): keep theirs.
                shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
