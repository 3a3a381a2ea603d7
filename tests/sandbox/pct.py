"""Stand-in for Proxmox VE's `pct`, installed on the stand-in host's PATH.

Containers are directories under <state>/containers/<CTID>/ (this file is copied to <state>/bin/pct, so the
state dir is found from its own path). Output and errors follow the real `pct`:
`Configuration file 'nodes/pve/lxc/999.conf' does not exist`, `container '201' not running!`, exit 255.

`pct exec` is faithful where gpuctl cares:
- the command runs in a private mount namespace where the container's own directories are bind-mounted over
  /root/gpuctl, /workspace and /tmp, with PATH=<ct-bin>:/sbin:/bin:/usr/sbin:/usr/bin;
- it runs in a new session, and when it returns every process still in that session is SIGKILLed: only what was
  started with `setsid` (its own session) survives, like a real `lxc-attach`;
- no PID namespace, so process groups can be signalled from a later exec session.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

STATE = Path(__file__).resolve().parent.parent
NODE = "pve"
# Paths of a container that `pct exec` shows from the container's own directories.
MOUNTED = ("/root/gpuctl", "/workspace", "/tmp")
# Where the container's bin dir (python3, nvidia-smi) appears inside `pct exec`; outside /tmp so that binding
# the container's /tmp does not hide it.
CT_BIN_MOUNT = "/run/gpuctl-standin-bin"
MARKER = "GPUCTL_STANDIN_CT"
INTERPRETER_ASIDE = "/run/gpuctl-standin-python"


def hidden_interpreter_dirs() -> list[str]:
    """The interpreter's directories (written by the stand-in host at start) that a mounted path would hide."""
    try:
        dirs = json.loads((STATE / "interpreter.json").read_text())
    except (OSError, ValueError):
        return []
    return [d for d in dirs if any(d == m or d.startswith(m + "/") for m in MOUNTED)]


class PctError(Exception):
    pass


def ct_dir(ctid: str) -> Path:
    if not ctid.isdigit() or not (STATE / "containers" / ctid / "conf.json").is_file():
        raise PctError(f"Configuration file 'nodes/{NODE}/lxc/{ctid}.conf' does not exist")
    return STATE / "containers" / ctid


def read_conf(ctid: str) -> dict:
    return json.loads((ct_dir(ctid) / "conf.json").read_text())


def write_conf(ctid: str, conf: dict) -> None:
    path = ct_dir(ctid) / "conf.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(conf))
    os.replace(tmp, path)


def require_running(ctid: str) -> None:
    if read_conf(ctid)["status"] != "running":
        raise PctError(f"container '{ctid}' not running!")


def marker(ctid: str) -> str:
    return f"{STATE}:{ctid}"


