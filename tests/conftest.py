"""Checks for every test: the markers say what a test needs (pyproject.toml registers them); and what the whole
session builds once and shares: the tiny world (`tiny_world`), also across pytest-xdist's workers (`built_once`)."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

# Torch's OpenMP threads spin while they wait for work. The tests run torch in several processes at once (two
# pytest-xdist workers, the trainers they start, other sessions on the machine): more threads than cores, and the
# spinning ones take the cores the working ones need (a tiny run took 3 times the CPU time on a loaded 2-core
# machine). Passive threads sleep instead. Set before any test imports torch; the stand-in host passes it on.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Tests press Ctrl-C (SIGINT) at gpuctl and the trainer. A shell without job control starts a background job
# with SIGINT ignored, and an ignored signal stays ignored across exec, so such a pytest's children would never
# see it. A handler here is reset to the default in every child: they get the signal as in a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # `pytest -m "not sshd"` must never start the stand-in host: a test that uses it says so.
    if "standin" in item.fixturenames and item.get_closest_marker("sshd") is None:
        pytest.fail(f"{item.nodeid} uses the stand-in host: mark it @pytest.mark.sshd", pytrace=False)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups off the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (scripts/test.sh: -n 2 --dist loadgroup), the tests that use a module-scoped fixture of
    their own module run in one worker, so that it is built once (a trained run, a real target), and the `e2e`
    tests start first: a long one left for the end would keep one worker busy while the other waits."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return
    for item in items:
        if (module := module_sharing_a_fixture(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(module))
    items.sort(key=lambda item: item.get_closest_marker("e2e") is None)  # a stable sort: each part in its order


def module_sharing_a_fixture(item: pytest.Item) -> str | None:
    """The node id of the item's module where the item uses a module-scoped fixture that module defines."""
    module = item.getparent(pytest.Module)
    fixtures = getattr(item, "_fixtureinfo", None)
    if module is None or fixtures is None:
        return None
    shared = any(d.scope == "module" and d.baseid == module.nodeid
                 for defs in fixtures.name2fixturedefs.values() for d in defs)
    return module.nodeid if shared else None


def command_line(pid: str | int) -> str:
    """A process's command line as one string ("" once it is gone): what a test looks for among /proc's."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A directory that `build` fills once per test session. Under pytest-xdist each worker is a session of its
    own: the first worker to ask builds it in the directory the workers share (their base temp dir's parent),
    under a lock, and the others wait for it and use it as it is. Whoever uses it reads or copies what it holds,
    never changes it (what the trainer adds beside a data file, its tokenized cache, appears whole, by rename)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        path = tmp_path_factory.mktemp(name)
        build(path)
        return path
    path = tmp_path_factory.getbasetemp().parent / name
    with open(path.with_name(f"{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, and if the worker dies
        done = path.with_name(f"{name}.built")
        if not done.exists():  # a worker that died half-way left a part: start again
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(path)
            done.touch()
    return path


@dataclass
class TinyWorld:
    target: Path
    train: Path
    eval: Path

    @property
    def root(self) -> Path:
        """The directory of all three, laid out as the tiny preset's cache (~/.cache/gpuctl/tiny-v2)."""
        return self.target.parent

    def overrides(self, output_dir: Path) -> list[str]:
        """--set arguments pointing the tiny preset at this world and a private output dir."""
        return [f"target_path={self.target}", f"data_path={self.train}", f"eval_data_path={self.eval}",
                f"output_dir={output_dir}"]


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> TinyWorld:
    """The tiny random target and its generated data, built once (the tiny preset's own builder)."""

    def build(root: Path) -> None:
        import torch

        from training.target.tiny import ensure_tiny

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as tests/training/ runs: the same world whichever worker builds it, and fast
        try:  # on a loaded machine (spinning threads stall when others want the cores)
            ensure_tiny(str(root / "target"), str(root / "train.jsonl"), str(root / "eval.jsonl"))
        finally:
            torch.set_num_threads(threads)

    root = built_once(tmp_path_factory, "tiny-world", build)
    return TinyWorld(root / "target", root / "train.jsonl", root / "eval.jsonl")
