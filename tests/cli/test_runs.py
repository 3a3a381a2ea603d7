"""Runs people can find and clean (issue 39): `launch --name`, what `runs` and `status --json` say of a run's
launch (its --set values, the run it resumed), `runs rm` and `runs prune`."""

from __future__ import annotations

import pytest
from tenacity import retry, stop_after_delay, wait_fixed

pytestmark = pytest.mark.sshd

LONG = ("steps=100000", "step_s=0.05")


@retry(stop=stop_after_delay(20), wait=wait_fixed(0.1), reraise=True)
def ended(gpuctl, run: str) -> dict:
    doc = gpuctl.status("--run", run)
    assert doc["state"] in ("succeeded", "failed", "killed"), doc
    return doc


def test_a_named_run_is_shown_and_found_by_its_name(gpuctl):
    first = gpuctl.launch_fake("steps=2", extra=("--name", "exp-1"))
    assert first.code == 0, first.stderr
    assert (first.json()["run_id"], first.json()["name"]) == ("tl1", "exp-1")
    assert ended(gpuctl, "exp-1")["run_id"] == "tl1"
    active = gpuctl.launch_fake(*LONG, extra=("--name", "long_one"))
    assert active.code == 0, active.stderr

    doc = gpuctl.status("--run", "exp-1")
    assert (doc["run_id"], doc["name"], doc["state"]) == ("tl1", "exp-1", "succeeded")
    assert gpuctl.status()["name"] == "long_one"  # the latest run
    listed = gpuctl("runs", "--json")
    assert [(r["run_id"], r["name"]) for r in listed.json()] == [("tl1", "exp-1"), ("tl2", "long_one")]
    table = gpuctl("runs").stdout.splitlines()
    assert "name" in table[0].split() and "exp-1" in table[1].split() and "long_one" in table[2].split()
    assert "tl1 (exp-1)" in gpuctl("status", "--run", "exp-1").stdout

    logs = gpuctl("logs", "--run", "exp-1")
    assert logs.code == 0 and logs.stdout == gpuctl.path("/workspace/train_tl1.log").read_text()
    pulled = gpuctl("pull", "--run", "exp-1", "--what", "metrics", str(gpuctl.home / "m.jsonl"))
    assert pulled.code == 0, pulled.stderr
    assert (gpuctl.home / "m.jsonl").read_bytes() == gpuctl.path("/workspace/.gpuctl/tl1.metrics.jsonl").read_bytes()
    plotted = gpuctl("plot", "--run", "exp-1", "-o", str(gpuctl.home / "loss.png"))
    assert plotted.code == 0 and "points of tl1" in plotted.stderr, plotted.stderr
    killed = gpuctl("kill", "--run", "long_one", "--grace", "10")
    assert killed.code == 0 and "killed tl2" in killed.stdout, killed.stderr
    resumed = gpuctl("launch", "--resume", "exp-1", "--python", "fake-trainer", "--set", "max_steps=50", "--json")
    assert resumed.code == 0, resumed.stderr
    assert (resumed.json()["run_id"], resumed.json()["resumed_from"]) == ("tl3", "tl1")

    unknown = gpuctl("logs", "--run", "nope")
    assert unknown.code == 2 and unknown.stdout == ""
    assert unknown.stderr.count("\n") == 1 and "no run named nope" in unknown.stderr
    assert "tl1 (exp-1), tl2 (long_one), tl3" in unknown.stderr  # the runs there are


def test_a_taken_or_malformed_name_is_refused_before_anything_is_staged(gpuctl):
    assert gpuctl.launch_fake("steps=1", extra=("--name", "exp")).code == 0
    ended(gpuctl, "exp")
    records = gpuctl.path("/workspace/.gpuctl")
    before = sorted(p.name for p in records.iterdir())
    package = gpuctl.path("/root/gpuctl/current").resolve()

    taken = gpuctl.launch_fake("steps=1", "weights_bytes=5", extra=("--name", "exp"))  # a changed run.sh
    assert taken.code == 2 and taken.stdout == ""
    assert taken.stderr.count("\n") == 1 and "--name exp is taken in CT" in taken.stderr and "tl1" in taken.stderr
    assert sorted(p.name for p in records.iterdir()) == before  # no run number used, no log
    assert not gpuctl.path("/workspace/train_tl2.log").exists()
    assert gpuctl.path("/root/gpuctl/current").resolve() == package  # nothing staged

    for bad in ("Exp", "tl7", "7", "a b", "-x", "x" * 33, ""):
        refused = gpuctl.launch_fake("steps=1", extra=("--name", bad))
        assert refused.code == 2 and refused.stderr.count("\n") == 1, (bad, refused.stderr)
        assert "--name takes a short slug" in refused.stderr, refused.stderr
    assert gpuctl("logs", "--run", "a*").code == 2  # not a number nor a name: never sent
    assert sorted(p.name for p in records.iterdir()) == before


