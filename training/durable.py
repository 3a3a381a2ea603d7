"""Writes that survive a crash: the one fsync by path, for the files and directories the trainer renames
into place (checkpoints, exports, the tokenized cache), and a directory built whole or not at all (the tiny
world, a target made from a GGUF file); temporary names that say their writer, so what a dead writer left is
known and removed."""

import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by its path (a directory's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_whole(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary name of this process and a rename, flushed to disk: a reader
    sees the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def writer_tag() -> str:
    """`HOST-PID`, the writer of a temporary name (`PREFIX + writer_tag() + "-" + ...`): `abandoned` tells a
    dead writer's leftovers from a live one's, even on a disk that several hosts share."""
    return f"{socket.gethostname()}-{os.getpid()}"


def abandoned(root: Path, prefix: str) -> Iterator[Path]:
    """The entries of root named PREFIX + writer_tag() + "-" ... by a writer of this host whose process is gone
    (killed mid-write: kill -9, the OOM killer, a node that went down)."""
    start = f"{prefix}{socket.gethostname()}-"
    for path in root.glob(start + "*"):
        pid = path.name[len(start):].split("-", 1)[0]
        if pid.isdigit() and not alive(int(pid)):
            yield path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
