"""The stand-in Proxmox host: a real OpenSSH sshd on 127.0.0.1 with a stand-in `pct` on its PATH.

All of its state lives in one directory (keys, sshd_config, authorized_keys, known_hosts, an ssh_config for
clients, the containers); nothing of the user's ~/.ssh is read or written. Used by the tests (as a library) and
by the demo (`python -m tests.sandbox up|env|down`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_exponential

HERE = Path(__file__).resolve().parent
# The fake trainer's own `--set fake.KEY=VALUE` options (fake_trainer.py), which gpuctl checks like any key: the
# stand-in's config schema (what tests/sandbox/cli.py gives gpuctl) is the trainer's with these added, of any
# scalar type.
FAKE_KEYS = ("steps", "step_s", "exit", "child", "ignore_term", "term_exit", "save_every", "weights_bytes",
             "state_bytes", "export", "require", "exit_seq", "env", "fail_rank", "say", "hold")
ANY_SCALAR = {"type": {"union": ["int", "float", "bool", "str"]}, "name": "a fake trainer option"}


def with_fake_keys(schema: dict) -> dict:
    """A trainer's config schema with the fake trainer's keys added to every task."""
    for task in schema["tasks"].values():
        task["keys"].update({f"fake.{key}": ANY_SCALAR for key in FAKE_KEYS})
    return schema
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
# This machine's settings that its sessions get on the stand-in host too (sshd starts them with an environment of
# its own): how torch's OpenMP threads wait (tests/conftest.py).
PASSED_ON = ("OMP_WAIT_POLICY",)
ALIAS = "gpuctl-standin"
DEFAULT_GPUS = [
    {"name": "NVIDIA H200", "utilization": 97, "memory_used_mib": 81234, "memory_total_mib": 143771},
    {"name": "NVIDIA H200", "utilization": 95, "memory_used_mib": 80012, "memory_total_mib": 143771},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_script(source: Path, target: Path) -> None:
    """Copy a Python script, pointing its shebang at this interpreter (the one that has torch).

    -S: these scripts need only the standard library, and skipping site-packages' start-up hooks keeps the
    stand-in's own overhead out of gpuctl's measured latency.
    """
    target.write_text(f"#!{sys.executable} -S\n" + source.read_text())
    target.chmod(0o755)


def interpreter_dirs() -> list[str]:
    """The directories this interpreter runs from (its prefixes and the directory of its executable, also as
    reached through links): `pct exec` binds them into the container's root (where /usr does not show them
    already: a pyenv under /root, a virtual environment under /tmp), so the container's python3 runs."""
    found = set()
    for path in (sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)):
        found |= {os.path.abspath(path), os.path.realpath(path)}
    # The outermost ones: a directory inside another is shown with it.
    return sorted(d for d in found if not any(d != o and d.startswith(o.rstrip("/") + "/") for o in found))


def _socket_inodes(pid: int) -> set[str]:
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                found.add(link[len("socket:["):-1])
    except OSError:
        pass  # the process went away while we looked
    return found


