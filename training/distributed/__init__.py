"""One run over several trainer processes (nodes), through torch.distributed alone (ARCHITECTURE §8).

Each node is one process running the threaded pipeline over its own devices. The pipeline sums its own
replicas' gradients first; `Nodes` then all-reduces that sum across the processes (gloo on the CPU, NCCL on
GPUs) before the one clip and the optimizer step, so every replica on every node takes the same step.

A run is multi-node when WORLD_SIZE > 1: the env:// variables RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
(gpuctl sets them, one process per node; torchrun sets the same). Node 0 hosts the rendezvous (a TCPStore on
MASTER_PORT) and is the only one that writes checkpoints, the run's metrics and the export.

Trust (training/distributed/secret.py, wire.py): with a node secret ($GPUCTL_NODE_SECRET_FILE, else
$GPUCTL_NODE_SECRET), every node and node 0 prove it to each other (HMAC-signed hellos through the store; a
bad one is dropped) before the process group forms, over a store whose every value is sealed with it; without
one a multi-node trainer refuses, unless GPUCTL_TRUSTED_NETWORK=1. Nothing a node sends is unpickled:
JSON in tensors, checked before use; the names node 0 sends with its checkpoint are checked.

Timeouts: joining waits `node_start_timeout_s` for every node (a node that never starts does not hold the
others for ten minutes); collectives around slow, uneven work (start, the first step after warm-up, node 0's
checkpoints, evaluations and export) wait `node_sync_timeout_s`; steady-state steps wait `node_timeout_s`.
Each node also beats a counter in the store every second; a node whose counter stops for 20 s (or
`node_timeout_s`, if shorter: hung or dead), or a store that stops answering as long (node 0 gone), makes every
other node stop with a line naming it, before any collective's own timeout. On NCCL, TORCH_NCCL_BLOCKING_WAIT
makes a failed collective raise in the thread that waits on it (a line, exit 6) rather than abort the process.

A single-node run has the same interface: `join_nodes` gives a `SingleNode` (the null object: every
collective is the identity, nothing to wait for), so the trainer and the pipeline never ask how many nodes
there are.
"""

from training.distributed.env import (
    PER_NODE_KEYS,
    NodeEnv,
    NodeLost,
    Timeouts,
    default_micro_batch,
    micro_batch_share,
    node_env,
    timeouts_of,
)
from training.distributed.fingerprint import fingerprint_difference, run_fingerprint, tensor_sums
from training.distributed.nodes import Nodes, join_nodes
from training.distributed.single import SingleNode

__all__ = ["PER_NODE_KEYS", "NodeEnv", "NodeLost", "Nodes", "SingleNode", "Timeouts", "default_micro_batch",
           "fingerprint_difference", "join_nodes", "micro_batch_share", "node_env", "run_fingerprint", "tensor_sums",
           "timeouts_of"]
