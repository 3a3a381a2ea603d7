"""Layouts (training/layout.py): topology strings, the auto model and its choice, and the trainer on every
role: colocated equals disaggregated, auto picks a layout on CPU devices, the random 8B-shaped preset at a
reduced width, a resume that extends max_steps."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest

from training.config import ConfigError, load_config
from training.layout import (
    Layout,
    StageProfile,
    candidate_layouts,
    choose_layout,
    estimate_memory,
    explicit_layout,
    layout_from_topology,
    predict_sequences_per_s,
)
from training.train import main
from training.trainer import CosineSchedule

GIB = 2**30


def test_topologies_name_layouts():
    assert layout_from_topology("colocated", ["cuda:0", "cuda:1"]) == Layout(colocated=("cuda:0", "cuda:1"))
    assert layout_from_topology("1:2", ["cuda:0", "cuda:1", "cuda:2"]) == Layout(("cuda:0",), ("cuda:1", "cuda:2"))
    assert layout_from_topology("1:1", ["cuda:0"]) == Layout(("cuda:0",), ("cuda:0",))  # both threads on one GPU
    with pytest.raises(ConfigError, match="needs 3 devices"):
        layout_from_topology("1:2", ["cuda:0", "cuda:1"])
    for bad in ("2", "0:1", "x:y", "serial"):
        with pytest.raises(ConfigError, match="topology must be"):
            load_config("tiny", [f"topology={bad}"])


def test_explicit_keys_win_and_keep_their_old_meaning():
    assert explicit_layout([], [], []) is None
    assert explicit_layout([0], [1], []) == Layout(("cuda:0",), ("cuda:1",))
    assert explicit_layout([0], [], []) == Layout(("cuda:0",), ("cpu",))  # the other one's old default
    assert explicit_layout([1], [2], [0]).name == "1:1 + 1 colocated"
    config = load_config("qwen3-8b", ["target_devices=[0]", "drafter_devices=[1]"])
    assert (config.topology, config.devices) == ("auto", [0])  # the preset's, ignored: explicit keys win


def test_candidates_give_each_device_one_role():
    names = [layout.name for layout in candidate_layouts(["a", "b", "c"])]
    assert names == ["colocated", "1:1 + 1 colocated", "1:2", "2:1"]
    assert [layout.name for layout in candidate_layouts(["a"])] == ["colocated"]


PROFILE = StageProfile(target_s=0.084, drafter_s=0.168, rows=1, tokens_per_sequence=3072)


def test_the_model_adds_colocated_capacity_to_the_slower_stage():
    many = 840  # micro-batches a step: the step granularity vanishes
    colocated = Layout(colocated=tuple(f"cuda:{i}" for i in range(8)))
    split = Layout(targets=("cuda:0", "cuda:1", "cuda:2"), drafters=tuple(f"cuda:{i}" for i in range(3, 8)))
    mix = Layout(targets=("cuda:2",), drafters=("cuda:3", "cuda:4"), colocated=("cuda:0", "cuda:1"))
    assert predict_sequences_per_s(colocated, PROFILE, many) == pytest.approx(8 / 0.252)
    assert predict_sequences_per_s(split, PROFILE, many) == pytest.approx(min(3 / 0.084, 5 / 0.168), rel=1e-2)
    assert predict_sequences_per_s(mix, PROFILE, many) == pytest.approx(2 / 0.252 + 2 / 0.168, rel=1e-2)


def test_with_one_micro_batch_a_step_a_split_beats_colocated_replicas():
    """The recipe's batch_size 1: a step is one sequence, so only one replica works."""
    one = choose_layout(["cuda:0", "cuda:1"], PROFILE, micro_batches=1, queue_depth=4)
    assert one.chosen.layout.name == "1:1"
    assert one.chosen.tokens_per_s == pytest.approx(3072 / 0.168)
    two = choose_layout(["cuda:0", "cuda:1"], PROFILE, micro_batches=2, queue_depth=4)
    assert two.chosen.layout.name == "colocated"
    assert two.chosen.tokens_per_s == pytest.approx(2 * 3072 / 0.252)
    single = choose_layout(["cuda:0"], PROFILE, micro_batches=1, queue_depth=4)
    assert single.chosen.layout == Layout(colocated=("cuda:0",))


