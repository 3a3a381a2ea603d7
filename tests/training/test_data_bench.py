"""bench/data_bench.py cannot rot: a small run goes through every path and reports a cached start faster than
the first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, str(REPO / "bench" / "data_bench.py")]


def test_a_small_data_bench_runs_and_the_cached_start_is_faster(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(BENCH + ["--conversations", "300", "--workers", "2", "--starts", "1", "--json", str(out)],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "second start: cached" in result.stdout and "300 conversations" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["built"] for r in rows] == [True, True, False]
    assert rows[-1]["seconds"] < rows[0]["seconds"]
    assert len({(r["records"], r["tokens"], r["sequences"]) for r in rows}) == 1 and rows[0]["records"] == 300


@pytest.mark.parametrize("argv", [["--conversations", "0"], ["--starts", "x"], ["--nope"]])
def test_bad_arguments_give_one_line_and_exit_2(argv):
    result = subprocess.run(BENCH + argv, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1, result.stderr
