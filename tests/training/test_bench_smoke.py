"""bench/drafter_bench.py cannot rot: its toy-dims CPU form runs every code path, its step is the trainer's,
and its FLOP count equals what the matrix products actually do."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import drafter_bench

from training.model.loss import dflash_loss
from training.model.step import drafter_loss

BENCH = [sys.executable, str(REPO / "bench" / "drafter_bench.py")]


@pytest.fixture(scope="module")
def small_bench() -> drafter_bench.Bench:
    return drafter_bench.Bench(torch.device("cpu"), drafter_bench.SMALL, context=300, num_anchors=6,
                               matmul_tflops=1.0)


def test_drafter_bench_runs_on_the_cpu_and_reports_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(BENCH + ["--small", "--device", "cpu", "--repeats", "2", "--warmup", "1", "--profile",
                                     "--profile-steps", "1", "--chunk-sizes", "256,100000", "--json", str(out)],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MFU f+b" in result.stdout and "target forward" in result.stdout
    report = json.loads(out.read_text())
    names = [row["variant"] for row in report["variants"]]
    assert names == ["new", "old", "old-loss", "old-norm", "old-qkv", "old-rope", "old-mask", "new chunk=100000"]
    for row in report["variants"]:
        assert 0 < row["fwd_bwd_ms"] <= row["step_ms"] and 0 < row["mfu_step"] < math.inf, row
        # In float32 the old and the new code compute the same loss and gradients.
        assert row["loss_rel_diff"] < 1e-5 and row["grad_rel_diff"] < 1e-4, row
    assert all(flop > 0 for flop in report["flops"].values())
    assert math.isclose(sum(report["flops"].values()), report["flops_total"])
    profile = report["profile"]
    assert profile["categories_ms_per_step"] and profile["top_kernels"]
    assert math.isclose(sum(profile["categories_ms_per_step"].values()), profile["busy_ms_per_step"], rel_tol=1e-6)
    assert report["target"]["forward_ms"] > 0 and report["target"]["flops"] > 0
    before, after = report["target_all_layers"], report["target"]
    assert (before["layers_run"], after["layers_run"]) == (8, 6)  # SMALL: 8 layers, features up to layer 5
    assert after["flops"] == pytest.approx(before["flops"] * 6 / 8)
    compiled = report["target_compiled"]  # compile = "all": the same forward, its layers one compiled stage
    assert compiled["layers_run"] == 6 and compiled["forward_ms"] > 0 and compiled["compile_s"] > 0
    assert compiled["compiles_after_warmup"] == 0 and "layers compiled (compile = all)" in result.stdout


@pytest.mark.parametrize("argv", [["--small", "--device", "cpu", "--variants", "new,fast"],
                                  ["--device", "cpu"],
                                  ["--small", "--device", "cpu", "--chunk-sizes", "big"]])
def test_bad_arguments_give_one_line_and_exit_2(argv):
    result = subprocess.run(BENCH + argv, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_benchmarked_step_is_the_trainers_drafter_loss(small_bench):
    b = small_bench
    mask = b.build_mask()
    loss = b.forward_loss(dflash_loss, 64, mask)
    expected = drafter_loss(b.drafter, b.features, b.batch, b.backend, drafter_bench.GAMMA, 64, b.dtype,
                             b.flex_attention).loss
    assert torch.equal(loss, expected)


def test_counted_flops_equal_the_matrix_products_that_run(small_bench):
    """Every component but attention is a plain matmul: FlopCounterMode sees exactly what we count. Attention
    is counted over the allowed pairs only (the CPU's SDPA computes the dense scores)."""
    b = small_bench
    mask = b.build_mask()
    with FlopCounterMode(display=False) as counter:
        b.forward_loss(dflash_loss, 64, mask).backward()
    b.optimizer.zero_grad(set_to_none=True)
    counts = counter.get_flop_counts()["Global"]
    matmul = sum(n for op, n in counts.items() if "attention" not in str(op))
    counted = sum(flop for name, flop in b.flops.items() if not name.startswith("attention"))
    assert matmul == counted


def test_attention_counts_only_the_pairs_the_mask_allows():
    c = drafter_bench.DrafterConfig(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=8,
                                    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                                    vocab_size=10, num_layers=3, num_features=2, block_size=4, target_layers=[0, 1],
                                    mask_token_id=9, num_target_layers=4, max_position_embeddings=64)
    anchors, valid = torch.tensor([[3, 10]]), torch.tensor([[True, False]])
    flops = drafter_bench.drafter_flops(c, 1, 16, anchors, valid, loss_positions=3)
    pairs = 4 * (3 + 4)  # 4 block tokens see 3 context positions and their 4-token block; padding sees nothing
    assert flops["attention, allowed pairs"] == 3 * 3 * 4 * 2 * 4 * pairs
    assert flops["LM head (fwd + input grad)"] == 2 * 2 * 8 * 10 * 3


@pytest.mark.parametrize("name, parents, category", [
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTT", ["aten::mm", "MmBackward0"], "matmul: backward"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", ["aten::mm", "aten::linear"], "matmul: forward"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", ["aten::mm", drafter_bench.LOSS_RANGE], "matmul: LM head (loss)"),
    ("void at::native::cunn_SoftMaxForward<4, float>", ["aten::_softmax", drafter_bench.LOSS_RANGE],
     "loss: max / softmax / scaled gradient"),
    ("triton_tem_fused_0", ["CompiledFunctionBackward"], "attention backward"),
    ("triton_tem_fused_0", ["CompiledFunction"], "attention forward"),
    ("triton_tem_fused_0", [], "attention (not linked to an op: fwd or bwd)"),
    ("void at::native::vectorized_layer_norm_kernel<float, float, true>", ["aten::_fused_rms_norm"],
     "norm (rms_norm)"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>", ["aten::cat"], "copies / casts / cat"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>", ["aten::silu"],
     "elementwise / rope / silu / reductions"),
    ("void at::native::multi_tensor_apply_kernel<...>", [drafter_bench.OPTIMIZER_RANGE], "optimizer (clip + AdamW)"),
])
def test_profile_categories(name, parents, category):
    assert drafter_bench.kernel_category(name, parents) == category


def test_named_ranges_on_the_device_timeline_are_not_kernels():
    """--profile: a record_function range also shows on the GPU's timeline; counting it would add its whole
    span to "other" (or, for the optimizer's range, to the optimizer a second time)."""
    from types import SimpleNamespace

    def event(name, device, us, annotation=False, kernels=()):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: us),
                               kernels=list(kernels), cpu_parent=None, is_user_annotation=annotation,
                               self_cpu_time_total=us)

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    kernel = SimpleNamespace(name="void at::native::multi_tensor_apply_kernel<...>", duration=10.0)
    events = [
        event(drafter_bench.OPTIMIZER_RANGE, cpu, 30.0, annotation=True, kernels=[kernel]),
        event("void at::native::multi_tensor_apply_kernel<...>", cuda, 10.0),
        event(drafter_bench.OPTIMIZER_RANGE, cuda, 25.0, annotation=True),  # the range's GPU span
        event(drafter_bench.FORWARD_RANGE, cuda, 70.0),  # a torch that does not flag annotations
    ]
    summary = drafter_bench.summarise_profile(events, cuda=True, wall_ms=1.0, steps=1)
    assert summary["categories_ms_per_step"] == {"optimizer (clip + AdamW)": 0.01}


