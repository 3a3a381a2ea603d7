"""The recipe's switches a run can name (ARCHITECTURE §5, "Sample efficiency"): schedule = "wsd" and
init_layers = "target", on their own and in the real trainer on the tiny world."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from training.config import ConfigError, load_config
from training.model.drafter import Drafter, DrafterConfig
from training.serve.warm_start import copy_target_layers
from training.train import main
from training.trainer.schedule import CosineSchedule, WSDSchedule, make_schedule


def test_wsd_warms_up_holds_the_rate_then_decays_linearly_to_zero_over_the_last_fraction():
    schedule = WSDSchedule(100, 0.04, 0.2)
    factors = [schedule(k) for k in range(100)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4:80] == [1.0] * 76  # stable: a checkpoint here has trained at the full rate
    decay = factors[80:]
    assert all(a > b for a, b in itertools.pairwise(decay)) and decay[-1] == pytest.approx(1 / 21)
    assert decay[0] == pytest.approx(20 / 21)
    assert isinstance(make_schedule("cosine", 100, 0.04, 0.2), CosineSchedule)


def test_a_wsd_run_resumed_in_its_stable_phase_with_more_steps_moves_its_decay_to_the_new_end():
    resumed = WSDSchedule(100, 0.04, 0.2)
    resumed.continue_to(60, 200)
    planned = WSDSchedule(200, 0.04, 0.2)
    # From the checkpoint on, the rate is what a 200-step plan gives (its warm-up is long past).
    assert [resumed(k) for k in range(60, 200)] == [planned(k) for k in range(60, 200)]
    assert resumed(159) == 1.0 and resumed(199) == pytest.approx(1 / 41)


def test_a_wsd_run_resumed_in_its_decay_goes_on_down_from_its_rate_without_a_jump():
    schedule = WSDSchedule(100, 0.04, 0.2)
    before = schedule(89)
    schedule.continue_to(90, 150)
    after = [schedule(k) for k in range(90, 150)]
    assert after[0] < before and all(a > b for a, b in itertools.pairwise(after)) and min(after) > 0


def test_schedule_and_init_layers_take_their_choices_only():
    assert load_config("tiny", ["schedule=wsd", "init_layers=target"]).schedule == "wsd"
    with pytest.raises(ConfigError, match="^schedule must be one of cosine, wsd, got 'linear'$"):
        load_config("tiny", ["schedule=linear"])
    with pytest.raises(ConfigError, match="^init_layers must be one of random, target"):
        load_config("tiny", ["init_layers=copy"])
    with pytest.raises(ConfigError, match="decay_ratio must be in"):
        load_config("tiny", ["decay_ratio=0.99", "warmup_ratio=0.1"])
    with pytest.raises(ConfigError, match='init_layers = "target" and init_from'):
        load_config("tiny", ["init_layers=target", "init_from=/some/export"])


def small_llama() -> transformers.LlamaForCausalLM:
    """SmolLM2's kind of target (Llama: no q/k norms), tiny and random, built here."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_init_layers_target_copies_the_targets_top_layers_and_final_norm():
    target = small_llama()
    config = DrafterConfig.from_target(target.config, 2, 8, [1, 3], mask_token_id=5)
    embedding = target.get_input_embeddings().weight
    drafter = Drafter(config, embedding, embedding)
    fc_before, q_norm_before = drafter.fc.weight.clone(), drafter.layers[0].q_norm.weight.clone()
    torch.nn.init.normal_(target.model.norm.weight)  # so that a copy is told from the ones it replaces
    assert copy_target_layers(drafter, target) == [4, 5]
    for ours, theirs in zip(drafter.layers, target.model.layers[4:]):
        assert torch.equal(ours.q_proj.weight, theirs.self_attn.q_proj.weight)
        assert torch.equal(ours.v_proj.weight, theirs.self_attn.v_proj.weight)
        assert torch.equal(ours.down_proj.weight, theirs.mlp.down_proj.weight)
        assert torch.equal(ours.input_norm.weight, theirs.input_layernorm.weight)
        assert torch.equal(ours.post_attention_norm.weight, theirs.post_attention_layernorm.weight)
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)
    # What the target has no weight for keeps its fresh value: the fusion layer, Llama's missing q/k norms.
    assert torch.equal(drafter.fc.weight, fc_before) and torch.equal(drafter.layers[0].q_norm.weight, q_norm_before)


def test_init_layers_target_refuses_a_drafter_deeper_than_the_target_in_one_line():
    target = small_llama()
    config = DrafterConfig.from_target(target.config, 7, 8, [1, 3], mask_token_id=5)
    embedding = target.get_input_embeddings().weight
    with pytest.raises(ConfigError, match="the drafter has 7 layers, the target only 6"):
        copy_target_layers(Drafter(config, embedding, embedding), target)


def tiny_args(world, output_dir: Path, *overrides: str) -> list[str]:
    sets = [*world.overrides(output_dir), "num_threads=1", "eval_every=0", "log_every=1", *overrides]
    return ["--config", "tiny"] + [a for s in sets for a in ("--set", s)]


def lrs(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in map(json.loads, metrics.read_text().splitlines()) if "lr" in r}


def test_a_wsd_run_from_the_targets_layers_trains_and_a_second_call_continues_it(tiny_world, tmp_path, capsys):
    """Two calls train one run: a 12-step WSD plan's checkpoint at step 4 (its stable phase; the later ones
    removed, as if the first call had been stopped there), resumed to 24 steps: the rate stays at lr past step
    12 and the decay comes in the last quarter of 24."""
    out = tmp_path / "run"
    sets = ["schedule=wsd", "decay_ratio=0.25", "init_layers=target", "save_every=4", "warmup_ratio=0.1",
            "keep_checkpoints=5"]
    assert main(tiny_args(tiny_world, out, "max_steps=12", *sets)) == 0
    assert "the drafter's layers start as the target's layers" in capsys.readouterr().out
    for late in ("step_00000008", "step_00000012"):
        shutil.rmtree(out / "checkpoints" / late)
    (out / "metrics.jsonl").unlink()
    assert main(tiny_args(tiny_world, out, "max_steps=24", *sets) + ["--resume"]) == 0
    rates = lrs(out / "metrics.jsonl")
    lr = load_config("tiny").lr
    assert [rates[step] for step in range(5, 19)] == [pytest.approx(lr)] * 14  # stable past the first plan's end
    assert all(a > b for a, b in itertools.pairwise(rates[step] for step in range(19, 25)))
