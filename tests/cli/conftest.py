"""CLI fixtures: one stand-in Proxmox host (real sshd) per test session, a fresh container per test, and
`gpuctl`, which runs the real command line in a subprocess with HOME and the XDG dirs in a temp dir (nothing of
the user's ~/.ssh or ~/.local is read or written). Trainer fixtures live in tests/training/conftest.py.

A test of the real trainer (the tiny preset) need not build the tiny world nor train for itself:
- `tiny_cache`: the test's container (`gpuctl`'s) with the tiny preset's cache (~/.cache/gpuctl/tiny-v2: the
  target and its data) already there, copied from the session's `tiny_world`: a launch of the tiny preset starts
  training at once. Other containers (a multi-node test's) get it with `seed_tiny_cache(host, ctid, world)`.
- `tiny_run`: the test's container as a clone of one holding a finished run, `gpuctl launch --config tiny
  --follow` (60 steps, tl1 succeeded, its export written), made once per session; `tiny_run.launched` is that
  launch's Result. For a test that reads a finished run (status, logs, runs, pull, plot, inspect, a resume); it
  may change its clone as it likes. A test that needs a run of other settings launches its own, with
  `tiny_cache`.
Both are built once per session, and once for all of pytest-xdist's workers (tests/conftest.py's `built_once`).
"""

from __future__ import annotations

import codecs
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest

from gpuctl import timeouts
from gpuctl.address import tomllib
from tests.conftest import TinyWorld, built_once
from tests.sandbox import ALIAS, StandInHost
from tests.sandbox.host import free_port

REPO = Path(__file__).resolve().parents[2]
_ctids = itertools.count(200)


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


