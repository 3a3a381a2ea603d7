"""Layouts of the real trainer on one GPU, and the stages before and after issue 12's speed changes: one call.

    python bench/layout_runs.py [--gpu 0] [--steps 25] [--out DIR]
    python bench/layout_runs.py --smoke          # the same code on the CPU at toy shapes (numbers mean nothing)

1. `python -m training.train --config qwen3-8b-random` (a random-weight Qwen3-8B-shaped target, synthetic
   3072-token conversations, the recipe's batch_size 1) for --steps steps in each layout on the GPU:
   colocated (the serial loop: target forward then drafter step in one thread), 1:1 (a target thread and a
   drafter thread sharing the GPU), and auto (its trial's prediction against what it measured). Evaluation
   off; the one checkpoint and the export at the end go to a temporary directory, removed after each run.
2. Stages (bench/drafter_bench.py, variants "new" and "old-mask", one chunk size, the target with and
   without its layers after the last feature layer): per-stage time and MFU before/after, and the card's
   bf16 matrix rate, the MFU denominator of both tables.

Table per layout: steady tokens/s (the windows after the first, which holds the pipeline's fill), counted
TFLOP/s (training/layout/flops.py: the target forward up to its last feature layer + the drafter step) and MFU
against the measured matrix rate, peak memory, and auto's predicted tokens/s. Everything each run printed
and its metrics lines go to --out (default: a temporary directory), with a JSON summary.

About 5-6 minutes on an H200 (most of it building 8B-shaped targets, compiling, and writing each run's 12 GB
checkpoint); --budget-s (540) bounds the whole call: what would start past it is skipped and said so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOKE_SETS = ["random_target=qwen3-8b-narrow", 'devices="cpu"', "dtype=auto", "attention=auto", "max_length=160",
              "length_buckets=[160]", "num_anchors=8", "num_threads=2"]


def run(command: list[str], log: Path, timeout_s: float, env: dict | None = None) -> tuple[int, float]:
    """Run a command to a log file; its exit code (124 on timeout) and wall seconds."""
    start = time.time()
    with open(log, "w") as out:
        try:
            code = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  env=env, check=False).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return code, time.time() - start


def stages(args, out: Path) -> dict | None:
    report = out / "stages.json"
    command = [sys.executable, "bench/drafter_bench.py", "--variants", "new,old-mask", "--chunk-sizes", "2048",
               "--warmup", "2", "--repeats", str(args.repeats), "--json", str(report)]
    command += ["--small", "--device", "cpu"] if args.smoke else ["--device", str(args.gpu)]
    code, seconds = run(command, out / "stages.log", args.stage_timeout)
    print(f"stages: exit {code} in {seconds:.0f} s (log {out / 'stages.log'})", flush=True)
    return json.loads(report.read_text()) if code == 0 and report.exists() else None


def steady(records: list[dict], key: str) -> float:
    """The rate over the logged windows after the first (equal steps each: the harmonic mean); the only
    window when there is one."""
    windows = [r[key] for r in records if r.get(key)]
    kept = windows[1:] or windows
    return len(kept) / sum(1 / w for w in kept) if kept else float("nan")


def train_run(name: str, sets: list[str], args, out: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"layout-{name}-", dir=args.scratch))
    metrics = out / f"{name}.metrics.jsonl"
    metrics.unlink(missing_ok=True)
    every = max(1, args.steps // 5)
    sets = [*sets, f"max_steps={args.steps}", f"log_every={every}", "eval_every=0",
            f"save_every={10 * args.steps}", "keep_checkpoints=1", f"output_dir={run_dir}"]
    if args.smoke:
        sets = [*SMOKE_SETS, *sets]
    command = [sys.executable, "-m", "training.train", "--config", "qwen3-8b-random"]
    command += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "GPUCTL_METRICS": str(metrics)}
    code, seconds = run(command, out / f"{name}.log", args.run_timeout, env)
    shutil.rmtree(run_dir, ignore_errors=True)
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    trained = [r for r in records if "loss" in r]
    row = {"layout": name, "exit": code, "wall_s": round(seconds, 1), "steps": trained[-1]["step"] if trained else 0,
           "chosen": trained[0]["layout"] if trained else None,
           "tokens_per_s": steady(trained, "tokens_per_s"), "tflops_per_s": steady(trained, "tflops_per_s"),
           "peak_gib": max((max(r["peak_memory_gib"].values()) for r in trained), default=float("nan")),
           "predicted_tokens_per_s": trained[0].get("predicted_tokens_per_s") if trained else None}
    if trained and "layout_auto" in trained[0]:
        row["auto"] = trained[0]["layout_auto"]
    print(f"{name}: exit {code} in {seconds:.0f} s, {row['steps']} steps, {row['tokens_per_s']:.0f} tokens/s "
          f"(log {out / (name + '.log')})", flush=True)
    return row


def print_stages(report: dict) -> None:
    rate = report["matmul_tflops"]
    print(f"\n== stages: {report['device_name']}, torch {report['torch']}, matmul {rate:.0f} TFLOP/s ==")
    print(f"{'drafter step':26} {'mask':>7} {'fwd':>7} {'bwd':>7} {'opt':>6} {'f+b':>7} {'MFU f+b':>8} "
          f"{'MFU step':>9} {'peak GiB':>9}")
    names = {"new": "after (tile mask)", "old-mask": "before (create_block_mask)"}
    for row in report["variants"]:
        print(f"{names.get(row['variant'], row['variant']):26} {row['mask_ms']:7.1f} {row['forward_ms']:7.1f} "
              f"{row['backward_ms']:7.1f} {row['optimizer_ms']:6.1f} {row['fwd_bwd_ms']:7.1f} "
              f"{100 * row['mfu_fwd_bwd']:7.1f}% {100 * row['mfu_step']:8.1f}% {row['peak_gib']:9.1f}")
    print(f"{'target forward':26} {'layers':>7} {'ms':>7} {'tok/s':>8} {'GFLOP':>9} {'MFU':>7}")
    for key, label in (("target_all_layers", "before (every layer)"), ("target", "after (to the last feature)")):
        if target := report.get(key):
            print(f"{label:26} {target['layers_run']:7d} {target['forward_ms']:7.1f} {target['tokens_per_s']:8.0f} "
                  f"{target['flops'] / 1e9:9.0f} {100 * target['mfu']:6.1f}%")


def print_runs(rows: list[dict], rate: float | None, devices: int) -> None:
    print(f"\n== qwen3-8b-random layouts on {devices} device(s), batch_size 1 ==")
    print(f"{'layout':24} {'chosen':10} {'steps':>5} {'tok/s':>8} {'vs colocated':>12} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'peak GiB':>9} {'predicted':>10} {'meas/pred':>9}")
    base = next((r["tokens_per_s"] for r in rows if r["layout"] == "colocated"), None)
    for r in rows:
        mfu = f"{100 * r['tflops_per_s'] / (rate * devices):5.1f}%" if rate else "     -"
        predicted = r["predicted_tokens_per_s"]
        ratio = r["tokens_per_s"] / predicted if predicted else None
        print(f"{r['layout']:24} {r['chosen']!s:10} {r['steps']:5d} {r['tokens_per_s']:8.0f} "
              f"{(r['tokens_per_s'] / base if base else float('nan')):12.3f} {r['tflops_per_s']:8.1f} {mfu:>6} "
              f"{r['peak_gib']:9.1f} {(f'{predicted:.0f}' if predicted else '-'):>10} "
              f"{(f'{ratio:.3f}' if ratio else '-'):>9}")
    for r in rows:
        if auto := r.get("auto"):
            print(f"auto's trial: target {auto['target_ms_per_sequence']:.1f} ms + drafter "
                  f"{auto['drafter_ms_per_sequence']:.1f} ms per sequence"
                  + (f", both at once as a pair {shared:.1f} ms" if (shared := auto.get("shared_ms_per_sequence"))
                     else "") + "; candidates: "
                  + ", ".join(f"{c['layout']} {c['predicted_tokens_per_s']:.0f}"
                              f"{'' if c['fits'] else ' (does not fit)'}" for c in auto["candidates"]))
    print("colocated = the serial loop (target forward then drafter step in one thread); 1:1 = a target thread "
          "and a drafter thread sharing the GPU; MFU = counted FLOPs per second over the measured matrix rate.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=5, help="timed drafter steps per stage variant")
    parser.add_argument("--layouts", default="colocated,1:1,auto")
    parser.add_argument("--compile", default="auto",
                        help="comma list of the trainer's compile settings (auto: the preset's, all on CUDA): each "
                             "layout runs once per setting")
    parser.add_argument("--skip-stages", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="CPU, toy shapes: checks the script")
    parser.add_argument("--out", type=Path, help="logs, metrics and summary.json (default: a temporary dir)")
    parser.add_argument("--scratch", default=None, help="where runs write their checkpoint (default: $TMPDIR)")
    parser.add_argument("--run-timeout", type=float, default=170.0)
    parser.add_argument("--stage-timeout", type=float, default=200.0)
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="the whole call's time: a run that would start past it is skipped, the last cut short")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="layout-runs-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    deadline = started + args.budget_s
    device = '"cpu"' if args.smoke else f"[{args.gpu}]"
    rows, skipped = [], []
    modes = [mode.strip() for mode in args.compile.split(",") if mode.strip()]
    for layout in [name.strip() for name in args.layouts.split(",") if name.strip()]:
        for mode in modes:
            name = layout if len(modes) == 1 else f"{layout} compile={mode}"
            left = deadline - time.time()
            if left < 60:
                skipped.append(name)
                continue
            args.run_timeout = min(args.run_timeout, left)
            rows.append(train_run(name.replace(":", "-").replace(" ", "-").replace("=", "-"),
                                  [f"devices={device}", f"topology={layout}", f'compile="{mode}"'], args, out))
            rows[-1]["layout"] = name
    # The stages last: the layouts are the issue's question; the stages' table is its second.
    args.stage_timeout = min(args.stage_timeout, max(deadline - time.time(), 0.0))
    report = None if args.skip_stages or args.stage_timeout < 60 else stages(args, out)
    rate = report["matmul_tflops"] if report else None
    if report:
        print_stages(report)
    print_runs(rows, rate, devices=1)
    if skipped or (report is None and not args.skip_stages):
        print(f"skipped for lack of time: {', '.join(skipped + ([] if report or args.skip_stages else ['stages']))}")
    summary = {"stages": report, "runs": rows, "matmul_tflops": rate, "skipped": skipped,
               "wall_s": round(time.time() - started, 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nall in {time.time() - started:.0f} s; logs and summary.json in {out}")
    return 0 if all(r["exit"] == 0 for r in rows) and (report or args.skip_stages) else 1


if __name__ == "__main__":
    sys.exit(main())
