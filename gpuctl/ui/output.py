"""Where gpuctl writes (httpie's Environment, smaller): stdout for what a command gives (one JSON document, a
table, the log's own bytes), stderr for people. One Output is made per invocation and passed down; a test
hands in its own streams. Streams not given are sys.stdout and sys.stderr as they are when written.

Nothing a container sends takes over the terminal: every text gpuctl shows (through Rich, message, error,
log_tail) has its control characters made visible by visible(); a log written to a terminal goes through
LogView. JSON documents stay exact data (json.dumps escapes control characters as \\u00XX itself).

Rich is imported when something is first shown through it, not with this module (`gpuctl --help` shows nothing
through it).
"""

from __future__ import annotations

import codecs
import functools
import json
import re
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TextIO

from gpuctl.text import CONTROL

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.segment import Segment



def _escape(match: re.Match) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def visible(text: str) -> str:
    """Text from a container, safe to show: each control or format character (CONTROL) as an escape: ESC as
    \\x1b, DEL as \\x7f, CSI as \\x9b, a right-to-left override as \\u202e, a lone surrogate as \\udcNN; newlines
    and tabs stay."""
    return CONTROL.sub(_escape, text)


def one_line(text: str) -> str:
    """visible(), and a newline or tab as \\n or \\t: a field shown on one line (a cell, a name, a failure line)
    can never forge the next row."""
    return visible(text).replace("\n", "\\n").replace("\t", "\\t")


def visible_log(text: str) -> str:
    """A log's lines for a terminal: a carriage return ends a line (a progress bar shows as lines), the rest as
    visible()."""
    return visible(text.replace("\r\n", "\n").replace("\r", "\n"))


class LogView:
    """A log's bytes as they arrive, for a terminal: decoded as UTF-8 across chunk boundaries (what is not UTF-8
    shows as U+FFFD) and made visible_log(); a trailing carriage return waits for the next chunk (\\r\\n is one
    line end)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._cr = False

    def feed(self, data: bytes, final: bool = False) -> str:
        text = ("\r" if self._cr else "") + self._decoder.decode(data, final)
        self._cr = not final and text.endswith("\r")
        return visible_log(text[:-1] if self._cr else text)


TRAILING_SPACES = re.compile(r"[ \t]+$", re.MULTILINE)


@functools.cache
def visible_console() -> type[Console]:
    """VisibleConsole, made (with Rich imported) the first time it is asked for."""
    from rich.console import Console
    from rich.segment import Segment

    class VisibleConsole(Console):
        """A Rich console that is the one gate for what reaches the stream: every text segment, however deep a
        Group, Table, Panel or Live nests it, passes visible() in _render_buffer, where Rich turns the segments of
        a print into the characters it writes (a filter in render() sees nested segments through generators that
        interleave, and missed them). Rich's own control segments (a live display's cursor moves) and styles
        pass; markup is off, so no remote string becomes a style or a link. A str is made visible() before it
        becomes a Text too: Text drops BEL, BS, VT, FF and CR unseen, and a table measures what it will show."""

        def render_str(self, text: str, **kwargs: Any) -> Any:
            return super().render_str(visible(text), **kwargs)

        def _render_buffer(self, buffer: Iterable[Segment]) -> str:
            text = super()._render_buffer(
                segment if segment.control else Segment(visible(segment.text), segment.style) for segment in buffer)
            if self.is_terminal:
                return text
            # to a pipe or a file: no padding after a line's last cell (grep, diff and `cut` see only the text)
            return TRAILING_SPACES.sub("", text)

    return VisibleConsole


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
        """Rich honours NO_COLOR (and FORCE_COLOR, TTY_INTERACTIVE) from the environment by itself. Markup and emoji
        codes are off: a remote string (`:smile:` in a config's name) is shown as it is."""
        stream = self.stderr if stderr else self.stdout
        # Not a terminal: wide enough that long paths are not wrapped into a pipe.
        return visible_console()(file=stream, stderr=stderr, width=None if stream.isatty() else 160, highlight=False,
                              markup=False, emoji=False)

    def show(self, renderable: RenderableType | str, stderr: bool = False) -> None:
        """A result; a line of text is never broken by Rich (a pipe is 80 columns to it): the terminal wraps it,
        a script reads it whole."""
        from rich.text import Text

        self.console(stderr).print(renderable, soft_wrap=isinstance(renderable, str | Text))

    def message(self, text: str) -> None:
        """A human message: always on stderr."""
        from rich.text import Text

        self.console(stderr=True).print(Text(f"gpuctl: {visible(text)}"), soft_wrap=True)

    def error(self, text: str) -> None:
        from rich.text import Text

        self.console(stderr=True).print(Text(f"gpuctl: error: {visible(text)}", style="bold red"), soft_wrap=True)

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

    def log_writer(self, raw: bool = False) -> LogWriter:
        """Where a log's bytes go: through LogView wherever stdout is (a pipe into `tail` on a terminal shows what
        it gets), untouched only with raw (`logs --raw`)."""
        return LogWriter(self, None if raw else LogView())

    def log_tail(self, data: bytes) -> None:
        """A log's last lines (a run that ended during its start), on stderr, made visible_log()."""
        self.stderr.write(visible_log(data.decode(errors="replace")).rstrip("\n") + "\n")


class LogWriter:
    """A log's bytes on stdout as they arrive (write), then close() (what LogView still holds)."""

    def __init__(self, out: Output, view: LogView | None):
        self.out, self.view = out, view

    def write(self, data: bytes) -> None:
        if self.view is None:
            self.out.write_bytes(data)
        else:
            self.out.write_bytes(self.view.feed(data).encode())

    def close(self) -> None:
        if self.view is not None:
            self.out.write_bytes(self.view.feed(b"", final=True).encode())