class Output:
    """A process's stdout, read as it arrives (in a thread), so a test waits for what it will assert on rather
    than for a proxy seen through another connection."""

    def __init__(self, process: subprocess.Popen):
        self.process = process
        self._chunks: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while chunk := os.read(self.process.stdout.fileno(), 65536):  # raw: never waits for a line's end
            with self._changed:
                self._chunks.append(decoder.decode(chunk))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def text(self) -> str:
        with self._changed:
            return "".join(self._chunks)

    def wait_for(self, needle: str, timeout: float = 30) -> str:
        """Block until needle has appeared in the output; the output so far."""
        return self._wait_until(lambda text: needle in text, repr(needle), timeout)

    def wait_for_more(self, than: int, timeout: float = 30) -> str:
        """Block until the output is longer than `than` characters; the output so far."""
        return self._wait_until(lambda text: len(text) > than, f"more than {than} characters", timeout)

    def _wait_until(self, done, what: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not done(text := "".join(self._chunks)):
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    raise AssertionError(f"never saw {what} in the output: {text[-2000:]!r}")
                self._changed.wait(min(left, 0.5))
            return text

    def finish(self, timeout: float = 20) -> tuple[str, str]:
        """Wait for the process to end (killed, and the test failed, after `timeout`): all of its stdout, and its
        stderr (a little: it waits in the pipe until the end)."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"still running after {timeout} s; its output: {self.text[-2000:]!r}, "
                                 f"{self.process.stderr.read()[-2000:]!r}") from None
        err = self.process.stderr.read()
        self._thread.join(timeout=timeout)
        return self.text, err


# gpuctl's command line with the stand-in trainer's config schema (tests/sandbox/cli.py): `--set fake.KEY` is known.
CLI = (sys.executable, "-m", "tests.sandbox.cli")


class Gpuctl:
    """Runs `python -m gpuctl ARGS` against the stand-in host and one container."""

    def __init__(self, host: StandInHost, ctid: int, home: Path, source: Path = REPO):
        self.host, self.ctid, self.home = host, ctid, home
        self.source = source  # the checkout gpuctl runs from (and stages training/ of)
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("GPUCTL_", "SSH_", "XDG_", "FORCE_COLOR", "TTY_"))}
        self.env.update(HOME=str(home), XDG_STATE_HOME=str(home / "state"), XDG_CONFIG_HOME=str(home / "config"),
                        PYTHONPATH=os.pathsep.join(dict.fromkeys([str(source), str(REPO)])), NO_COLOR="1",
                        **host.env(ctid))

    def __call__(self, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> Result:
        proc = subprocess.run([*CLI, *args], cwd=self.source, env=self.env | (env or {}),
                              capture_output=True, text=True, timeout=timeout, check=False)
        return Result(proc.returncode, proc.stdout, proc.stderr)

    def popen(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        return subprocess.Popen([*CLI, *args], cwd=self.source, env=self.env | (env or {}),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def launch_fake(self, *sets: str, extra: tuple[str, ...] = ()) -> Result:
        """Launch the fake trainer (tests/sandbox/fake_trainer.py) with `--set fake.K=V` options."""
        args = ["launch", "--python", "fake-trainer", "--json", *extra]
        for item in sets:
            args += ["--set", f"fake.{item}"]
        return self(*args)

    def status(self, *args: str) -> dict:
        result = self("status", "--json", *args)
        assert result.code == 0, result.stderr
        return result.json()

    def path(self, path: str) -> Path:
        """Where a path of the container lives on this machine."""
        return self.host.path_in(self.ctid, path)


def timeouts_config(folder: Path, **limits: float) -> dict[str, str]:
    """The environment of a gpuctl whose config.toml (in FOLDER, its XDG_CONFIG_HOME) has these [timeouts]:
    a test's short limits, given the way a user gives theirs (gpuctl/timeouts.py)."""
    (folder / "gpuctl").mkdir(parents=True, exist_ok=True)
    (folder / "gpuctl" / "config.toml").write_text("[timeouts]\n" + "".join(f"{k} = {v}\n" for k, v in limits.items()))
    return {"XDG_CONFIG_HOME": str(folder)}


@pytest.fixture(autouse=True)
def _timeouts_read_again():
    """gpuctl reads its [timeouts] once per process: an in-process test's config.toml is not the next one's."""
    timeouts.timeouts.cache_clear()
    yield
    timeouts.timeouts.cache_clear()


def started_host(tmp_path_factory, name: str) -> Iterator[StandInHost]:
    host = StandInHost(tmp_path_factory.mktemp(name)).start()
    yield host
    host.stop()


@pytest.fixture(scope="session")
def standin(tmp_path_factory) -> StandInHost:
    yield from started_host(tmp_path_factory, "standin")


@pytest.fixture
def ctid(standin: StandInHost) -> int:
    ctid = next(_ctids)
    standin.add_container(ctid)
    yield ctid
    standin.kill_container_processes(ctid)  # leave nothing running behind a failed test


@pytest.fixture
def gpuctl(standin: StandInHost, ctid: int, tmp_path: Path) -> Gpuctl:
    home = tmp_path / "home"
    home.mkdir()
    return Gpuctl(standin, ctid, home)


# The real trainer's tiny preset, without each test building its world and training its own run.

def tiny_cache_path() -> str:
    """The tiny preset's cache in a container (the directory of its target_path; ~ is /root there)."""
    target = tomllib.loads((REPO / "training" / "presets" / "tiny.toml").read_text())["target_path"]
    return str(PurePosixPath(target.replace("~", "/root", 1)).parent)


def seed_tiny_cache(host: StandInHost, ctid: int, world: TinyWorld) -> Path:
    """Copy the tiny world into container ctid as the tiny preset's cache (what its first run would build)."""
    cache = host.path_in(ctid, tiny_cache_path())
    cache.mkdir(parents=True, exist_ok=True)
    shutil.copytree(world.target, cache / "target")
    for data in (world.train, world.eval):
        shutil.copy2(data, cache / data.name)
    return cache


@pytest.fixture
def tiny_cache(standin: StandInHost, ctid: int, tiny_world: TinyWorld) -> Path:
    """The tiny preset's cache in the test's container; its host path."""
    return seed_tiny_cache(standin, ctid, tiny_world)


# What of a container a run leaves: the trainer's files and records, and gpuctl's staged package and run.sh.
RUN_DIRS = ("workspace", "root")


@dataclass
class TinyRun:
    launched: Result  # `gpuctl launch --config tiny --follow`, as the session's run printed it
    ctid: int  # the container it ran in (its records say so); the test's container is a clone of it


@pytest.fixture(scope="session")
def _tiny_run_made(standin: StandInHost, tmp_path_factory) -> Path:
    """The container of the session's finished tiny run, copied aside: launched the demo's way, in a container
    of its own that builds its own world (the first run's path)."""

    def build(saved: Path) -> None:
        ctid = next(_ctids)
        standin.add_container(ctid)
        home = saved / "home"
        home.mkdir()
        launched = Gpuctl(standin, ctid, home)("launch", "--config", "tiny", "--follow", timeout=600)
        standin.kill_container_processes(ctid)
        assert launched.code == 0, launched.stderr[-3000:]
        for sub in RUN_DIRS:
            shutil.copytree(standin.path_in(ctid, sub), saved / "rootfs" / sub, symlinks=True)
        (saved / "launched.json").write_text(json.dumps({"ctid": ctid, **launched.__dict__}))

    return built_once(tmp_path_factory, "tiny-run", build)


@pytest.fixture
def tiny_run(standin: StandInHost, ctid: int, _tiny_run_made: Path) -> TinyRun:
    """The test's container (`gpuctl`'s) as a clone of the session's finished tiny run (as `pct clone` would
    make one: its files, nothing running)."""
    for sub in RUN_DIRS:
        shutil.copytree(_tiny_run_made / "rootfs" / sub, standin.path_in(ctid, sub), symlinks=True,
                        dirs_exist_ok=True)
    saved = json.loads((_tiny_run_made / "launched.json").read_text())
    return TinyRun(Result(saved["code"], saved["stdout"], saved["stderr"]), saved["ctid"])


# Multi-node runs (launch --node): containers as nodes, on the stand-in host and on a second one behind it.

SECOND_HOST = "pve2"  # the second stand-in host's alias: reached only through ProxyJump via the first


@dataclass
class NodeSet:
    """The containers of a multi-node run, node 0 first: (stand-in host, CTID, the TARGET that names it), and
    `gpuctl` pointed at an ssh_config that reaches them all, with no host or container of its own (so a command
    without options acts on the remembered nodes)."""

    gpuctl: Gpuctl
    nodes: list[tuple[StandInHost, int, str]]

    def node_args(self) -> list[str]:
        return [arg for _, _, spec in self.nodes for arg in ("--node", spec)]

    @staticmethod
    def rendezvous_args() -> list[str]:
        """The stand-in shares this machine's network (a container has no address of its own): node 0 on
        127.0.0.1 at a free port, gloo on the loopback interface (DESIGN §8)."""
        return ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--env", "GLOO_SOCKET_IFNAME=lo"]

    def path(self, k: int, path: str) -> Path:
        host, ctid, _ = self.nodes[k]
        return host.path_in(ctid, path)

    def processes(self, k: int) -> list[int]:
        host, ctid, _ = self.nodes[k]
        return host.container_processes(ctid)

    def launch_fake(self, *sets: str, extra: tuple[str, ...] = ()) -> Result:
        """Launch the fake trainer on every node, like Gpuctl.launch_fake."""
        args = ["launch", *self.node_args(), "--python", "fake-trainer", "--json", *extra]
        for item in sets:
            args += ["--set", f"fake.{item}"]
        return self.gpuctl(*args)


def node_set(home: Path, ssh_config: Path, nodes: list[tuple[StandInHost, int, str]]) -> NodeSet:
    gpuctl = Gpuctl(nodes[0][0], nodes[0][1], home)
    for var in ("GPUCTL_HOST", "GPUCTL_CT"):
        gpuctl.env.pop(var)
    gpuctl.env["GPUCTL_SSH_CONFIG"] = str(ssh_config)
    return NodeSet(gpuctl, nodes)


@pytest.fixture
def two_containers(standin: StandInHost, tmp_path: Path) -> NodeSet:
    """Two containers of the stand-in host as nodes 0 and 1."""
    ctids = [next(_ctids), next(_ctids)]
    for ctid in ctids:
        standin.add_container(ctid)
    (tmp_path / "nodes-home").mkdir()  # beside `gpuctl`'s home, when a test takes both
    yield node_set(tmp_path / "nodes-home", standin.ssh_config, [(standin, c, f"{ALIAS}/{c}") for c in ctids])
    for ctid in ctids:
        standin.kill_container_processes(ctid)


@pytest.fixture(scope="session")
def second_host(tmp_path_factory) -> StandInHost:
    """A second stand-in host (its own sshd on 127.0.0.1, its own containers)."""
    yield from started_host(tmp_path_factory, "standin2")


@pytest.fixture
def two_hosts(standin: StandInHost, second_host: StandInHost, tmp_path: Path) -> NodeSet:
    """Node 0 a container of the stand-in host, node 1 one of the second host, which the ssh_config reaches only
    through `ProxyJump` via the first (host keys checked on both hops)."""
    first, second = next(_ctids), next(_ctids)
    standin.add_container(first)
    second_host.add_container(second)
    config = tmp_path / "ssh_config"
    config.write_text(standin.ssh_config_entry(ALIAS)
                      + second_host.ssh_config_entry(SECOND_HOST, extra=(f"ProxyJump {ALIAS}",)))
    (tmp_path / "nodes-home").mkdir()
    yield node_set(tmp_path / "nodes-home", config, [(standin, first, f"{ALIAS}/{first}"),
                                               (second_host, second, f"{SECOND_HOST}/{second}")])
    standin.kill_container_processes(first)
    second_host.kill_container_processes(second)
