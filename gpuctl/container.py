"""`pct` operations on one container: every container-side script runs as `pct exec CT -- /bin/bash -s` with
the rendered script on stdin (no nested quoting), and pct's own errors become gpuctl's exit code 4.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuctl import scripts
from gpuctl.errors import ExitCode, GpuctlError, usage_error
from gpuctl.ssh import Completed, Session

RECORDS_DIR = "/workspace/.gpuctl"
STAGE_DIR = "/root/gpuctl"
PCT_MISSING = re.compile(r"Configuration file '\S+/lxc/(\d+)\.conf' does not exist")
PCT_NOT_RUNNING = re.compile(r"container '(\d+)' not running")
# Exit codes of gpuctl's own scripts (templates/*.sh.j2).
SCRIPT_LOCKED, SCRIPT_ACTIVE, SCRIPT_NO_PYTHON, SCRIPT_NO_RUN, SCRIPT_LOG_GONE = 75, 76, 77, 78, 79


def parse_sections(data: bytes) -> list[tuple[str, bytes]]:
    """Read back what the scripts' `emit NAME VALUE` wrote: `@@NAME LENGTH\\nVALUE\\n`, in order."""
    sections, pos = [], 0
    while True:
        start = data.find(b"@@", pos)
        if start < 0:
            return sections
        header_end = data.index(b"\n", start)
        name, length = data[start + 2:header_end].decode().split(" ")
        value_start = header_end + 1
        sections.append((name, data[value_start:value_start + int(length)]))
        pos = value_start + int(length) + 1


@dataclass
class Container:
    session: Session
    ctid: int
    host: str

    def command(self) -> str:
        return scripts.render("pct_exec", ctid=self.ctid).strip()

    def script(self, template: str, **values: Any) -> str:
        return scripts.render(f"{template}.sh", records_dir=RECORDS_DIR, **values)

    def run(self, template: str, **values: Any) -> Completed:
        """Run templates/TEMPLATE.sh.j2 in the container and collect its output."""
        return self._checked(self.session.run(self.command(), self.script(template, **values).encode()))

    def stream(self, template: str, on_stdout: Callable[[bytes], None], **values: Any) -> Completed:
        """Run a script whose stdout goes to on_stdout as it arrives."""
        result = self.session.stream(self.command(), self.script(template, **values).encode(), on_stdout)
        return self._checked(result)

    def _checked(self, result: Completed) -> Completed:
        if result.rc == 0:
            return result
        err = result.stderr.decode(errors="replace")
        if PCT_MISSING.search(err):
            raise GpuctlError(f"container {self.ctid} does not exist on {self.host} ({err.strip()})",
                              ExitCode.CONTAINER)
        if PCT_NOT_RUNNING.search(err):
            raise GpuctlError(f"container {self.ctid} on {self.host} is not running (start it: pct start "
                              f"{self.ctid})", ExitCode.CONTAINER)
        if result.rc == 127 and "pct" in err:
            raise GpuctlError(f"{self.host} has no `pct` command: is it a Proxmox VE host?", ExitCode.HOST)
        if result.rc == SCRIPT_NO_RUN:
            raise usage_error(f"{err.strip()} (CT {self.ctid})")
        return result

    def failure(self, result: Completed, what: str) -> GpuctlError:
        """The error for a script that failed in a way its caller does not handle itself."""
        lines = result.stderr.decode(errors="replace").strip().splitlines()
        detail = lines[-1] if lines else f"exit code {result.rc}"
        return GpuctlError(f"{what} in CT {self.ctid} failed: {detail}", ExitCode.RUN_FAILED)
