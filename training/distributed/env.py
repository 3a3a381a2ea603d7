"""What makes a process one node of a run: the env:// variables, the timeouts, its share of each step."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from training.config import ConfigError

ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Config keys each node may set for itself: where things are on its disk and how it uses its own devices.
PER_NODE_KEYS = frozenset({"target_path", "data_path", "eval_data_path", "output_dir", "runs_dir", "build_tiny",
                           "target_gguf", "overwrite_output", "devices", "topology", "target_devices", "drafter_devices",
                           "colocated_devices", "num_threads", "queue_depth"})


class NodeLost(RuntimeError):
    """Another node died, hung or left: this run cannot go on (the trainer exits failed, with this line)."""


@dataclass(frozen=True)
class NodeEnv:
    rank: int
    world_size: int
    master_addr: str
    master_port: int


def node_env(environ: dict[str, str] | None = None) -> NodeEnv | None:
    """The env:// variables of a multi-node run; None for a single-node run (WORLD_SIZE unset or 1)."""
    environ = os.environ if environ is None else environ
    if int(environ.get("WORLD_SIZE", "1") or "1") <= 1:
        return None
    missing = [key for key in ENV_KEYS if not environ.get(key)]
    if missing:
        raise ConfigError(f"WORLD_SIZE={environ['WORLD_SIZE']} but {', '.join(missing)} not set: a multi-node run "
                          "needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
    try:
        env = NodeEnv(int(environ["RANK"]), int(environ["WORLD_SIZE"]), environ["MASTER_ADDR"],
                      int(environ["MASTER_PORT"]))
    except ValueError as err:
        raise ConfigError(f"RANK, WORLD_SIZE and MASTER_PORT must be integers ({err})") from None
    if not 0 <= env.rank < env.world_size:
        raise ConfigError(f"RANK={env.rank} is outside 0..{env.world_size - 1} (WORLD_SIZE={env.world_size})")
    if not 0 < env.master_port < 65536:
        raise ConfigError(f"MASTER_PORT={env.master_port} is not a TCP port")
    return env


@dataclass(frozen=True)
class Timeouts:
    start_s: float  # every node joins within this
    sync_s: float  # collectives around uneven work: the first step, node 0's checkpoints, evaluation, export
    step_s: float  # steady-state collectives; also how long a node may go without a heartbeat


def micro_batch_share(micro_batches_per_step: int, rank: int, world_size: int) -> list[int]:
    """The indices of a step's micro-batches that node `rank` computes: n % world_size == rank, so every
    micro-batch goes to exactly one node whatever their number and layouts."""
    if micro_batches_per_step < world_size:
        raise ConfigError(f"a step has {micro_batches_per_step} micro-batch(es) for {world_size} nodes: raise "
                          "batch_size (or lower micro_batch_size) so that every node has at least one")
    return list(range(rank, micro_batches_per_step, world_size))


def default_micro_batch(config, world_size: int):
    """With micro_batch_size unset (0) on several nodes, the global batch is shared among them: each node one
    micro-batch of batch_size / world_size sequences a step (a batch that does not divide evenly is refused in
    one line). Returns (the config with micro_batch_size set, the words for the log), or (config, "") when
    micro_batch_size is set or the run has one node."""
    if config.micro_batch_size or world_size <= 1:
        return config, ""
    if config.batch_size % world_size:
        raise ConfigError(f"batch_size ({config.batch_size}) cannot be shared evenly among {world_size} nodes "
                          f"(micro_batch_size unset): make it a multiple of {world_size}, or set micro_batch_size")
    rows = config.batch_size // world_size
    return (dataclasses.replace(config, micro_batch_size=rows),
            f" (micro_batch_size unset: batch_size {config.batch_size} shared among {world_size} nodes)")


def timeouts_of(config) -> Timeouts:
    return Timeouts(config.node_start_timeout_s, config.node_sync_timeout_s, config.node_timeout_s)
