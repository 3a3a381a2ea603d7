"""Cold launches of the threaded trainer on GPUs: does the compile discipline hold from a fresh cache?

Each launch is a fresh `python -m training.train` process with fresh inductor and triton caches, the tiny
preset on CUDA (compiled flex_attention) with enough length buckets that drafter devices x buckets exceeds
dynamo's default recompile limit of 8. A launch passes when it runs every step, exits 0, reports 0 compiles,
0 eager runs and 0 FX traces after warm-up with the FX tracing flag False, and never prints the FX error.
A launch that outlives --timeout-s counts as a hang.

    python bench/cold_launches.py --topology 0:1 --topology 0:0,1 --topology 0,0:0,0 --launches 5

A topology is TARGETS:DRAFTERS as GPU indices (0,0 = two threads sharing GPU 0). Prints a table; --json writes
every launch's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FX_ERROR = "Detected that you are using FX to symbolically trace a dynamo-optimized function"
STATS = re.compile(r"compiled flex_attention: (\d+) calls, (\d+) compiles after warm-up, (\d+) eager runs, "
                   r"(\d+) FX traces after warm-up, FX tracing flag (\w+)")
# compile = "all": each compiled stage's line (training/compile/stages.py StageStats.line)
STAGE = re.compile(r"compiled ([a-z ]+): (\d+) keys warmed, (\d+) calls, (\d+) compiles after warm-up, "
                   r"(\d+) eager runs, (\d+) FX traces")


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _device_list(entries: str) -> str:
    """'0,0' -> [0, 0]; 'cpu' -> ["cpu"] (a TOML list for --set)."""
    return json.dumps([int(e) if e.isdigit() else e for e in entries.split(",")])


def launch(targets: str, drafters: str, buckets: list[int], steps: int, timeout_s: float, compile_mode: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="cold-") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor", TRITON_CACHE_DIR=f"{tmp}/triton",
                   GPUCTL_METRICS=f"{tmp}/metrics.jsonl", PYTHONUNBUFFERED="1")
        overrides = {
            "target_devices": _device_list(targets), "drafter_devices": _device_list(drafters), "max_steps": str(steps),
            "length_buckets": json.dumps(buckets), "max_length": str(max(buckets)), "log_every": "10",
            "eval_every": "100000", "save_every": "100000", "output_dir": json.dumps(f"{tmp}/run"),
            "compile": json.dumps(compile_mode),
        }
        command = [sys.executable, "-m", "training.train", "--config", "tiny"]
        for key, value in overrides.items():
            command += ["--set", f"{key}={value}"]
        started = time.perf_counter()
        try:
            proc = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=timeout_s)
            output, code, hang = proc.stdout + proc.stderr, proc.returncode, False
        except subprocess.TimeoutExpired as exc:
            output, code, hang = _text(exc.stdout) + _text(exc.stderr), None, True
        wall = time.perf_counter() - started
        records = [json.loads(line) for line in Path(f"{tmp}/metrics.jsonl").read_text().splitlines()] \
            if Path(f"{tmp}/metrics.jsonl").exists() else []
    stats = STATS.search(output)
    last = next((r for r in reversed(records) if "busy" in r), {})
    row = {
        "targets": targets, "drafters": drafters, "exit": code, "hang": hang, "wall_s": round(wall, 1),
        "steps": last.get("step"), "fx_error": FX_ERROR in output,
        "calls": int(stats[1]) if stats else None, "compiles": int(stats[2]) if stats else None,
        "eager": int(stats[3]) if stats else None, "traces": int(stats[4]) if stats else None,
        "flag": stats[5] if stats else None, "busy": last.get("busy"), "queue": last.get("queue_depth"),
        "tokens_per_s": last.get("tokens_per_s"),
        "stages": {m[1]: {"keys": int(m[2]), "calls": int(m[3]), "compiles": int(m[4]), "eager": int(m[5]),
                          "traces": int(m[6])} for m in STAGE.finditer(output)},
    }
    stages_clean = all(s["compiles"] == s["eager"] == s["traces"] == 0 and s["calls"] > 0
                       for s in row["stages"].values())
    # compile = "all" on CUDA: the target's layers and the drafter's three stages, each with its line
    stages_there = compile_mode != "all" or len(row["stages"]) == 4
    row["ok"] = (code == 0 and not hang and not row["fx_error"] and row["steps"] == steps and stages_clean
                 and stages_there and row["compiles"] == 0 and row["eager"] == 0 and row["traces"] == 0
                 and row["flag"] == "False")
    if not row["ok"]:
        row["tail"] = output[-3000:]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", action="append", required=True, help="TARGETS:DRAFTERS, e.g. 0:1 or 0,0:0,0")
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--buckets", default="32,48,64,80,96", help="sequence-length buckets (tokens)")
    parser.add_argument("--timeout-s", type=float, default=240)
    parser.add_argument("--parallel", type=int, default=1, help="launches running at once")
    parser.add_argument("--compile", default="all", choices=("all", "attention"),
                        help="the trainer's compile setting (all: every stage; attention: flex only)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    buckets = [int(b) for b in args.buckets.split(",")]
    header = (f"{'targets':>8} {'drafters':>8} {'#':>2} {'ok':>5} {'exit':>4} {'steps':>5} {'wall_s':>6} "
              f"{'calls':>6} {'compiles*':>9} {'eager':>5} {'traces*':>7} {'flag':>5} {'fx_err':>6} {'hang':>5}  busy")
    print(header, flush=True)
    jobs = [(topology, n) for topology in args.topology for n in range(1, args.launches + 1)]

    def run(job):
        targets, drafters = job[0].split(":")
        return job, launch(targets, drafters, buckets, args.steps, args.timeout_s, args.compile)

    # Launches are independent processes: --parallel N runs N at once (busy fractions then include contention).
    rows = []
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        for (topology, n), row in pool.map(run, jobs):
            rows.append(row)
            busy = " ".join(f"{k} {v:.0%}" for k, v in (row["busy"] or {}).items())
            print(f"{row['targets']:>8} {row['drafters']:>8} {n:>2} {row['ok']!s:>5} {row['exit']!s:>4} "
                  f"{row['steps']!s:>5} {row['wall_s']:>6} {row['calls']!s:>6} {row['compiles']!s:>9} "
                  f"{row['eager']!s:>5} {row['traces']!s:>7} {row['flag']!s:>5} {row['fx_error']!s:>6} "
                  f"{row['hang']!s:>5}  {busy}", flush=True)
            for name, stage in row["stages"].items():
                print(f"{'':>20} compiled {name}: {stage['keys']} keys, {stage['calls']} calls, {stage['compiles']} "
                      f"compiles*, {stage['eager']} eager, {stage['traces']} traces", flush=True)
            if not row["ok"]:
                print(row["tail"], file=sys.stderr)
    entries = {t: len(set(t.split(":")[1].split(","))) * len(buckets) for t in args.topology}
    print(f"* after warm-up. compile cache entries per topology (drafter devices x buckets x 1 grad mode): {entries}")
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} launches clean")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
