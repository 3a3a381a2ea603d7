"""The package a launch stages in the container, and what of it must travel.

The package is the trainer (training/), the --config file when it names a local file (under configs/), and the
launch's run.sh and wrapper. Every file is named by its sha256 in a manifest; the container's side reports the
hashes of the package it has, and only files whose hash differs travel (one gzipped tar), so a re-launch with
nothing changed sends no file bytes at all. The container assembles the new package in a fresh directory
(unchanged files hard-linked from the current one), checks every hash, and only then switches to it.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

from gpuctl import paths
from gpuctl.errors import usage_error

SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache"}
SKIP_SUFFIXES = {".pyc", ".pyo"}


@dataclass(frozen=True)
class PackageFile:
    name: str  # the path inside the package, e.g. training/train.py
    sha256: str
    data: bytes | None  # None: a file only the container has (kept from its current package)
    mode: int = 0o644


@dataclass(frozen=True)
class Package:
    files: dict[str, PackageFile]

    @property
    def size(self) -> int:
        return sum(len(f.data or b"") for f in self.files.values())

    @property
    def digest(self) -> str:
        """sha256 of the manifest: the same files give the same digest."""
        return hashlib.sha256(self.manifest()).hexdigest()

    def manifest(self) -> bytes:
        """`sha256sum` lines, sorted by name: what the container checks the assembled package against."""
        return b"".join(f"{f.sha256}  {name}\n".encode() for name, f in sorted(self.files.items()))

    def with_files(self, extra: list[PackageFile]) -> Package:
        return Package({**self.files, **{f.name: f for f in extra}})


def file_from_bytes(name: str, data: bytes, mode: int = 0o644) -> PackageFile:
    if "\n" in name or "\\" in name or name.startswith(("/", ".gpuctl")) or ".." in name.split("/"):
        raise usage_error(f"cannot stage a file named {name!r}")
    return PackageFile(name, hashlib.sha256(data).hexdigest(), data, mode)


def _tree(root: Path, prefix: str) -> list[tuple[str, Path]]:
    found = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and not SKIP_DIRS.intersection(rel.parts) and path.suffix not in SKIP_SUFFIXES:
            found.append((f"{prefix}/{rel.as_posix()}", path))
    return found


def build_package(config_file: Path | None = None) -> Package:
    """The trainer and the local config file; the launch adds run.sh and the wrapper."""
    members = _tree(paths.training_dir(), "training")
    if config_file is not None:
        members.append((f"configs/{config_file.name}", config_file))
    return Package({name: file_from_bytes(name, path.read_bytes()) for name, path in members})


def parse_manifest(text: bytes) -> dict[str, str]:
    """`sha256sum` output (HASH, two spaces, NAME per line) -> {name: hash}."""
    found = {}
    for line in text.decode(errors="replace").splitlines():
        digest, sep, name = line.partition("  ")
        if sep and len(digest) == 64:
            found[name.removeprefix("./")] = digest
    return found


@dataclass(frozen=True)
class StagePlan:
    """What travels: the files the container lacks (by content), as one gzipped tar."""

    changed: list[str]
    archive: bytes  # empty when nothing changed

    @property
    def changed_bytes(self) -> int:
        return len(self.archive)


def plan_stage(package: Package, remote: dict[str, str]) -> StagePlan:
    changed = [name for name, f in sorted(package.files.items()) if remote.get(name) != f.sha256]
    missing = [name for name in changed if package.files[name].data is None]
    if missing:
        raise usage_error(f"{', '.join(missing)} is no longer staged in the container: pass --config PATH")
    if not changed:
        return StagePlan([], b"")
    import tarfile  # here: status imports this module (for parse_manifest) and never archives

    buf = io.BytesIO()
    # mtime 0 and sorted names: the archive depends on content only.
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for name in changed:
            f = package.files[name]
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(f.data), f.mode, 0
            tar.addfile(info, io.BytesIO(f.data))
    return StagePlan(changed, buf.getvalue())
