"""The drafter step at the recipe's shapes on one GPU: time, FLOPs counted per component, MFU against the
card's bf16 matrix rate measured in the same run, peak memory; the target's forward timed and counted
separately. The code before the speed changes (bench/drafter_baseline.py) runs beside the product's, on the
same weights and batch, so one call measures before and after.

    python bench/drafter_bench.py [--device 0] [--variants new,old,old-loss,old-norm,old-qkv,old-rope,old-mask]
        [--chunk-sizes 2048,8192] [--repeats 10] [--profile] [--skip-target] [--json out.json]
    python bench/drafter_bench.py --small --device cpu   # toy dims on the CPU: a dry run of every code path
    python bench/drafter_bench.py --shape smollm2-135m    # SmolLM2-135M's dims, batch as its preset trains

Shapes (--shape): "qwen3-8b" (the default, below); "smollm2-135m": SmolLM2-135M-Instruct's dims (hidden 576, 9/3
heads, MLP 1536, 30 layers, vocabulary 49,152, tied), 16 sequences of 1,024 tokens with 256 anchors each, as the
smollm2-135m preset's micro-batch; "small" (= --small): toy dims. --rows overrides the sequences per step.

Shapes (default): Qwen3-8B dims, random weights built on the device (no download): drafter of 5 layers with a
random [151936, 4096] bf16 embedding and LM head, random [1, 3072, 5 x 4096] bf16 target features, 512
anchors x 16 = 8192 block tokens, bf16 autocast over float32 master weights, compiled flex attention, fused
AdamW. Variants: "new" is the product; "old" is all of the old code; "old-<part>" reverts one part (norm, qkv,
rope, loss, mask) so each change's share is measured. Extra chunk sizes add "new chunk=N" rows.

Times are medians over --repeats steps after --warmup steps, measured with CUDA events (no host clock). The
block mask is built inside the timed step, as the trainer's drafter stage builds it: "fwd+bwd" is mask +
forward + backward (the "mask" column shows its share). FLOPs count matrix products only, backward = 2 x
forward (input and weight gradients; no recomputation), with training/layout/flops.py's functions. The target's
forward is timed twice: as the trainer runs it (up to its last feature layer) and with every layer ("before").
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.profiler import record_function

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from drafter_baseline import PARTS, use_old
from gpu_smoke import QWEN3_8B, SMALL, SMOLLM2_135M, random_batch

from training.layout.devices import autocast
from training.layout.flops import drafter_flops, target_flops
from training.model.attention import AttentionMask, build_mask, compile_flex_attention
from training.model.drafter import Drafter, DrafterConfig
from training.model.loss import MATMUL_WRITES_FLOAT32, block_targets, dflash_loss
from training.model.mask import create_block_mask_reference
from training.target.frozen import default_feature_layers

__all__ = ["DrafterConfig", "drafter_flops", "target_flops"]  # the tests read them here

GAMMA, LR, NUM_FEATURES, BLOCK = 7.0, 6e-4, 5, 16
# --shape: (target dims, context tokens, anchors per sequence, sequences per step)
SHAPES = {"qwen3-8b": (QWEN3_8B, 3072, 512, 1), "smollm2-135m": (SMOLLM2_135M, 1024, 256, 16),
          "small": (SMALL, 600, 32, 1)}
VARIANTS = {"new": (), "compiled": (), "old": PARTS, **{f"old-{part}": (part,) for part in PARTS}}
OPTIMIZER_RANGE, LOSS_RANGE, FORWARD_RANGE = "optimizer: clip + AdamW", "dflash loss", "drafter forward"
RANGES = (OPTIMIZER_RANGE, LOSS_RANGE, FORWARD_RANGE)  # record_function names: ranges, not kernels


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, like every other bad-input path
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


class Clock:
    """Device time: CUDA events on a GPU (nothing waits inside the timed region), perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def median_ms(fn, clock: Clock, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = clock.mark()
        fn()
        end = clock.mark()
        clock.sync()
        times.append(clock.ms(start, end))
    return statistics.median(times)


def matmul_tflops(device: torch.device, n: int, clock: Clock, repeats: int) -> float:
    """The card's bf16 matrix rate (the MFU denominator): an n^3 product on random data, rotating inputs."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pairs = [(torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype))
             for _ in range(3)]
    turn = iter(range(10**9))
    ms = median_ms(lambda: torch.mm(*pairs[next(turn) % 3]), clock, warmup=5, repeats=repeats)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def copy_gbps(device: torch.device, nbytes: int, clock: Clock, repeats: int) -> float:
    """Device memory bandwidth: a large device-to-device copy, bytes read plus bytes written."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), clock, warmup=3, repeats=repeats)
    return 2 * nbytes / (ms * 1e-3) / 1e9


@dataclass
class Variant:
    name: str
    old_parts: tuple[str, ...]
    chunk_size: int
    compiled: bool = False  # the drafter's stages compiled (compile = "all"): fusion, layer halves

@dataclass
class Row:
    variant: str
    chunk_size: int
    mask_ms: float
    forward_ms: float  # drafter forward + chunked loss (the loss's gradient is computed here)
    backward_ms: float
    optimizer_ms: float  # clip + fused AdamW + zero_grad
    fwd_bwd_ms: float  # mask + forward + backward
    step_ms: float
    mfu_fwd_bwd: float
    mfu_step: float
    peak_gib: float
    loss_rel_diff: float  # against the first variant, same weights and batch
    grad_rel_diff: float  # |g - g_first| / |g_first| over all trainable parameters


class Bench:
    """One drafter, its optimizer and one batch; variants swap code, never weights."""

    def __init__(self, device: torch.device, dims: dict, context: int, num_anchors: int, matmul_tflops: float,
                 rows: int = 1):
        from transformers import Qwen3Config

        self.device, self.clock, self.matmul_tflops = device, Clock(device), matmul_tflops
        self.compiled = False  # the running variant's: through the drafter's compiled stages
        cuda = device.type == "cuda"
        self.dtype, self.backend = (torch.bfloat16, "flex") if cuda else (torch.float32, "sdpa")
        self.flex_attention = compile_flex_attention() if self.backend == "flex" else None
        self.target_config = Qwen3Config(**dims)
        layers = default_feature_layers(self.target_config.num_hidden_layers, NUM_FEATURES)
        # A random target has no tokenizer: its last row stands in for <|MASK|> (the timing is the same).
        self.config = DrafterConfig.from_target(self.target_config, num_layers=5, block_size=BLOCK,
                                                target_layers=layers, mask_token_id=self.target_config.vocab_size - 1)
        c = self.config
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.device(device):
            embedding = torch.randn(c.vocab_size, c.hidden_size, generator=gen, dtype=self.dtype) * 0.02
            lm_head = torch.randn(c.vocab_size, c.hidden_size, generator=gen, dtype=self.dtype) * 0.02
            torch.manual_seed(0)
            self.drafter = Drafter(c, embedding, lm_head).train()
            self.features = torch.randn(rows, context, NUM_FEATURES * c.hidden_size, generator=gen,
                                        dtype=self.dtype)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0, fused=cuda)
        self.batch = random_batch(device, c.vocab_size, context, num_anchors, rows)
        _, weights = self.targets()
        self.flops = drafter_flops(c, rows, context, self.batch.anchors, self.batch.block_valid,
                                   int((weights > 0).sum()))
        self.total_flops = sum(self.flops.values())

    @contextlib.contextmanager
    def running(self, variant: Variant):
        """Within the block the drafter runs `variant`'s code; yields the loss function to use."""
        self.compiled = variant.compiled
        try:
            with use_old(self.drafter, variant.old_parts) as loss_fn:
                yield loss_fn
        finally:
            self.compiled = False

    def compile_stages(self, chunk_size: int) -> dict:
        """compile = "all": the drafter's stages (training/compile/stages.py) warmed on this batch's shapes, forward and
        backward, as the trainer's main thread warms them; returns the warm-up's seconds and keys."""
        from training.compile.stages import compiled_drafter_stages, stages_of, warming_all

        self.drafter.stages = compiled_drafter_stages(keys_expected=2 * self.config.num_layers)
        start = time.time()
        with warming_all(stages_of(self.drafter.stages)), self.running(Variant("compiled", (), chunk_size, True)):
            for _ in range(2):
                self.forward_loss(dflash_loss, chunk_size, self.build_mask()).backward()
        self.clock.sync()
        self.optimizer.zero_grad(set_to_none=True)
        for stage in stages_of(self.drafter.stages):
            stage.seal()
        return {"compile_s": time.time() - start, "keys": {s.name: s.stats().keys for s in stages_of(self.drafter.stages)}}

    def stage_counters(self) -> dict:
        from training.compile.stages import stages_of

        return {s.name: s.stats().line() for s in stages_of(self.drafter.stages)} if self.drafter.stages else {}

    def targets(self):
        b = self.batch
        return block_targets(b.input_ids, b.loss_mask, b.anchors, b.block_valid, BLOCK, GAMMA)

    def forward_loss(self, loss_fn, chunk_size: int, mask) -> torch.Tensor:
        """What training.model.step.drafter_loss does after building the mask, with profiler ranges."""
        labels, weights = self.targets()
        with autocast(self.device, self.dtype):
            anchor_tokens = self.batch.input_ids.gather(1, self.batch.anchors)
            with record_function(FORWARD_RANGE):
                hidden = self.drafter(self.features, anchor_tokens, self.batch.anchors, mask, compiled=self.compiled)
            with record_function(LOSS_RANGE):
                loss, _ = loss_fn(hidden, self.drafter.lm_head_weight, labels, weights, chunk_size)
        return loss

    def build_mask(self, old: bool = False):
        """The trainer's mask; `old`: through create_block_mask (the "mask" part's old code)."""
        b = self.batch
        if old and self.backend == "flex":
            block_mask = create_block_mask_reference(b.anchors, b.block_valid, b.input_ids.shape[1], BLOCK)
            return AttentionMask("flex", block_mask=block_mask, flex_attention=self.flex_attention)
        return build_mask(self.backend, b.anchors, b.block_valid, b.input_ids.shape[1], BLOCK, self.flex_attention)

    def step(self, loss_fn, chunk_size: int, old_mask: bool = False) -> list:
        """One training step; returns clock marks: start, mask built, forward, backward, optimizer."""
        marks = [self.clock.mark()]
        mask = self.build_mask(old_mask)
        marks.append(self.clock.mark())
        loss = self.forward_loss(loss_fn, chunk_size, mask)
        marks.append(self.clock.mark())
        loss.backward()
        marks.append(self.clock.mark())
        with record_function(OPTIMIZER_RANGE):
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        marks.append(self.clock.mark())
        return marks

    def loss_and_grads(self, variant: Variant) -> tuple[float, list[torch.Tensor]]:
        with self.running(variant) as loss_fn:
            loss = self.forward_loss(loss_fn, variant.chunk_size, self.build_mask("mask" in variant.old_parts))
            loss.backward()
        grads = [p.grad for p in self.params]
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()), grads

    def differences(self, variants: list[Variant]) -> dict[str, tuple[float, float]]:
        """Each variant's loss and gradient against the first one's, relative, before any optimizer step."""
        ref_loss, ref_grads = self.loss_and_grads(variants[0])
        ref_norm = math.sqrt(sum(float(r.float().square().sum()) for r in ref_grads))
        found = {}
        for variant in variants:
            loss, grads = self.loss_and_grads(variant)
            diff = math.sqrt(sum(float((g.float() - r.float()).square().sum()) for g, r in zip(grads, ref_grads)))
            found[variant.name] = (abs(loss - ref_loss) / abs(ref_loss), diff / ref_norm)
        return found

    def time(self, variant: Variant, warmup: int, repeats: int, differences: tuple[float, float]) -> Row:
        if self.clock.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        phases = []
        with self.running(variant) as loss_fn:
            for index in range(warmup + repeats):
                marks = self.step(loss_fn, variant.chunk_size, "mask" in variant.old_parts)
                self.clock.sync()
                if index >= warmup:
                    phases.append([self.clock.ms(a, b) for a, b in itertools.pairwise(marks)])
        mask_ms, forward_ms, backward_ms, optimizer_ms = (statistics.median(p[i] for p in phases) for i in range(4))
        fwd_bwd_ms = statistics.median(p[0] + p[1] + p[2] for p in phases)
        step_ms = statistics.median(sum(p) for p in phases)
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.clock.cuda else float("nan")
        mfu = self.total_flops / (self.matmul_tflops * 1e9)  # divided by a time in ms
        return Row(variant.name, variant.chunk_size, mask_ms, forward_ms, backward_ms, optimizer_ms, fwd_bwd_ms,
                   step_ms, mfu / fwd_bwd_ms, mfu / step_ms, peak, *differences)

    def profile(self, variant: Variant, steps: int) -> dict:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.clock.cuda else [])
        with self.running(variant) as loss_fn:
            self.step(loss_fn, variant.chunk_size, "mask" in variant.old_parts)  # warm
            self.clock.sync()
            with profile(activities=activities) as prof:
                marks = [self.step(loss_fn, variant.chunk_size, "mask" in variant.old_parts) for _ in range(steps)]
                self.clock.sync()
        wall_ms = sum(self.clock.ms(m[0], m[-1]) for m in marks)
        return summarise_profile(prof.events(), self.clock.cuda, wall_ms, steps)


