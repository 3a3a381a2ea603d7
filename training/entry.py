"""What every `python -m training.X` entry point shares: its one-line argument errors, its stop signals and
its end (train, regenerate and export; ARCHITECTURE §5, "How a failed run ends")."""

import argparse
import os
import signal
import sys
import threading
import traceback
import typing


class OneLineArgumentParser(argparse.ArgumentParser):
    """The entry points' parser: a bad argument is one line on stderr and exit 2, like every other bad input."""

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def end_process(code: int) -> typing.NoReturn:
    """The entry points' end, with `code`. A run that ended well (0) exits normally. One that did not may leave
    threads the interpreter's teardown cannot stop cleanly: one inside a device call or a generate loop that a
    second signal left running, a failed node's store and process group (closing those would wait on nodes that
    may be gone). Their C++ side can abort that teardown ("terminate called without an active exception":
    SIGABRT in place of the code, seen in CI), so such a run ends at once, once its output is out.

    From here the code is decided: a stop signal that arrives now must not replace it. In a multi-node run the
    first node's stop ends every node at one step, so a node can be on its way out when its own `gpuctl kill`
    SIGTERM lands: with the default action restored, that was exit 143 for a run that stopped cleanly (CI)."""
    if threading.current_thread() is threading.main_thread():  # (a lost node ends the process from a watchdog)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
    if code == 0:
        sys.exit(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_entry_point(main: typing.Callable[[], int]) -> typing.NoReturn:
    """`python -m training.X`: main's exit code, through end_process; an exception main did not expect (a bug)
    prints its traceback and ends the same way, with 1."""
    try:
        code = main()
    except Exception:  # noqa: BLE001 - a bug: its traceback, then the end of any failed run
        traceback.print_exc()
        code = 1
    end_process(code)


class StopSignals:
    """The entry points' stop: while active (`with`), SIGTERM and SIGINT call `_handle`, which records the first
    one in `signal` (each entry point says what a signal means for it); the previous handlers come back at the
    end."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict = {}

    def __enter__(self):
        self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame) -> None:
        self.signal = signum

    @property
    def requested(self) -> bool:
        return self.signal is not None