def test_runs_and_status_show_each_runs_set_values_and_the_run_it_resumed(gpuctl):
    assert gpuctl.launch_fake("steps=2", "step_s=0.01").code == 0
    ended(gpuctl, "1")
    # max_steps raised: tl1 did all its steps, and a resume of a finished run would do nothing.
    resumed = gpuctl("launch", "--resume", "1", "--python", "fake-trainer", "--set", "max_steps=9", "--set",
                     "fake.steps=3", "--json")
    assert resumed.code == 0, resumed.stderr
    ended(gpuctl, "2")
    # A record an older gpuctl wrote: no sets, no name, no resumed_from.
    gpuctl.path("/workspace/.gpuctl/tl3.json").write_text(
        '{"id": "tl3", "number": 3, "log_path": "/workspace/train_tl3.log", "task": "train", "config": "tiny", '
        '"launched_at": 1764000000.0, "started_at": 1764000001.0, "exit_code": 0, "ended_at": 1764000060.0}\n')

    runs = {r["run_id"]: r for r in gpuctl("runs", "--json").json()}
    assert runs["tl1"]["sets"] == ["fake.steps=2", "fake.step_s=0.01"] and runs["tl1"]["resumed_from"] is None
    # A resumed run runs with its run's --set values, then its own (which win): the record says all of them.
    assert runs["tl2"]["sets"] == ["fake.steps=2", "fake.step_s=0.01", "max_steps=9", "fake.steps=3"]
    assert runs["tl2"]["resumed_from"] == "tl1"
    assert (runs["tl3"]["sets"], runs["tl3"]["resumed_from"], runs["tl3"]["state"]) == ([], None, "succeeded")
    doc = gpuctl.status("--run", "2")
    assert (doc["sets"], doc["resumed_from"]) == (runs["tl2"]["sets"], "tl1")
    assert gpuctl.status("--run", "3")["sets"] == []

    table = gpuctl("runs")
    assert table.code == 0, table.stderr
    rows = {line.split()[0]: line for line in table.stdout.splitlines() if line.startswith("tl")}
    assert " tl1 " in rows["tl2"] and "--set fake.steps=3" in table.stdout
    assert "tiny" in rows["tl3"]
    human = gpuctl("status", "--run", "2").stdout
    assert "--set fake.step_s=0.01 --set max_steps=9 --set fake.steps=3 (resumed tl1)" in human
    assert gpuctl("status", "--run", "3").code == 0


# runs rm / runs prune ------------------------------------------------------------------------------------------

UNTOUCHED = {".gpuctl/launch.lock", ".gpuctl/.records.lock", ".gpuctl/removed.max"}  # gpuctl's own, not a run's


def tree(gpuctl) -> set[str]:
    """Every file and directory under the container's /workspace, relative to it."""
    root = gpuctl.path("/workspace")
    return {str(p.relative_to(root)) for p in root.rglob("*")} - UNTOUCHED


def own_files(n: int, out: str) -> set[str]:
    return {f"train_tl{n}.log", *(f".gpuctl/tl{n}.{ext}" for ext in ("json", "metrics.jsonl", "info.json", "log",
                                                                      "lock")), out}


def launch_into(gpuctl, out: str, *sets: str, name: str | None = None) -> str:
    extra = ("--set", f"output_dir=/workspace/{out}", *(("--name", name) if name else ()))
    launched = gpuctl.launch_fake(*sets, extra=extra)
    assert launched.code == 0, launched.stderr
    return launched.json()["run_id"]


