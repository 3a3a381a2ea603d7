"""The package a launch stages in the container: the trainer (training/) and, when --config names a local
file, that file under configs/. Sent as one gzipped tar inside the launch script (one round trip).
"""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile
from dataclasses import dataclass
from pathlib import Path

from gpuctl import paths

SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache"}
SKIP_SUFFIXES = {".pyc", ".pyo"}


@dataclass(frozen=True)
class Package:
    payload_b64: str
    files: list[str]  # paths inside the package, e.g. training/train.py
    size: int  # bytes of the files before compression
    digest: str  # sha256 of the files' names and contents: the same tree gives the same digest


def _tree(root: Path, prefix: str) -> list[tuple[str, Path]]:
    found = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and not SKIP_DIRS.intersection(rel.parts) and path.suffix not in SKIP_SUFFIXES:
            found.append((f"{prefix}/{rel.as_posix()}", path))
    return found


def build_package(config_file: Path | None = None) -> Package:
    members = _tree(paths.training_dir(), "training")
    if config_file is not None:
        members.append((f"configs/{config_file.name}", config_file))
    buf, digest, size = io.BytesIO(), hashlib.sha256(), 0
    # mtime 0 and sorted names: the archive depends on content only.
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for name, path in members:
            data = path.read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
            digest.update(name.encode() + b"\0" + data)
            size += len(data)
    return Package(payload_b64=base64.b64encode(buf.getvalue()).decode(), files=[n for n, _ in members],
                   size=size, digest=digest.hexdigest())
