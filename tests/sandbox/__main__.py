"""`python -m tests.sandbox up|env|down [--dir DIR] [--ct CTID]`: the stand-in host as a command (the demo).

up    starts sshd in the background with one running container and prints `export` lines for gpuctl
env   prints those lines again
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

from tests.sandbox.host import StandInHost

DEFAULT_DIR = Path(tempfile.gettempdir()) / "gpuctl-standin"


def exports(host: StandInHost, ctid: int) -> str:
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in host.env(ctid).items())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sandbox", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "env", "down"])
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("GPUCTL_STANDIN_DIR", DEFAULT_DIR)))
    parser.add_argument("--ct", type=int, default=200)
    args = parser.parse_args(argv)
    host = StandInHost(args.dir)
    if args.action == "up":
        if host.pidfile.exists():
            print(f"a stand-in host already runs from {args.dir} (run 'down' first)", file=sys.stderr)
            return 1
        host.start(daemon=True)
        if args.ct not in host.containers():
            host.add_container(args.ct)
        print(f"stand-in Proxmox host on 127.0.0.1:{host.port}, CT {args.ct} running, state in {args.dir}",
              file=sys.stderr)
        sys.stdout.write(exports(host, args.ct))
    elif args.action == "env":
        host.port = int((args.dir / "port").read_text())
        sys.stdout.write(exports(host, args.ct))
    else:
        if args.dir.exists():
            host.stop()
            shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
