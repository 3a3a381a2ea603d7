"""Container data is typed where gpuctl reads it (issue 46): a run's record and its metrics lines are checked
against their schema (gpuctl/runs.py RECORD_SCHEMA), so whatever a container writes there, status, status
--json, runs, kill, pull and the loss history parse and render it without an internal error; a malformed record
is named in one line (which file, what is wrong) and the other runs show as before. The generated inputs go
through the same parsers and renderers the commands use, on the container's reply bytes."""

from __future__ import annotations

import io
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuctl.commands.kill import KillResult
from gpuctl.commands.remove import Removed
from gpuctl.commands.status import StatusReport
from gpuctl.remote.protocol import Inspection, KillReply, MetricsChain, PullReply, RemoveReply, section
from gpuctl.runs import RECORD_SCHEMA, checked_record, parse_metrics_lines, parse_progress
from gpuctl.ui import render
from gpuctl.ui.output import Output

EXAMPLES = 400  # per test: docs/BENCHMARKS.md counts what the tests try
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**62, 2**62), st.floats(), st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                      max_leaves=6)
records = st.one_of(values, st.dictionaries(st.sampled_from(sorted(RECORD_SCHEMA)), values, max_size=10))
metrics = st.dictionaries(st.sampled_from(["step", "total_steps", "loss", "tokens_per_s", "time", "acceptance_length"]),
                          values, max_size=6)
# a record file's bytes as the container hands them back: JSON of anything, or bytes that are not JSON at all
record_bytes = st.one_of(records.map(lambda r: json.dumps(r).encode()), st.binary(max_size=40))
metrics_bytes = st.one_of(metrics.map(lambda m: json.dumps(m).encode()), st.binary(max_size=40))
fuzzed = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


def output() -> tuple[Output, io.StringIO, io.StringIO]:
    stdout, stderr = io.StringIO(), io.StringIO()
    return Output(stdout, stderr), stdout, stderr


@fuzzed
@given(st.lists(st.tuples(record_bytes, st.booleans(), metrics_bytes, metrics_bytes), min_size=1, max_size=3),
       st.lists(metrics_bytes, max_size=4))
def test_status_and_runs_read_any_record_and_metrics_lines(runs, history):
    reply = section("now", b"1765000000.5")
    for number, (record, alive, first, last) in enumerate(runs, 1):
        reply += section("run", str(number).encode()) + section("alive", b"1" if alive else b"0")
        reply += section("record", record) + section("log_size", b"42")
        reply += section("metrics_first", first) + section("metrics_last", last)
        reply += section("metrics_history", b"\n".join(history)) + section("tail", b"the last line\n")
    inspection = Inspection.parse(reply)
    losses = [r["loss"] for r in parse_metrics_lines(inspection.histories.get(1, b""))
              if isinstance(r.get("loss"), float)]
    out, _stdout, stderr = output()
    report = StatusReport(ctid=200, host="pve", container_status="running", run=inspection.runs[0], gpus=[],
                          losses=losses, last_line="the last line")
    for as_json in (False, True):
        render.status_report(out, report, as_json)
        render.runs_table(out, inspection.runs, 200, "pve", as_json)
    malformed = [run for run in inspection.runs if run.problem]
    assert stderr.getvalue().count("is malformed") == len(malformed)  # one line each, from `runs`
    assert len(stderr.getvalue().splitlines()) == len(malformed)


@fuzzed
@given(record_bytes, st.lists(st.integers(1, 2**31), max_size=2), st.lists(st.tuples(record_bytes, metrics_bytes),
                                                                            min_size=1, max_size=3))
def test_kill_pull_remove_and_the_metrics_chain_read_any_record(record, pids, chain):
    out, _, _ = output()
    killed = KillReply.parse(section("run", b"4") + section("pids", " ".join(map(str, pids)).encode())
                             + section("record", record))
    render.kill_result(out, KillResult(killed.run, signalled=bool(pids)))
    pulled = PullReply.parse(section("run", b"4") + section("record", record))
    json.dumps(pulled.run.to_json())
    removal = RemoveReply.parse(section("remove", b"4") + section("record", record) + section("path", b"/x"))
    render.removed(out, Removed(removal.removals, dry_run=True, ctid=200, host="pve"), as_json=False)
    links = b"".join(section("run", str(n).encode()) + section("record", r) + section("metrics", m)
                     for n, (r, m) in enumerate(chain, 1))
    for run, lines in MetricsChain.parse(links).links:
        json.dumps(run.to_json())
        assert all(isinstance(line["step"], int) and not isinstance(line["step"], bool) for line in lines)


def test_the_records_the_issue_found_are_one_line_each_and_the_other_runs_show_as_before():
    """`[1,2]`, `"launched_at": "soon"`, a metrics line with `"total_steps": "10"` and `"loss": "high"`: no
    internal error; each malformed record named with its file and what is wrong; the good run as it was."""
    good = {"pid": 7, "launched_at": 1765000000.0, "started_at": 1765000001.0, "config": "tiny", "name": "exp"}
    reply = section("now", b"1765000100")
    for number, (record, last) in enumerate([(b"[1,2]", b""), (json.dumps({"launched_at": "soon"}).encode(), b""),
                                             (json.dumps(good).encode(),
                                              b'{"step": 5, "total_steps": "10", "loss": "high"}')], 1):
        reply += section("run", str(number).encode()) + section("alive", b"1") + section("record", record)
        reply += section("metrics_first", b'{"step": 0, "time": 1}') + section("metrics_last", last)
    runs = Inspection.parse(reply).runs
    assert [r.problem for r in runs] == ["the record is not a JSON object but list",
                                         'launched_at is "soon", not a time in seconds', None]
    assert runs[2].progress.step == 5 and runs[2].progress.total_steps is None and runs[2].progress.loss is None
    out, stdout, stderr = output()
    render.runs_table(out, runs, 200, "pve", as_json=False)
    said = stderr.getvalue().splitlines()
    assert said == [("gpuctl: tl1: its record /workspace/.gpuctl/tl1.json is malformed: the record is not a JSON "
                    "object but list"),
                    ('gpuctl: tl2: its record /workspace/.gpuctl/tl2.json is malformed: launched_at is "soon", not '
                    "a time in seconds")]
    assert "exp" in stdout.getvalue() and "tiny" in stdout.getvalue()
    assert checked_record(good) == (good, None)
    assert parse_progress(b'{"step": 0}', b'{"step": 3, "loss": NaN, "tokens_per_s": [1]}', True).loss is None
