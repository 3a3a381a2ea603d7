"""Layouts (training/layout/roles.py): topology strings, the auto model and its choice, and the trainer on every
role: colocated equals disaggregated, auto picks a layout on CPU devices, the random 8B-shaped preset at a
reduced width, a resume that extends max_steps."""

from __future__ import annotations

import itertools
import json
import math
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from training.config import ConfigError, load_config
from training.layout.roles import (
    Layout,
    RoleProfile,
    candidate_layouts,
    choose_layout,
    estimate_memory,
    explicit_layout,
    layout_from_topology,
    measure_shared,
    step_seconds,
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


PROFILE = RoleProfile(target_s=0.084, drafter_s=0.168, rows=1, tokens_per_sequence=3072)


def predict_sequences_per_s(layout: Layout, profile: RoleProfile, micro_batches: int) -> float:
    """The model's sequences a second: a step's sequences over its modelled time."""
    return micro_batches * profile.rows / step_seconds(layout, profile, micro_batches)


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
    profile = RoleProfile(0.08, 0.17, 1, 3072, target_static=60 * GIB, target_peak=2 * GIB,
                           drafter_static=20 * GIB, drafter_peak=30 * GIB, features=GIB // 8,
                           device_memory={"cuda:0": 80 * GIB, "cuda:1": 80 * GIB})
    colocated = Layout(colocated=("cuda:0",))
    assert estimate_memory(colocated, profile, 4)["cuda:0"] == (60 + 20 + 30) * GIB + GIB // 8  # larger peak
    choice = choose_layout(["cuda:0", "cuda:1"], profile, micro_batches=2, queue_depth=4)
    assert choice.chosen.layout.name == "1:1" and not choice.candidates[0].fits
    tight = RoleProfile(**{**profile.__dict__, "device_memory": {"cuda:0": 40 * GIB, "cuda:1": 40 * GIB}})
    with pytest.raises(ConfigError, match="fits in memory"):
        choose_layout(["cuda:0", "cuda:1"], tight, micro_batches=2, queue_depth=4)


def test_on_gpus_auto_offers_a_target_and_a_drafter_thread_sharing_each_device():
    faster = RoleProfile(**{**PROFILE.__dict__, "shared_s": 0.200})  # the pair overlaps: under 0.084 + 0.168
    single = choose_layout(["cuda:0"], faster, micro_batches=1, queue_depth=4)
    assert single.chosen.layout == Layout(targets=("cuda:0",), drafters=("cuda:0",))  # topology 1:1 on one GPU
    assert single.chosen.tokens_per_s == pytest.approx(3072 / 0.200)
    assert [c.layout.name for c in single.candidates] == ["colocated", "1:1"]
    assert single.as_dict()["shared_ms_per_sequence"] == 200.0 and "200.0 ms as a pair" in single.summary()
    two = choose_layout(["cuda:0", "cuda:1"], faster, micro_batches=2, queue_depth=4)
    assert two.chosen.layout == Layout(targets=("cuda:0", "cuda:1"), drafters=("cuda:0", "cuda:1"))
    assert two.chosen.tokens_per_s == pytest.approx(2 * 3072 / 0.200)
    slower = RoleProfile(**{**PROFILE.__dict__, "shared_s": 0.300})  # contention worse than the serial loop
    assert choose_layout(["cuda:0"], slower, 1, 4).chosen.layout == Layout(colocated=("cuda:0",))
    # Not measured, or not GPUs: no pair is offered.
    assert [c.layout.name for c in choose_layout(["cuda:0"], PROFILE, 1, 4).candidates] == ["colocated"]
    assert [c.layout.name for c in choose_layout(["cpu"], faster, 1, 4).candidates] == ["colocated"]


def test_a_pair_sharing_a_gpu_needs_both_threads_memory():
    sizes = {"target_static": 16 * GIB, "target_peak": 4 * GIB, "drafter_static": 12 * GIB,
             "drafter_peak": 26 * GIB, "features": GIB // 4, "shared_s": 0.2}
    roomy = RoleProfile(0.07, 0.14, 1, 3072, **sizes, device_memory={"cuda:0": 140 * GIB})
    pair = Layout(targets=("cuda:0",), drafters=("cuda:0",))
    assert estimate_memory(pair, roomy, 4)["cuda:0"] == (16 + 4 + 12 + 26) * GIB + 5 * GIB // 4  # 4 queued + 1
    assert choose_layout(["cuda:0"], roomy, 1, 4).chosen.layout == pair
    # 0.9 x 62 GiB: colocated's 54.25 GiB fits, the pair's 59.25 does not.
    tight = RoleProfile(**{**roomy.__dict__, "device_memory": {"cuda:0": 62 * GIB}})
    choice = choose_layout(["cuda:0"], tight, 1, 4)
    assert choice.chosen.layout == Layout(colocated=("cuda:0",)) and not choice.candidates[1].fits


class Spans:
    """Which thread ran each call, and when."""

    def __init__(self):
        self.calls: list[tuple[str, int, float, float]] = []

    def timed(self, role: str, seconds: float, fail_at: int | None = None):
        def call(*_args):
            start = time.perf_counter()
            if fail_at is not None and sum(c[0] == role for c in self.calls) == fail_at:
                raise RuntimeError(f"{role} failed")
            time.sleep(seconds)  # sleeps release the GIL, as CUDA kernels and torch's CPU ops do
            self.calls.append((role, threading.get_ident(), start, time.perf_counter()))
            return torch.zeros(1)
        return call


def test_the_trial_pair_runs_the_target_in_its_own_thread_beside_the_drafter():
    spans = Spans()
    per_sequence = measure_shared(torch.device("cpu"), ["a", "b"], 2, spans.timed("target", 0.02),
                                  spans.timed("drafter", 0.05), steps=5)
    targets = [c for c in spans.calls if c[0] == "target"]
    drafters = [c for c in spans.calls if c[0] == "drafter"]
    assert len(drafters) == 5 and len(targets) >= 5  # the target ran ahead, over the batches again and again
    assert {c[1] for c in drafters} == {threading.get_ident()} and threading.get_ident() not in {c[1] for c in targets}
    assert any(t[2] < d[3] and d[2] < t[3] for t in targets for d in drafters)  # at once, not in turns
    assert per_sequence >= 0.05 / 2  # per sequence (2 a micro-batch), from the first drafter step's end
    assert not [t for t in threading.enumerate() if t.name.startswith("layout trial")]  # nothing left running


def test_a_failure_in_either_thread_of_the_trial_pair_ends_both_and_is_raised():
    for failing in ("target", "drafter"):
        spans = Spans()
        target = spans.timed("target", 0.01, fail_at=3 if failing == "target" else None)
        drafter = spans.timed("drafter", 0.02, fail_at=2 if failing == "drafter" else None)
        with pytest.raises(RuntimeError, match=f"{failing} failed"):
            measure_shared(torch.device("cpu"), ["a"], 1, target, drafter, steps=8)
        assert not [t for t in threading.enumerate() if t.name.startswith("layout trial")]


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
    assert auto["shared_ms_per_sequence"] > 0  # the pair is measured on CPUs too (and offered on GPUs only)
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
    from training.output.metrics import format_progress

    line = format_progress({"step": 3, "total_steps": 9, "elapsed_s": 1.0, "loss": 1.0, "layout": "1:1",
                            "peak_memory_gib": {"cuda:0": 40.5, "cuda:1": 21.0}})
    assert "layout 1:1" in line and "mem 40.5 GiB" in line
