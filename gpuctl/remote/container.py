"""`pct` operations on one container: every container-side script runs as `pct exec CT -- /bin/bash -s` with
the rendered script on stdin (no nested quoting), and pct's own errors become gpuctl's exit code 4.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from gpuctl.address import Address
from gpuctl.errors import ExitCode, GpuctlError, usage_error
from gpuctl.paths import RECORDS_DIR
from gpuctl.remote import scripts, ssh
from gpuctl.remote.protocol import ScriptExit, stderr_messages
from gpuctl.remote.ssh import Completed, ConnectionLost, RemoteCommand, Session, Unreachable

PROBE_S = ssh.env_seconds("GPUCTL_PROBE_TIMEOUT", 10)  # a container-side probe (nvidia-smi, du) answers within it
PCT_MISSING = re.compile(r"Configuration file '\S+/lxc/(\d+)\.conf' does not exist")
PCT_NOT_RUNNING = re.compile(r"container '(\d+)' not running")
# The key was accepted but the account may not log in: its shell (nologin) says so and ends, running nothing.
LOGIN_REFUSED = re.compile(r"This account is currently not available")


class Reply(Protocol):
    """A script's typed reply (gpuctl.remote.protocol): made from the script's stdout."""

    @classmethod
    def parse(cls, stdout: bytes) -> Any: ...


R = TypeVar("R", bound=Reply)


class ContainerNotRunning(GpuctlError):
    def __init__(self, message: str):
        super().__init__(message, ExitCode.CONTAINER)


@dataclass
class Container:
    session: Session
    address: Address

    @property
    def ctid(self) -> int:
        return self.address.ct

    @property
    def host(self) -> str:
        return self.address.host

    def command(self) -> str:
        return scripts.render("pct_exec", ctid=self.ctid).strip()

    def script(self, template: str, **values: Any) -> str:
        return scripts.render(f"{template}.sh", records_dir=RECORDS_DIR, alive_s=f"{ssh.HEARTBEAT_S:g}", probe_s=f"{PROBE_S:g}",
                              **values)

    def run(self, template: str, **values: Any) -> Completed:
        """Run templates/TEMPLATE.sh.j2 in the container and collect its output."""
        return self._checked(self.session.run(self.command(), self.script(template, **values).encode()))

    def call(self, template: str, reply: type[R], what: str, **values: Any) -> R:
        """The one container call: run templates/TEMPLATE.sh.j2, check its exit code (pct's errors and an unknown
        run raise their own; any other failure says `what` failed), parse its typed reply."""
        result = self.run(template, **values)
        if result.rc != 0:
            raise self.failure(result, what)
        return reply.parse(result.stdout)

    def stream(self, template: str, on_stdout: Callable[[bytes], None],
               on_stderr: Callable[[bytes], None] | None = None, idle_timeout: float | None = None,
               **values: Any) -> Completed:
        """Run a script whose output goes to the callbacks as it arrives."""
        result = self.session.stream(self.command(), self.script(template, **values).encode(), on_stdout,
                                     on_stderr, idle_timeout)
        return self._checked(result)

    def start(self, template: str, **values: Any) -> RemoteCommand:
        """Start a script that converses: it reads more of its stdin after the script itself."""
        remote = self.session.start(self.command())
        remote.send(self.script(template, **values).encode())
        return remote

    def finish(self, remote: RemoteCommand, on_stdout: Callable[[bytes], None] | None = None) -> Completed:
        """The rest of a conversing script: its output (to on_stdout as it arrives, when given) and exit code."""
        return self._checked(remote.finish(on_stdout))

    def reconnect(self, within_s: float) -> None:
        """A new connection in place of a lost one, retried with backoff for up to within_s seconds."""
        # tenacity (and asyncio, which it imports) only for a reconnect: not at every start of gpuctl
        from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_exponential

        self.session.close()

        @retry(stop=stop_after_delay(within_s), wait=wait_exponential(multiplier=0.1, max=2.0),
               retry=retry_if_exception_type((Unreachable, ConnectionLost)), reraise=True)
        def attempt() -> Session:
            return ssh.connect(self.address, stats=self.session.stats, bound_s=self.session.bound_s)

        self.session = attempt()

    def _checked(self, result: Completed) -> Completed:
        if result.rc == 0:
            return result
        err = result.stderr.decode(errors="replace")
        said = result.stdout.decode(errors="replace") + "\n" + err
        if LOGIN_REFUSED.search(said) and not result.stdout.startswith(b"@@"):
            reason = "; ".join(line.strip() for line in said.splitlines() if line.strip())
            raise ssh.host_error(f"{self.session.endpoint.describe()} refused the login: {reason}")
        if PCT_MISSING.search(err):
            raise GpuctlError(f"container {self.ctid} does not exist on {self.host} ({err.strip()}): pass the "
                              "right --ct (pct list on the host shows its containers)", ExitCode.CONTAINER)
        if PCT_NOT_RUNNING.search(err):
            raise ContainerNotRunning(f"container {self.ctid} on {self.host} is not running (start it: pct start "
                                      f"{self.ctid})")
        if result.rc == 127 and "pct" in err:
            raise GpuctlError(f"{self.host} has no `pct` command: is it a Proxmox VE host?", ExitCode.HOST)
        if result.rc == ScriptExit.NO_RUN:
            raise usage_error(f"{err.strip()} (CT {self.ctid})")
        return result

    def failure(self, result: Completed, what: str) -> GpuctlError:
        """The error for a script that failed in a way its caller does not handle itself."""
        lines = stderr_messages(result.stderr)
        detail = lines[-1] if lines else f"exit code {result.rc}"
        return GpuctlError(f"{what} in CT {self.ctid} failed: {detail}", ExitCode.RUN_FAILED)
