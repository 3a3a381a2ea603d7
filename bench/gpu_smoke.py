"""GPU smoke test of the single-device trainer (run by hand on a CUDA machine; needs no network).

    python bench/gpu_smoke.py [--device 0] [--steps 4] [--skip-tiny] [--skip-8b]
    python bench/gpu_smoke.py --device cpu --small --skip-tiny   # a dry run of part 2 at toy dims, on the CPU

1. The tiny preset on the GPU (flex attention, bf16 autocast), as `python -m training.train` runs it: wall
   time, first/last loss, acceptance length before and after.
2. A Qwen3-8B-shaped RANDOM target (Qwen3-8B's dims, bf16, built directly on the GPU) and the full drafter
   (5 layers, compiled flex) at the recipe's shapes: 3072 context tokens, 512 anchors x 16. A few steps of the
   real step functions (target stage, drafter stage, backward, clip, fused AdamW), then one acceptance-length
   evaluation through the SDPA path. Prints step time, stage times and peak memory as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training.data.chat import Batch
from training.model.attention import compile_flex_attention
from training.model.drafter import Drafter, DrafterConfig
from training.model.step import drafter_loss
from training.serve.evaluate import EvalSet, acceptance_length
from training.target.frozen import Target
from training.trainer import cosine_schedule

QWEN3_8B = {  # Qwen3-8B's config.json dims
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "rope_theta": 1000000.0, "tie_word_embeddings": False,
}
SMOLLM2_135M = {  # SmolLM2-135M-Instruct's dims (a Llama; the drafter's layers are Qwen3-style either way)
    **QWEN3_8B, "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    "tie_word_embeddings": True}
SMALL = {**QWEN3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
BLOCK, GAMMA, CHUNK = 16, 7.0, 2048


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def table(rows: list[tuple[str, str]]) -> None:
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}", flush=True)


def tiny_on_gpu(device: int, workdir: Path) -> None:
    print(f"== tiny preset on cuda:{device} ==", flush=True)
    metrics = workdir / "tiny-metrics.jsonl"
    sets = [f"target_path={workdir}/tiny/target", f"data_path={workdir}/tiny/train.jsonl",
            f"eval_data_path={workdir}/tiny/eval.jsonl", f"output_dir={workdir}/tiny-run",
            f"target_devices=[{device}]", f"drafter_devices=[{device}]"]
    command = [sys.executable, "-m", "training.train", "--config", "tiny"] + [a for s in sets for a in ("--set", s)]
    start = time.time()
    result = subprocess.run(command, cwd=REPO, env={**os.environ, "GPUCTL_METRICS": str(metrics)},
                            capture_output=True, text=True, check=False)
    wall = time.time() - start
    print(result.stdout[-3000:], result.stderr[-3000:], sep="\n", flush=True)
    if result.returncode != 0:
        raise SystemExit(f"tiny preset on the GPU failed with exit code {result.returncode}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    taus = [r["acceptance_length"] for r in records if "acceptance_length" in r]
    table([("wall time (incl. build, compile)", f"{wall:.1f} s"), ("loss first/last", f"{losses[0]:.3f} / {losses[-1]:.3f}"),
           ("tau untrained/trained", f"{taus[0]:.3f} / {taus[-1]:.3f}")])


def random_batch(device: torch.device, vocab: int, context: int, num_anchors: int, rows: int = 1) -> Batch:
    """`rows` sequences of `context` tokens, each a 200-token prompt and `num_anchors` anchors in its reply."""
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (rows, context), generator=gen)
    loss_mask = torch.ones((rows, context), dtype=torch.bool)
    loss_mask[:, :200] = False  # a prompt
    candidates = torch.arange(200, context - BLOCK + 1)
    anchors = torch.stack([candidates[torch.randperm(len(candidates), generator=gen)[:num_anchors]].sort().values
                           for _ in range(rows)])
    return Batch(input_ids, loss_mask, anchors, torch.ones((rows, num_anchors), dtype=torch.bool),
                 context).to(device)


def memory_gib(device: torch.device, peak: bool = False) -> float:
    if device.type != "cuda":
        return float("nan")
    return (torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)) / 2**30


def qwen3_8b_shapes(device: torch.device, steps: int, small: bool) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    dims, context, num_anchors = (SMALL, 600, 32) if small else (QWEN3_8B, 3072, 512)
    cuda = device.type == "cuda"
    dtype, backend = (torch.bfloat16, "flex") if cuda else (torch.float32, "sdpa")
    flex_attention = compile_flex_attention() if backend == "flex" else None
    if cuda:
        torch.cuda.set_device(device)
    print(f"== {'toy' if small else 'Qwen3-8B'}-shaped random target + DFlash drafter on {device} ==", flush=True)
    start = time.time()
    with torch.device(device):  # initialised where it lives: no 16 GB detour through host memory
        model = AutoModelForCausalLM.from_config(Qwen3Config(**dims), dtype=dtype, attn_implementation="sdpa")
    target = Target(model, tokenizer=None)
    sync(device)
    build_s = time.time() - start
    target_gib = memory_gib(device)

    torch.manual_seed(0)
    config = DrafterConfig.from_target(model.config, num_layers=5, block_size=BLOCK, target_layers=target.layers,
                                       mask_token_id=model.config.vocab_size - 1)  # no tokenizer: the last row
    with torch.device(device):
        drafter = Drafter(config, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=cuda)
    scheduler = cosine_schedule(optimizer, 1000, 0.04)
    batch = random_batch(device, model.config.vocab_size, context, num_anchors)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    rows = []
    for step in range(1, steps + 1):
        sync(device)
        t0 = time.time()
        features = target.features(batch.input_ids).to(device, non_blocking=True)  # the target stage
        sync(device)
        t1 = time.time()
        output = drafter_loss(drafter, features, batch, backend, GAMMA, CHUNK, dtype, flex_attention)
        output.loss.backward()
        sync(device)
        t2 = time.time()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        t3 = time.time()
        rows.append((step, t1 - t0, t2 - t1, t3 - t2, t3 - t0, float(output.loss.detach()), float(grad_norm)))
        print(f"  step {step}: target {t1 - t0:.3f}s  drafter fwd+bwd {t2 - t1:.3f}s  optimizer {t3 - t2:.3f}s  "
              f"total {t3 - t0:.3f}s  loss {rows[-1][5]:.3f}  grad {rows[-1][6]:.2f}", flush=True)
    peak_gib = memory_gib(device, peak=True)

    # Acceptance length through the SDPA path at a realistic evaluation size (4 rows x 1024 tokens).
    tokens = batch.input_ids[:, :1024].repeat(4, 1)
    evalset = EvalSet(tokens, target.features(tokens), torch.tensor([200, 300, 400, 500], device=device),
                      torch.full((4,), tokens.shape[1], device=device))
    sync(device)
    t0 = time.time()
    tau = acceptance_length(drafter, evalset, dtype)
    sync(device)
    eval_s = time.time() - t0

    steady = rows[1:] or rows
    mean = [sum(r[i] for r in steady) / len(steady) for i in range(1, 5)]
    tokens_per_s = context / mean[3]
    print("== summary (steady state = steps after the first, which compiles) ==", flush=True)
    table([
        ("torch / device", f"{torch.__version__} / {torch.cuda.get_device_name(device) if cuda else 'cpu'}"),
        ("random target build", f"{build_s:.1f} s, {target_gib:.1f} GiB"),
        ("drafter trainable params", f"{drafter.num_trainable() / 1e9:.3f} B"),
        ("shapes", f"context {context}, {num_anchors} anchors x {BLOCK} = {num_anchors * BLOCK} block tokens"),
        ("first step (compile)", f"{rows[0][4]:.1f} s"),
        ("steady target stage", f"{mean[0] * 1000:.0f} ms"),
        ("steady drafter fwd+bwd", f"{mean[1] * 1000:.0f} ms"),
        ("steady optimizer", f"{mean[2] * 1000:.0f} ms"),
        ("steady step", f"{mean[3] * 1000:.0f} ms ({tokens_per_s:.0f} target tokens/s)"),
        ("peak memory (training)", f"{peak_gib:.1f} GiB"),
        ("eval (4 x 1024, sdpa)", f"{eval_s:.1f} s, tau {tau:.3f} (random weights)"),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="0", help="GPU index, or cpu (with --small)")
    parser.add_argument("--small", action="store_true", help="toy dims instead of Qwen3-8B's (a dry run)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--skip-tiny", action="store_true")
    parser.add_argument("--skip-8b", action="store_true")
    args = parser.parse_args()
    device = torch.device("cpu" if args.device == "cpu" else f"cuda:{args.device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: CUDA is not available (use --device cpu --small for a dry run)")
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        if not args.skip_tiny and device.type == "cuda":
            tiny_on_gpu(device.index, Path(workdir))
        if not args.skip_8b:
            qwen3_8b_shapes(device, args.steps, args.small)


if __name__ == "__main__":
    main()
