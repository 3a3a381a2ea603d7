"""The one SSH session type: one paramiko connection per gpuctl invocation, reused for every remote command.

Host keys are checked like OpenSSH does, for every hop: an unknown host is refused unless --accept-new-host-key
(which records the key in known_hosts, like StrictHostKeyChecking=accept-new); a changed key is always refused.
Keys: --identity, then ssh_config's IdentityFile, the agent, the default key files. ssh_config's HostName, Port,
User, IdentityFile, UserKnownHostsFile and ProxyJump are honoured through paramiko's own SSHConfig; a jump is a
direct-tcpip channel through the previous hop's transport, used as the socket of the next connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from typing_extensions import Self

from gpuctl.address import Address, parse_address_arg
from gpuctl.errors import ExitCode, GpuctlError, usage_error


def _import_paramiko():
    """paramiko without invoke (a third of its import: yaml, asyncio, unittest.mock), which paramiko.config wants
    only to run `Match exec`: load_ssh_config brings it in for a config that has one."""
    blocked = "invoke" not in sys.modules
    if blocked:
        sys.modules["invoke"] = None  # `import invoke` raises ImportError: paramiko.config records it as missing
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # cryptography's deprecation notices are not the user's business
            import paramiko
    finally:
        if blocked and sys.modules.get("invoke", 0) is None:
            del sys.modules["invoke"]
    return paramiko


paramiko = _import_paramiko()
MATCH_EXEC = re.compile(r"^\s*match\b.*\bexec\b", re.IGNORECASE | re.MULTILINE)
logging.getLogger("paramiko").addHandler(logging.NullHandler())

RECV_BYTES = 65536
SEND_CHUNK = 32768
MAX_JUMPS = 8
KEEPALIVE_S = 15  # every transport sends an SSH keepalive this often, so a NAT or firewall keeps the link open
STDERR_CAP = 64 * 1024  # what is kept of a remote command's stderr (its heartbeats not counted)
STDOUT_CAP = 256 * 1024 * 1024  # what one remote command's stdout may fill when collected (not streamed)
HEARTBEAT = b"@@alive\n"  # what the container's scripts write on stderr while they work (templates/lib.sh.j2)


def env_seconds(name: str, default: float) -> float:
    """A time limit from the environment (tests give small ones), else its default."""
    return float(os.environ.get(name, default))


# The container's scripts send a heartbeat this often; no byte (output or heartbeat) from a remote command for
# IDLE_S means the host or the link is dead (exit 3).
HEARTBEAT_S = env_seconds("GPUCTL_HEARTBEAT", 5)
IDLE_S = env_seconds("GPUCTL_IDLE_TIMEOUT", max(30, 4 * HEARTBEAT_S))


@dataclass
class Stats:
    """What a session cost (GPUCTL_TRACE and the benchmark read it from the session); a reconnect counts on."""

    connect_s: float = 0.0  # the latest connection's
    remote_commands: int = 0
    sent: Counter = field(default_factory=Counter)  # bytes written to remote commands' stdin, by kind
    received: int = 0  # bytes read from remote commands' stdout and stderr


@dataclass(frozen=True)
class Completed:
    rc: int
    stdout: bytes
    stderr: bytes


@dataclass(frozen=True)
class Endpoint:
    """Where a connection really goes, after ssh_config; `jump` is the hop it goes through, if any."""

    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...]
    known_hosts: Path
    accept_new: bool
    jump: Endpoint | None = None

    def describe(self) -> str:
        where = f"{self.user}@{self.hostname}:{self.port}"
        return f"{where} (through {self.jump.describe()})" if self.jump else where


def host_error(message: str) -> GpuctlError:
    return GpuctlError(message, ExitCode.HOST)


class ConnectionLost(GpuctlError):
    """An established connection dropped or went silent: a follower may reconnect and go on."""

    def __init__(self, message: str):
        super().__init__(message, ExitCode.HOST)


class TooMuch(GpuctlError):
    """A remote command sent more than gpuctl keeps of its output: it fails, and nothing unbounded is held."""

    def __init__(self, message: str):
        super().__init__(message, ExitCode.RUN_FAILED)


class Unreachable(GpuctlError):
    """The host did not answer (as opposed to a refused login or host key): worth trying again later."""

    def __init__(self, message: str):
        super().__init__(message, ExitCode.HOST)


def load_ssh_config(path: str | None) -> paramiko.SSHConfig:
    config_path = Path(path or "~/.ssh/config").expanduser()
    if not config_path.is_file():
        if path is None:
            return paramiko.SSHConfig()
        raise usage_error(f"--ssh-config: no such file: {config_path}")
    text = config_path.read_text(errors="replace")
    if MATCH_EXEC.search(text) and paramiko.config.invoke is None:
        with contextlib.suppress(ImportError):  # without invoke, paramiko says so when it meets the Match
            import invoke
            paramiko.config.invoke = invoke
    return paramiko.SSHConfig.from_text(text)


def resolve_endpoint(address: Address) -> Endpoint:
    """The address's endpoint: the command line's port, user and identity win over its ssh_config entry."""
    config = load_ssh_config(address.ssh_config)
    identity = None
    if address.identity:
        identity = Path(address.identity).expanduser()
        if not identity.is_file():
            raise usage_error(f"--identity: no such key file: {identity}")
    return _endpoint(config, address.host, port=address.port, user=address.user, identity=identity,
                     accept_new=address.accept_new_host_key, hops=0)


def _endpoint(config: paramiko.SSHConfig, host: str, *, port: int | None, user: str | None,
              identity: Path | None, accept_new: bool, hops: int, jump: Endpoint | None = None) -> Endpoint:
    found = config.lookup(host)
    if found.get("proxycommand", "none").lower() != "none":
        raise usage_error(f"ssh_config ProxyCommand (for {host}) is not supported: use ProxyJump")
    key_files = [str(identity)] if identity else []
    key_files += [str(Path(p).expanduser()) for p in found.get("identityfile", [])
                  if Path(p).expanduser().is_file()]
    known = found.get("userknownhostsfile", "~/.ssh/known_hosts").split()[0]
    accept_new = accept_new or found.get("stricthostkeychecking", "").lower() in ("accept-new", "no", "off")
    spec = found.get("proxyjump", "none")
    if jump is None and spec.lower() != "none":
        jump = _jump_chain(config, spec, accept_new, hops + 1)
    return Endpoint(hostname=found.get("hostname", host), port=port or int(found.get("port", 22)),
                    user=user or found.get("user", "root"), key_files=tuple(dict.fromkeys(key_files)),
                    known_hosts=Path(known).expanduser(), accept_new=accept_new, jump=jump)


def _jump_chain(config: paramiko.SSHConfig, spec: str, accept_new: bool, hops: int) -> Endpoint:
    """`ProxyJump a,b`: a is reached as configured (its own ProxyJump included), b through a (like ssh -J)."""
    if hops > MAX_JUMPS:
        raise usage_error(f"ssh_config ProxyJump: more than {MAX_JUMPS} hops (a loop?)")
    jump = None
    for hop in (h.strip() for h in spec.split(",")):
        try:
            parts = parse_address_arg(hop.removeprefix("ssh://"))
        except GpuctlError:
            raise usage_error(f"ssh_config ProxyJump: cannot read the hop {hop!r} ([USER@]HOST[:PORT])") from None
        if "ct" in parts:
            raise usage_error(f"ssh_config ProxyJump: cannot read the hop {hop!r} ([USER@]HOST[:PORT])")
        jump = _endpoint(config, parts["host"], port=parts.get("port"), user=parts.get("user"), identity=None,
                         accept_new=accept_new, hops=hops, jump=jump)
    return jump


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


class RemoteCommand:
    """One remote command in progress: write to its stdin as the conversation goes, read its output."""

    def __init__(self, chan: paramiko.Channel, session: Session):
        self._chan = chan
        self._session = session
        self._pending = bytearray()  # stdout read past a marker, for the next reader
        self.stderr = bytearray()  # at most STDERR_CAP bytes, without the heartbeats
        bound = session.bound_s
        self._deadline = time.monotonic() + bound if bound else None

    def send(self, data: bytes, kind: str = "script", progress: Callable[[int], None] | None = None) -> int:
        """Write to the command's stdin; returns the bytes written (all of data: a failed write raises), which
        the session's stats count under `kind`."""
        start, moved = 0, time.monotonic()
        while start < len(data):
            try:
                n = self._chan.send(data[start:start + SEND_CHUNK])
            except TimeoutError:  # the channel's window is full: the far end reads nothing
                if time.monotonic() - moved > self._session.idle_s:
                    raise self._session.lost(f"nothing could be written for {self._session.idle_s:g} s") from None
                continue
            except (OSError, EOFError, paramiko.SSHException) as e:
                raise self._session.lost(f"writing to the remote command failed: {e or type(e).__name__}")
            if n <= 0:
                raise self._session.lost("writing to the remote command failed: the channel is closed")
            start, moved = start + n, time.monotonic()
            self._session.stats.sent[kind] += n
            if progress:
                progress(n)
        return len(data)

    def close_stdin(self) -> None:
        try:
            self._chan.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass  # the command already ended; finish() tells how

    def read_until(self, marker: bytes) -> tuple[bytes, bool]:
        """stdout up to and including `marker`; (everything, False) when the output ends without it."""
        buf = bytearray(self._pending)
        self._pending.clear()

        def found() -> bool:
            return marker in buf

        ended = found() or self._pump(self._collect(buf), self._keep_stderr, idle_timeout=None, stop=found)
        if ended and not found():
            return bytes(buf), False
        end = buf.index(marker) + len(marker)
        self._pending.extend(buf[end:])
        return bytes(buf[:end]), True

    def finish(self, on_stdout: Callable[[bytes], None] | None = None,
               on_stderr: Callable[[bytes], None] | None = None, idle_timeout: float | None = None) -> Completed:
        """Read the rest of the output (to the callbacks, else collected) and the exit status."""
        out = bytearray()
        on_stdout = on_stdout or self._collect(out)

        def on_err(data: bytes) -> None:  # always kept too: the caller's error message may need it
            self._keep_stderr(data)
            if on_stderr:
                on_stderr(data)

        try:
            if self._pending:
                on_stdout(bytes(self._pending))
                self._pending.clear()
            self._pump(on_stdout, on_err, idle_timeout, stop=None)
            while (data := self._recv(stderr=True)) != b"":
                if data:
                    on_err(data)
            if not self._chan.status_event.wait(self._session.idle_s):
                raise self._session.lost(f"no exit status within {self._session.idle_s:g} s of the output's end")
            rc = self._chan.recv_exit_status()
            if rc == -1 and self._session.dropped():
                raise self._session.lost("the connection dropped")
        finally:
            try:
                self._chan.close()
            except (OSError, EOFError, paramiko.SSHException):
                pass  # the connection is gone: what ended the command says so
        return Completed(rc, bytes(out), bytes(self.stderr))

    def _collect(self, buf: bytearray) -> Callable[[bytes], None]:
        """A writer of stdout into buf that fails, in one line, past STDOUT_CAP."""
        def extend(data: bytes) -> None:
            if len(buf) + len(data) > STDOUT_CAP:
                raise TooMuch(f"{self._session.endpoint.describe()}: a remote command sent more than "
                              f"{STDOUT_CAP >> 20} MiB of output; gpuctl stopped reading it")
            buf.extend(data)
        return extend

    def _keep_stderr(self, data: bytes) -> None:
        data = data.replace(HEARTBEAT, b"")
        if len(self.stderr) + len(data) > STDERR_CAP:
            raise TooMuch(f"{self._session.endpoint.describe()}: a remote command wrote more than "
                          f"{STDERR_CAP >> 10} KiB on stderr; gpuctl stopped reading it")
        self.stderr.extend(data)

    def _recv(self, stderr: bool = False) -> bytes | None:
        """One read of the command's stdout (or stderr): b"" at its end, None when nothing came within the channel's
        timeout. A read may make paramiko write (a window adjustment), which fails on a dead link: a lost
        connection, like any other failed read."""
        try:
            data = (self._chan.recv_stderr if stderr else self._chan.recv)(RECV_BYTES)
        except TimeoutError:
            return None
        except (OSError, EOFError, paramiko.SSHException) as e:
            raise self._session.lost(f"reading from the remote command failed: {e or type(e).__name__}") from None
        self._session.stats.received += len(data)
        return data

    def _pump(self, on_stdout: Callable[[bytes], None], on_stderr: Callable[[bytes], None],
              idle_timeout: float | None, stop: Callable[[], bool] | None) -> bool:
        """Pass output on until stdout ends (True) or stop() holds (False). Silence longer than idle_timeout (the
        session's idle deadline when None: every container script sends heartbeats) means the link or the host
        is dead even if TCP has not noticed yet; the session's bound, when it has one, ends a command that
        takes longer."""
        idle_timeout = idle_timeout or self._session.idle_s
        heard = time.monotonic()
        while True:
            data = self._recv()
            while self._chan.recv_stderr_ready():
                on_stderr(self._recv(stderr=True) or b"")
                heard = time.monotonic()
            if data:
                on_stdout(data)
                heard = time.monotonic()
            elif data == b"":
                return True  # end of the command's output (or of the connection: finish() tells which)
            elif not self._session.connected():
                raise self._session.lost("the connection dropped")
            elif idle_timeout and time.monotonic() - heard > idle_timeout:
                raise self._session.lost(f"nothing heard for {idle_timeout:g} s")
            if self._deadline is not None and time.monotonic() > self._deadline:
                raise host_error(f"{self._session.endpoint.describe()}: the remote command did not finish "
                                 f"within {self._session.bound_s:g} s")
            if stop and stop():
                return False


