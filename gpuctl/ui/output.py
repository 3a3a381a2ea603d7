"""Where gpuctl writes (httpie's Environment, smaller): stdout for what a command gives (one JSON document, a
table, the log's own bytes), stderr for people. One Output is made per invocation and passed down; a test
hands in its own streams. Streams not given are sys.stdout and sys.stderr as they are when written.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from rich.console import Console, RenderableType
from rich.text import Text


class Output:
    def __init__(self, stdout: TextIO | None = None, stderr: TextIO | None = None):
        self._stdout, self._stderr = stdout, stderr

    @property
    def stdout(self) -> TextIO:
        return self._stdout or sys.stdout

    @property
    def stderr(self) -> TextIO:
        return self._stderr or sys.stderr

    def console(self, stderr: bool) -> Console:
        """Rich honours NO_COLOR (and FORCE_COLOR, TTY_INTERACTIVE) from the environment by itself."""
        stream = self.stderr if stderr else self.stdout
        # Not a terminal: wide enough that long paths are not wrapped into a pipe.
        return Console(file=stream, stderr=stderr, width=None if stream.isatty() else 160, highlight=False)

    def show(self, renderable: RenderableType | str, stderr: bool = False) -> None:
        self.console(stderr).print(renderable)

    def message(self, text: str) -> None:
        """A human message: always on stderr."""
        self.console(stderr=True).print(Text(f"gpuctl: {text}"))

    def error(self, text: str) -> None:
        self.console(stderr=True).print(Text(f"gpuctl: error: {text}", style="bold red"), soft_wrap=True)

    def json_doc(self, doc: Any) -> None:
        self.stdout.write(json.dumps(doc, indent=2) + "\n")
        self.stdout.flush()

    def write(self, text: str) -> None:
        """Plain text on stdout, as it is (a --dry-run's scripts)."""
        self.stdout.write(text)

    def write_bytes(self, data: bytes) -> None:
        """The log's own bytes, untouched, on stdout."""
        self.stdout.buffer.write(data)
        self.stdout.buffer.flush()

    def log_tail(self, data: bytes) -> None:
        """A log's last lines (a run that ended during its start), on stderr."""
        self.stderr.write(data.decode(errors="replace").rstrip("\n") + "\n")
