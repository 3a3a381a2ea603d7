"""`gpuctl logs [-f]`: a run's log bytes, exactly once each, across dropped connections (ARCHITECTURE §2)."""

from __future__ import annotations

from gpuctl.commands.records import inspect
from gpuctl.commands.session import Notify, Write, reconnecting
from gpuctl.errors import ExitCode
from gpuctl.remote.container import Container
from gpuctl.remote.protocol import FollowStart, parse_follow_start
from gpuctl.runs import Run, State
from gpuctl.timeouts import timeouts


def print_log(ct: Container, run_number: int, lines: int | None, write: Write) -> None:
    result = ct.stream("logs", on_stdout=write, run_number=run_number, follow=False, lines=lines, offset=0,
                       heartbeat_s=timeouts().heartbeat)
    if result.rc != 0:
        raise ct.failure(result, "reading the log")


def follow_log(ct: Container, run_number: int, lines: int | None, write: Write, offset: int | None = None,
               notify: Notify = lambda _: None, reconnect_s: float | None = None) -> Run:
    """Stream the run's log until the run ends; every byte exactly once, across dropped connections (which are
    reconnected, and the stream resumed at the byte offset already written). Returns the ended run."""
    position, number = offset, run_number
    heartbeat_s = timeouts().heartbeat  # `logs --follow` hears from the container at least this often

    def follow_once() -> Run:
        nonlocal position, number
        received, stderr = 0, bytearray()
        start: FollowStart | None = None

        def on_stdout(data: bytes) -> None:
            nonlocal received
            write(data)
            received += len(data)

        def on_stderr(data: bytes) -> None:
            nonlocal start
            stderr.extend(data)
            start = start or parse_follow_start(stderr)

        try:
            result = ct.stream("logs", on_stdout=on_stdout, on_stderr=on_stderr, idle_timeout=4 * heartbeat_s,
                               run_number=number, follow=True, lines=lines if position is None else None,
                               offset=position or 0, heartbeat_s=heartbeat_s)
        finally:  # what was written counts, even when the connection dropped half-way
            if start:
                number, position = start.run, start.offset + received
        if result.rc != 0 or not start:
            raise ct.failure(result, "following the log")
        # tail may not have read the last bytes before the run's end stopped it: fetch them from the offset.
        inspection = inspect(ct, number, rest_from=position)
        rest = inspection.rests.get(number, b"")
        if rest:
            write(rest)
            position += len(rest)
        return inspection.runs[0]

    while True:
        run = reconnecting(ct, follow_once, notify, reconnect_s)
        if run.record.get("retried_as") and not run.state.active:  # launch --retry: on to the next attempt's log
            number, position = run.record["retried_as"], 0
            continue
        if not run.state.active:
            return run


def follow_exit_code(run: Run) -> ExitCode:
    return ExitCode.OK if run.state == State.SUCCEEDED else ExitCode.RUN_FAILED