def ancestors(event) -> list[str]:
    names, parent = [], event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


GEMM_NAMES = ("gemm", "nvjet", "cutlass", "xmma", "splitk", "gemv", "s16816", "aten::mm", "aten::addmm",
              "aten::bmm", "aten::_mm_dtype")
COPY_NAMES = ("copy", "cat", "fill", "memset", "memcpy", "index", "gather", "scatter", "clone", "zero")


def kernel_category(name: str, parents: list[str]) -> str:
    """Where a kernel's (or, on the CPU, an op's) time goes, from its name and the ops it was launched under."""
    lower, within = name.lower(), " | ".join(parents).lower()
    if OPTIMIZER_RANGE.lower() in within or "adam" in lower or "multi_tensor_apply" in lower:
        return "optimizer (clip + AdamW)"
    gemm = any(key in lower for key in GEMM_NAMES)
    if LOSS_RANGE in within:
        return "matmul: LM head (loss)" if gemm else "loss: max / softmax / scaled gradient"
    backward = "backward" in within or "backward" in lower
    if gemm:
        return "matmul: backward" if backward else "matmul: forward"
    if "flex" in lower or lower.startswith("triton") or "attention" in lower:  # only attention is compiled
        if not parents and "backward" not in lower:
            return "attention (not linked to an op: fwd or bwd)"
        return "attention backward" if backward else "attention forward"
    if "softmax" in lower or "logsumexp" in lower:
        return "loss: max / softmax / scaled gradient"
    if "norm" in lower or "rms_norm" in within:
        return "norm (rms_norm)"
    if any(key in lower for key in COPY_NAMES):
        return "copies / casts / cat"
    if "elementwise" in lower or "reduce" in lower or lower.startswith("aten::"):
        return "elementwise / rope / silu / reductions"
    return "other"