class Session:
    """An open SSH connection (and the jump hosts' connections under it)."""

    def __init__(self, client: paramiko.SSHClient, endpoint: Endpoint, timeout: float, stats: Stats,
                 jumps: list[paramiko.SSHClient] | None = None, bound_s: float | None = None):
        self._client = client
        self._jumps = jumps or []
        self.endpoint = endpoint
        self._timeout = timeout
        self.stats = stats
        self.idle_s = IDLE_S
        self.bound_s = bound_s  # when set, every remote command must end within it (status, runs, kill, doctor)

    def connected(self) -> bool:
        transport = self._client.get_transport()
        return transport is not None and transport.is_active()

    def dropped(self, wait_s: float = 1.0) -> bool:
        """Whether the connection is gone; paramiko closes the channels a moment before it says so."""
        deadline = time.monotonic() + wait_s
        while self.connected():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def lost(self, why: str) -> ConnectionLost:
        return ConnectionLost(f"connection to {self.endpoint.describe()} lost: {why}")

    def start(self, command: str) -> RemoteCommand:
        """Start a remote command; talk to it through the RemoteCommand."""
        if not self.connected():
            raise self.lost("the connection dropped")
        transport = self._client.get_transport()
        self.stats.remote_commands += 1
        # paramiko waits for the server's answer to exec without a bound: a host that froze would hold it forever,
        # so the transport is closed (the wait ends, the connection is lost) if no answer comes within idle_s.
        watchdog = threading.Timer(self.idle_s, transport.close)
        watchdog.daemon = True
        try:
            chan = transport.open_session(timeout=self._timeout)
            watchdog.start()
            chan.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError) as e:
            if self.dropped():
                raise self.lost(str(e) or type(e).__name__) from None
            raise host_error(f"{self.endpoint.describe()}: cannot run a remote command: {e}") from None
        finally:
            watchdog.cancel()
        chan.settimeout(0.5)  # recv wakes up this often, so Ctrl-C and a dead link are noticed promptly
        return RemoteCommand(chan, self)

    def stream(self, command: str, stdin: bytes = b"", on_stdout: Callable[[bytes], None] | None = None,
               on_stderr: Callable[[bytes], None] | None = None, idle_timeout: float | None = None) -> Completed:
        """Run a command with this stdin; its output goes to the callbacks as it arrives (else it is collected)."""
        remote = self.start(command)
        if stdin:
            remote.send(stdin)
        remote.close_stdin()
        return remote.finish(on_stdout, on_stderr, idle_timeout)

    def run(self, command: str, stdin: bytes = b"") -> Completed:
        return self.stream(command, stdin)

    def close(self) -> None:
        for client in [self._client, *reversed(self._jumps)]:
            client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _login(endpoint: Endpoint, timeout: float, opened: list[paramiko.SSHClient]) -> paramiko.SSHClient:
    """Connect and log in to endpoint, through its jump hosts first; every client opened goes to `opened`."""
    sock = None
    if endpoint.jump is not None:
        via = _login(endpoint.jump, timeout, opened)
        try:
            sock = via.get_transport().open_channel("direct-tcpip", (endpoint.hostname, endpoint.port),
                                                    ("127.0.0.1", 0), timeout=timeout)
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise Unreachable(f"cannot reach {endpoint.hostname}:{endpoint.port} through "
                              f"{endpoint.jump.describe()}: {e or type(e).__name__}") from None
    client = paramiko.SSHClient()
    opened.append(client)
    for path in (Path("/etc/ssh/ssh_known_hosts"), endpoint.known_hosts):
        if path.is_file():
            try:
                client.get_host_keys().load(str(path))
            except (OSError, paramiko.SSHException) as e:
                raise host_error(f"cannot read {path}: {e}") from None
    client.set_missing_host_key_policy(_HostKeyPolicy(endpoint))
    where = endpoint.describe()
    try:
        client.connect(endpoint.hostname, port=endpoint.port, username=endpoint.user,
                       key_filename=list(endpoint.key_files) or None, allow_agent=True, look_for_keys=True,
                       timeout=timeout, banner_timeout=timeout, auth_timeout=timeout, sock=sock)
    except paramiko.BadHostKeyException as e:
        raise host_error(
            f"host key for {e.hostname} has CHANGED (now {e.key.get_name()} {e.key.fingerprint}); refusing to "
            f"connect. If the host was really re-installed, remove the old key from {endpoint.known_hosts} "
            f"(ssh-keygen -R) and connect again") from None
    except paramiko.AuthenticationException as e:
        tried = ", ".join(endpoint.key_files) or "agent and default keys"
        raise host_error(f"authentication failed for {where} ({e}; tried {tried}); "
                         "pass --identity KEY") from None
    except socket.gaierror as e:
        raise Unreachable(f"cannot resolve host {endpoint.hostname}: {e.strerror}") from None
    except (paramiko.SSHException, OSError, EOFError) as e:
        reason = str(e) or type(e).__name__
        if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError):
            reason = "connection refused"
        elif isinstance(e, (TimeoutError, socket.timeout)):
            reason = f"no answer within {timeout:g} s"
        raise Unreachable(f"cannot connect to {where}: {reason}") from None
    client.get_transport().set_keepalive(KEEPALIVE_S)
    return client


def connect(address: Address, stats: Stats | None = None, bound_s: float | None = None) -> Session:
    """Connect to the address. The session counts what it costs into `stats` when given (a reconnect passes the
    lost session's, so the counts go on), else into fresh Stats; `bound_s`: each remote command's bound."""
    endpoint = resolve_endpoint(address)
    opened: list[paramiko.SSHClient] = []
    started = time.perf_counter()
    try:
        client = _login(endpoint, address.connect_timeout, opened)
    except BaseException:
        for client in reversed(opened):
            client.close()
        raise
    if stats is None:
        stats = Stats()
    stats.connect_s = time.perf_counter() - started
    return Session(client, endpoint, address.connect_timeout, stats, jumps=opened[:-1], bound_s=bound_s)


def trace_line(stats: Stats) -> str:
    sent = ", ".join(f"{kind} {n} B" for kind, n in sorted(stats.sent.items())) or "nothing"
    return (f"gpuctl: trace: connect {stats.connect_s * 1000:.0f} ms, {stats.remote_commands} remote commands, "
            f"sent: {sent}; received {stats.received} B")


def tracing() -> bool:
    return os.environ.get("GPUCTL_TRACE", "") not in ("", "0")
