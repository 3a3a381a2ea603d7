"""Checks for every test: the markers say what a test needs (pyproject.toml registers them)."""

from __future__ import annotations

import pytest


def pytest_runtest_setup(item: pytest.Item) -> None:
    # `pytest -m "not sshd"` must never start the stand-in host: a test that uses it says so.
    if "standin" in item.fixturenames and item.get_closest_marker("sshd") is None:
        pytest.fail(f"{item.nodeid} uses the stand-in host: mark it @pytest.mark.sshd", pytrace=False)
