"""This process's place in a multi-node run (`Nodes`), and `join_nodes`, which gives the run its nodes: `Nodes`
when WORLD_SIZE > 1, else the single node (training/distributed/single.py)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training.config import ConfigError
from training.console import say
from training.distributed.collectives import Collectives
from training.distributed.env import NodeEnv, Timeouts, micro_batch_share, node_env, timeouts_of
from training.distributed.fingerprint import fingerprint_difference
from training.distributed.rendezvous import Rendezvous
from training.distributed.secret import require_node_secret
from training.distributed.single import SingleNode
from training.distributed.wire import check_figures, check_fingerprint, check_listing, decode, encode
from training.output.checkpoint import FILES as CHECKPOINT_FILES

_FILE_CHUNK_BYTES = 64 * 2**20  # checkpoint files go from node 0 to the others in chunks of this size


class Nodes(Collectives):
    """This process's place in a multi-node run: joined (Rendezvous), its process groups formed later
    (`form_group`), the collectives the trainer uses (Collectives'), and the run's exchanges over them: its
    checks at start, its metrics, node 0's checkpoint for a resume, its end."""

    def __init__(self, env: NodeEnv, timeouts: Timeouts, on_lost: Callable[[str], None],
                 secret: bytes | None = None):
        """Join node 0's rendezvous and start beating (Rendezvous). The process group comes later
        (`form_group`), once this node knows the device its collectives run on."""
        super().__init__(Rendezvous(env, timeouts, on_lost, secret))
        self.per_step = 0  # share's: a step's micro-batches on every node together

    def close(self) -> None:
        """The run ended well on every node: stop beating, meet once more (so that node 0, whose process holds
        the store, outlives every other node's last use of it), and leave the process group."""
        self.heartbeat.stop()
        self._collective("the end", dist.barrier, group=self._sync_group)
        dist.destroy_process_group()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """A run that ended well closes (`close`); one that failed only stops beating: it is ending anyway, and
        a node that ends first is not "lost"."""
        if exc_type is None:
            self.close()
        else:
            self.heartbeat.stop(wait=False)

    # The run's shape on this node.
    def share(self, per_step: int) -> list[int]:
        """The indices of each step's `per_step` micro-batches this node computes (micro_batch_share)."""
        self.per_step = per_step
        return micro_batch_share(per_step, self.rank, self.world_size)

    def stall_timeout_s(self, alone_s: float) -> float:
        """The pipeline's stall watchdog: waiting for node 0's checkpoint or evaluation makes no progress here,
        and is not a stall."""
        return max(alone_s, self.timeouts.sync_s + 60)

    # The run's exchanges.
    def combine_figures(self, step: int, tokens_per_s: float, tflops_per_s: float,
                        busy: dict[str, float]) -> tuple[float, float, dict[str, Any]]:
        """A metrics window's figures exchanged between the nodes: node 0 gets the run's tokens/s and TFLOP/s and
        every node's own (`nodes`), each other node its own and its all-reduce time."""
        mine = {"node": self.rank, "tokens_per_s": round(tokens_per_s, 1), "tflops_per_s": tflops_per_s,
                "busy": busy, "all_reduce_ms": self.take_all_reduce_ms()}
        everyone = self.gather(mine, f"step {step}'s metrics", check_figures)
        if not self.leader:
            return tokens_per_s, tflops_per_s, {"node": self.rank, "all_reduce_ms": mine["all_reduce_ms"]}
        return (sum(node["tokens_per_s"] for node in everyone),
                round(sum(node["tflops_per_s"] for node in everyone), 3), {"nodes": everyone})

    def check_same(self, fingerprint: Callable[[], dict[str, Any]]) -> None:
        """Refuse (ConfigError, on every node alike) a run whose nodes differ in config, data, target or drafter
        from node 0: `fingerprint()` maps each to what this node has (see run_fingerprint)."""
        what = "fingerprint of config, data and target"
        payloads = self._all_gather_bytes(encode(fingerprint()), f"the start's {what}", self._sync_group)
        everyone = [decode(data, rank, what, check_fingerprint) for rank, data in enumerate(payloads)]
        first = everyone[0]
        for rank, theirs in enumerate(everyone[1:], 1):
            difference = fingerprint_difference(first, theirs)
            if difference is not None:
                raise ConfigError(f"node {rank} {difference}: every node must train the same drafter on the same "
                                  "data with the same config (only devices, topology, paths and num_threads may "
                                  "differ)")
        share = micro_batch_share(self.per_step, self.rank, self.world_size)
        say(f"node {self.rank} of {self.world_size}: every node has the same config, data, target and drafter; "
            f"this node computes {len(share)} of each step's {self.per_step} micro-batches")

    @contextlib.contextmanager
    def resume_from(self, checkpoint: Path | None, into: Path) -> Iterator[Path | None]:
        """Node 0's checkpoint (`checkpoint`, None for none) on every node, for the time of the `with`: a node
        other than 0 gets its copy under `into` (share_checkpoint), deleted afterwards."""
        try:
            yield self.share_checkpoint(checkpoint, into)
        finally:
            if not self.leader:
                shutil.rmtree(into, ignore_errors=True)
                with contextlib.suppress(OSError):  # empty unless another node shares this output_dir
                    into.parent.rmdir()

    def share_checkpoint(self, checkpoint: Path | None, into: Path) -> Path | None:
        """Node 0's checkpoint to resume from, for every node: node 0 sends its files (other hosts do not share
        its disk) and gets `checkpoint` back; the others write them under `into` and get that copy's path.
        None on every node when node 0 has none."""
        files = None
        if self.leader and checkpoint is not None:
            files = {"name": checkpoint.name, "files": [[name, (checkpoint / name).stat().st_size]
                                                        for name in CHECKPOINT_FILES if (checkpoint / name).is_file()]}
        listing = self._broadcast_bytes(encode(files) if self.leader else None, "checkpoint listing")
        files = decode(listing, 0, "checkpoint listing", check_listing(CHECKPOINT_FILES))
        if files is None:
            return None
        copy = into / files["name"]  # a plain step_NNNNNNNN name (check_listing): inside `into`
        if not self.leader:
            shutil.rmtree(copy, ignore_errors=True)
            copy.mkdir(parents=True)
        for name, size in files["files"]:
            source = checkpoint / name if self.leader else None
            with open(source if self.leader else copy / name, "rb" if self.leader else "wb") as file:
                for start in range(0, size, _FILE_CHUNK_BYTES):
                    length = min(_FILE_CHUNK_BYTES, size - start)
                    if self.leader:
                        chunk = torch.frombuffer(bytearray(file.read(length)), dtype=torch.uint8).to(self.comm_device)
                    else:
                        chunk = torch.empty(length, dtype=torch.uint8, device=self.comm_device)
                    self._collective(f"sending checkpoint file {name}", dist.broadcast, chunk, src=0,
                                     group=self._sync_group)
                    if not self.leader:
                        file.write(chunk.cpu().numpy().tobytes())
        return checkpoint if self.leader else copy


def join_nodes(config, on_lost: Callable[[str], None]) -> Nodes | SingleNode:
    """This run's nodes: with WORLD_SIZE > 1 in the environment, node 0's rendezvous joined (Nodes, which calls
    `on_lost(line)` from its heartbeat thread when another node hangs or dies); else the single node."""
    env = node_env()
    if env is None:
        return SingleNode()
    micro_batch_share(config.micro_batches_per_step(), env.rank, env.world_size)  # refused before joining
    secret = require_node_secret()  # none: refused, unless GPUCTL_TRUSTED_NETWORK=1 opts out
    say(f"node {env.rank} of {env.world_size}: joining node 0 at {env.master_addr}:{env.master_port}"
        f"{', proving the node secret' if secret else ''}")
    return Nodes(env, timeouts_of(config), on_lost, secret)
