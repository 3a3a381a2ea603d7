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
from gpuctl.timeouts import timeouts


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
# What every remote command echoes first, from the host's login shell (Session.start): a shell that refuses the
# login (nologin, /bin/sync, a forced command) never runs the command, so the marker never comes. Output before
# it is the shell's own (a banner) and passes on to nobody (LOGIN_SAID_CAP bytes of it at most).
LOGIN_MARK = b"@@gpuctl\n"
LOGIN_SAID_CAP = 4096


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
    started: bool = False  # a container script's first heartbeat came: pct ran it (templates/lib.sh.j2)


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


class CommandEnded(GpuctlError):
    """A remote command ended while it was still being written to; its exit status and stderr say why."""

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


def load_ssh_config(path: str | None, origin: str = "") -> paramiko.SSHConfig:
    """origin: where the path came from, when not the command line (Address.origin)."""
    config_path = Path(path or "~/.ssh/config").expanduser()
    if not config_path.is_file():
        if path is None:
            return paramiko.SSHConfig()
        raise usage_error(f"--ssh-config{origin}: no such file: {config_path}")
    text = config_path.read_text(errors="replace")
    if MATCH_EXEC.search(text) and paramiko.config.invoke is None:
        with contextlib.suppress(ImportError):  # without invoke, paramiko says so when it meets the Match
            import invoke
            paramiko.config.invoke = invoke
    return paramiko.SSHConfig.from_text(text)


def resolve_endpoint(address: Address) -> Endpoint:
    """The address's endpoint: the command line's port, user and identity win over its ssh_config entry."""
    config = load_ssh_config(address.ssh_config, address.origin("ssh_config"))
    identity = None
    if address.identity:
        identity = Path(address.identity).expanduser()
        if not identity.is_file():
            raise usage_error(f"--identity{address.origin('identity')}: no such key file: {identity}")
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
        self._before_mark: bytearray | None = bytearray()  # stdout until LOGIN_MARK came (then None)
        self.stderr = bytearray()  # at most STDERR_CAP bytes, without the heartbeats
        self.started = False  # a heartbeat came: the container's script runs
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
                raise self._write_failed(f"writing to the remote command failed: {e or type(e).__name__}") from None
            if n <= 0:
                raise self._write_failed("writing to the remote command failed: the channel is closed")
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
        return Completed(rc, bytes(out), bytes(self.stderr), self.started)

    def _collect(self, buf: bytearray) -> Callable[[bytes], None]:
        """A writer of stdout into buf that fails, in one line, past STDOUT_CAP."""
        def extend(data: bytes) -> None:
            if len(buf) + len(data) > STDOUT_CAP:
                raise TooMuch(f"{self._session.endpoint.describe()}: a remote command sent more than "
                              f"{STDOUT_CAP >> 20} MiB of output; gpuctl stopped reading it")
            buf.extend(data)
        return extend

    def _keep_stderr(self, data: bytes) -> None:
        self.started = self.started or HEARTBEAT in data
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

    def _write_failed(self, why: str) -> GpuctlError:
        """A write the command did not take: the connection is lost, or the command ended. Before LOGIN_MARK came
        that means the login shell refused it (what it said tells); after it, the command ended without reading
        all of its stdin (pct failing before the script runs, say): its exit status tells (`finish`)."""
        if self._session.dropped(0.5):
            return self._session.lost(why)
        if self._before_mark is not None:
            try:
                self._pump(lambda data: None, self._keep_stderr, idle_timeout=None, stop=None)
            except GpuctlError as e:
                return e
        return CommandEnded(f"{self._session.endpoint.describe()}: the remote command ended before it read its "
                            f"input ({why})")

    def _past_mark(self, data: bytes) -> bytes:
        """What of data follows LOGIN_MARK (b"" while it has not come yet)."""
        self._before_mark.extend(data)
        at = self._before_mark.find(LOGIN_MARK)
        if at < 0:
            if len(self._before_mark) > LOGIN_SAID_CAP:  # far more than any banner: the command is not running
                raise self._refused()
            return b""
        rest = bytes(self._before_mark[at + len(LOGIN_MARK):])
        self._before_mark = None
        return rest

    def _refused(self) -> GpuctlError:
        """The command's output ended before LOGIN_MARK: the login shell ran none of it. What it said (on stdout
        and stderr), else its exit code, in one line."""
        deadline = time.monotonic() + 2.0  # what it wrote on stderr comes with its end
        while time.monotonic() < deadline and (data := self._recv(stderr=True)) != b"":
            if data:
                self._keep_stderr(data)
        said = (bytes(self._before_mark[:LOGIN_SAID_CAP]) + b"\n" + bytes(self.stderr[-LOGIN_SAID_CAP:]))
        lines = [line.strip() for line in said.decode(errors="replace").splitlines() if line.strip()]
        if not lines:
            rc = self._chan.recv_exit_status() if self._chan.status_event.wait(1.0) else "unknown"
            lines = [f"its login shell ran nothing (exit {rc})"]
        return host_error(f"{self._session.endpoint.describe()} refused the login: {'; '.join(lines)}")

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
                heard = time.monotonic()
                if self._before_mark is not None:
                    data = self._past_mark(data)
                if data:
                    on_stdout(data)
            elif data == b"":
                if self._before_mark is not None and not self._session.dropped(0.5):
                    raise self._refused()
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
        self.idle_s = timeouts().idle  # no byte for this long from a remote command: the link is dead
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
        chan = self._exec(f"echo {LOGIN_MARK.decode().strip()}; {command}")
        chan.settimeout(0.5)  # recv wakes up this often, so Ctrl-C and a dead link are noticed promptly
        return RemoteCommand(chan, self)

    def open_terminal(self, command: str, pty: tuple[str, int, int] | None) -> paramiko.Channel:
        """A remote command for a person (gpuctl shell): on a pty (TERM, columns, rows) when `pty` is given, else
        on plain streams. No idle deadline and no bound: a shell waits for its user (the transport's keepalive
        still notices a dead link)."""
        return self._exec(command, pty)

    def _exec(self, command: str, pty: tuple[str, int, int] | None = None) -> paramiko.Channel:
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
            if pty:
                term, columns, rows = pty
                chan.get_pty(term=term, width=columns, height=rows)
            chan.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError) as e:
            if self.dropped():
                raise self.lost(str(e) or type(e).__name__) from None
            raise host_error(f"{self.endpoint.describe()}: cannot run a remote command: {e}") from None
        finally:
            watchdog.cancel()
        return chan

    def stream(self, command: str, stdin: bytes = b"", on_stdout: Callable[[bytes], None] | None = None,
               on_stderr: Callable[[bytes], None] | None = None, idle_timeout: float | None = None) -> Completed:
        """Run a command with this stdin; its output goes to the callbacks as it arrives (else it is collected)."""
        remote = self.start(command)
        try:
            if stdin:
                remote.send(stdin)
        except CommandEnded:
            pass  # before reading all of its stdin: its exit code and stderr tell why
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


