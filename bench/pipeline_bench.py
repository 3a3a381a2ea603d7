"""Pipeline throughput on two GPUs: the threaded pipeline against the serial loop, same data and global batch.

- threaded: one target thread on GPU 0 (frozen target forward -> features) and one drafter thread on GPU 1
  (drafter forward + backward + optimizer step), overlapping through training/pipeline/;
- serial: each GPU runs the target forward and then the drafter step on its share of the global batch (the
  loop of other trainers), gradients summed across the two GPUs before one optimizer step: the pipeline's
  colocated role on both GPUs (the trainer's `topology = "colocated"`), so gradient sum and step are the
  same code.

Both use the trainer's own stages (TargetReplica and DrafterReplica, training/trainer/replicas.py: fused AdamW,
the chunked loss, bf16 autocast over fp32 master weights, compiled flex_attention). Qwen3-8B shapes (36 layers,
hidden 4096, features of layers 1, 9, 17, 25, 33), random weights, bf16 target, 5-layer drafter, 3072-token
sequences with 512 anchors x 16. Prints tokens/s, each thread's busy fraction and time per sequence, the
ideal (the slower stage 100% busy) and the threaded/serial ratio. Each mode builds its own replicas and
optimizers and frees them (and resets the peak-memory counters) before the next, so no mode's figures carry
the previous one's optimizer state.

    python bench/pipeline_bench.py [--global-batch 8] [--steps 6] [--warmup-steps 2] [--json out.json]

Needs two CUDA GPUs (about 45 GiB each) and a few minutes. `--smoke` runs the same code on two CPU "devices"
with tiny shapes, float32 and SDPA, to check the script itself (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from training.config import TrainConfig
from training.data.chat import Batch, BatchStream, Sequence
from training.model.attention import FlexAttention, compile_flex_attention
from training.model.drafter import Drafter, DrafterConfig
from training.pipeline import Pipeline, PipelineConfig, Utilisation
from training.target.frozen import Target
from training.trainer import DrafterReplica, TargetReplica

FEATURE_LAYERS = [1, 9, 17, 25, 33]
QWEN3_8B = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128}
SMOKE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16}
# One compiled shape, so one plain compiled flex_attention, passed to every replica, serves; warm-ups still take
# turns so that no thread calls it while another compiles it (ARCHITECTURE §6). The trainer uses training/compile/flex.py's
# full discipline.
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


class BenchReplica(DrafterReplica):
    """The trainer's drafter replica, warmed up at the benchmark's one shape."""

    def __init__(self, drafter: Drafter, config: TrainConfig, backend: str, dtype: torch.dtype,
                 flex_attention: FlexAttention | None, warmup_batch: Batch):
        super().__init__(drafter, config, backend, dtype, flex_attention)
        self.warmup_batch = warmup_batch

    def warm_up(self) -> None:
        """Compile flex_attention forward and backward at the benchmark's one shape, on this device."""
        batch = self.warmup_batch.to(self.device)
        c = self.drafter.config
        features = torch.randn(*batch.input_ids.shape, c.num_features * c.hidden_size, device=self.device,
                               dtype=self.dtype)
        with WARMUP_LOCK:
            loss, _ = self.loss(features, batch)
            loss.backward()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        for param in self.params:
            param.grad = None


def run_mode(name: str, targets, drafters, target_devices, drafter_devices, args,
             stream: BatchStream, colocated=(), colocated_devices=()) -> dict:
    """One mode's figures. The workers are dropped with the pipeline when it returns (free_mode)."""
    marks: dict[str, float] = {}
    windows: list[Utilisation] = []
    total_steps = args.warmup_steps + args.steps

    def on_step(report) -> None:
        if report.step == args.warmup_steps:
            pipeline.utilisation()  # the measured window starts here
            marks["start"] = time.perf_counter()
        elif report.step == total_steps:
            windows.append(pipeline.utilisation())
            marks["end"] = time.perf_counter()

    config = PipelineConfig(target_devices, drafter_devices, micro_batches_per_step=args.global_batch,
                            queue_depth=args.queue_depth, colocated_devices=colocated_devices)
    pipeline = Pipeline(config, targets, drafters, stream, start_step=0, max_steps=total_steps,
                        on_step=on_step, colocated=colocated)
    gpus = sorted({d for d in [*target_devices, *drafter_devices, *colocated_devices] if d.type == "cuda"},
                  key=str)
    for gpu in gpus:
        torch.cuda.reset_peak_memory_stats(gpu)
    pipeline.run()

    seconds = marks["end"] - marks["start"]
    sequences = args.steps * args.global_batch
    util = windows[0]
    # Each thread's busy time per sequence it handled (a stage's threads share its sequences).
    stage_threads = {"target": len(target_devices), "drafter": len(drafter_devices),
                     "colocated": len(colocated_devices)}
    ms_per_sequence = {thread: 1e3 * busy * seconds * stage_threads[thread.rstrip("0123456789")] / sequences
                       for thread, busy in util.busy.items()}
    device_busy = list(util.busy.values())
    tokens_per_s = sequences * args.length / seconds
    return {
        "mode": name,
        "tokens_per_s": tokens_per_s,
        "step_s": seconds / args.steps,
        "busy": util.busy,
        "ms_per_sequence": ms_per_sequence,
        "ideal_tokens_per_s": tokens_per_s / max(device_busy),
        "queue_depth": util.as_metrics()["queue_depth"],
        "peak_memory_gib": {str(gpu): torch.cuda.max_memory_allocated(gpu) / 2**30 for gpu in gpus},
    }