def test_memory_decides_when_colocated_does_not_fit():
    profile = StageProfile(0.08, 0.17, 1, 3072, target_static=60 * GIB, target_peak=2 * GIB,
                           drafter_static=20 * GIB, drafter_peak=30 * GIB, features=GIB // 8,
                           device_memory={"cuda:0": 80 * GIB, "cuda:1": 80 * GIB})
    colocated = Layout(colocated=("cuda:0",))
    assert estimate_memory(colocated, profile, 4)["cuda:0"] == (60 + 20 + 30) * GIB + GIB // 8  # larger peak
    choice = choose_layout(["cuda:0", "cuda:1"], profile, micro_batches=2, queue_depth=4)
    assert choice.chosen.layout.name == "1:1" and not choice.candidates[0].fits
    tight = StageProfile(**{**profile.__dict__, "device_memory": {"cuda:0": 40 * GIB, "cuda:1": 40 * GIB}})
    with pytest.raises(ConfigError, match="fits in memory"):
        choose_layout(["cuda:0", "cuda:1"], tight, micro_batches=2, queue_depth=4)


def test_a_longer_run_continues_the_schedule_from_the_checkpoints_rate():
    schedule = CosineSchedule(100, 0.04)
    before = [schedule(k) for k in range(60)]
    schedule.continue_to(60, 300)
    after = [schedule(k) for k in range(60, 300)]
    assert after[0] < before[-1] and all(a > b for a, b in itertools.pairwise(after))  # no jump, always down
    assert min(after) > 0 and after[-1] < 1e-3 * before[-1]  # never 0 before the end, about 0 at it
    unchanged = CosineSchedule(100, 0.04)
    assert [unchanged(k) for k in range(100)] == [CosineSchedule(100, 0.04)(k) for k in range(100)]
    assert math.isclose(unchanged(99) + 1.0, 1.0, abs_tol=1e-3)


# The real trainer on the tiny world (CPU threads, float32).
def tiny_args(world, output_dir: Path, *overrides: str) -> list[str]:
    sets = [*world.overrides(output_dir), "num_threads=1", "eval_every=0", "log_every=1", *overrides]
    return ["--config", "tiny"] + [a for s in sets for a in ("--set", s)]


def records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def losses(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(output_dir) if "loss" in r}


@pytest.mark.e2e
def test_the_colocated_role_trains_like_a_target_drafter_pair(tiny_world, tmp_path):
    """One colocated thread and a target:drafter pair compute the same micro-batches in the same order."""
    steps = ["max_steps=6"]
    assert main(tiny_args(tiny_world, tmp_path / "c", *steps, 'devices="cpu"', "topology=colocated")) == 0
    assert main(tiny_args(tiny_world, tmp_path / "d", *steps, 'target_devices=["cpu"]',
                          'drafter_devices=["cpu"]')) == 0
    colocated, pair = losses(tmp_path / "c"), losses(tmp_path / "d")
    assert sorted(colocated) == list(range(1, 7))
    assert colocated == pytest.approx(pair, rel=1e-6, abs=0)
    assert records(tmp_path / "c")[0]["layout"] == "colocated" and records(tmp_path / "d")[0]["layout"] == "1:1"


@pytest.mark.e2e
def test_auto_measures_and_picks_a_layout_on_cpu_devices(tiny_world, tmp_path, capsys):
    args = tiny_args(tiny_world, tmp_path, "max_steps=4", 'devices=["cpu", "cpu"]', "topology=auto",
                     "micro_batch_size=4", "log_every=2")
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "layout auto: " in out and "predicted" in out
    first, second = [r for r in records(tmp_path) if "loss" in r]
    auto = first["layout_auto"]
    assert {c["layout"] for c in auto["candidates"]} == {"colocated", "1:1"}
    assert auto["chosen"]["name"] == first["layout"] == second["layout"]
    assert auto["target_ms_per_sequence"] > 0 and auto["drafter_ms_per_sequence"] > 0
    assert first["predicted_tokens_per_s"] == auto["predicted_tokens_per_s"] > 0
    assert set(first["peak_memory_gib"]) == {"cpu"} and first["tflops_per_s"] > 0
    assert "layout auto: " + first["layout"] + ": measured" in out