class _Heard:
    """A connection's socket (or a jump's channel) that keeps the first bytes the server sent and whether it
    closed: what a handshake that failed before the SSH banner is told by (silence, a close, not SSH)."""

    KEEP = 200

    def __init__(self, sock: socket.socket | paramiko.Channel):
        self._sock = sock
        self.first = b""
        self.closed = False

    def recv(self, n: int) -> bytes:
        data = self._io(self._sock.recv, n)
        if not data:
            self.closed = True
        elif len(self.first) < self.KEEP:
            self.first += data[:self.KEEP - len(self.first)]
        return data

    def send(self, data: bytes) -> int:
        return self._io(self._sock.send, data)

    def _io(self, call: Callable, arg):
        """A read or write; a reset (the server closed with our banner unread) counts as its close."""
        try:
            return call(arg)
        except TimeoutError:
            raise
        except OSError:
            self.closed = True
            raise

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


def _tcp(endpoint: Endpoint, timeout: float, opened: list[paramiko.SSHClient]) -> socket.socket | paramiko.Channel:
    """The connection's first stage: a TCP connection to the endpoint (a direct-tcpip channel through its jump)."""
    where = endpoint.describe()
    if endpoint.jump is not None:
        via = _login(endpoint.jump, timeout, opened)
        try:
            return via.get_transport().open_channel("direct-tcpip", (endpoint.hostname, endpoint.port),
                                                    ("127.0.0.1", 0), timeout=timeout)
        except (paramiko.SSHException, OSError, EOFError) as e:
            said = getattr(e, "text", None) or str(e) or type(e).__name__  # a ChannelException's own words
            raise Unreachable(f"cannot connect to {where}: TCP connect failed: the jump host could not reach "
                              f"{endpoint.hostname}:{endpoint.port} ({said})") from None
    try:
        return socket.create_connection((endpoint.hostname, endpoint.port), timeout=timeout)
    except socket.gaierror as e:
        raise Unreachable(f"cannot resolve host {endpoint.hostname}: {e.strerror}") from None
    except ConnectionRefusedError:
        reason = f"connection refused (nothing listens on port {endpoint.port} there: is sshd running, on that port?)"
    except TimeoutError:
        reason = (f"no answer within {timeout:g} s (a wrong or unreachable address, or a firewall that drops it; "
                  "--connect-timeout waits longer)")
    except OSError as e:
        reason = e.strerror or str(e) or type(e).__name__
    raise Unreachable(f"cannot connect to {where}: TCP connect failed: {reason}")