def free_mode() -> None:
    """After a mode: its replicas, optimizer state and pipeline are garbage now; give their memory back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per mode")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--length", type=int, default=3072)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--layers", type=int, default=36, help="target layers (36 = Qwen3-8B)")
    parser.add_argument("--queue-depth", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.global_batch % 2:
        sys.exit("pipeline_bench: --global-batch must be even (the serial loop splits it over two GPUs)")
    block = 16
    if args.smoke:
        devices, shapes, dtype, backend = [torch.device("cpu")] * 2, SMOKE, torch.float32, "sdpa"
        args.length, args.anchors, args.layers, block = 64, 4, 6, 8
        torch.set_num_threads(1)
    elif torch.cuda.device_count() < 2:
        sys.exit("pipeline_bench: needs two CUDA GPUs (or --smoke)")
    else:
        devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
        shapes, dtype, backend = QWEN3_8B, torch.bfloat16, "flex"
    # The recipe's optimisation settings (TrainConfig's defaults) at these shapes.
    config = TrainConfig(max_length=args.length, num_anchors=args.anchors, block_size=block,
                         max_steps=args.warmup_steps + args.steps)

    t0 = time.perf_counter()
    targets = [random_target(device, args.layers, shapes, dtype) for device in devices]
    target = targets[0]
    drafter_config = DrafterConfig.from_target(target.config, config.num_draft_layers, block, target.layers,
                                               target.config.vocab_size - 1)  # no tokenizer: the last row
    torch.manual_seed(1)
    with torch.device(devices[0]):
        first = Drafter(drafter_config, target.model.get_input_embeddings().weight,
                        target.model.get_output_embeddings().weight)
    drafters = [first, copy.deepcopy(first).to(devices[1])]  # identical replicas
    sequences = random_sequences(max(64, args.global_batch * 4), args.length, target.config.vocab_size)

    def stream() -> BatchStream:  # the same micro-batches, in the same order, for both modes
        return BatchStream(sequences, 1, [args.length], block, args.anchors, 0, seed=0)

    warmup_batch = next(stream())
    flex_attention = compile_flex_attention() if backend == "flex" else None
    print(f"built 2 x {'tiny' if args.smoke else 'Qwen3-8B'}-shaped random targets and drafters "
          f"({first.num_trainable() / 1e9:.3f} B trainable parameters) in {time.perf_counter() - t0:.0f} s",
          flush=True)

    def replica(drafter: Drafter) -> BenchReplica:
        return BenchReplica(drafter, config, backend, dtype, flex_attention, warmup_batch)

    # Serial first: it needs both drafter replicas identical, and training changes them. Every mode builds
    # its own replicas (fresh optimizers) inline, so nothing of it outlives run_mode but the figures.
    serial = run_mode("serial", [], [], [], [], args, stream(),
                      colocated=[(TargetReplica(t), replica(d)) for t, d in zip(targets, drafters)],
                      colocated_devices=devices)
    free_mode()
    # The serial loop kept both replicas identical: the shared split trains both, the 1:1 split one of them.
    shared = run_mode("threaded 1:2", [TargetReplica(target)], [replica(d) for d in drafters], [devices[0]],
                      devices, args, stream())
    free_mode()
    threaded = run_mode("threaded", [TargetReplica(target)], [replica(drafters[1])], [devices[0]], [devices[1]],
                        args, stream())
    free_mode()

    card = torch.cuda.get_device_name(0) if devices[0].type == "cuda" else "CPU (smoke)"
    print(f"\nPipeline throughput: global batch {args.global_batch} x {args.length} tokens, {args.anchors} "
          f"anchors x {block}, {args.steps} measured steps after {args.warmup_steps}; {card} x 2, "
          f"torch {torch.__version__}")
    print(f"{'mode':12} {'tok/s':>8} {'step s':>7} {'ideal tok/s':>12}  busy (ms per sequence)")
    for row in (serial, shared, threaded):
        busy = "  ".join(f"{thread} {fraction:.0%} ({row['ms_per_sequence'][thread]:.0f})"
                         for thread, fraction in row["busy"].items())
        print(f"{row['mode']:12} {row['tokens_per_s']:8.0f} {row['step_s']:7.2f} "
              f"{row['ideal_tokens_per_s']:12.0f}  {busy}")
    print("serial: colocated0/1 run target forward + drafter step on GPU 0/1 (the colocated role).\n"
          "threaded 1:2: target0 runs the target on GPU 0, drafter0/1 drafter replicas on GPU 0/1.\n"
          "threaded: target0 runs the target on GPU 0, drafter0 the drafter on GPU 1.")
    ratio = threaded["tokens_per_s"] / serial["tokens_per_s"]
    shared_ratio = shared["tokens_per_s"] / serial["tokens_per_s"]
    print(f"threaded / serial tokens/s: {ratio:.3f}; threaded 1:2 / serial: {shared_ratio:.3f}")
    for row in (serial, shared, threaded):
        if row["peak_memory_gib"]:
            memory = ", ".join(f"{gpu} {gib:.1f} GiB" for gpu, gib in row["peak_memory_gib"].items())
            print(f"peak memory ({row['mode']}): {memory}")
    if args.json:
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "serial": serial, "threaded": threaded,
                  "threaded_shared": shared, "threaded_over_serial": ratio,
                  "threaded_shared_over_serial": shared_ratio, "torch": torch.__version__, "card": card}
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
