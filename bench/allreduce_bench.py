"""What crosses between nodes in a multi-node run: the drafter's summed gradients, once a step.

    python bench/allreduce_bench.py [--nodes 2] [--device cpu|cuda] [--shape qwen3-8b|small] [--steps 3]

Starts `--nodes` processes on this machine (gloo on loopback for the CPU; NCCL, one GPU each, for cuda), joined
through the trainer's own `training.distributed.Nodes` (the env:// rendezvous, the step group), each holding a
gradient shaped like the drafter's trainable tensors at `--shape` (5 layers on Qwen3-8B: counted on the meta
device, nothing allocated but the gradients), and times `Nodes.sum_tensors`, the trainer's per-step all-reduce
(flat 256 MB buckets), as the trainer does (`all_reduce_ms`). Then prints a table: the measured time and the bus
bandwidth it implies, and the time the same bytes take at N nodes over a few links, counted with the ring
all-reduce's 2 (N - 1) / N of the gradient's bytes sent and received per node (no overlap, no compression).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.distributed import NodeEnv, Nodes, Timeouts
from training.model.drafter import Drafter, DrafterConfig
from training.target.random_world import QWEN3_8B

SMALL = {**QWEN3_8B, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64}
LINKS = {"10 GbE": 1.25e9, "100 GbE": 12.5e9, "InfiniBand NDR 400 Gb/s": 50e9}


def trainable_shapes(shape: dict) -> list[torch.Size]:
    """The trainable tensors of the trainer's 5-layer drafter on a target of `shape` (built on meta)."""
    target = Qwen3Config(**shape, max_position_embeddings=40960)
    config = DrafterConfig.from_target(target, 5, 16, [1, 9, 17, 25, 33], mask_token_id=shape["vocab_size"] - 1)
    with torch.device("meta"):
        table = torch.empty(shape["vocab_size"], shape["hidden_size"])
        drafter = Drafter(config, table, table)
    return [p.shape for p in drafter.parameters() if p.requires_grad]


def node_main(rank: int, nodes: int, port: int, device: str, shape_name: str, steps: int) -> None:
    shapes = trainable_shapes(QWEN3_8B if shape_name == "qwen3-8b" else SMALL)
    where = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    group = Nodes(NodeEnv(rank, nodes, "127.0.0.1", port), Timeouts(120, 1800, 1800),
                  on_lost=lambda line: sys.exit(f"error: {line}"))
    group.form_group(where)
    grads = [torch.full(s, float(rank + 1), device=where) for s in shapes]
    group.begin(-1)  # time the steady-state group
    group.sum_tensors(0, grads)  # warm-up: connections and buffers
    if where.type == "cuda":
        torch.cuda.synchronize(where)
    group.take_all_reduce_ms()
    started = time.perf_counter()
    for step in range(steps):
        group.sum_tensors(step, grads)
    if where.type == "cuda":
        torch.cuda.synchronize(where)
    wall_ms = 1000 * (time.perf_counter() - started) / steps
    ms = group.take_all_reduce_ms()
    if rank == 0:
        numel = sum(g.numel() for g in grads)
        print(f"RESULT {numel} {grads[0].element_size()} {ms:.1f} {wall_ms:.1f}", flush=True)
    group.close()


def seconds(t: float) -> str:
    return f"{t:.2f} s" if t >= 1 else f"{1000 * t:.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", choices=["qwen3-8b", "small"], default="qwen3-8b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--node", type=int, default=None, help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node is not None:
        node_main(args.node, args.nodes, args.port, args.device, args.shape, args.steps)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    children = [subprocess.Popen([sys.executable, __file__, "--nodes", str(args.nodes), "--device", args.device,
                                  "--shape", args.shape, "--steps", str(args.steps), "--node", str(rank), "--port",
                                  str(port)], env=env, stdout=subprocess.PIPE, text=True)
                for rank in range(args.nodes)]
    outputs = [child.communicate()[0] for child in children]
    if any(child.returncode for child in children):
        sys.exit(f"a node failed: exit codes {[c.returncode for c in children]}")
    _, numel, size, ms, wall_ms = next(line for line in outputs[0].splitlines() if line.startswith("RESULT")).split()
    numel, size, ms, wall_ms = int(numel), int(size), float(ms), float(wall_ms)
    grad_bytes = numel * size
    ring = 2 * (args.nodes - 1) / args.nodes
    print(f"drafter gradient ({args.shape}): {numel / 1e9:.3f} B trainable values x {size} bytes = "
          f"{grad_bytes / 1e9:.2f} GB a step\n")
    print("| measured | nodes | backend | all_reduce_ms a step | wall ms a step | bus GB/s |")
    print("|---|---|---|---|---|---|")
    backend = "nccl" if args.device == "cuda" else "gloo (loopback)"
    print(f"| this machine | {args.nodes} | {backend} | {ms:.0f} | {wall_ms:.0f} | "
          f"{ring * grad_bytes / (ms / 1000) / 1e9:.2f} |\n")
    print("| counted: ring all-reduce of the same bytes | " + " | ".join(f"{n} nodes" for n in (2, 8, 100)) + " |")
    print("|---|---|---|---|")
    for link, rate in LINKS.items():
        times = [2 * (n - 1) / n * grad_bytes / rate for n in (2, 8, 100)]
        print(f"| {link} ({rate / 1e9:.2f} GB/s a node) | " + " | ".join(seconds(t) for t in times) + " |")


if __name__ == "__main__":
    main()
