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
from gpuctl.timeouts import timeouts

PCT_MISSING = re.compile(r"Configuration file '\S+/lxc/(\d+)\.conf' does not exist")
PCT_NOT_RUNNING = re.compile(r"container '(\d+)' not running")


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

    def command(self, argv: list[str] | None = None) -> str:
        """The host's `pct exec` command: bash reading a script on stdin, or argv (run as it is in the container)."""
        if argv is None:
            return scripts.render("pct_exec", ctid=self.ctid).strip()
        return scripts.render("pct_exec", ctid=self.ctid, argv=argv).strip()

    def check(self) -> None:
        """The container exists and runs: pct's errors raise as for every script (gpuctl shell asks first, since on
        a terminal what pct says would reach the user as the shell's output)."""
        result = self._checked(self.session.run(self.command(), b"exit 0\n"))
        if result.rc != 0:
            raise self.failure(result, "pct exec")

    def script(self, template: str, **values: Any) -> str:
        return scripts.render(f"{template}.sh", records_dir=RECORDS_DIR, alive_s=f"{timeouts().heartbeat:g}",
                              probe_s=f"{timeouts().probe:g}", **values)

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
        try:
            remote.send(self.script(template, **values).encode())
        except ssh.CommandEnded:
            self._checked(remote.finish())  # pct's (or the host's) failure in its own words, where it is one
            raise
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
        if PCT_MISSING.search(err):
            raise GpuctlError(f"container {self.ctid}{self.address.origin('ct')} does not exist on {self.host} "
                              f"({err.strip()}): pass the right --ct (pct list on the host shows its containers)",
                              ExitCode.CONTAINER)
        if PCT_NOT_RUNNING.search(err):
            raise ContainerNotRunning(f"container {self.ctid}{self.address.remembered('ct')} on {self.host} is not "
                                      f"running (start it: pct start {self.ctid})")
        if result.rc == 127 and "pct" in err:
            raise GpuctlError(f"{self.host}: pct failed: the host has no `pct` command (is it a Proxmox VE host?)",
                              ExitCode.HOST)
        if not result.started:  # the script never ran: pct (or the host's shell) failed before it
            lines = stderr_messages(result.stderr)
            said = f": {lines[-1]}" if lines else " without a word"
            raise GpuctlError(f"{self.host}: pct failed: `pct exec {self.ctid}` ended with exit {result.rc} before "
                              f"running gpuctl's script{said}", ExitCode.HOST)
        if result.rc == ScriptExit.NO_RUN:
            raise usage_error(f"{err.strip()} (CT {self.ctid})")
        return result

    def failure(self, result: Completed, what: str) -> GpuctlError:
        """The error for a script that failed in a way its caller does not handle itself."""
        lines = stderr_messages(result.stderr)
        detail = lines[-1] if lines else f"exit code {result.rc}"
        return GpuctlError(f"{what} in CT {self.ctid} failed: {detail}", ExitCode.RUN_FAILED)
