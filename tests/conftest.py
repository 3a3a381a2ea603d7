"""Checks for every test: the markers say what a test needs (pyproject.toml registers them)."""

from __future__ import annotations

import signal

import pytest

# Tests press Ctrl-C (SIGINT) at gpuctl and the trainer. A shell without job control starts a background job
# with SIGINT ignored, and an ignored signal stays ignored across exec, so such a pytest's children would never
# see it. A handler here is reset to the default in every child: they get the signal as in a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # `pytest -m "not sshd"` must never start the stand-in host: a test that uses it says so.
    if "standin" in item.fixturenames and item.get_closest_marker("sshd") is None:
        pytest.fail(f"{item.nodeid} uses the stand-in host: mark it @pytest.mark.sshd", pytrace=False)
