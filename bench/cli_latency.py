"""gpuctl's latency on the stand-in Proxmox host (real sshd on loopback), and the remote commands each issues.

    python bench/cli_latency.py [--runs N] [--startup]

For launch (to verified-running, with the fake trainer so the trainer's own start-up is excluded; into a fresh
container, which gets the whole package, and again, when nothing changed and no file travels), status and
`logs -n 20`: the median of N runs of the command's work in-process (connect + remote commands, no interpreter
start-up), the median wall time of the whole CLI process, the number of SSH round trips (remote commands) and
the file bytes the SSH layer sent.
Aim (issue 2): launch <= 1.5 s, status <= 0.5 s on loopback.

--startup: only the start-up table (issue 29): the median wall time of `gpuctl --version`, `--help` and `status`
(on the stand-in, one running fake run) as whole processes of this interpreter (`python -m gpuctl`: no pyenv shim
in between), beside a bare interpreter's start; with gpuctl's bytecode cached (as installed) and compiled at each
start, and (cached) the median CPU time each process used, which a loaded machine hardly changes; and, for
reference, OpenSSH's `ssh` running status's one remote command (sshd and the stand-in's pct, no Python client).
Aim: --version <= 0.15 s, --help <= 0.25 s, status <= 0.5 s.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpuctl import address, commands
from gpuctl.commands.kill import kill as kill_run
from gpuctl.commands.launch import launch as launch_run
from gpuctl.commands.status import status as status_of
from tests.sandbox import ALIAS, StandInHost
from tests.sandbox.cli import use_standin_schema

use_standin_schema()  # the in-process launches set the fake trainer's keys

CTID = 200
FAKE = ["fake.steps=1000000", "fake.step_s=0.05"]


def timed_in_process(operation, flags, runs: int, after=None) -> tuple[float, int, float, int]:
    """Median seconds of connect + operation, the remote commands it issued, the median connect time, the
    median file bytes sent. `flags` is an AddressFlags, or a function of the run's index that gives one."""
    seconds, connects, trips, sent = [], [], set(), []
    for i in range(runs):
        start = time.perf_counter()
        t = address.resolve(flags(i) if callable(flags) else flags)
        with commands.connected(t) as ct:
            operation(ct, t)
        seconds.append(time.perf_counter() - start)
        stats = ct.session.stats
        connects.append(stats.connect_s)
        trips.add(stats.remote_commands)
        sent.append(stats.sent["files"])
        if after:
            after(t)
    assert len(trips) == 1, f"the number of remote commands varied: {trips}"
    return statistics.median(seconds), trips.pop(), statistics.median(connects), int(statistics.median(sent))


def timed_cli(args: list[str], env: dict[str, str], runs: int, after=None, module: str = "gpuctl") -> float:
    """Median wall seconds of `python -m MODULE ARGS` (tests.sandbox.cli: gpuctl knowing the fake trainer's keys)."""
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seconds.append(time.perf_counter() - start)
        if after:
            after(None)
    return statistics.median(seconds)


def startup_table(host: StandInHost, env: dict[str, str], flags: address.AddressFlags, runs: int,
                  pycache: Path) -> None:
    """Median wall seconds of whole gpuctl processes that connect to nothing (--version, --help) and of status:
    with gpuctl's bytecode cached (as a pip install has it; a warm-up run writes it under `pycache`), and
    compiled at every start (PYTHONDONTWRITEBYTECODE=1, this sandbox's default for a source checkout)."""
    os.environ.update(host.env(CTID))
    scope = commands.resolve(flags)
    with scope.connected(None):
        scope.launch(scope.checked(commands.LaunchOptions(python="fake-trainer", sets=FAKE)), notify=print,
                     progress=None)
    cached = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PYTHONPYCACHEPREFIX": str(pycache)}
    compiled = env | {"PYTHONDONTWRITEBYTECODE": "1"}
    rows = [("python -c pass (the interpreter alone)", ["-c", "pass"])]
    rows += [(f"gpuctl {' '.join(args)}", ["-m", "gpuctl", *args]) for args in (["--version"], ["--help"], ["status"])]
    rows.append(("python -c 'import gpuctl.cli'", ["-c", "import gpuctl.cli"]))
    timed = [(name, *timed_python(args, cached, runs, warm_up=True), timed_python(args, compiled, runs)[0])
             for name, args in rows]
    work = []  # status's own work, in this process: connect, the one remote command, the report
    for _ in range(runs):
        start = time.perf_counter()
        with commands.resolve(flags).connected(None) as one:
            one.status(0)
        work.append(time.perf_counter() - start)
    timed.append(("(status's work in-process: connect + remote)", statistics.median(work), float("nan"),
                  float("nan")))
    floor = openssh_floor(host, *status_remote_command(flags), runs)
    if floor is not None:
        timed.append(("(ssh: OpenSSH running status's remote cmd)", floor, float("nan"), float("nan")))
    with scope.connected(None):
        scope.kill(0, "KILL", grace=5, notify=print)
    print(f"gpuctl start-up ({sys.executable}), median of {runs} runs each; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'command':<44} {'bytecode cached':>16} {'its CPU time':>14} {'compiled each run':>18}")
    for name, warm, cpu, cold in timed:
        print(f"{name:<44} {warm:>14.3f} s {cpu:>12.3f} s {cold:>16.3f} s")


