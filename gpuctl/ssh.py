"""The one SSH session type: one paramiko connection per gpuctl invocation, reused for every remote command.

Host keys are checked like OpenSSH does: an unknown host is refused unless --accept-new-host-key (which records
the key in known_hosts, like StrictHostKeyChecking=accept-new); a changed key is always refused. Keys: --identity,
then ssh_config's IdentityFile, the agent, the default key files. ssh_config's HostName, Port, User, IdentityFile
and UserKnownHostsFile are honoured through paramiko's own SSHConfig.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from typing_extensions import Self

from gpuctl.errors import ExitCode, GpuctlError, usage_error
from gpuctl.target import Target

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # cryptography's deprecation notices are not the user's business
    import paramiko

logging.getLogger("paramiko").addHandler(logging.NullHandler())

RECV_BYTES = 65536


@dataclass
class Stats:
    """What the last connection cost: the benchmark and GPUCTL_TRACE read it."""

    connect_s: float = 0.0
    remote_commands: int = 0


STATS = Stats()


@dataclass(frozen=True)
class Completed:
    rc: int
    stdout: bytes
    stderr: bytes


@dataclass(frozen=True)
class Endpoint:
    """Where the connection really goes, after ssh_config."""

    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...]
    known_hosts: Path
    accept_new: bool

    def describe(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


def host_error(message: str) -> GpuctlError:
    return GpuctlError(message, ExitCode.HOST)


def load_ssh_config(path: str | None) -> paramiko.SSHConfig:
    if path is None:
        default = Path("~/.ssh/config").expanduser()
        return paramiko.SSHConfig.from_path(str(default)) if default.is_file() else paramiko.SSHConfig()
    config_path = Path(path).expanduser()
    if not config_path.is_file():
        raise usage_error(f"--ssh-config: no such file: {config_path}")
    return paramiko.SSHConfig.from_path(str(config_path))


def resolve_endpoint(target: Target) -> Endpoint:
    config = load_ssh_config(target.ssh_config).lookup(target.host)
    if config.get("proxyjump", "none").lower() != "none":
        raise usage_error(f"ssh_config ProxyJump (for {target.host}) is not supported yet; "
                          "connect to the host directly")
    key_files = []
    if target.identity:
        identity = Path(target.identity).expanduser()
        if not identity.is_file():
            raise usage_error(f"--identity: no such key file: {identity}")
        key_files.append(str(identity))
    key_files += [str(Path(p).expanduser()) for p in config.get("identityfile", [])
                  if Path(p).expanduser().is_file()]
    known = config.get("userknownhostsfile", "~/.ssh/known_hosts").split()[0]
    accept_new = target.accept_new_host_key or config.get("stricthostkeychecking", "").lower() in ("accept-new",
                                                                                                   "no", "off")
    port = target.port or int(config.get("port", 22))
    return Endpoint(hostname=config.get("hostname", target.host), port=port,
                    user=target.user or config.get("user", "root"), key_files=tuple(dict.fromkeys(key_files)),
                    known_hosts=Path(known).expanduser(), accept_new=accept_new)


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """An unknown host: refuse with a hint, or (--accept-new-host-key) record its key and go on."""

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if not self.endpoint.accept_new:
            raise host_error(
                f"unknown host key for {hostname} ({key.get_name()} {key.fingerprint}) not in "
                f"{self.endpoint.known_hosts}; check it and re-run with --accept-new-host-key to record it")
        path = self.endpoint.known_hosts
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(path, "a") as f:  # append one line: the rest of the file (hashed entries, comments) stays
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


class Session:
    """An open SSH connection; run() and stream() execute one remote command each."""

    def __init__(self, client: paramiko.SSHClient, endpoint: Endpoint, timeout: float):
        self._client = client
        self.endpoint = endpoint
        self._timeout = timeout

    def _connected(self) -> bool:
        transport = self._client.get_transport()
        return transport is not None and transport.is_active()

    def _open(self, command: str, stdin: bytes) -> paramiko.Channel:
        if not self._connected():
            raise host_error(f"connection to {self.endpoint.describe()} was lost")
        transport = self._client.get_transport()
        STATS.remote_commands += 1
        try:
            chan = transport.open_session(timeout=self._timeout)
            chan.exec_command(command)
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
        except (paramiko.SSHException, OSError) as e:
            raise host_error(f"{self.endpoint.describe()}: cannot run a remote command: {e}") from None
        chan.settimeout(0.5)  # recv wakes up this often, so Ctrl-C is noticed promptly
        return chan

    def stream(self, command: str, stdin: bytes = b"", on_stdout: Callable[[bytes], None] | None = None,
               on_stderr: Callable[[bytes], None] | None = None) -> Completed:
        """Run a command; its output goes to the callbacks as it arrives (else it is collected)."""
        out, err = bytearray(), bytearray()
        on_stdout = on_stdout or out.extend
        on_stderr = on_stderr or err.extend
        chan = self._open(command, stdin)
        try:
            while True:
                try:
                    data = chan.recv(RECV_BYTES)
                except TimeoutError:
                    data = None
                while chan.recv_stderr_ready():
                    on_stderr(chan.recv_stderr(RECV_BYTES))
                if data:
                    on_stdout(data)
                elif data == b"":
                    break  # end of the command's output
                elif not self._connected():
                    raise host_error(f"connection to {self.endpoint.describe()} was lost")
            while True:
                data = chan.recv_stderr(RECV_BYTES)
                if not data:
                    break
                on_stderr(data)
            rc = chan.recv_exit_status()
            if rc == -1 and not self._connected():
                raise host_error(f"connection to {self.endpoint.describe()} was lost")
        finally:
            chan.close()
        return Completed(rc, bytes(out), bytes(err))

    def run(self, command: str, stdin: bytes = b"") -> Completed:
        return self.stream(command, stdin)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(target: Target) -> Session:
    endpoint = resolve_endpoint(target)
    client = paramiko.SSHClient()
    for path in (Path("/etc/ssh/ssh_known_hosts"), endpoint.known_hosts):
        if path.is_file():
            try:
                client.get_host_keys().load(str(path))
            except (OSError, paramiko.SSHException) as e:
                raise host_error(f"cannot read {path}: {e}") from None
    client.set_missing_host_key_policy(_HostKeyPolicy(endpoint))
    where = endpoint.describe()
    started = time.perf_counter()
    try:
        client.connect(endpoint.hostname, port=endpoint.port, username=endpoint.user,
                       key_filename=list(endpoint.key_files) or None, allow_agent=True, look_for_keys=True,
                       timeout=target.connect_timeout, banner_timeout=target.connect_timeout,
                       auth_timeout=target.connect_timeout)
    except GpuctlError:
        client.close()
        raise
    except paramiko.BadHostKeyException as e:
        client.close()
        raise host_error(
            f"host key for {e.hostname} has CHANGED (now {e.key.get_name()} {e.key.fingerprint}); refusing to "
            f"connect. If the host was really re-installed, remove the old key from {endpoint.known_hosts} "
            f"(ssh-keygen -R) and connect again") from None
    except paramiko.AuthenticationException as e:
        client.close()
        tried = ", ".join(endpoint.key_files) or "agent and default keys"
        raise host_error(f"authentication failed for {where} ({e}; tried {tried}); "
                         "pass --identity KEY") from None
    except socket.gaierror as e:
        client.close()
        raise host_error(f"cannot resolve host {endpoint.hostname}: {e.strerror}") from None
    except (paramiko.SSHException, OSError, EOFError) as e:
        client.close()
        reason = str(e) or type(e).__name__
        if isinstance(e, (TimeoutError, socket.timeout)):
            reason = f"no answer within {target.connect_timeout:g} s"
        raise host_error(f"cannot connect to {where}: {reason}") from None
    STATS.connect_s = time.perf_counter() - started
    STATS.remote_commands = 0
    return Session(client, endpoint, target.connect_timeout)


def trace_line() -> str:
    return f"gpuctl: trace: connect {STATS.connect_s * 1000:.0f} ms, {STATS.remote_commands} remote commands"


def tracing() -> bool:
    return os.environ.get("GPUCTL_TRACE", "") not in ("", "0")