@pytest.mark.e2e
def test_qwen3_8b_random_builds_at_a_reduced_width_and_trains(tmp_path):
    """The 8B-shaped random preset, narrowed for the CPU: served-format checks, synthetic data, two steps."""
    sets = ["random_target=qwen3-8b-narrow", 'devices="cpu"', "dtype=auto", "attention=auto", "max_length=160",
            "length_buckets=[160]", "num_anchors=8", "max_steps=2", "log_every=1", "eval_every=2",
            "eval_prompts=2", "eval_new_tokens=16", f"output_dir={tmp_path}", "num_threads=1"]
    assert main(["--config", "qwen3-8b-random"] + [a for s in sets for a in ("--set", s)]) == 0
    trained = [r for r in records(tmp_path) if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2] and all(math.isfinite(r["loss"]) for r in trained)
    assert trained[0]["layout"] == "colocated"
    served = json.loads((tmp_path / "export" / "config.json").read_text())
    assert served["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33] and served["num_target_layers"] == 36
    assert served["dflash_config"]["mask_token_id"] < served["vocab_size"]


def test_the_random_preset_is_the_8b_recipe_on_a_random_target():
    config = load_config("qwen3-8b-random")
    recipe = load_config("qwen3-8b")
    assert config.random_target == "qwen3-8b" and (config.topology, config.devices) == ("auto", [0])
    for key in ("lr", "warmup_ratio", "grad_clip", "max_length", "num_anchors", "block_size", "gamma",
                "num_draft_layers", "target_layers", "dtype", "attention"):
        assert getattr(config, key) == getattr(recipe, key), key


@pytest.mark.e2e
def test_resume_with_a_larger_max_steps_continues_the_learning_rate(tiny_world, tmp_path):
    args = tiny_args(tiny_world, tmp_path, "max_steps=12", "save_every=6", "keep_checkpoints=5")
    assert main(args) == 0
    first = {r["step"]: r["lr"] for r in records(tmp_path) if "lr" in r}
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000012")  # resume from step 6 of 12 ...
    (tmp_path / "metrics.jsonl").unlink()
    assert main(args + ["--set", "max_steps=30", "--resume"]) == 0  # ... to 30
    resumed = {r["step"]: r["lr"] for r in records(tmp_path) if "lr" in r}
    assert sorted(resumed) == list(range(7, 31))
    rates = [resumed[step] for step in range(7, 31)]
    assert min(rates) > 0  # never 0, the first resumed step included
    assert rates[0] < first[6] and all(a > b for a, b in itertools.pairwise(rates))  # from the checkpoint's, down
    # Resuming the extended run again with the same max_steps is exact.
    again = {r["step"]: r for r in records(tmp_path)}
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000030")
    (tmp_path / "metrics.jsonl").unlink()
    assert main(args + ["--set", "max_steps=30", "--resume"]) == 0
    third = {r["step"]: r for r in records(tmp_path) if "lr" in r}
    assert sorted(third) == list(range(25, 31))  # from step 24, saved by the extended run itself
    assert all((third[s]["lr"], third[s]["loss"]) == (again[s]["lr"], again[s]["loss"]) for s in third)


def test_peak_memory_and_layout_are_in_the_metrics_line():
    from training.metrics import format_progress

    line = format_progress({"step": 3, "total_steps": 9, "elapsed_s": 1.0, "loss": 1.0, "layout": "1:1",
                            "peak_memory_gib": {"cuda:0": 40.5, "cuda:1": 21.0}})
    assert "layout 1:1" in line and "mem 40.5 GiB" in line
