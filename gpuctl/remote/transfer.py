"""`gpuctl pull`'s side on the workstation: where the files go, what must travel, and receiving them.

The files arrive in a staging directory beside their destination (`.DEST.partial`), each as NAME.part while its
bytes come in, renamed to NAME once its sha256 is the one the container reported. Only when every file is there
do they move to DEST: a new directory is one rename (so DEST appears complete or not at all), an existing one (an
earlier pull) gets the files that changed, each by a rename. The staging directory remembers which container file
each .part holds (`.gpuctl-pull.json`, name -> sha256), so the next pull continues a cut file at its byte offset;
a file already at DEST or in staging with the same sha256 does not travel at all.

The staging directory is made without following a link (one that exists and is not a plain directory of this
user is refused) and locked for the whole pull, so a second pull to the same DEST is refused (exit 5) rather
than mixing its bytes in. Each file's sha256 is checked on disk, not only as its bytes arrived, before its rename.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import Any

from gpuctl.errors import ExitCode, GpuctlError, usage_error
from gpuctl.remote.protocol import RemoteFile
from gpuctl.text import CONTROL

STATE_FILE = ".gpuctl-pull.json"
PART = ".part"
READ_CHUNK = 1 << 20
TRAILER_CAP = 4096  # what is kept of bytes sent after the last file (there should be none)


class Action(str, Enum):
    SKIPPED = "skipped"  # already at DEST (or staged by an earlier pull) with the same sha256
    RESUMED = "resumed"  # an earlier pull's cut .part continues at its byte offset
    SENT = "sent"  # travels whole


@dataclass(frozen=True)
class Destination:
    path: Path  # DEST, absolute
    directory: bool  # a directory of files (export, checkpoint), else one file (metrics)
    into: bool = False  # one file, and DEST was written as a directory (`./regen/`): it goes in, made if need be

    @property
    def in_directory(self) -> bool:
        """The files go in DEST, each by its own name (else DEST is the one file)."""
        return self.directory or self.into or self.path.is_dir()

    def final(self, name: str) -> Path:
        return self.path / name if self.in_directory else self.path


def destination(text: str, directory: bool) -> Destination:
    """DEST, checked before anything is asked of the container: bad DEST is a usage error (exit 2)."""
    if not text.strip() or "\0" in text:
        raise usage_error("DEST must be a path")
    path = Path(text).expanduser().absolute()
    into = not directory and text.endswith(("/", os.sep))  # Path() drops the slash that says "a directory"
    if (directory or into) and path.exists() and not path.is_dir():
        raise usage_error(f"{path} exists and is not a directory (DEST is the directory the files go in)")
    if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
        raise usage_error(f"cannot write in {path}")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise usage_error(f"{parent} is not a directory, so {path} cannot be created")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise usage_error(f"cannot write in {parent}, so {path} cannot be created")
    return Destination(path, directory, into)


@dataclass
class FilePlan:
    index: int  # in the container's manifest
    remote: RemoteFile
    final: Path
    action: Action
    offset: int = 0  # bytes already here (a resumed .part)
    hasher: Any = None  # sha256 of those bytes, to go on with

    @property
    def to_send(self) -> int:
        return 0 if self.action == Action.SKIPPED else self.remote.size - self.offset


@dataclass
class PullPlan:
    dest: Destination
    staging: Path
    files: list[FilePlan]
    lock: int | None = None  # the staging directory, open and locked (flock) until release()

    def release(self) -> None:
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None

    @property
    def wanted(self) -> list[tuple[int, int]]:
        """What to ask the container for: (manifest index, byte offset) of each file that must travel."""
        return [(f.index, f.offset) for f in self.files if f.to_send]

    @property
    def to_send(self) -> int:
        return sum(f.to_send for f in self.files)

    def staged(self, name: str) -> Path:
        return self.staging / name

    def part(self, name: str) -> Path:
        return self.staging / (name + PART)


def sha256_of(path: Path, hasher: Any = None) -> Any:
    hasher = hasher or hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            hasher.update(chunk)
    return hasher


def _same(path: Path, remote: RemoteFile) -> bool:
    return path.is_file() and path.stat().st_size == remote.size and sha256_of(path).hexdigest() == remote.sha256


def _check_names(files: list[RemoteFile]) -> None:
    """A container could name anything: only plain relative paths, so nothing lands outside DEST, and no control
    or format character (a terminal escape, a right-to-left override) in a name a user's shell will list."""
    seen = set()
    for f in files:
        parts = PurePosixPath(f.name).parts
        if (not parts or f.name.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in f.name
                or f.name.endswith(PART) or f.name == STATE_FILE or f.name in seen or CONTROL.search(f.name)
                or "\n" in f.name or "\t" in f.name):
            raise GpuctlError(f"the container offered a file gpuctl will not write: {f.name!r}", ExitCode.RUN_FAILED)
        seen.add(f.name)
    for name in seen:  # `a` and `a/b`: one cannot be both a file and a directory
        parts = PurePosixPath(name).parts
        prefix = next((p for p in (PurePosixPath(*parts[:i]).as_posix() for i in range(1, len(parts)))
                       if p in seen), None)
        if prefix is not None:
            raise GpuctlError(f"the container offered both {prefix!r} and {name!r}: gpuctl will not write a file "
                              "where a directory must be", ExitCode.RUN_FAILED)


