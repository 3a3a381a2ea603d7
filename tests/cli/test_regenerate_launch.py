"""gpuctl launch --task regenerate: python -m training.regenerate detached like a training run (its own numbered
log, a record with task "regenerate", status showing its progress, kill, runs), killed half-way and continued by
`launch --resume`, which runs it again: the module skips every record already written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tenacity import retry, stop_after_delay, wait_fixed

from tests.cli.conftest import REPO

PROMPTS = 96
# Slowed honestly so that a kill lands before the end: one record per generate call, short replies, one thread;
# enough records that a slow status poll on a loaded machine still sees the run well before its end.
SETS = ["build_tiny=false", "target_path=/workspace/tiny-target", "prompts_path=/workspace/prompts.jsonl",
        "output_path=/workspace/regen/out.jsonl", "batch_size=1", "max_new_tokens=24", "num_threads=1"]


def read_records(path: Path) -> dict:
    lines = path.read_text().splitlines()
    records = {r["id"]: r for r in map(json.loads, lines)}
    assert len(records) == len(lines), "an id was written twice"
    return records


@pytest.mark.sshd
@pytest.mark.e2e
def test_regenerate_killed_half_way_then_resumed_writes_every_id_once(gpuctl, tiny_world, tmp_path, monkeypatch):
    from training.config import load_config
    from training.regenerate.run import RegenerateConfig, regenerate

    # The tiny world (the session's, the preset's own builder's), its target copied into the container, and PROMPTS
    # of its conversations as the prompts, with ids.
    world_target = tiny_world.target
    shutil.copytree(world_target, gpuctl.path("/workspace/tiny-target"))
    conversations = tiny_world.train.read_text().splitlines()[:PROMPTS]
    prompts = "".join(json.dumps({"id": f"p{i}", "messages": json.loads(line)["messages"]}) + "\n"
                      for i, line in enumerate(conversations))
    gpuctl.path("/workspace/prompts.jsonl").write_text(prompts)

    args = ["launch", "--task", "regenerate", *(a for s in SETS for a in ("--set", s))]
    launched = gpuctl(*args, "--json")
    assert launched.code == 0, launched.stderr[-3000:]
    doc = launched.json()
    assert (doc["run_id"], doc["task"], doc["config"]) == ("tl1", "regenerate", "tiny-regenerate")
    assert doc["log_path"] == "/workspace/regenerate_tl1.log"
    assert "-m training.regenerate --config tiny-regenerate --set build_tiny=false" in \
        gpuctl.path("/root/gpuctl/run.sh").read_text()

    @retry(stop=stop_after_delay(180), wait=wait_fixed(0.2), reraise=True)
    def records_done() -> int:
        progress = gpuctl.status()["progress"]
        assert progress and progress["step"] >= 8
        return progress["step"]

    done = records_done()
    assert done <= PROMPTS * 3 // 4, f"{done} of {PROMPTS} records before the kill: too fast to stop half-way"
    killed = gpuctl("kill", "--grace", "60")
    assert killed.code == 0, killed.stderr
    status = gpuctl.status()
    assert (status["state"], status["exit_code"], status["task"]) == ("killed", 0, "regenerate")  # SIGTERM: clean
    output = gpuctl.path("/workspace/regen/out.jsonl")
    written = len(read_records(output))
    assert done <= written < PROMPTS
    assert f"stopped: {written} of {PROMPTS} records" in gpuctl.path("/workspace/regenerate_tl1.log").read_text()

    # Resuming a regenerate run is running it again: the same task, config and sets, a new numbered log.
    resumed = gpuctl("launch", "--resume", "--follow", timeout=600)
    assert resumed.code == 0, resumed.stderr[-3000:]
    assert "started tl2 (task regenerate, " in resumed.stderr and "resuming tl1" in resumed.stderr
    assert f"{PROMPTS} records in /workspace/prompts.jsonl; {written} already in /workspace/regen/out.jsonl" \
        in resumed.stdout
    assert resumed.stdout == gpuctl.path("/workspace/regenerate_tl2.log").read_text()
    record = json.loads(gpuctl.path("/workspace/.gpuctl/tl2.json").read_text())
    assert (record["task"], record["resumed_from"], record["sets"]) == ("regenerate", 1, SETS)
    assert " --resume" not in gpuctl.path("/root/gpuctl/run.sh").read_text()  # the module has none
    status = gpuctl.status()
    assert (status["run_id"], status["state"], status["resumed_from"]) == ("tl2", "succeeded", "tl1")
    assert (status["progress"]["step"], status["progress"]["total_steps"]) == (PROMPTS, PROMPTS)
    text = gpuctl("status").stdout
    assert f"records {PROMPTS}/{PROMPTS} (100%)" in text and "config    tiny-regenerate --set " in text
    assert "(task regenerate, resumed tl1)" in text  # the config line ends with its --set values, then the notes
    runs = gpuctl("runs", "--json").json()
    assert [(r["run_id"], r["task"], r["state"]) for r in runs] == [("tl1", "regenerate", "killed"),
                                                                      ("tl2", "regenerate", "succeeded")]

    # The data comes back with `pull --what data`, byte for byte; asking a regenerate run for a model is one line.
    pulled = gpuctl("pull", "--what", "data", str(tmp_path / "pulled"), "--json")
    assert pulled.code == 0, pulled.stderr
    assert pulled.json()["source"] == "/workspace/regen/out.jsonl"
    assert (tmp_path / "pulled").read_bytes() == output.read_bytes()
    model = gpuctl("pull", str(tmp_path / "model"))
    assert model.code == 1 and model.stderr.count("\n") == 1, model.stderr
    assert "tl2 is a regenerate run: its output is a data file, not a model (gpuctl pull --what data)" in model.stderr
    assert not (tmp_path / "model").exists()

    # Every id exactly once, each record what a straight, uninterrupted regeneration of the same prompts makes.
    regenerated = read_records(output)
    assert sorted(regenerated) == sorted(f"p{i}" for i in range(PROMPTS))
    (tmp_path / "prompts.jsonl").write_text(prompts)
    monkeypatch.setenv("GPUCTL_METRICS", str(tmp_path / "metrics.jsonl"))
    straight = [s.replace("/workspace/tiny-target", str(world_target)).replace("/workspace", str(tmp_path))
                for s in SETS]
    assert regenerate(load_config("tiny-regenerate", straight, kind=RegenerateConfig)) == 0
    assert regenerated == read_records(tmp_path / "regen" / "out.jsonl")


def gpuctl_offline(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCTL_", "XDG_"))} | {"HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "gpuctl", "launch", "--host", "h", "--ct", "200", "--dry-run",
                           *args], cwd=REPO, capture_output=True, text=True, check=False, env=env)


def test_launch_task_regenerate_dry_run_and_an_unknown_task(tmp_path):
    planned = gpuctl_offline("--task", "regenerate", "--set", "batch_size=4", home=tmp_path)
    assert planned.returncode == 0, planned.stderr
    assert "-m training.regenerate --config tiny-regenerate --set batch_size=4\n" in planned.stdout
    assert '"/workspace/regenerate_tl' in planned.stdout and '"task": "regenerate"' in planned.stdout
    unknown = gpuctl_offline("--task", "bogus", home=tmp_path)
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert len(unknown.stderr.strip().splitlines()) == 1 and "'bogus' is not one of" in unknown.stderr
