"""Attention for the DFlash training mask at the recipe's shapes: compiled flex vs SDPA (dense mask) vs
uncompiled flex, forward+backward; and the block mask's construction time, compiled and not.

    python bench/attention_bench.py [--context 3072] [--anchors 512] [--json out.json]

Needs CUDA. Prints a table; times are medians over --repeats runs after warm-up, measured with CUDA events.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from training.model.mask import build_block_mask, dense_mask, dflash_mask_mod


def cuda_median_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def matmul_tflops(repeats: int) -> float:
    """The card's bf16 matrix rate, measured here (the MFU denominator)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_median_ms(lambda: a @ b, repeats)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def random_anchors(batch: int, num_anchors: int, context: int, block: int, gen: torch.Generator):
    anchors = torch.stack(
        [torch.randperm(context - block, generator=gen)[:num_anchors].sort().values + 1 for _ in range(batch)]
    )
    return anchors.cuda(), torch.ones_like(anchors, dtype=torch.bool).cuda()


def allowed_pairs(anchors: torch.Tensor, block: int) -> int:
    """Query-key pairs the mask allows: each block token sees `anchor` context positions and its block."""
    return int(((anchors + block) * block).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=3072)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_bench: needs a CUDA GPU")

    gen = torch.Generator().manual_seed(0)
    anchors, valid = random_anchors(args.batch, args.anchors, args.context, args.block, gen)
    q_len = args.anchors * args.block
    kv_len = args.context + q_len
    shape_q = (args.batch, args.heads, q_len, args.head_dim)
    shape_kv = (args.batch, args.kv_heads, kv_len, args.head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)

    rows = []
    peak_tflops = matmul_tflops(args.repeats)
    # Useful FLOPs: forward QK^T and PV (2 matmuls x 2 FLOP), backward about 2.5x the forward.
    fwd_flop = 4 * args.heads * args.head_dim * allowed_pairs(anchors, args.block)
    train_flop = 3.5 * fwd_flop

    block_mask = build_block_mask(anchors, valid, args.context, args.block)
    mask = dense_mask(anchors, valid, args.context, args.block)[:, None]
    compiled_flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)

    def run(attend):
        def step():
            q.grad = k.grad = v.grad = None
            attend().backward(grad_out)
        return step

    variants = {
        "flex (compiled)": lambda: compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True),
        "sdpa (dense bool mask)": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True
        ),
        "flex (uncompiled)": lambda: flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True),
    }
    for name, attend in variants.items():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            ms = cuda_median_ms(run(attend), args.repeats if "uncompiled" not in name else 3, warmup=2)
            peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
            rows.append({"variant": name, "ms": ms, "tflops": train_flop / (ms * 1e-3) / 1e12,
                         "peak_gib": peak_gib})
            print(f"{name}: {ms:.2f} ms, peak {peak_gib:.2f} GiB", flush=True)
        except torch.OutOfMemoryError as exc:
            rows.append({"variant": name, "ms": None, "tflops": None, "peak_gib": None,
                         "error": str(exc).splitlines()[0][:120]})

    mod = dflash_mask_mod(anchors, valid, args.context, args.block)

    compiled_create = torch.compile(create_block_mask)

    def mask_build_ms(compile_: bool) -> float:
        create = compiled_create if compile_ else create_block_mask

        def build():
            create(mod, args.batch, None, q_len, kv_len, device="cuda")
        for _ in range(2):
            build()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            build()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    mask_rows = {"create_block_mask": mask_build_ms(False)}
    print(f"mask build (eager): {mask_rows['create_block_mask']:.2f} ms", flush=True)
    mask_rows["torch.compile(create_block_mask)"] = mask_build_ms(True)

    print(f"\nDFlash training mask: batch {args.batch}, context {args.context}, {args.anchors} anchors x "
          f"{args.block} = {q_len} queries, KV {kv_len}, {args.heads}/{args.kv_heads} heads x {args.head_dim}, bf16")
    print(f"card: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"measured bf16 matmul {peak_tflops:.0f} TFLOP/s; useful attention FLOP/step {train_flop:.3e}")
    print(f"{'variant (fwd+bwd)':28} {'ms':>9} {'TFLOP/s':>9} {'% matmul':>9} {'peak GiB':>9}")
    for row in rows:
        if row["ms"] is None:
            print(f"{row['variant']:28} {'OOM':>9}   {row['error']}")
        else:
            print(f"{row['variant']:28} {row['ms']:9.2f} {row['tflops']:9.1f} "
                  f"{100 * row['tflops'] / peak_tflops:8.1f}% {row['peak_gib']:9.2f}")
    for name, ms in mask_rows.items():
        print(f"mask build: {name:34} {ms:9.2f} ms")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "matmul_tflops": peak_tflops,
                                         "attention": rows, "mask_build_ms": mask_rows,
                                         "torch": torch.__version__, "card": torch.cuda.get_device_name()},
                                        indent=2))


if __name__ == "__main__":
    main()