def processes_where(predicate) -> list[int]:
    """Pids (other than ours) whose /proc entry satisfies predicate(pid)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if predicate(int(entry)):
                    found.append(int(entry))
            except OSError:
                pass  # the process went away while we looked
    return found


def session_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[3])  # field 6 of stat: session id


def in_container(ctid: str):
    needle = f"{MARKER}={marker(ctid)}".encode() + b"\0"

    def test(pid: int) -> bool:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read()

    return test


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def cmd_list(args: list[str]) -> int:
    print(f"{'VMID':<10} {'Status':<10} {'Lock':<12} {'Name':<20}")
    root = STATE / "containers"
    for ctid in sorted((p.name for p in root.iterdir() if p.name.isdigit()), key=int) if root.is_dir() else []:
        conf = read_conf(ctid)
        print(f"{ctid:<10} {conf['status']:<10} {'':<12} {conf.get('hostname', 'ct' + ctid):<20}")
    return 0


def cmd_status(args: list[str]) -> int:
    print(f"status: {read_conf(args[0])['status']}")
    return 0


def cmd_start(args: list[str]) -> int:
    conf = read_conf(args[0])
    if conf["status"] == "running":
        raise PctError(f"CT {args[0]} already running")
    conf["status"] = "running"
    write_conf(args[0], conf)
    return 0


def cmd_stop(args: list[str]) -> int:
    conf = read_conf(args[0])
    if conf["status"] != "running":
        raise PctError(f"CT {args[0]} not running")
    kill_all(processes_where(in_container(args[0])))
    conf["status"] = "stopped"
    write_conf(args[0], conf)
    return 0


def host_path(ctid: str, path: str) -> Path:
    """Where a path inside the container lives on the host."""
    if not path.startswith("/"):
        raise PctError(f"path '{path}' must be absolute")
    return ct_dir(ctid) / "rootfs" / path.lstrip("/")


def cmd_push(args: list[str]) -> int:
    ctid, src, dst = args[:3]
    require_running(ctid)
    target = host_path(ctid, dst)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(Path(src).read_bytes())
    return 0


def cmd_pull(args: list[str]) -> int:
    ctid, src, dst = args[:3]
    require_running(ctid)
    source = host_path(ctid, src)
    if not source.is_file():
        raise PctError(f"failed to open {src} for reading")
    Path(dst).write_bytes(source.read_bytes())
    return 0


def cmd_exec(args: list[str]) -> int:
    ctid = args[0]
    command = args[2:] if args[1:2] == ["--"] else args[1:]
    if not command:
        raise PctError("missing command")
    base = ct_dir(ctid)
    require_running(ctid)
    binds = [(base / "bin", CT_BIN_MOUNT)] + [(base / "rootfs" / p.lstrip("/"), p) for p in MOUNTED]
    for source, mountpoint in binds:
        source.mkdir(parents=True, exist_ok=True)
        os.makedirs(mountpoint, exist_ok=True)  # an empty mount point on the host
    # /tmp is bound last: the state dir may itself live under the host's /tmp.
    steps = [f'mount --bind "${i + 1}" {m}' for i, (_, m) in enumerate(binds)]
    # The interpreter the stand-in was started with (the container's python3 runs it) stays visible where a
    # mounted path would hide it: bound aside before the mounts, back in its place after them.
    for i, path in enumerate(hidden_interpreter_dirs()):
        aside = f"{INTERPRETER_ASIDE}/{i}"
        os.makedirs(aside, exist_ok=True)
        steps.insert(0, f"mount --bind {shlex.quote(path)} {aside}")
        steps.append(f"mkdir -p {shlex.quote(path)} && mount --bind {aside} {shlex.quote(path)}")
    setup = " && ".join(steps)
    # Without sshd's SSH_CLIENT, bash does not read ~/.bashrc: this machine's own /root/.bashrc is not the
    # container's (a real container has its own /root).
    env = {k: v for k, v in os.environ.items() if k not in ("SSH_CLIENT", "SSH2_CLIENT", "SSH_CONNECTION")}
    env.update(PATH=f"{CT_BIN_MOUNT}:/sbin:/bin:/usr/sbin:/usr/bin", HOME="/root", **{MARKER: marker(ctid)})
    child = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "--", "/bin/bash", "-c",
         f'{setup} && shift {len(binds)} && cd /root && exec "$@"', "pct-exec", *(str(s) for s, _ in binds),
         *command],
        env=env, start_new_session=True,
    )
    # The ssh channel going away (SIGHUP/SIGTERM to us) ends the exec like a normal return.
    for sig in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, lambda *_: child.kill())
    try:
        code = child.wait()
    finally:
        # The session dies with the exec: only what left it (setsid) survives.
        kill_all(processes_where(lambda pid: session_of(pid) == child.pid))
    return code if code >= 0 else 128 - code


COMMANDS = {"list": cmd_list, "status": cmd_status, "start": cmd_start, "stop": cmd_stop, "exec": cmd_exec,
            "push": cmd_push, "pull": cmd_pull}
MIN_ARGS = {"list": 0, "status": 1, "start": 1, "stop": 1, "exec": 1, "push": 3, "pull": 3}


def log_call(argv: list[str]) -> None:
    """Every call, one JSON line in <state>/pct.log (StandInHost.pct_calls reads it): what reached the host."""
    with open(STATE / "pct.log", "a") as f:
        f.write(json.dumps(argv) + "\n")


def main(argv: list[str]) -> int:
    log_call(argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"ERROR: unknown command 'pct {' '.join(argv[:1])}'", file=sys.stderr)
        return 255
    name, args = argv[0], argv[1:]
    if len(args) < MIN_ARGS[name]:
        print("400 not enough arguments", file=sys.stderr)
        return 255
    try:
        return COMMANDS[name](args)
    except PctError as e:
        print(e, file=sys.stderr)
        return 255


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