def test_serve_bench_runs_on_the_cpu_and_the_served_drafter_proposes_what_the_trainer_does(tmp_path):
    """bench/serve_bench.py (the exported drafter in the reference's loop at the 8B shape) in its toy form."""
    out = tmp_path / "serve.json"
    result = subprocess.run([sys.executable, str(REPO / "bench" / "serve_bench.py"), "--small", "--device", "cpu",
                             "--prompt-len", "48", "--new-tokens", "16", "--repeats", "2", "--json", str(out)],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["proposal_agreement"] == 1.0  # float32: the served drafter is the trainer's
    assert report["draft_ms_per_block"] > 0 and report["loop_ms_per_token"] > 0 and report["output_tokens"] == 16
    assert "draft one block" in result.stdout


@pytest.mark.e2e
def test_layout_runs_drives_the_trainer_in_its_smoke_form(tmp_path):
    """bench/layout_runs.py (the H200 measurement of issue 12) on the CPU: the trainer in two layouts."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / "layout_runs.py"), "--smoke", "--skip-stages",
                             "--layouts", "colocated,auto", "--steps", "2", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["layout"] for r in summary["runs"]] == ["colocated", "auto"]
    assert all(r["steps"] == 2 and r["tokens_per_s"] > 0 for r in summary["runs"])
    assert summary["runs"][1]["predicted_tokens_per_s"] > 0 and "auto's trial" in result.stdout


def test_allreduce_bench_runs_two_nodes_on_the_cpu():
    done = subprocess.run([sys.executable, "bench/allreduce_bench.py", "--shape", "small", "--steps", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "| this machine | 2 | gloo (loopback) |" in done.stdout
    assert "| InfiniBand NDR 400 Gb/s" in done.stdout


def test_multinode_runs_bench_compares_one_process_with_two_nodes_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, "bench/multinode_runs.py", "--smoke", "--steps", "2", "--out",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=400,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| one process", "| two"))]
    assert len(rows) == 2 and "[0, 0]" in rows[1]
    assert len(json.loads((tmp_path / "summary.json").read_text())) == 2
