"""Each run its own directory (training/output/run_home.py): <runs_dir>/<run home>, the home from $GPUCTL_RUN_HOME or,
by hand, the next free run<N>; every checkpoint and export records the run that wrote it; an explicit
output_dir keeps its meaning (overwrite_output included)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from training.config import ConfigError, load_config
from training.output.checkpoint import checkpoint_run, latest_checkpoint, list_checkpoints
from training.output.run_home import resolve_run_dir
from training.serve.export import main as export_main
from training.train import main

pytestmark = pytest.mark.e2e
FAST = ["num_threads=1", "max_steps=2", "eval_every=0", "log_every=1", "save_every=2"]


def args_for(world, runs_dir: Path, *overrides: str, resume: bool = False) -> list[str]:
    """The tiny preset on the test world, each run under `runs_dir` (output_dir left unset)."""
    sets = [o for o in world.overrides(Path("unused")) if not o.startswith("output_dir=")]
    sets += [f"runs_dir={runs_dir}", *FAST, *overrides]
    return ["--config", "tiny", *[a for s in sets for a in ("--set", s)], *(["--resume"] if resume else [])]


def export_of(run: Path) -> dict:
    return json.loads((run / "export" / "config.json").read_text())["gpuctl"]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def gpuctl_env(monkeypatch):
    """Set what gpuctl's wrapper sets for run `tlN` (home `home`, tlN's own unless given)."""
    def setting(number: int, home: str | None = None) -> None:
        monkeypatch.setenv("GPUCTL_RUN_ID", f"tl{number}")
        monkeypatch.setenv("GPUCTL_RUN_HOME", home or f"tl{number}")
    monkeypatch.delenv("GPUCTL_METRICS", raising=False)
    monkeypatch.delenv("GPUCTL_RUN_ID", raising=False)
    monkeypatch.delenv("GPUCTL_RUN_HOME", raising=False)
    return setting


# ---- resolving the directory ---------------------------------------------------------------------------------


def test_the_run_home_names_the_directory_and_by_hand_the_next_free_run_n_counts_as_numbers(tmp_path):
    config = load_config("tiny", [f"runs_dir={tmp_path}"])
    assert config.output_dir == "" and config.runs_dir == str(tmp_path)
    got = resolve_run_dir(config, False, {"GPUCTL_RUN_HOME": "tl4"})
    assert (got.config.output_dir, got.home, got.per_run) == (str(tmp_path / "tl4"), "tl4", True)
    assert got.line == f"run home tl4 ($GPUCTL_RUN_HOME): this run writes {tmp_path / 'tl4'}"
    assert resolve_run_dir(config, False, {}).home == "run1"
    assert resolve_run_dir(config, True, {}).home == "run1"  # --resume with nothing to resume: run1, step 0
    for name in ("run2", "run9", "run10", "tl30", "runx"):
        (tmp_path / name).mkdir()
    assert resolve_run_dir(config, False, {}).home == "run11"
    resumed = resolve_run_dir(config, True, {})
    assert resumed.home == "run10" and "--resume: the newest run<N>" in resumed.line
    assert resolve_run_dir(config, True, {"GPUCTL_RUN_HOME": "tl30"}).home == "tl30"
    with pytest.raises(ConfigError, match="GPUCTL_RUN_HOME='../x' is not a directory name"):
        resolve_run_dir(config, False, {"GPUCTL_RUN_HOME": "../x"})


def test_an_explicit_output_dir_is_kept_as_it_is(tmp_path):
    config = load_config("tiny", [f"output_dir={tmp_path / 'mine'}"])
    got = resolve_run_dir(config, False, {"GPUCTL_RUN_HOME": "tl4"})
    assert got.config is config and got.home == "mine" and not got.per_run
    with pytest.raises(ConfigError, match="runs_dir and output_dir are both empty"):
        load_config("tiny", ["runs_dir="])


# ---- runs of one preset --------------------------------------------------------------------------------------


def test_two_gpuctl_runs_of_one_preset_write_their_own_directories_and_exports(tiny_world, tmp_path, gpuctl_env,
                                                                               capsys):
    runs = tmp_path / "runs"
    gpuctl_env(1)
    assert main(args_for(tiny_world, runs)) == 0
    assert f"run home tl1 ($GPUCTL_RUN_HOME): this run writes {runs / 'tl1'}" in capsys.readouterr().out
    gpuctl_env(2)
    assert main(args_for(tiny_world, runs, "seed=1")) == 0
    assert sorted(p.name for p in runs.iterdir()) == ["tl1", "tl2"]
    for number in (1, 2):
        run = runs / f"tl{number}"
        assert export_of(run) == {"run": f"tl{number}", "home": f"tl{number}", "checkpoint": "step_00000002",
                                  "step": 2}
        assert checkpoint_run(latest_checkpoint(run)) == {"id": f"tl{number}", "home": f"tl{number}"}
        assert (run / "metrics.jsonl").is_file()
    assert sha(runs / "tl1" / "export" / "model.safetensors") != sha(runs / "tl2" / "export" / "model.safetensors")


def test_a_resume_with_the_home_of_tl1_continues_tl1s_directory(tiny_world, tmp_path, gpuctl_env, capsys):
    runs = tmp_path / "runs"
    gpuctl_env(1)
    assert main(args_for(tiny_world, runs)) == 0
    gpuctl_env(3, home="tl1")  # `launch --resume` of tl1 is run tl3, continuing tl1's home
    assert main(args_for(tiny_world, runs, "max_steps=4", "save_every=4", resume=True)) == 0
    assert f"resumed from {runs / 'tl1' / 'checkpoints' / 'step_00000002'} at step 2" in capsys.readouterr().out
    assert sorted(p.name for p in runs.iterdir()) == ["tl1"]
    assert export_of(runs / "tl1") == {"run": "tl3", "home": "tl1", "checkpoint": "step_00000004", "step": 4}
    # A fresh run that finds checkpoints in its home is refused, and deletes nothing.
    gpuctl_env(4, home="tl1")
    assert main(args_for(tiny_world, runs)) == 2
    assert "already holds checkpoints of an earlier run" in capsys.readouterr().err
    assert [p.name for p in list_checkpoints(runs / "tl1")] == ["step_00000002", "step_00000004"]
    assert export_of(runs / "tl1")["run"] == "tl3"


def test_by_hand_runs_take_run1_then_run2_and_resume_continues_the_newest(tiny_world, tmp_path, gpuctl_env,
                                                                          capsys):
    runs = tmp_path / "runs"
    assert main(args_for(tiny_world, runs)) == 0
    assert main(args_for(tiny_world, runs, "seed=1")) == 0
    assert sorted(p.name for p in runs.iterdir()) == ["run1", "run2"]
    assert export_of(runs / "run1") == {"run": None, "home": "run1", "checkpoint": "step_00000002", "step": 2}
    assert export_of(runs / "run2")["home"] == "run2"
    capsys.readouterr()
    assert main(args_for(tiny_world, runs, "seed=1", "max_steps=4", "save_every=4", resume=True)) == 0
    out = capsys.readouterr().out
    assert "run home run2 (--resume: the newest run<N> under" in out
    assert f"resumed from {runs / 'run2' / 'checkpoints' / 'step_00000002'} at step 2" in out
    assert export_of(runs / "run2")["step"] == 4 and export_of(runs / "run1")["step"] == 2


def test_an_explicit_output_dir_keeps_overwrite_output_refusing_or_replacing(tiny_world, tmp_path, gpuctl_env,
                                                                            capsys):
    out = tmp_path / "shared"
    explicit = args_for(tiny_world, tmp_path / "runs", f"output_dir={out}")
    gpuctl_env(1)
    assert main(explicit + ["--set", "max_steps=4", "--set", "save_every=4"]) == 0
    assert export_of(out) == {"run": "tl1", "home": "shared", "checkpoint": "step_00000004", "step": 4}
    gpuctl_env(2)
    assert main(explicit + ["--set", "overwrite_output=false"]) == 2  # refused as ever
    assert "already holds checkpoints: pass --resume, or set overwrite_output=true" in capsys.readouterr().err
    assert export_of(out)["run"] == "tl1"
    assert main(explicit) == 0  # the preset's overwrite_output=true: tl1's files make way for tl2's
    assert [p.name for p in list_checkpoints(out)] == ["step_00000002"]
    assert export_of(out) == {"run": "tl2", "home": "shared", "checkpoint": "step_00000002", "step": 2}
    assert not (tmp_path / "runs").exists()


def test_a_hand_export_records_the_checkpoints_run_not_the_exporters(tiny_world, tmp_path, gpuctl_env):
    runs = tmp_path / "runs"
    gpuctl_env(1)
    assert main(args_for(tiny_world, runs)) == 0
    gpuctl_env(9)  # exported later, from another run's shell
    assert export_main([str(runs / "tl1"), str(tmp_path / "exported")]) == 0
    gpuctl = json.loads((tmp_path / "exported" / "config.json").read_text())["gpuctl"]
    assert gpuctl == {"run": "tl1", "home": "tl1", "checkpoint": "step_00000002", "step": 2}