def is_range(event) -> bool:
    """A named range (record_function) rather than an op or a kernel: on a GPU the profiler also puts each one
    on the device's timeline, where counting it would add its whole span to a category."""
    on_device = event.device_type != torch.autograd.DeviceType.CPU
    return on_device and (getattr(event, "is_user_annotation", False) or event.name in RANGES)


def summarise_profile(events, cuda: bool, wall_ms: float, steps: int) -> dict:
    """Device time per category and the top kernels, per step. On the CPU: op self times instead."""
    categories: dict[str, float] = {}
    kernels: dict[tuple[str, str], list] = {}

    def add(name: str, parents: list[str], us: float) -> None:
        category = kernel_category(name, parents)
        categories[category] = categories.get(category, 0.0) + us
        entry = kernels.setdefault((name, category), [0.0, 0])
        entry[0] += us
        entry[1] += 1

    device_us: dict[str, float] = {}  # every kernel on the device, linked to an op or not
    for event in events:
        if is_range(event):  # a record_function range's span on the device's timeline: no kernel
            continue
        if not cuda:
            if event.device_type == torch.autograd.DeviceType.CPU:
                add(event.name, ancestors(event), event.self_cpu_time_total)
            continue
        if event.device_type == torch.autograd.DeviceType.CUDA:
            device_us[event.name] = device_us.get(event.name, 0.0) + event.time_range.elapsed_us()
        for kernel in event.kernels:
            add(kernel.name, [event.name, *ancestors(event)], kernel.duration)
            device_us[kernel.name] = device_us.get(kernel.name, 0.0) - kernel.duration
    for name, unlinked_us in device_us.items():  # e.g. Triton launches no op records: categorised by name
        if unlinked_us > 1e-3:
            add(name, [], unlinked_us)
    busy_us = sum(categories.values())
    per_step = {name: us / steps / 1e3 for name, us in sorted(categories.items(), key=lambda kv: -kv[1])}
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:20]
    return {
        "steps": steps,
        "wall_ms_per_step": wall_ms / steps,
        "busy_ms_per_step": busy_us / steps / 1e3,
        "categories_ms_per_step": per_step,
        "top_kernels": [{"name": name[:140], "ms_per_step": us / steps / 1e3, "calls_per_step": calls / steps,
                         "category": category} for (name, category), (us, calls) in top],
    }