def status_remote_command(flags: address.AddressFlags) -> tuple[str, bytes]:
    """The one remote command status issues, its command line and its script, taken from a real status."""
    sent = []
    with commands.resolve(flags).connected(None) as one:
        session = one.ct.session
        run = session.run
        session.run = lambda command, stdin=b"": sent.append((command, stdin)) or run(command, stdin)
        one.status(0)
    assert len(sent) == 1, f"status issued {len(sent)} remote commands"
    return sent[0]


def openssh_floor(host: StandInHost, command: str, script: bytes, runs: int) -> float | None:
    """Median wall seconds of OpenSSH's own client running status's remote command on the stand-in: what sshd and
    the stand-in's pct cost with no Python on the client's side (None without an ssh client)."""
    ssh = shutil.which("ssh")
    if ssh is None:
        return None
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([ssh, "-F", str(host.ssh_config), "-o", "BatchMode=yes", ALIAS, command], input=script,
                       check=True, stdout=subprocess.DEVNULL)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def timed_python(args: list[str], env: dict[str, str], runs: int, warm_up: bool = False) -> tuple[float, float]:
    """Median wall seconds of the process, and median CPU seconds (user + system) it used: the CPU figure hardly
    moves with the machine's load, where the wall figure grows with it (status's remote side runs in sshd and
    pct, other processes, so its CPU figure is gpuctl's own start-up, connection and drawing)."""
    seconds, cpu = [], []
    for i in range(runs + warm_up):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([sys.executable, *args], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if i or not warm_up:
            seconds.append(time.perf_counter() - start)
            cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return statistics.median(seconds), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--startup", action="store_true", help="only the start-up table (issue 29)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuctl-bench-") as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        os.environ.update(HOME=str(home), XDG_STATE_HOME=str(home / "state"), XDG_CONFIG_HOME=str(home / "cfg"))
        host = StandInHost(Path(tmp) / "standin").start()
        try:
            host.add_container(CTID)
            env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCTL_", "SSH_"))}
            env.update(PYTHONPATH=str(REPO), **host.env(CTID))
            flags = address.AddressFlags(host=ALIAS, ct=CTID, ssh_config=str(host.ssh_config))
            if args.startup:
                startup_table(host, env, flags, args.runs, Path(tmp) / "pycache")
                return
            options = commands.LaunchOptions(python="fake-trainer", sets=FAKE)

            def stop_run(_) -> None:
                with commands.connected(address.resolve(flags)) as ct:
                    kill_run(ct, 0, "KILL", grace=5, notify=lambda _: None)

            rows = []

            def fresh_container(i: int) -> address.AddressFlags:
                host.add_container(CTID + 1 + i)
                return address.AddressFlags(host=ALIAS, ct=CTID + 1 + i, ssh_config=str(host.ssh_config))

            def stop_that_run(t) -> None:
                with commands.connected(t) as ct:
                    kill_run(ct, 0, "KILL", grace=5, notify=lambda _: None)

            first = timed_in_process(lambda ct, t: launch_run(ct, t, options, notify=lambda _: None),
                                     fresh_container, args.runs, after=stop_that_run)
            rows.append(("launch, first (whole package)", first, None))
            launch = timed_in_process(lambda ct, t: launch_run(ct, t, options, notify=lambda _: None), flags,
                                      args.runs, after=stop_run)
            sets = [arg for item in FAKE for arg in ("--set", item)]
            launch_cli = timed_cli(["launch", "--python", "fake-trainer", *sets], env, args.runs, after=stop_run,
                                   module="tests.sandbox.cli")
            rows.append(("launch, again (to verified running)", launch, launch_cli))
            # A running run for status and logs to read.
            with commands.connected(address.resolve(flags)) as ct:
                launch_run(ct, address.resolve(flags), options, notify=lambda _: None)
            time.sleep(2)  # let the fake trainer write a few dozen log lines and metrics records
            status = timed_in_process(lambda ct, t: status_of(ct), flags, args.runs)
            rows.append(("status", status, timed_cli(["status"], env, args.runs)))
            logs = timed_in_process(lambda ct, t: commands.print_log(ct, 0, 20, lambda _: None), flags, args.runs)
            rows.append(("logs -n 20", logs, timed_cli(["logs", "-n", "20"], env, args.runs)))
            stop_run(None)
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import gpuctl.cli"], cwd=REPO, check=True)
            import_s = time.perf_counter() - start
        finally:
            host.stop()

    print(f"gpuctl on the stand-in host (sshd on 127.0.0.1), median of {args.runs} runs each")
    print(f"{'command':<36} {'in-process':>11} {'CLI wall':>9} {'remote cmds':>12} {'connect':>8} "
          f"{'file bytes sent':>16}")
    for name, (seconds, trips, connect, sent), cli_s in rows:
        wall = f"{cli_s:>7.3f} s" if cli_s is not None else f"{'-':>9}"
        print(f"{name:<36} {seconds:>9.3f} s {wall} {trips:>12d} {connect * 1000:>5.0f} ms {sent:>16d}")
    print(f"{'(python -c import gpuctl.cli)':<36} {'':>11} {import_s:>7.3f} s")


if __name__ == "__main__":
    main()