def test_runs_rm_removes_exactly_a_finished_runs_files_and_never_an_active_runs(gpuctl):
    assert launch_into(gpuctl, "out/one", "steps=2", name="one") == "tl1"
    ended(gpuctl, "1")
    assert launch_into(gpuctl, "out/two", *LONG, "save_every=1") == "tl2"
    assert gpuctl("kill", "--grace", "10").code == 0
    ended(gpuctl, "2")
    # tl3 continues tl2 (its checkpoints, in tl2's output_dir and run home) and is still running.
    resumed = gpuctl("launch", "--resume", "2", "--python", "fake-trainer", "--set", "fake.save_every=0", "--json")
    assert resumed.code == 0 and resumed.json()["state"] == "running", resumed.stderr
    before = tree(gpuctl)
    assert {"out/one/checkpoints", "out/two/checkpoints", "train_tl3.log"} <= before

    for refused in (["3"], ["1", "3"]):  # an active run, alone or among finished ones: nothing removed
        rm = gpuctl("runs", "rm", *refused)
        assert rm.code == 5 and rm.stdout == "", rm.stderr
        assert rm.stderr.count("\n") == 1 and "tl3 is active in CT" in rm.stderr, rm.stderr
        assert "nothing was removed" in rm.stderr
        assert tree(gpuctl) == before

    dry = gpuctl("runs", "rm", "--dry-run", "one", "--json")
    assert dry.code == 0, dry.stderr
    [planned] = dry.json()["runs"]
    assert (planned["run_id"], planned["name"], planned["state"]) == ("tl1", "one", "succeeded")
    assert {p.removeprefix("/workspace/") for p in planned["paths"]} == own_files(1, "out/one")
    assert dry.json()["dry_run"] is True and tree(gpuctl) == before  # nothing removed

    rm = gpuctl("runs", "rm", "one")
    assert rm.code == 0 and "removed tl1 (one)" in rm.stdout, rm.stderr
    gone = {p for p in before if p in own_files(1, "out/one") or p.startswith("out/one/")}
    assert before - tree(gpuctl) == gone and tree(gpuctl) <= before  # exactly tl1's: nothing of tl2's or tl3's
    assert gone >= {"out/one/export/model.safetensors", ".gpuctl/tl1.json", "train_tl1.log"}

    # tl2 has ended, but tl3 continues in its directory: tl2's log and record go, the checkpoints stay.
    before = tree(gpuctl)
    rm = gpuctl("runs", "rm", "2", "--json")
    assert rm.code == 0, rm.stderr
    [removal] = rm.json()["runs"]
    assert removal["kept"] == [{"path": "/workspace/out/two", "why": "tl3 uses it too"}]
    assert before - tree(gpuctl) == own_files(2, "out/two") - {"out/two"}
    assert gpuctl.status("--run", "3")["state"] == "running"
    assert [r["run_id"] for r in gpuctl("runs", "--json").json()] == ["tl3"]
    unknown = gpuctl("runs", "rm", "2")
    assert unknown.code == 2 and "no run tl2" in unknown.stderr


def test_runs_prune_keeps_the_newest_finished_runs_and_never_an_active_one(gpuctl):
    for k in (1, 2, 3):
        assert launch_into(gpuctl, f"out/{k}", "steps=1") == f"tl{k}"
        ended(gpuctl, str(k))
    assert launch_into(gpuctl, "out/4", *LONG) == "tl4"
    before = tree(gpuctl)

    dry = gpuctl("runs", "prune", "--keep", "1", "--dry-run")
    assert dry.code == 0, dry.stderr
    assert "would remove tl1" in dry.stdout and "would remove tl2" in dry.stdout and "tl3" not in dry.stdout
    assert tree(gpuctl) == before

    pruned = gpuctl("runs", "prune", "--keep", "1", "--json")
    assert pruned.code == 0, pruned.stderr
    assert [r["run_id"] for r in pruned.json()["runs"]] == ["tl1", "tl2"]
    assert before - tree(gpuctl) == {p for p in before for k in (1, 2)
                                     if p in own_files(k, f"out/{k}") or p.startswith(f"out/{k}/")}
    assert [r["run_id"] for r in gpuctl("runs", "--json").json()] == ["tl3", "tl4"]

    pruned = gpuctl("runs", "prune", "--keep", "0", "--json")  # the active run stays, whatever K
    assert [r["run_id"] for r in pruned.json()["runs"]] == ["tl3"]
    assert gpuctl.status("--run", "4")["state"] == "running"
    assert gpuctl("runs", "prune", "--keep", "0").stdout.startswith("nothing to remove")

    assert gpuctl("kill", "--grace", "10").code == 0
    assert [r["run_id"] for r in gpuctl("runs", "prune", "--keep", "0", "--json").json()["runs"]] == ["tl4"]
    assert gpuctl("runs", "--json").json() == []
    # A removed run's number is never taken again: tl5, not tl1.
    assert launch_into(gpuctl, "out/5", "steps=1") == "tl5"


def test_runs_rm_over_the_nodes_of_a_multi_node_run(two_containers):
    nodes = two_containers
    launched = nodes.launch_fake(*LONG, extra=("--name", "wide", *nodes.rendezvous_args()))
    assert launched.code == 0, launched.stderr
    records = [nodes.path(k, "/workspace/.gpuctl/tl1.json") for k in (0, 1)]
    doc = nodes.gpuctl("status", "--run", "wide", "--json").json()
    assert (doc["run_id"], doc["name"], [n["node"] for n in doc["nodes"]]) == ("tl1", "wide", [0, 1])
    assert "run tl1 on 2 nodes" in nodes.gpuctl("status", "--run", "wide").stdout
    refused = nodes.gpuctl("runs", "rm", "wide")  # the remembered nodes: active on both
    assert refused.code == 5 and "nothing was removed on any node" in refused.stderr, refused.stderr
    assert all(record.exists() for record in records)

    assert nodes.gpuctl("kill", "--grace", "10").code == 0
    removed = nodes.gpuctl("runs", "rm", "wide", "--json")
    assert removed.code == 0, removed.stderr
    assert [(n["node"], [r["run_id"] for r in n["runs"]]) for n in removed.json()["nodes"]] == [(0, ["tl1"]),
                                                                                                (1, ["tl1"])]
    assert not any(record.exists() for record in records)
    assert not any(nodes.path(k, "/workspace/train_tl1.log").exists() for k in (0, 1))