def _handshake_failure(endpoint: Endpoint, transport: paramiko.Transport | None, heard: _Heard, timeout: float,
                       error: BaseException) -> GpuctlError:
    """Which stage of the SSH handshake failed, told from how far the transport got (not from paramiko's words:
    a silent server is 'No existing session' or 'Error reading SSH protocol banner' by a race)."""
    where, reason = endpoint.describe(), str(error) or type(error).__name__
    if transport is None or not transport.remote_version:
        if heard.first:
            line = heard.first.decode(errors="replace").strip().splitlines()[0][:80] if heard.first.strip() else ""
            said = f"answered {line!r}" if line else f"sent {len(heard.first)} bytes"
            why = f"{said}, not an SSH banner (is port {endpoint.port} an SSH server's?)"
        elif heard.closed:
            why = ("the server accepted the TCP connection and closed it without a word (sshd refusing "
                   "connections: MaxStartups, a TCP wrapper, fail2ban?)")
        else:
            why = (f"the server accepted the TCP connection but sent no SSH banner within {timeout:g} s (a hung "
                   "sshd, or not an SSH server; --connect-timeout waits longer)")
        return Unreachable(f"cannot connect to {where}: SSH banner failed: {why}")
    if not transport.initial_kex_done:
        if isinstance(error, TimeoutError) or "No existing session" in reason:
            reason = f"no answer within {timeout:g} s"
        return Unreachable(f"cannot connect to {where}: SSH key exchange failed: {reason}")
    return host_error(f"cannot log in to {where}: authentication failed: {reason}")


def _login(endpoint: Endpoint, timeout: float, opened: list[paramiko.SSHClient]) -> paramiko.SSHClient:
    """Connect and log in to endpoint, through its jump hosts first; every client opened goes to `opened`. Each
    stage that fails says so: TCP connect, the SSH banner, the key exchange, the host key, authentication."""
    heard = _Heard(_tcp(endpoint, timeout, opened))
    client = paramiko.SSHClient()
    opened.append(client)
    for path in (Path("/etc/ssh/ssh_known_hosts"), endpoint.known_hosts):
        if path.is_file():
            try:
                client.get_host_keys().load(str(path))
            except (OSError, paramiko.SSHException) as e:
                heard.close()
                raise host_error(f"cannot read {path}: {e}") from None
    client.set_missing_host_key_policy(_HostKeyPolicy(endpoint))
    where = endpoint.describe()
    try:
        client.connect(endpoint.hostname, port=endpoint.port, username=endpoint.user,
                       key_filename=list(endpoint.key_files) or None, allow_agent=True, look_for_keys=True,
                       timeout=timeout, banner_timeout=timeout, auth_timeout=timeout, sock=heard)
    except paramiko.BadHostKeyException as e:
        raise host_error(
            f"host key for {e.hostname} has CHANGED (now {e.key.get_name()} {e.key.fingerprint}); refusing to "
            f"connect. If the host was really re-installed, remove the old key from {endpoint.known_hosts} "
            f"(ssh-keygen -R) and connect again") from None
    except paramiko.AuthenticationException as e:
        tried = ", ".join(endpoint.key_files) or "the agent's and the default keys"
        said = "" if str(e) in ("", "Authentication failed.") else f" ({e})"
        raise host_error(f"cannot log in to {where}: authentication failed: the host accepted none of the keys "
                         f"tried{said} ({tried}); pass --identity KEY") from None
    except paramiko.SSHException as e:
        if str(e) == "No authentication methods available":  # paramiko found no key at all to offer
            raise host_error(f"cannot log in to {where}: gpuctl has no SSH key to offer (no --identity, none in "
                             "ssh-agent, no ~/.ssh/id_* and no IdentityFile in the ssh config): pass --identity KEY, "
                             "add one to the agent (ssh-add KEY), or name one in ~/.ssh/config") from None
        raise _handshake_failure(endpoint, client.get_transport(), heard, timeout, e) from None
    except (OSError, EOFError) as e:
        raise _handshake_failure(endpoint, client.get_transport(), heard, timeout, e) from None
    finally:
        if client.get_transport() is None or not client.get_transport().is_authenticated():
            heard.close()  # a failed stage: the socket goes with it (the client closes its own transport)
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
    except GpuctlError as e:
        for client in reversed(opened):
            client.close()
        origin = address.remembered("host", "port", "user", "identity", "ssh_config")
        if origin:  # the user typed none of it: say where gpuctl got it, and how to forget it
            e.args = (f"{e}{origin}",)
        raise
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
