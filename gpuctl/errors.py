"""gpuctl's exit codes (one enum, ARCHITECTURE §2) and the one exception type that carries them."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    RUN_FAILED = 1  # the run failed (or was killed) while we followed it; also unexpected errors
    USAGE = 2
    HOST = 3  # cannot reach or log in to the host, host key refused
    CONTAINER = 4  # container missing or not running
    CONFLICT = 5  # a run is active, or another launch holds the lock
    ENV_NOT_READY = 6  # the container's Python environment cannot train (doctor: no interpreter, missing packages, ...)
    INTERRUPTED = 130


class GpuctlError(Exception):
    """An error the user can act on: one line of message, one exit code."""

    def __init__(self, message: str, code: ExitCode = ExitCode.RUN_FAILED):
        super().__init__(message)
        self.code = code


def usage_error(message: str) -> GpuctlError:
    return GpuctlError(message, ExitCode.USAGE)