def _locked_staging(staging: Path, dest: Path) -> int:
    """Make the staging directory (or take an earlier pull's) without following a link there, and lock it: its
    descriptor, held until the pull ends. One that is not a plain directory of this user is refused (exit 2); one
    locked by another pull is a conflict (exit 5)."""
    try:
        staging.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(staging)
    except FileExistsError:
        pass
    except OSError as e:
        raise usage_error(f"cannot create {staging}: {e.strerror}") from None
    refused = usage_error(f"{staging} exists and is not a plain directory of yours (a link?): gpuctl stages the "
                          "pull there; remove it, or choose another DEST")
    try:
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        raise refused from None
    found = os.fstat(fd)
    try:
        if found.st_uid != os.getuid():
            raise refused
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GpuctlError(f"another pull to {dest} is running (it stages in {staging}): let it end",
                              ExitCode.CONFLICT) from None
        try:
            now = os.lstat(staging)
        except FileNotFoundError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != (found.st_dev, found.st_ino):  # that pull moved it to DEST
            raise GpuctlError(f"another pull to {dest} just ended: run this one again", ExitCode.CONFLICT)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _existing_files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if not p.is_dir()}


def _read_state(staging: Path) -> dict[str, str]:
    try:
        state = json.loads((staging / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def plan(dest: Destination, files: list[RemoteFile]) -> PullPlan:
    """Compare what the container offers with what is here: skip, resume or send each file. Prepares the staging
    directory (what an earlier pull left there for other files goes)."""
    _check_names(files)
    names = {f.name for f in files}
    if dest.directory:
        staging = dest.path.parent / f".{dest.path.name}.partial"
        if dest.path.is_dir():
            extra = sorted(_existing_files(dest.path) - names)
            if extra:
                raise usage_error(f"{dest.path} holds files this pull would not write ({', '.join(extra[:3])}"
                                  f"{', ...' if len(extra) > 3 else ''}): choose another DEST, or empty it")
    else:
        if len(files) != 1 and not (dest.in_directory and files):  # metrics into a directory: TensorBoard's too
            raise GpuctlError(f"expected one file from the container, it offered {len(files)}", ExitCode.RUN_FAILED)
        final = dest.final(files[0].name)
        if final.is_dir():
            raise usage_error(f"{final} is a directory")
        staging = final.parent / f".{final.name}.partial"
    lock = _locked_staging(staging, dest.path)
    try:
        return _plan_files(dest, files, staging, lock)
    except BaseException:
        os.close(lock)
        raise


def _plan_files(dest: Destination, files: list[RemoteFile], staging: Path, lock: int) -> PullPlan:
    names = {f.name for f in files}
    keep = {STATE_FILE} | names | {name + PART for name in names}
    for leftover in sorted(_existing_files(staging) - keep, reverse=True):
        (staging / leftover).unlink()
    state = _read_state(staging)

    result = PullPlan(dest, staging, [], lock)
    for index, remote in enumerate(files):
        final = dest.final(remote.name)
        staged, part = result.staged(remote.name), result.part(remote.name)
        if _same(final, remote) or _same(staged, remote):
            result.files.append(FilePlan(index, remote, final, Action.SKIPPED))
            continue
        staged.unlink(missing_ok=True)
        if part.is_file() and state.get(remote.name) == remote.sha256 and part.stat().st_size <= remote.size:
            offset = part.stat().st_size
            file_plan = FilePlan(index, remote, final, Action.RESUMED, offset, sha256_of(part))
            if offset == remote.size:  # cut after its last byte, before its rename
                _finish(part, staged, remote, file_plan.hasher)
            result.files.append(file_plan)
            continue
        part.unlink(missing_ok=True)
        result.files.append(FilePlan(index, remote, final, Action.SENT))
    _write_atomically(staging / STATE_FILE, json.dumps({f.name: f.sha256 for f in files}).encode())
    return result


def _finish(part: Path, staged: Path, remote: RemoteFile, hasher: Any) -> None:
    """A file fully here: checked against the container's sha256 (as it arrived, and as it is on disk), then
    renamed to its own name."""
    got = hasher.hexdigest()
    if got == remote.sha256:
        got = sha256_of(part).hexdigest()
    if got != remote.sha256:
        part.unlink(missing_ok=True)
        raise GpuctlError(f"{remote.name} arrived with sha256 {got[:16]}…, not the container's "
                          f"{remote.sha256[:16]}…; run the pull again", ExitCode.RUN_FAILED)
    staged.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, staged)


class Receiver:
    """Takes what pull.sh sends (the asked files' bytes back to back, in the order asked) and writes each into its
    .part file; a file complete and checked is renamed into the staging directory at once. Bytes after the last
    file (there should be none) are counted in `extra`, the first TRAILER_CAP of them kept in `trailer`."""

    def __init__(self, pull_plan: PullPlan, progress: Callable[[int], None] | None = None):
        self.plan = pull_plan
        self.progress = progress
        self.sent: dict[str, int] = {}
        self.trailer = bytearray()
        self.extra = 0
        self._queue = [f for f in pull_plan.files if f.to_send]
        self._current: FilePlan | None = None
        self._file = None
        self._left = 0

    def __call__(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._current is None:
                if not self._queue:
                    self.extra += len(view)
                    self.trailer += view[:max(0, TRAILER_CAP - len(self.trailer))]
                    return
                self._open(self._queue.pop(0))
            n = min(len(view), self._left)
            chunk = view[:n]
            self._file.write(chunk)
            self._current.hasher.update(chunk)
            self._left -= n
            self.sent[self._current.remote.name] += n
            view = view[n:]
            if self.progress:
                self.progress(n)
            if self._left == 0:
                self._close_current()

    def _open(self, file_plan: FilePlan) -> None:
        part = self.plan.part(file_plan.remote.name)
        part.parent.mkdir(parents=True, exist_ok=True)
        # Open across calls (one chunk at a time): _close_current() and close() close it.
        self._file = open(part, "r+b" if file_plan.offset else "wb")  # noqa: SIM115
        if file_plan.offset:
            self._file.seek(file_plan.offset)
            self._file.truncate()
        else:
            file_plan.hasher = hashlib.sha256()
        self._current, self._left = file_plan, file_plan.to_send
        self.sent[file_plan.remote.name] = 0

    def _close_current(self) -> None:
        file_plan, f = self._current, self._file
        self._current, self._file = None, None
        f.flush()
        os.fsync(f.fileno())
        f.close()
        name = file_plan.remote.name
        _finish(self.plan.part(name), self.plan.staged(name), file_plan.remote, file_plan.hasher)

    def close(self) -> None:
        """Keep what arrived of a file cut short: the next pull continues it."""
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def complete(self) -> bool:
        return self._current is None and not self._queue

    @property
    def kept(self) -> int:
        """Bytes here for files not yet complete (what a cut leaves for the next pull)."""
        return sum(self.plan.part(f.remote.name).stat().st_size for f in self.plan.files
                   if self.plan.part(f.remote.name).is_file())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(pull_plan: PullPlan) -> None:
    """Every file is at DEST already or staged and checked: move them there. A new DEST directory is the staging
    directory renamed; otherwise each staged file replaces its namesake."""
    staging, dest = pull_plan.staging, pull_plan.dest
    (staging / STATE_FILE).unlink(missing_ok=True)
    if dest.directory and not dest.path.exists():
        _fsync_dir(staging)
        os.replace(staging, dest.path)
    else:
        for f in pull_plan.files:
            staged = pull_plan.staged(f.remote.name)
            if staged.is_file():
                f.final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staged, f.final)
        shutil.rmtree(staging)
    _fsync_dir(dest.path.parent)


@dataclass(frozen=True)
class Pulled:
    """One file of a pull, as the result reports it."""

    name: str
    size: int
    sha256: str
    action: Action
    resumed: int = 0  # bytes an earlier pull had brought
    sent: int = 0  # bytes that travelled now

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "sha256": self.sha256, "action": self.action.value,
                "resumed_bytes": self.resumed, "sent_bytes": self.sent}


@dataclass(frozen=True)
class Outcome:
    files: list[Pulled] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def sent(self) -> int:
        return sum(f.sent for f in self.files)

    @property
    def resumed(self) -> int:
        return sum(f.resumed for f in self.files)

    @property
    def skipped(self) -> int:
        return sum(f.size for f in self.files if f.action == Action.SKIPPED)


def outcome(pull_plan: PullPlan, receiver: Receiver) -> Outcome:
    return Outcome([Pulled(f.remote.name, f.remote.size, f.remote.sha256, f.action, f.offset,
                           receiver.sent.get(f.remote.name, 0)) for f in pull_plan.files])
