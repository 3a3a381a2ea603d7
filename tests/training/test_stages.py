"""Compiled stages beside flex_attention (issue 27, ARCHITECTURE §6): the target's decoder layers compiled once
for every layer, warmed under the lock, proven, sealed; the same features and the same training losses as eager;
a shape outside the warmed keys raises before dynamo compiles; evaluation's shapes stay eager; `compile` set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import training.model.drafter as model_module
from training.compile.flex import UnwarmedShapeError
from training.compile.run import CompiledRun, warm_up_batch
from training.compile.stages import CompiledStage, decoder_layer_forward, resolve_compile, stages_of
from training.config import load_config
from training.layout.devices import autocast
from training.model.attention import attend, build_mask
from training.model.drafter import projected_strides, restrided
from training.model.step import drafter_loss
from training.target.frozen import Target
from training.train import main as train_main
from training.trainer.replicas import DrafterReplica
from training.trainer.world import build_drafters


@pytest.fixture(autouse=True)
def _fresh_dynamo_caches():
    """dynamo keeps its cache entries on the compiled function's code object for the whole process: a run has one
    set of stages, but these tests build several in one process, whose entries would add up past each limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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
    # the drafter's stages: one micro-batch a step, one bucket, its 2 layers (first: input without gradient)
    for line in ("compiled drafter fusion: 1 keys warmed, 3 calls, 0 compiles after warm-up, 0 eager runs, 0 FX",
                 "compiled drafter layers before attention: 2 keys warmed, 6 calls, 0 compiles after warm-up, 0 eager",
                 "compiled drafter layers after attention: 2 keys warmed, 6 calls, 0 compiles after warm-up, 0 eager"):
        assert line in logs["all"], logs["all"]
    assert "compiled target layers" not in logs["off"] and "compiled drafter" not in logs["off"]