def _tcp_sockets() -> list[tuple[int, int, str]]:
    """(local port, remote port, inode) of every TCP socket of this machine (IPv4 and IPv6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            found.append((int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16), fields[9]))
    return found


class StandInHost:
    def __init__(self, root: Path | str, log_level: str = "ERROR"):
        self.root = Path(root).resolve()
        self.port: int | None = None
        self.log_level = log_level  # DEBUG1 logs every forwarded (direct-tcpip) connection: a jump host's proof
        self._sshd: subprocess.Popen | None = None

    # Paths of the state dir.
    @property
    def host_key(self) -> Path:
        return self.root / "ssh_host_ed25519_key"

    @property
    def client_key(self) -> Path:
        return self.root / "client_key"

    @property
    def known_hosts(self) -> Path:
        return self.root / "known_hosts"

    @property
    def ssh_config(self) -> Path:
        return self.root / "ssh_config"

    @property
    def pidfile(self) -> Path:
        return self.root / "sshd.pid"

    def start(self, daemon: bool = False) -> StandInHost:
        """Generate keys and config, start sshd; daemon=True leaves it running after this process exits."""
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "bin").mkdir(exist_ok=True)
        (self.root / "containers").mkdir(exist_ok=True)
        (self.root / "home").mkdir(exist_ok=True)
        install_script(HERE / "pct.py", self.root / "bin" / "pct")
        (self.root / "interpreter.json").write_text(json.dumps(interpreter_dirs()))
        for key in (self.host_key, self.client_key):
            if not key.exists():
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpuctl-standin", "-f",
                                str(key)], check=True)
        shutil.copy(self.client_key.with_suffix(".pub"), self.root / "authorized_keys")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        for attempt in range(5):  # a port free a moment ago may be taken (another test session, another worker)
            try:
                self._start_sshd(daemon)
                break
            except (RuntimeError, subprocess.CalledProcessError):
                if attempt == 4:
                    raise
        return self

    def _start_sshd(self, daemon: bool) -> None:
        self.port = free_port()
        (self.root / "sshd_config").write_text(self._sshd_config())
        self.known_hosts.write_text(self.known_hosts_line())
        self.write_ssh_config(self.ssh_config)
        (self.root / "port").write_text(str(self.port))
        cmd = [SSHD, "-f", str(self.root / "sshd_config"), "-E", str(self.root / "sshd.log")]
        if daemon:
            subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
        else:
            self._sshd = subprocess.Popen([*cmd, "-D"], stdin=subprocess.DEVNULL)
        self._wait_listening()

    @retry(stop=stop_after_delay(10), wait=wait_exponential(multiplier=0.01, max=0.2),
           retry=retry_if_exception_type(OSError), reraise=True)
    def _wait_listening(self) -> None:
        if self._sshd is not None and self._sshd.poll() is not None:
            raise RuntimeError(f"sshd exited: {(self.root / 'sshd.log').read_text()[-2000:]}")
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
            s.recv(4)  # the server's banner: sshd is really serving

    def _sshd_config(self) -> str:
        return "\n".join([
            f"Port {self.port}",
            "ListenAddress 127.0.0.1",
            f"HostKey {self.host_key}",
            f"PidFile {self.pidfile}",
            f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
            "StrictModes no",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "MaxStartups 100:30:200",
            "MaxSessions 100",
            f"LogLevel {self.log_level}",
            # HOME in the state dir: the shell sshd starts reads no dotfiles of the machine's real root.
            f"SetEnv PATH={self.root / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin HOME={self.root / 'home'}"
            + "".join(f" {name}={os.environ[name]}" for name in PASSED_ON if name in os.environ),
            "",
        ])

    def known_hosts_line(self, port: int | None = None) -> str:
        """This server's known_hosts line, as reached at `port` (another port forwards to it)."""
        key_type, key_b64 = self.host_key.with_suffix(".pub").read_text().split()[:2]
        return f"[127.0.0.1]:{port or self.port} {key_type} {key_b64}\n"

    def ssh_config_entry(self, alias: str = ALIAS, known_hosts: Path | None = None, port: int | None = None,
                         extra: tuple[str, ...] = ()) -> str:
        """A Host block for this server (reached at `port`, when a forwarder stands in front of it)."""
        lines = [f"Host {alias}", "    HostName 127.0.0.1", f"    Port {port or self.port}", "    User root",
                 f"    IdentityFile {self.client_key}",
                 f"    UserKnownHostsFile {known_hosts or self.known_hosts}", *(f"    {e}" for e in extra), ""]
        return "\n".join(lines)

    def write_ssh_config(self, path: Path, known_hosts: Path | None = None, alias: str = ALIAS) -> Path:
        """An ssh_config with a Host alias for this server; known_hosts defaults to the pre-filled one."""
        path.write_text(self.ssh_config_entry(alias, known_hosts))
        return path

    def env(self, ctid: int | None = None) -> dict[str, str]:
        """The environment that points gpuctl at this host (and container)."""
        env = {"GPUCTL_SSH_CONFIG": str(self.ssh_config), "GPUCTL_HOST": ALIAS}
        if ctid is not None:
            env["GPUCTL_CT"] = str(ctid)
        return env

    def stop(self) -> None:
        for ctid in self.containers():
            self.kill_container_processes(ctid)
        if self._sshd is not None:
            self._sshd.terminate()
            self._sshd.wait(timeout=10)
            self._sshd = None
        elif self.pidfile.exists():
            try:
                os.kill(int(self.pidfile.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass

    @property
    def log(self) -> Path:
        return self.root / "sshd.log"

    def connection_processes(self, client_pid: int) -> list[int]:
        """The per-connection sshd processes serving the connections process client_pid has open to this sshd
        (found through /proc: the client's sockets, their ports, the server side's sockets). Never the listener."""
        sockets = _tcp_sockets()
        client_inodes = _socket_inodes(client_pid)
        client_ports = {local for local, remote, inode in sockets if inode in client_inodes and remote == self.port}
        server_inodes = {inode for local, remote, inode in sockets if local == self.port and remote in client_ports}
        listener = self._sshd.pid if self._sshd else int(self.pidfile.read_text()) if self.pidfile.exists() else None
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != listener and _socket_inodes(int(entry)) & server_inodes:
                found.append(int(entry))
        return found

    def drop_connections(self, client_pid: int) -> list[int]:
        """Cut process client_pid's connections to this sshd the hard way: SIGKILL their sshd processes."""
        killed = self.connection_processes(client_pid)
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return killed

    # Containers.
    def ct_dir(self, ctid: int) -> Path:
        return self.root / "containers" / str(ctid)

    def containers(self) -> list[int]:
        root = self.root / "containers"
        return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []

    def add_container(self, ctid: int, running: bool = True, gpus: list[dict] | None = None) -> Path:
        base = self.ct_dir(ctid)
        for sub in ("rootfs/root/gpuctl", "rootfs/workspace", "rootfs/tmp", "bin"):
            (base / sub).mkdir(parents=True, exist_ok=True)
        # A wrapper, not a symlink: a virtualenv's interpreter must be started by its own path.
        python = base / "bin" / "python3"
        python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
        python.chmod(0o755)
        install_script(HERE / "nvidia_smi.py", base / "bin" / "nvidia-smi")
        install_script(HERE / "fake_trainer.py", base / "bin" / "fake-trainer")
        self.set_gpus(ctid, DEFAULT_GPUS if gpus is None else gpus)
        conf = {"status": "running" if running else "stopped", "hostname": f"ct{ctid}"}
        (base / "conf.json").write_text(json.dumps(conf))
        return base

    def set_gpus(self, ctid: int, gpus: list[dict]) -> None:
        (self.ct_dir(ctid) / "bin" / "gpus.json").write_text(json.dumps(gpus))

    def hang_gpus(self, ctid: int) -> None:
        """From now on the container's nvidia-smi never answers (a wedged driver)."""
        (self.ct_dir(ctid) / "bin" / "hang").touch()

    def path_in(self, ctid: int, path: str) -> Path:
        """The host path of a path inside the container."""
        return self.ct_dir(ctid) / "rootfs" / path.lstrip("/")

    def pct_calls(self, ctid: int) -> list[list[str]]:
        """Every pct call made for container ctid (its argv), in order: the stand-in's pct logs each."""
        log = self.root / "pct.log"
        calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        return [argv for argv in calls if argv[1:2] == [str(ctid)]]

    def pct(self, *args: str) -> subprocess.CompletedProcess:
        """Run the stand-in pct directly (not over ssh), e.g. to stop a container."""
        return subprocess.run([str(self.root / "bin" / "pct"), *args], check=False, capture_output=True, text=True)

    def start_detached(self, ctid: int, command: str) -> int:
        """Start `command` in the container with setsid (as a user would by hand); return its pid.

        The exec returns only once the process leads its own session: before that, the end of the exec
        session would kill it (the race gpuctl's launch closes with a handshake).
        """
        script = (f"setsid {command} </dev/null >/dev/null 2>&1 & p=$!; "
                  'until [ "$(ps -o sid= -p $p | tr -d " ")" = "$p" ]; do :; done; echo $p')
        result = self.pct("exec", str(ctid), "--", "/bin/bash", "-c", script)
        return int(result.stdout)

    def container_processes(self, ctid: int) -> list[int]:
        needle = f"GPUCTL_STANDIN_CT={self.root}:{ctid}".encode() + b"\0"
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        if needle in f.read():
                            found.append(int(entry))
                except OSError:
                    pass
        return found

    def kill_container_processes(self, ctid: int) -> None:
        for pid in self.container_processes(ctid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
