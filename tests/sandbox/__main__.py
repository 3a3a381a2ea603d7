"""`python -m tests.sandbox up|env|down [--dir DIR] [--ct CTID] [--containers N] [--gpus N]`: the stand-in host
as a command (the demo).

up    starts sshd in the background with N running containers (CTID, CTID+1, ...), each with --gpus fake H200s
      (0: nvidia-smi finds none, as in a container without GPUs, where a CPU torch is right), and prints
      `export` lines for gpuctl that point at the first
env   prints those lines again (for --ct)
down  stops sshd, kills what runs in its containers, removes the state dir
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from tests.sandbox.host import DEFAULT_GPUS, StandInHost

DEFAULT_DIR = Path(tempfile.gettempdir()) / "gpuctl-standin"
MAX_CONTAINERS = 100
MAX_GPUS = 64


def exports(host: StandInHost, ctid: int) -> str:
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in host.env(ctid).items())


def fake_gpus(count: int) -> list[dict]:
    """count fake H200s, alike (the first two as the tests' DEFAULT_GPUS)."""
    return [dict(DEFAULT_GPUS[min(i, len(DEFAULT_GPUS) - 1)]) for i in range(count)]


def bounded(low: int, high: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{what} must be {low} to {high}, got {value}")
        return value
    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.sandbox", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "env", "down"])
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("GPUCTL_STANDIN_DIR", DEFAULT_DIR)))
    parser.add_argument("--ct", type=bounded(100, 999_999_000, "--ct"), default=200,
                        help="the (first) container's CTID, 200 by default")
    parser.add_argument("--containers", type=bounded(1, MAX_CONTAINERS, "--containers"), default=1,
                        help="how many containers up makes: CTID, CTID+1, ...")
    parser.add_argument("--gpus", type=bounded(0, MAX_GPUS, "--gpus"), default=0,
                        help="fake GPUs in each container's nvidia-smi (0 by default: a CPU machine)")
    return parser.parse_args(argv)


def up(host: StandInHost, args: argparse.Namespace) -> int:
    if host.pidfile.exists():
        print(f"a stand-in host already runs from {args.dir} (run 'down' first)", file=sys.stderr)
        return 1
    host.start(daemon=True)
    ctids = list(range(args.ct, args.ct + args.containers))
    for ctid in ctids:
        if ctid not in host.containers():
            host.add_container(ctid, gpus=fake_gpus(args.gpus))
    listed = ", ".join(map(str, ctids))
    gpus = (f"with {args.gpus} fake GPU{'s' * (args.gpus != 1)} each" if args.gpus else
            "without GPUs (a CPU machine: the tiny run trains on the CPU; --gpus N gives fake ones)")
    print(f"stand-in Proxmox host on 127.0.0.1:{host.port}, CT {listed} running {gpus}, state in {args.dir}",
          file=sys.stderr)
    sys.stdout.write(exports(host, args.ct))
    return 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    host = StandInHost(args.dir)
    if args.action == "up":
        return up(host, args)
    if args.action == "env":
        try:
            host.port = int((args.dir / "port").read_text())
        except (OSError, ValueError):
            print(f"no stand-in host runs from {args.dir} (run 'up' first)", file=sys.stderr)
            return 1
        sys.stdout.write(exports(host, args.ct))
    elif args.dir.exists():
        host.stop()
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