@pytest.mark.parametrize("overrides,message", [
    (["compile=off", "attention=flex"], ('compile = "off" with attention = "flex": uncompiled flex_attention is the '
                                        "dense path the compile discipline forbids (ARCHITECTURE §6)")),
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


def compiled_drafter(world, target: Target, dtype: torch.dtype, architecture: str = "dflash", extra=()):
    """The tiny preset's drafter replica on the CPU with its stages compiled (compile = "all"), warmed, sealed."""
    sets = [*world.overrides(Path("unused")), f"architecture={architecture}", *extra]
    if architecture == "dflash2":
        sets += ["conv_kernel_size=3", "conv_group_size=16", "selector_rank=8", "selector_top_k=4"]
    config = load_config("tiny", sets)
    replica = DrafterReplica(build_drafters(config, target, [torch.device("cpu")])[0], config, "sdpa", dtype)
    run = CompiledRun(config, target, devices=1)
    run.warm_drafter(replica, dtype)
    run.seal()
    return config, replica, run


def step_gradients(replica: DrafterReplica, features: torch.Tensor, batch, compiled: bool):
    c = replica.config
    output = drafter_loss(replica.drafter, features, batch, "sdpa", c.gamma, c.loss_chunk_size, replica.dtype,
                           None, c.selector_loss_alpha, compiled=compiled)
    output.loss.backward()
    grads = [p.grad.float().clone() for p in replica.params]
    for p in replica.params:
        p.grad = None
    return float(output.loss.detach()), grads


def relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(torch.cat([(x - y).flatten() for x, y in zip(a, b)]).norm() / torch.cat([y.flatten() for y in b]).norm())


# float32: fused kernels sum in another order (1e-5). bf16 autocast: eager rounds every intermediate to bf16 and
# the fused kernels keep some in float32, so the two differ by bf16's rounding (8 bits of mantissa): within 2%.
# The preset's two length buckets once; the other cases compile one (each bucket is a compile of every stage: on a
# 2-core CPU about 20 s).
ONE_BUCKET = ("max_length=64", "length_buckets=[64]")


@pytest.mark.parametrize("dtype,architecture,tolerance,extra", [
    (torch.float32, "dflash", 1e-5, ()), (torch.bfloat16, "dflash", 2e-2, ONE_BUCKET),
    (torch.float32, "dflash2", 1e-5, ONE_BUCKET)])
def test_compiled_drafter_stages_give_the_eager_loss_and_gradients(tiny_world, target, dtype, architecture,
                                                                   tolerance, extra):
    config, replica, run = compiled_drafter(tiny_world, target, dtype, architecture, extra)
    batch = warm_up_batch(config, 64, replica.device)
    batch.input_ids.random_(5, 300, generator=torch.Generator().manual_seed(1))
    features = target.features(batch.input_ids).to(dtype)  # the target's dtype: the run's dtype
    eager_loss, eager_grads = step_gradients(replica, features, batch, compiled=False)
    loss, grads = step_gradients(replica, features, batch, compiled=True)
    assert loss == pytest.approx(eager_loss, rel=tolerance)
    assert relative(grads, eager_grads) < tolerance
    layers, buckets = config.num_draft_layers, len(config.buckets())
    # The first layer's input has no gradient (the frozen embedding), the others' do: two keys per bucket before
    # attention (the context's length is the bucket's), two in all after it (the block tokens alone).
    expected = {"drafter fusion": (buckets, 1), "drafter layers before attention": (2 * buckets, layers),
                "drafter layers after attention": (2, layers)}
    for stage in stages_of(run.drafter):
        stats = stage.stats()
        assert (stats.keys, stats.compiled_calls, stats.compiles_after_seal, stats.eager_runs, stats.fx_traces) == (
            *expected[stage.name], 0, 0, 0), stats
    with pytest.raises(UnwarmedShapeError, match="drafter fusion: a call outside the warmed keys"):
        step_gradients(replica, target.features(batch.input_ids[:, :40]).to(dtype), batch, compiled=True)
    # evaluation's shapes vary: eager, whatever the length, and nothing compiles
    anchors = batch.anchors[:, :2].clamp(max=30)
    with autocast(replica.device, dtype):
        hidden = replica.drafter(features[:, :40], batch.input_ids[:, :2], anchors,
                                 build_mask("sdpa", anchors, batch.block_valid[:, :2], 40, config.block_size))
    assert hidden.shape[1] == 2 * config.block_size
    assert all(stage.stats().compiles_after_seal == 0 for stage in run.stages)
    run.close()


def test_attention_gets_the_eager_layout_from_the_compiled_stages_at_one_row(tiny_world, target, monkeypatch):
    """The shared flex_attention's keys include every stride: a compiled stage may give the size-1 batch dimension
    of q/k/v any stride (an H200 run at batch_size 1 failed on it), so the drafter hands attention eager's."""
    config, replica, run = compiled_drafter(tiny_world, target, torch.float32, extra=["batch_size=1"])
    seen = {}

    def recording_attend(q, k, v, mask):
        seen.setdefault(seen.get("mode"), []).append(tuple(t.stride() for t in (q, k, v)))
        return attend(q, k, v, mask)

    monkeypatch.setattr(model_module, "attend", recording_attend)
    batch = warm_up_batch(config, 64, replica.device)
    features = target.features(batch.input_ids)
    for seen["mode"] in ("eager", "compiled"):
        step_gradients(replica, features, batch, compiled=seen["mode"] == "compiled")
    assert seen["compiled"] == seen["eager"] and len(seen["eager"]) == config.num_draft_layers
    q_shape = (1, replica.drafter.config.num_heads, config.num_anchors * config.block_size,
               replica.drafter.config.head_dim)
    assert seen["eager"][0][0] == projected_strides(q_shape)
    run.close()


def test_restrided_changes_only_the_strides_of_size_one_dimensions_without_a_copy():
    x = torch.randn(1, 6, 4, 8).transpose(1, 2)
    odd = x.as_strided(x.shape, (32, 8, 32, 1))  # size-1 batch dimension with another stride
    same = restrided(odd, projected_strides(x.shape))
    assert same.stride() == x.stride() and same.data_ptr() == odd.data_ptr() and torch.equal(same, x)
    other = restrided(x.contiguous(), projected_strides(x.shape))  # another layout: copied into the one asked
    assert other.stride() == x.stride() and torch.equal(other, x)
