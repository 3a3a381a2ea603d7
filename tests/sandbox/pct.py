"""Stand-in for Proxmox VE's `pct`, installed on the stand-in host's PATH.

Containers are directories under <state>/containers/<CTID>/ (this file is copied to <state>/bin/pct, so the
state dir is found from its own path). Output and errors follow the real `pct`:
`Configuration file 'nodes/pve/lxc/999.conf' does not exist`, `container '201' not running!`, exit 255.

`pct exec` is faithful where gpuctl cares:
- the command runs chrooted into the container's own root, <state>/containers/<CTID>/rootfs, in a private mount
  namespace: the host's system directories (/usr, /etc, the /bin and /lib links, ...) and the interpreter the
  stand-in was started with are bound into it read-only, /dev, /proc and /sys as they are; everything else (HOME
  /root, /workspace, /tmp, any absolute path a run names) is the container's, under the state dir, so nothing a
  run writes reaches the host's own directories; PATH=<ct-bin>:/sbin:/bin:/usr/sbin:/usr/bin;
- it runs in a new session, and when it returns every process still in that session is SIGKILLed: only what was
  started with `setsid` (its own session) survives, like a real `lxc-attach`;
- no PID namespace, so process groups can be signalled from a later exec session.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import subprocess
import sys
import termios
from pathlib import Path

STATE = Path(__file__).resolve().parent.parent
NODE = "pve"
# The host's directories a container sees, read-only: its operating system. Links among them (/bin -> usr/bin on
# a merged-/usr system) are made as links in the container's root.
SYSTEM = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")
# The kernel's file systems, bound as they are (no PID namespace: the host's /proc is the container's).
KERNEL = ("/dev", "/proc", "/sys")
# Where the container's bin dir (python3, nvidia-smi) appears inside `pct exec`.
CT_BIN_MOUNT = "/run/gpuctl-standin-bin"
MARKER = "GPUCTL_STANDIN_CT"


def interpreter_dirs() -> list[str]:
    """The interpreter's directories (written by the stand-in host at start) that SYSTEM does not show already."""
    try:
        dirs = json.loads((STATE / "interpreter.json").read_text())
    except (OSError, ValueError):
        return []
    return [d for d in dirs if not any(d == s or d.startswith(s + "/") for s in SYSTEM)]


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


# mount(2) and unshare(2) flags (<sys/mount.h>, <sched.h>).
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE, CLONE_NEWNS = 1, 32, 4096, 16384, 1 << 18, 0x20000


def root_mounts(ctid: str) -> list[tuple[str, Path, int]]:
    """The binds that make the container's root (host path, mount point in the root, extra flags); the links among
    the system directories and the mount points are made in the root on the way."""
    base = ct_dir(ctid)
    root = base / "rootfs"
    mounts = [(str(base / "bin"), root / CT_BIN_MOUNT.lstrip("/"), MS_RDONLY)]
    for path in SYSTEM:
        inside = root / path.lstrip("/")
        if os.path.islink(path):
            try:
                os.symlink(os.readlink(path), inside)
            except FileExistsError:  # made earlier, or by a pct exec running at the same time
                pass
        elif os.path.isdir(path):
            mounts.append((path, inside, MS_REC | MS_RDONLY))
    mounts += [(path, root / path.lstrip("/"), MS_REC) for path in KERNEL]
    mounts += [(path, root / path.lstrip("/"), MS_RDONLY) for path in interpreter_dirs()]
    for _, mountpoint, _ in mounts:
        mountpoint.mkdir(parents=True, exist_ok=True)
    return mounts


def enter_root(root: Path, mounts: list[tuple[str, Path, int]]) -> None:
    """In the exec's child, before its command starts: a private mount namespace, the binds, chroot to root.
    Calls to libc directly: no unshare, mount or chroot process per exec (gpuctl's latency is measured here)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if os.isatty(0):
        # On a terminal (ssh's pty) the command gets it as its controlling terminal (taken from pct's session),
        # with job control, as lxc-attach gives an exec on a terminal a pty of the container's own.
        fcntl.ioctl(0, termios.TIOCSCTTY, 1)

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"pct exec: {what}")

    check(libc.unshare(CLONE_NEWNS), "unshare")
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making / private")
    for source, mountpoint, flags in mounts:
        target = str(mountpoint).encode()
        check(libc.mount(source.encode(), target, None, MS_BIND | (flags & MS_REC), None), f"binding {source}")
        if flags & MS_RDONLY:
            check(libc.mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None), f"{source} read-only")
    os.chroot(root)
    os.chdir("/root")


def cmd_exec(args: list[str]) -> int:
    ctid = args[0]
    command = args[2:] if args[1:2] == ["--"] else args[1:]
    if not command:
        raise PctError("missing command")
    require_running(ctid)
    root = ct_dir(ctid) / "rootfs"
    (root / "root").mkdir(parents=True, exist_ok=True)
    mounts = root_mounts(ctid)
    # Without sshd's SSH_CLIENT, bash does not read ~/.bashrc (a real container has its own /root, and so does
    # this one: HOME is the container's /root).
    env = {k: v for k, v in os.environ.items() if k not in ("SSH_CLIENT", "SSH2_CLIENT", "SSH_CONNECTION")}
    env.update(PATH=f"{CT_BIN_MOUNT}:/sbin:/bin:/usr/sbin:/usr/bin", HOME="/root", **{MARKER: marker(ctid)})
    try:  # pct is one thread, so a preexec_fn is safe here
        child = subprocess.Popen(command, env=env, start_new_session=True,
                                 preexec_fn=lambda: enter_root(root, mounts))  # noqa: PLW1509
    except OSError as e:  # the command could not start in the container (what bash says of it, and its code)
        print(f"{command[0]}: {e.strerror}", file=sys.stderr)
        return 127 if isinstance(e, FileNotFoundError) else 126
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