def rms_norm_dispatch(device: torch.device) -> dict[str, bool]:
    """Whether F.rms_norm reaches the fused kernel here, forward and backward (the composite falls back
    silently on some backends)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(8, 64, device=device, requires_grad=True)
    weight = torch.ones(64, device=device, requires_grad=True)
    with Ops() as forward:
        y = torch.nn.functional.rms_norm(x, (64,), weight, 1e-6)
    with Ops() as backward:
        y.sum().backward()
    return {"forward": any("_fused_rms_norm" in n for n in forward.names),
            "backward": any("_fused_rms_norm_backward" in n for n in backward.names)}


def time_target(device: torch.device, dims: dict, context: int, clock: Clock, warmup: int, repeats: int,
                rate: float, batch_rows: int = 1) -> dict:
    """A Qwen3-8B-shaped random target (built where it runs), its features() forward at `context` tokens: as
    the trainer runs it (up to the last feature layer) and, as "before", with every layer."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from training.target.frozen import Target

    cuda = device.type == "cuda"
    start = time.time()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**dims), dtype=torch.bfloat16 if cuda else torch.float32,
                                                 attn_implementation="sdpa")
    clock.sync()
    build_s = time.time() - start
    input_ids = torch.randint(0, model.config.vocab_size, (batch_rows, context), device=device)
    rows = {}
    for name, run_all_layers in (("target", False), ("target_all_layers", True)):
        target = Target(model, tokenizer=None, run_all_layers=run_all_layers)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        ms = median_ms(lambda target=target: target.features(input_ids), clock, warmup, repeats)
        flops = target_flops(model.config, batch_rows, context, target.layers_run)
        rows[name] = {"build_s": build_s, "forward_ms": ms, "tokens_per_s": batch_rows * context / (ms * 1e-3), "flops": flops,
                      "mfu": flops / (ms * 1e-3) / (rate * 1e12), "layers_run": target.layers_run,
                      "feature_layers": target.layers,
                      "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")}
        # The next Target hooks the same model; this one's hooks stay, idle (they act only inside its features()).
    rows["target_compiled"] = time_compiled_target(model, input_ids, clock, warmup, repeats, rate, build_s)
    return rows


