"""Compiled stages beside flex_attention (issue 27, ARCHITECTURE §6): the target's decoder layers compiled once
for every layer, warmed under the lock, proven, sealed; the same features and the same training losses as eager;
a shape outside the warmed keys raises before dynamo compiles; evaluation's shapes stay eager; `compile` set."""

from __future__ import annotations

import json

import pytest
import torch

from training.compile import UnwarmedShapeError
from training.stages import CompiledStage, decoder_layer_forward, resolve_compile
from training.target import Target
from training.train import main as train_main


def compiled_target(world) -> tuple[Target, CompiledStage]:
    target = Target.load(str(world.target), "cpu", torch.float32)
    stage = CompiledStage("target layers", decoder_layer_forward, keys_expected=target.layers_run)
    target.compile_layers(stage)
    return target, stage


def test_compiled_target_layers_give_the_eager_features_and_compile_once(tiny_world):
    target, stage = compiled_target(tiny_world)
    ids = torch.randint(5, 300, (3, 64), generator=torch.Generator().manual_seed(0))
    eager = target.features(ids)  # not compiled=True: eager, as evaluation calls it
    with stage.warming():
        target.features(torch.zeros(3, 64, dtype=torch.long), compiled=True)
    stage.seal()
    compiled = target.features(ids, compiled=True)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)  # float32: fusion reorders sums only
    stats = stage.stats()
    # One key for every layer: the layers share one code object and their weights are the graph's inputs.
    assert (stats.keys, stats.compiled_calls, stats.compiles_after_seal, stats.eager_runs) == (
        1, target.layers_run, 0, 0), stats
    with pytest.raises(UnwarmedShapeError, match="outside the warmed keys"):
        target.features(torch.zeros(3, 32, dtype=torch.long), compiled=True)
    assert target.features(ids[:, :40]).shape == (3, 40, target.num_features * target.hidden_size)
    target.model.generate(ids[:1, :8], max_new_tokens=3, do_sample=False)  # eager, any shape
    assert stage.stats().compiles_after_seal == 0 and stage.stats().compiled_calls == target.layers_run
    stage.close()


def test_a_run_with_every_stage_compiled_trains_as_the_eager_run_does(tiny_world, tmp_path, capsys):
    losses, logs = {}, {}
    for mode in ("all", "off"):
        out = tmp_path / mode
        sets = [*tiny_world.overrides(out), "num_threads=1", "max_steps=3", "log_every=1", "eval_every=0",
                "save_every=3", "length_buckets=[96]", f"compile={mode}"]
        assert train_main(["--config", "tiny"] + [a for s in sets for a in ("--set", s)]) == 0
        logs[mode] = capsys.readouterr().out
        losses[mode] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
                        if "loss" in line]
    assert len(losses["all"]) == 3
    # float32 on the CPU: compiled kernels sum in another order; three steps of AdamW keep that near 1e-5
    assert losses["all"] == pytest.approx(losses["off"], rel=1e-4), losses
    layers_run = Target.load(str(tiny_world.target), "cpu", torch.float32).layers_run
    # a call per layer per step's forward (the layout trial's, before the seal, are not steady state)
    assert (f"compiled target layers: 1 keys warmed, {3 * layers_run} calls, 0 compiles after warm-up, 0 eager "
            "runs") in logs["all"], logs["all"]
    assert "compiled target layers" not in logs["off"]


@pytest.mark.parametrize("overrides,message", [
    (["compile=off", "attention=flex"], ('compile = "off" with attention = "flex": uncompiled flex_attention is the '
                                        "dense path DESIGN §6 forbids")),
    (["compile=fast"], "compile must be one of auto, all, attention, off, got 'fast'"),
])
def test_bad_compile_settings_are_one_line(tiny_world, tmp_path, capsys, overrides, message):
    sets = [*tiny_world.overrides(tmp_path / "run"), *overrides]
    assert train_main(["--config", "tiny"] + [a for s in sets for a in ("--set", s)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("mode,device,backend,resolved", [
    ("auto", "cuda:0", "flex", "all"), ("auto", "cpu", "flex", "attention"), ("auto", "cpu", "sdpa", "off"),
    ("attention", "cuda:0", "flex", "attention"), ("off", "cuda:0", "sdpa", "off"),
])
def test_compile_auto_is_all_on_cuda_and_never_leaves_flex_uncompiled(mode, device, backend, resolved):
    assert resolve_compile(mode, torch.device(device), backend) == resolved
