"""A stand-in node: joins a run as RANK of WORLD_SIZE (env://, the node secret from the environment) through
training/distributed's Nodes, forms the gloo group and sums its rank + 1 over the nodes a step, printing each
sum (node 0's sums are what a stranger must not change), until the file STOP exists on any node.

    python -m tests.training.sum_node STOP START_S"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from training.distributed import Nodes, node_env
from training.distributed.env import Timeouts
from training.distributed.secret import require_node_secret
from training.train import end_for_lost_node


def main(stop: Path, start_s: float) -> None:
    env = node_env()
    with Nodes(env, Timeouts(start_s, 60.0, 20.0), end_for_lost_node, require_node_secret()) as nodes:
        nodes.form_group(torch.device("cpu"), "gloo")
        print("group formed", flush=True)
        nodes.begin(0)
        step, stopping = 0, False
        while not stopping:
            _, stopping = nodes.agree(step, True, stop.exists())
            (total,) = nodes.sum_numbers(step, [env.rank + 1.0])
            print(f"sum {total}", flush=True)
            step += 1


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