def time_compiled_target(model, input_ids: torch.Tensor, clock: Clock, warmup: int, repeats: int, rate: float,
                         build_s: float) -> dict:
    """The trainer's forward with compile = "all": the decoder layers as one compiled stage (training/compile/stages.py),
    warmed at this shape first (the warm-up's seconds are the row's compile_s)."""
    from training.compile.stages import CompiledStage, decoder_layer_forward
    from training.target.frozen import Target

    device, (batch_rows, context) = input_ids.device, input_ids.shape
    target = Target(model, tokenizer=None)
    stage = CompiledStage("target layers", decoder_layer_forward, keys_expected=target.layers_run)
    target.compile_layers(stage)
    start = time.time()
    with stage.warming():
        target.features(input_ids, compiled=True)
    clock.sync()
    compile_s = time.time() - start
    stage.seal()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = median_ms(lambda: target.features(input_ids, compiled=True), clock, warmup, repeats)
    flops = target_flops(model.config, batch_rows, context, target.layers_run)
    stats = stage.stats()
    stage.close()
    return {"build_s": build_s, "compile_s": compile_s, "forward_ms": ms,
            "tokens_per_s": batch_rows * context / (ms * 1e-3), "flops": flops, "mfu": flops / (ms * 1e-3) / (rate * 1e12), "layers_run": target.layers_run,
            "feature_layers": target.layers, "compiles_after_warmup": stats.compiles_after_seal,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="0", help="GPU index, or cpu (with --small)")
    parser.add_argument("--small", action="store_true", help="toy dims (a dry run of every code path)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b", help="the dims and batch (above)")
    parser.add_argument("--rows", type=int, default=0, help="sequences per step (0 = the shape's)")
    parser.add_argument("--variants", default="new,old,old-loss,old-norm,old-qkv,old-rope,old-mask",
                        help=f"comma list from {', '.join(VARIANTS)}; the first is the correctness reference")
    parser.add_argument("--chunk-sizes", default="2048,8192",
                        help="loss chunk sizes: the first for every variant, the others as extra 'new' rows")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="torch.profiler over a few 'new' steps")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--skip-target", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.variant_names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := [v for v in args.variant_names if v not in VARIANTS]:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    try:
        args.chunks = [int(c) for c in args.chunk_sizes.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--chunk-sizes must be integers, got {args.chunk_sizes!r}")
    if not args.chunks or min(args.chunks) <= 0 or args.repeats < 1 or args.warmup < 0:
        parser.error("--chunk-sizes must be positive, --repeats >= 1, --warmup >= 0")
    return args


def print_table(report: dict) -> None:
    print(f"\n== drafter step ({report['shapes']}) ==")
    print(f"card {report['device_name']}, torch {report['torch']}; measured bf16 matmul "
          f"{report['matmul_tflops']:.0f} TFLOP/s, copy {report['copy_gbps']:.0f} GB/s; rms_norm fused "
          f"{report['rms_norm_fused']}; fp32-output matmul for the loss {report['mm_float32_output']}")
    print("counted FLOP per step:")
    for name, flop in report["flops"].items():
        print(f"  {name:34} {flop:10.3e}  {100 * flop / report['flops_total']:5.1f}%  "
              f"{flop / (report['matmul_tflops'] * 1e12) * 1e3:7.1f} ms at the matmul rate")
    print(f"  {'total':34} {report['flops_total']:10.3e}")
    header = (f"{'variant':18} {'chunk':>6} {'mask':>6} {'fwd':>7} {'bwd':>7} {'opt':>6} {'fwd+bwd':>8} "
              f"{'step':>7} {'MFU f+b':>8} {'MFU step':>9} {'peak GiB':>9} {'dloss':>8} {'dgrad':>8}")
    print(header)
    for r in report["variants"]:
        print(f"{r['variant']:18} {r['chunk_size']:6d} {r['mask_ms']:6.1f} {r['forward_ms']:7.1f} "
              f"{r['backward_ms']:7.1f} {r['optimizer_ms']:6.1f} {r['fwd_bwd_ms']:8.1f} {r['step_ms']:7.1f} "
              f"{100 * r['mfu_fwd_bwd']:7.1f}% {100 * r['mfu_step']:8.1f}% {r['peak_gib']:9.1f} "
              f"{r['loss_rel_diff']:8.1e} {r['grad_rel_diff']:8.1e}")
    if stages := report.get("drafter_stages"):
        print(f"drafter stages (compile = all): warm-up {stages['compile_s']:.1f} s")
        for line in stages["counters"].values():
            print(f"  {line}")
    if profile := report.get("profile"):
        print(f"profile of 'new' ({profile['steps']} steps): {profile['wall_ms_per_step']:.1f} ms/step wall, "
              f"{profile['busy_ms_per_step']:.1f} ms/step busy")
        for name, ms in profile["categories_ms_per_step"].items():
            print(f"  {name:40} {ms:8.2f} ms  {100 * ms / profile['wall_ms_per_step']:5.1f}%")
        print("  top kernels (ms/step, calls/step, category):")
        for k in profile["top_kernels"][:12]:
            print(f"    {k['ms_per_step']:7.2f} {k['calls_per_step']:5.0f}  {k['category'][:24]:24} {k['name'][:90]}")
    for key, label in (("target", "target forward"), ("target_all_layers", "target forward, every layer (before)"),
                       ("target_compiled", "target forward, layers compiled (compile = all)")):
        if target := report.get(key):
            compiled = (f", compile {target['compile_s']:.0f} s, {target['compiles_after_warmup']} compiles after "
                        "warm-up" if "compile_s" in target else "")
            print(f"{label} ({target['layers_run']} layers run, features from {target['feature_layers']}): "
                  f"{target['forward_ms']:.1f} ms, {target['tokens_per_s']:.0f} tokens/s, {target['flops']:.3e} "
                  f"FLOP, MFU {100 * target['mfu']:.1f}%, peak {target['peak_gib']:.1f} GiB "
                  f"(build {target['build_s']:.0f} s{compiled})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu" if args.device == "cpu" else f"cuda:{args.device}")
    shape = "small" if args.small else args.shape
    if device.type == "cpu" and shape != "small":
        print("error: --device cpu needs --small (Qwen3-8B shapes on the CPU would take hours)", file=sys.stderr)
        return 2
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("error: CUDA is not available (use --device cpu --small for a dry run)", file=sys.stderr)
            return 2
        torch.cuda.set_device(device)
    dims, context, num_anchors, batch_rows = SHAPES[shape]
    batch_rows = args.rows or batch_rows
    import transformers

    clock = Clock(device)
    n = 8192 if device.type == "cuda" else 256
    rate = matmul_tflops(device, n, clock, repeats=max(args.repeats, 30))
    bandwidth = copy_gbps(device, 2**30 if device.type == "cuda" else 2**24, clock, repeats=max(args.repeats, 20))
    print(f"matmul {rate:.1f} TFLOP/s, copy {bandwidth:.0f} GB/s", flush=True)

    start = time.time()
    bench = Bench(device, dims, context, num_anchors, rate, batch_rows)
    print(f"drafter built in {time.time() - start:.1f} s: {bench.drafter.num_trainable() / 1e6:.1f} M trainable; "
          f"counted {bench.total_flops:.3e} FLOP/step", flush=True)
    variants = [Variant(name, VARIANTS[name], args.chunks[0], name == "compiled") for name in args.variant_names]
    stages = bench.compile_stages(args.chunks[0]) if "compiled" in args.variant_names else None
    if stages:
        print(f"drafter stages compiled in {stages['compile_s']:.1f} s: {stages['keys']}", flush=True)
    variants += [Variant(f"new chunk={chunk}", (), chunk) for chunk in args.chunks[1:]]
    differences = bench.differences(variants)
    rows = []
    for variant in variants:
        row = bench.time(variant, args.warmup, args.repeats, differences[variant.name])
        rows.append(row)
        print(f"{variant.name}: fwd+bwd {row.fwd_bwd_ms:.1f} ms, step {row.step_ms:.1f} ms, "
              f"{batch_rows * context / (row.step_ms * 1e-3):,.0f} tokens/s, MFU {100 * row.mfu_step:.1f}%", flush=True)

    report = {
        "torch": torch.__version__, "transformers": transformers.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:],
        "shapes": f"{shape} dims, {batch_rows} x {context} tokens, {num_anchors} anchors x {BLOCK} each, "
                  f"{bench.dtype}, {bench.backend}",
        "tokens_per_step": batch_rows * context,
        "matmul_tflops": rate, "copy_gbps": bandwidth, "rms_norm_fused": rms_norm_dispatch(device),
        "mm_float32_output": MATMUL_WRITES_FLOAT32 and device.type == "cuda",
        "trainable_params": bench.drafter.num_trainable(), "flops": bench.flops, "flops_total": bench.total_flops,
        "variants": [asdict(r) for r in rows],
        "drafter_stages": {**stages, "counters": bench.stage_counters()} if stages else None,
    }
    if args.profile:
        report["profile"] = bench.profile(Variant("new", (), args.chunks[0]), args.profile_steps)
    del bench
    if not args.skip_target:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report.update(time_target(device, dims, context, clock, args.warmup, args.repeats, rate, batch_rows))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
