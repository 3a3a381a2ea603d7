"""Pipeline throughput on two GPUs: the threaded pipeline against the serial loop, same data, same global batch.

- threaded: one target thread on GPU 0 (frozen target forward -> features) and one drafter thread on GPU 1
  (drafter forward + backward + optimizer step), overlapping through training/pipeline.py;
- serial: each GPU runs the target forward and then the drafter step on its share of the global batch (the loop
  of other trainers), gradients summed across the two GPUs before one optimizer step. It runs through the same
  pipeline engine with a pass-through "target" thread, so the gradient sum and step are the same code.

Qwen3-8B shapes (36 layers, hidden 4096, features of layers 1, 9, 17, 25, 33), random weights, bf16 target,
5-layer drafter (fp32 master weights, bf16 autocast, compiled flex_attention), 3072-token sequences with 512
anchors x 16. Prints tokens/s, per-stage busy fractions, each stage's time per sequence, the ideal (the slower
stage 100% busy) and the threaded/serial ratio.

    python bench/pipeline_bench.py [--global-batch 8] [--steps 6] [--warmup-steps 2] [--json out.json]

Needs two CUDA GPUs (about 40 GiB each) and a few minutes. `--smoke` runs the same code on two CPU "devices"
with tiny shapes, float32 and SDPA, to check the script itself (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from training.data import Batch, BatchStream, Sequence
from training.model import Drafter, DrafterConfig
from training.pipeline import Pipeline, PipelineConfig, Utilisation
from training.step import drafter_stage
from training.target import Target

FEATURE_LAYERS = [1, 9, 17, 25, 33]
GAMMA, LOSS_CHUNK = 7.0, 2048
DTYPE = torch.bfloat16
QWEN3_8B = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128}
SMOKE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16}
# One compiled shape here; warm-ups still take turns so no thread calls the compiled function while another
# compiles it (DESIGN §6). The trainer itself uses training/compile.py's discipline.
WARMUP_LOCK = threading.Lock()


def random_target(device: torch.device, layers: int, shapes: dict, dtype: torch.dtype) -> Target:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        num_hidden_layers=layers, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rope_theta=1e6, **shapes,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return Target(model, None, [layer for layer in FEATURE_LAYERS if layer < layers - 2] or [1])


def random_sequences(count: int, length: int, vocab: int, seed: int = 0) -> list[Sequence]:
    rng = random.Random(seed)
    prompt = length // 8  # loss on the "assistant" part only, like the real data
    return [Sequence([rng.randrange(vocab) for _ in range(length)], [0] * prompt + [1] * (length - prompt))
            for _ in range(count)]


def batch_stream(sequences: list[Sequence], args) -> BatchStream:
    return BatchStream(sequences, 1, [args.length], args.block, args.anchors, 0, seed=0)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TargetStage:
    def __init__(self, target: Target):
        self.target = target

    def features(self, batch: Batch) -> torch.Tensor:
        return self.target.features(batch.input_ids)


class PassThrough:
    """The serial loop's "target thread": hands the batch on; the drafter replica runs the target itself."""

    def features(self, batch: Batch) -> None:
        return None


