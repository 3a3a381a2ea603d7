"""One process with two drafter replicas against two processes (nodes) with one each: same config, one call.

    python bench/multinode_runs.py --gpus 0,1 [--backend auto] [--steps 10] [--batch-size 4] [--out DIR]
    python bench/multinode_runs.py --gpus 0,0 --backend gloo     # one GPU: two nodes share it (NCCL refuses)
    python bench/multinode_runs.py --smoke                         # the same code on the CPU at toy shapes

Both runs train `--config qwen3-8b-random` (a random-weight Qwen3-8B-shaped target, synthetic 3072-token
conversations) for --steps steps with batch_size --batch-size and one sequence a micro-batch, evaluation off:
1. *one process*: colocated replicas on both --gpus entries (the in-process sum: NCCL between two GPUs, a plain
   sum on one);
2. *two nodes*: RANK 0 and 1 on this machine (MASTER_ADDR 127.0.0.1), each colocated on its own --gpus entry,
   node_backend --backend: each node sums its one replica, then the all-reduce crosses between the processes.
Prints: steady tokens/s (node 0's metrics: the run's, every node counted), each node's all-reduce time a step,
and the largest relative difference between the two runs' losses over the steps (the same micro-batches go
into each step's sum; only the order of float additions differs, and the bf16 compute amplifies it). Logs and
metrics go to --out (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from layout_runs import SMOKE_SETS, steady

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def common_sets(args, run_dir: Path) -> list[str]:
    sets = [f"max_steps={args.steps}", "log_every=1", "eval_every=0", f"save_every={10 * args.steps}",
            "keep_checkpoints=1", f"output_dir={run_dir}", f"batch_size={args.batch_size}", "micro_batch_size=1",
            "topology=colocated"]
    return [*SMOKE_SETS, *sets] if args.smoke else sets


def start(sets: list[str], log: Path, metrics: Path, env: dict) -> subprocess.Popen:
    command = [sys.executable, "-m", "training.train", "--config", "qwen3-8b-random"]
    command += [a for s in sets for a in ("--set", s)]
    with open(log, "w") as out:
        return subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **env, "GPUCTL_METRICS": str(metrics)})


def finish(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    deadline = time.time() + timeout_s
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(124)
    return codes


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def one_process(args, gpus: list[str], out: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="one-", dir=args.scratch))
    metrics = out / "one.metrics.jsonl"
    devices = "[" + ",".join(f'"{g}"' if g == "cpu" else g for g in gpus) + "]"
    began = time.time()
    proc = start([*common_sets(args, run_dir), f"colocated_devices={devices}"], out / "one.log", metrics, {})
    (code,) = finish([proc], args.run_timeout)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"name": "one process, 2 replicas", "exit": [code], "wall_s": round(time.time() - began),
            "records": records(metrics)}


def two_nodes(args, gpus: list[str], out: Path) -> dict:
    port = free_port()
    secret = secrets.token_hex(32)  # the per-run node secret gpuctl gives every node (a run without one is refused)
    procs, dirs = [], []
    began = time.time()
    for rank, gpu in enumerate(gpus):
        run_dir = Path(tempfile.mkdtemp(prefix=f"node{rank}-", dir=args.scratch))
        dirs.append(run_dir)
        device = '"cpu"' if gpu == "cpu" else gpu
        env = {"RANK": str(rank), "WORLD_SIZE": str(len(gpus)), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo", "GPUCTL_NODE_SECRET": secret}
        sets = [*common_sets(args, run_dir), f"devices=[{device}]", f"node_backend={args.backend}"]
        procs.append(start(sets, out / f"node{rank}.log", out / f"node{rank}.metrics.jsonl", env))
    codes = finish(procs, args.run_timeout)
    for run_dir in dirs:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"name": f"two nodes ({args.backend})", "exit": codes, "wall_s": round(time.time() - began),
            "records": records(out / "node0.metrics.jsonl"),
            "node_records": [records(out / f"node{rank}.metrics.jsonl") for rank in range(len(gpus))]}


def losses(run: dict) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run["records"] if "loss" in r}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="0,1", help="two device entries: GPU indices, or cpu (--smoke)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--run-timeout", type=float, default=420)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--scratch", default=None, help="where the runs' checkpoints go (deleted after each)")
    parser.add_argument("--smoke", action="store_true", help="the CPU at toy shapes (numbers mean nothing)")
    args = parser.parse_args(argv)
    gpus = ["cpu", "cpu"] if args.smoke else args.gpus.split(",")
    if len(gpus) != 2:
        parser.error("--gpus takes two entries")
    out = args.out or Path(tempfile.mkdtemp(prefix="multinode-runs-"))
    out.mkdir(parents=True, exist_ok=True)
    runs = [one_process(args, gpus, out), two_nodes(args, gpus, out)]
    reference = losses(runs[0])
    print("\n| run | exit | steps | tokens/s (steady) | all_reduce_ms a step (each node) | max rel. loss diff | "
          "wall s |\n|---|---|---:|---:|---|---:|---:|")
    for run in runs:
        trained = [r for r in run["records"] if "loss" in r]
        mine = losses(run)
        common = sorted(set(mine) & set(reference))
        diff = max((abs(mine[s] - reference[s]) / abs(reference[s]) for s in common), default=float("nan"))
        reduce_ms = "-"
        if trained and "nodes" in trained[-1]:
            per_node = [[r["nodes"][k]["all_reduce_ms"] for r in trained[1:] or trained]
                        for k in range(len(trained[-1]["nodes"]))]
            reduce_ms = ", ".join(f"{sum(v) / len(v):.0f}" for v in per_node)
        print(f"| {run['name']} | {run['exit']} | {len(trained)} | {steady(trained, 'tokens_per_s'):.0f} | "
              f"{reduce_ms} | {diff:.2e} | {run['wall_s']} |")
    (out / "summary.json").write_text(json.dumps([{k: v for k, v in run.items() if k != "node_records"}
                                                  for run in runs], indent=1))
    print(f"\nlogs and metrics: {out}")
    return 0 if all(code == 0 for run in runs for code in run["exit"]) else 1


if __name__ == "__main__":
    sys.exit(main())
