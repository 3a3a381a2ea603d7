"""The run's human lines: `say` on stdout, `warn` on stderr, each flushed at once (the log is read through a
file while the run goes on). The machine-readable records are training/output/metrics.py's."""

import sys


def say(message: str) -> None:
    """A human line on stdout, flushed at once (the log is read through a file while the run goes on)."""
    print(message, file=sys.stdout, flush=True)


def warn(message: str) -> None:
    """Something went wrong and the run goes on: one line on stderr, flushed at once."""
    print(f"warning: {message}", file=sys.stderr, flush=True)