class DrafterStage:
    """A drafter replica with its optimizer; with `target`, it runs that target's forward first (serial loop)."""

    def __init__(self, drafter: Drafter, warmup_batch: Batch, attention: str, dtype: torch.dtype,
                 target: Target | None = None):
        self.drafter, self.target, self.warmup_batch = drafter, target, warmup_batch
        self.attention, self.dtype = attention, dtype
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=6e-4, betas=(0.9, 0.95), fused=True)
        self.device = self.params[0].device

    def trainable_parameters(self) -> list[torch.Tensor]:
        return self.params

    def loss(self, features: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        if self.target is not None:
            features = self.target.features(batch.input_ids)
        return drafter_stage(self.drafter, features, batch, self.attention, GAMMA, LOSS_CHUNK, self.dtype).loss

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def warm_up(self) -> None:
        """Compile flex_attention forward and backward at the benchmark's one shape, on this device."""
        batch = self.warmup_batch.to(self.device)
        config = self.drafter.config
        features = torch.randn(1, batch.input_ids.shape[1], config.num_features * config.hidden_size,
                               device=self.device, dtype=self.dtype)
        with WARMUP_LOCK:
            self.loss(features if self.target is None else None, batch).backward()
            synchronize(self.device)
        for param in self.params:
            param.grad = None


def run_mode(name: str, targets, drafters, target_devices, drafter_devices, args, sequences) -> dict:
    marks: dict[str, float] = {}
    windows: list[Utilisation] = []
    total_steps = args.warmup_steps + args.steps

    def on_step(report) -> None:
        if report.step == args.warmup_steps:
            pipeline.utilisation()  # start the measured window here
            marks["start"] = time.perf_counter()
        elif report.step == total_steps:
            windows.append(pipeline.utilisation())
            marks["end"] = time.perf_counter()

    config = PipelineConfig(target_devices, drafter_devices, micro_batches_per_step=args.global_batch,
                            queue_depth=args.queue_depth)
    pipeline = Pipeline(config, targets, drafters, batch_stream(sequences, args), start_step=0,
                        max_steps=total_steps, on_step=on_step)
    for device in {d for d in drafter_devices + target_devices if d.type == "cuda"}:
        torch.cuda.reset_peak_memory_stats(device)
    pipeline.run(handle_signals=False)
    seconds = marks["end"] - marks["start"]
    sequences_done = args.steps * args.global_batch
    util = windows[0]
    per_sequence_ms = {thread: 1e3 * busy * seconds / sequences_done * (
        len(drafter_devices) if thread.startswith("drafter") else len(target_devices))
        for thread, busy in util.busy.items()}
    gpu_threads = {t: b for t, b in util.busy.items() if not (name == "serial" and t.startswith("target"))}
    tokens_per_s = sequences_done * args.length / seconds
    return {
        "mode": name,
        "tokens_per_s": tokens_per_s,
        "step_s": seconds / args.steps,
        "busy": util.busy,
        "stage_ms_per_sequence": per_sequence_ms,
        "ideal_tokens_per_s": tokens_per_s / max(gpu_threads.values()),
        "queue_depth": {"mean": util.queue_depth_mean, "max": util.queue_depth_max, "bound": util.queue_bound},
        "peak_memory_gib": {str(d): torch.cuda.max_memory_allocated(d) / 2**30
                            for d in sorted({*target_devices, *drafter_devices}, key=str) if d.type == "cuda"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per mode")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--length", type=int, default=3072)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--layers", type=int, default=36, help="target layers (36 = Qwen3-8B)")
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--queue-depth", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on two CPU devices: checks the script")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.global_batch % 2:
        sys.exit("pipeline_bench: --global-batch must be even (the serial loop splits it over two GPUs)")
    if args.smoke:
        gpus, shapes, dtype, attention = [torch.device("cpu")] * 2, SMOKE, torch.float32, "sdpa"
        args.length, args.anchors, args.block, args.layers = 64, 4, 8, 6
        torch.set_num_threads(1)
    elif torch.cuda.device_count() < 2:
        sys.exit("pipeline_bench: needs two CUDA GPUs (or --smoke)")
    else:
        gpus, shapes, dtype, attention = [torch.device("cuda", 0), torch.device("cuda", 1)], QWEN3_8B, DTYPE, "flex"

    t0 = time.perf_counter()
    targets = [random_target(gpu, args.layers, shapes, dtype) for gpu in gpus]
    drafter_config = DrafterConfig.from_target(targets[0].config, 5, args.block, targets[0].layers)
    torch.manual_seed(1)
    with torch.device(gpus[0]):
        first = Drafter(drafter_config, targets[0].model.get_input_embeddings().weight,
                        targets[0].model.get_output_embeddings().weight)
    drafters = [first, copy.deepcopy(first).to(gpus[1])]  # identical replicas
    sequences = random_sequences(max(64, args.global_batch * 4), args.length, targets[0].config.vocab_size)
    warmup_batch = next(batch_stream(sequences, args))
    print(f"built 2 x {'tiny' if args.smoke else 'Qwen3-8B'}-shaped random targets and drafters "
          f"({drafters[0].num_trainable() / 1e9:.3f} B trainable parameters) in {time.perf_counter() - t0:.0f} s",
          flush=True)

    # Serial first: it keeps both drafter replicas identical, which the threaded run does not need.
    serial = run_mode("serial", [PassThrough()],
                      [DrafterStage(d, warmup_batch, attention, dtype, target=t) for d, t in zip(drafters, targets)],
                      [torch.device("cpu")], gpus, args, sequences)
    threaded = run_mode("threaded", [TargetStage(targets[0])],
                        [DrafterStage(drafters[1], warmup_batch, attention, dtype)], [gpus[0]], [gpus[1]], args,
                        sequences)

    card = torch.cuda.get_device_name(0) if gpus[0].type == "cuda" else "CPU (smoke)"
    print(f"\nPipeline throughput: global batch {args.global_batch} x {args.length} tokens, {args.anchors} anchors x "
          f"{args.block}, {args.steps} measured steps after {args.warmup_steps}; {card} x 2, "
          f"torch {torch.__version__}")
    print(f"{'mode':9} {'tok/s':>8} {'step s':>7} {'ideal tok/s':>12}  busy (ms per sequence)")
    for row in (serial, threaded):
        busy = "  ".join(f"{thread} {fraction:.0%} ({row['stage_ms_per_sequence'][thread]:.0f})"
                         for thread, fraction in row["busy"].items())
        print(f"{row['mode']:9} {row['tokens_per_s']:8.0f} {row['step_s']:7.2f} {row['ideal_tokens_per_s']:12.0f}  {busy}")
    print("serial: 'target0' is the pass-through thread; drafter0/1 each run target forward + drafter step on "
          "GPU 0/1.\nthreaded: target0 on GPU 0, drafter0 on GPU 1.")
    ratio = threaded["tokens_per_s"] / serial["tokens_per_s"]
    print(f"threaded / serial tokens/s: {ratio:.3f}")
    for row in (serial, threaded):
        if row["peak_memory_gib"]:
            memory = ", ".join(f"{d} {gib:.1f} GiB" for d, gib in row["peak_memory_gib"].items())
            print(f"peak memory ({row['mode']}): {memory}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "serial": serial,
                                         "threaded": threaded, "threaded_over_serial": ratio,
                                         "torch": torch.__version__, "card": card},
                                        indent=2))


if __name__ == "__main__":
    main()
