"""This process's place in a multi-node run (`Nodes`), and `join_nodes`, which gives the run its nodes: `Nodes`
when WORLD_SIZE > 1, else the single node (training/distributed/single.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training.checkpoint import FILES as CHECKPOINT_FILES
from training.config import ConfigError
from training.console import say, warn
from training.distributed.env import NodeEnv, NodeLost, Timeouts, micro_batch_share, node_env, timeouts_of
from training.distributed.fingerprint import fingerprint_difference
from training.distributed.heartbeat import HEARTBEAT_LOST_S, Heartbeat, describe_ranks
from training.distributed.secret import NO_SECRET_LINE, prove_joiners, prove_to_leader, read_node_secret
from training.distributed.single import SingleNode
from training.distributed.wire import (
    MAX_MESSAGE_BYTES,
    Malformed,
    check_figures,
    check_fingerprint,
    check_listing,
    decode,
    encode,
)

_NAMING_S = 3.0  # after a failed collective: a node silent this long is the one that went
_BUCKET_BYTES = 256 * 2**20  # gradients are all-reduced in flat buckets of this size
_FILE_CHUNK_BYTES = 64 * 2**20  # checkpoint files go from node 0 to the others in chunks of this size


class Nodes:
    """This process's place in a multi-node run, and the collectives the trainer uses (the pipeline's three a
    step: `agree`, `sum_numbers`, `sum_tensors`; the rest at start, at log steps and around node 0's slow work).
    Every collective is called in the same order on every node; a failed one raises NodeLost naming the node
    that went, when the heartbeats tell."""

    def __init__(self, env: NodeEnv, timeouts: Timeouts, on_lost: Callable[[str], None],
                 secret: bytes | None = None):
        """Join node 0's rendezvous (every node within timeouts.start_s; with `secret`, every node proves it
        holds it, both ways, before anything else: training/distributed/secret.py) and start beating. The
        process group comes later (`form_group`), once this node knows the device its collectives run on."""
        self.rank, self.world_size, self.env = env.rank, env.world_size, env
        self.timeouts = timeouts
        self.device, self.backend = torch.device("cpu"), "gloo"  # form_group's
        self.first_step: int | None = None  # begin's: that step's collectives wait out everyone's warm-up
        self.per_step = 0  # share's: a step's micro-batches on every node together
        self._all_reduce_spans: list[tuple[Any, Any]] = []  # per step since the last take: (start, end) marks
        deadline = time.monotonic() + timeouts.start_s
        try:
            raw = dist.TCPStore(env.master_addr, env.master_port, env.world_size, env.rank == 0,
                                timeout=timedelta(seconds=timeouts.start_s), wait_for_workers=secret is None)
            # Without a secret the keys are where they always were; with one, under a prefix only the proven
            # nodes can name, so a stranger takes no part in the group's formation nor in the heartbeats.
            self.store, prefix = raw, None
            if secret is not None:
                prove = prove_joiners if env.rank == 0 else prove_to_leader
                prefix = prove(raw, secret, env, deadline, timeouts.start_s)
                self.store = dist.PrefixStore(prefix, raw)
            # Its own connection: the heartbeat thread never waits behind the process group's use of the store.
            beat_store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, False,
                                       timeout=timedelta(seconds=30), wait_for_workers=False)
            if prefix is not None:
                beat_store = dist.PrefixStore(prefix, beat_store)
            self.heartbeat = Heartbeat(beat_store, env.rank, env.world_size, min(HEARTBEAT_LOST_S, timeouts.step_s),
                                       on_lost)
            beat_store.wait(self.heartbeat.keys, timedelta(seconds=max(0.1, deadline - time.monotonic())))
        except NodeLost:
            raise
        except Exception as err:  # noqa: BLE001 - torch raises several kinds here; all mean "could not join"
            raise NodeLost(self._join_failure(err)) from None
        self.heartbeat.start()

    def form_group(self, device: torch.device, backend: str = "auto") -> None:
        """The process groups, their collectives on `device` (the leader replica's: where the pipeline sums the
        gradients; the CPU for a CPU run). Every node's process then uses one device for every collective, so
        NCCL makes one communicator a group on every node alike."""
        self.device = device if device.type == "cuda" else torch.device("cpu")
        # auto: NCCL between GPUs, gloo on the CPU. gloo also sums CUDA tensors (through the host: slower),
        # which lets two nodes share one GPU, where NCCL refuses two ranks.
        self.backend = ("nccl" if self.device.type == "cuda" else "gloo") if backend == "auto" else backend
        if self.backend == "nccl" and self.device.type != "cuda":
            raise ConfigError("node_backend=nccl needs the drafter replicas on GPUs; use gloo (or auto) on the CPU")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL's collectives use the current device
        if self.backend == "nccl":
            # A failed or timed-out NCCL collective raises in the thread that waits on it (one line, exit 6),
            # instead of the watchdog aborting the process.
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        try:
            dist.init_process_group(self.backend, store=self.store, rank=self.rank, world_size=self.world_size,
                                    timeout=timedelta(seconds=self.timeouts.sync_s))
            self._sync_group = dist.group.WORLD
            self._step_group = dist.new_group(backend=self.backend,
                                              timeout=timedelta(seconds=self.timeouts.step_s))
            self._collective("forming the process group", dist.barrier, group=self._sync_group)
        except NodeLost:
            raise
        except Exception as err:  # noqa: BLE001 - e.g. no usable interface, or a peer gone while connecting
            raise NodeLost(f"every node joined node 0 at {self.env.master_addr}:{self.env.master_port}, but the "
                           f"{self.backend} process group could not be formed ({type(err).__name__}: {err}); with "
                           "several interfaces, name the one the nodes share: GLOO_SOCKET_IFNAME / "
                           "NCCL_SOCKET_IFNAME") from None

    @property
    def comm_device(self) -> torch.device:
        """Where the small tensors of agree/sum_numbers and the checkpoint's chunks go: the GPU for NCCL."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _join_failure(self, err: BaseException) -> str:
        where = f"{self.env.master_addr}:{self.env.master_port}"
        if self.rank == 0:
            return (f"not every node joined within {self.timeouts.start_s:.0f} s (node_start_timeout_s): this node "
                    f"listens on {where}; the others must reach it and start with WORLD_SIZE={self.world_size} "
                    f"({type(err).__name__}: {err})")
        return (f"could not join node 0 at {where} within {self.timeouts.start_s:.0f} s (node_start_timeout_s): is "
                f"it started, and is the port open between the nodes? ({type(err).__name__}: {err})")

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

    def begin(self, first_step: int) -> None:
        """Training starts at `first_step`: its collectives wait out every node's warm-up and compile."""
        self.first_step = first_step

    def stall_timeout_s(self, alone_s: float) -> float:
        """The pipeline's stall watchdog: waiting for node 0's checkpoint or evaluation makes no progress here,
        and is not a stall."""
        return max(alone_s, self.timeouts.sync_s + 60)

    # Collectives.
    def _collective(self, what: str, op: Callable, *args, **kwargs) -> Any:
        try:
            return op(*args, **kwargs)
        except NodeLost:
            raise
        except Exception as err:  # noqa: BLE001 - gloo/NCCL/store errors: all mean a node went
            raise NodeLost(f"{self._who()} during {what}: {type(err).__name__}: {err}") from None

    def _who(self) -> str:
        """Which node went, as far as the heartbeats tell within a few seconds."""
        deadline = time.monotonic() + 2 * _NAMING_S
        while time.monotonic() < deadline:
            if self.heartbeat.gone:
                return self.heartbeat.gone
            if self.heartbeat.unreachable_since is not None:
                return "node 0 (the rendezvous) stopped answering"
            silent = self.heartbeat.silent(_NAMING_S)
            if silent:
                return f"{describe_ranks(silent)} stopped answering"
            time.sleep(0.2)
        return "a node failed or timed out (every heartbeat still comes)"

    def _group(self, step: int | None):
        return self._sync_group if step is None or step == self.first_step else self._step_group

    def agree(self, step: int, complete: bool, stop: bool) -> tuple[bool, bool]:
        """Whether every node finished the step's micro-batches, and whether any asks to stop after it."""
        flags = torch.tensor([0.0 if complete else 1.0, 1.0 if stop else 0.0], device=self.comm_device)
        self._collective(f"step {step + 1}'s start of the update", dist.all_reduce, flags, group=self._group(step))
        incomplete, stops = flags.tolist()
        return incomplete == 0, stops > 0

    def any_stops(self, stop: bool) -> bool:
        """Whether any node asks to stop (before training: a signal while loading)."""
        flag = torch.tensor([1.0 if stop else 0.0], device=self.comm_device)
        self._collective("the check for a stop before training", dist.all_reduce, flag, group=self._sync_group)
        return flag.item() > 0

    def sum_numbers(self, step: int, values: list[float]) -> list[float]:
        """The sum over nodes of a few numbers (the step's loss and metric sums)."""
        numbers = torch.tensor(values, dtype=torch.float64 if self.backend == "gloo" else torch.float32,
                               device=self.comm_device)
        self._collective(f"step {step + 1}'s loss sum", dist.all_reduce, numbers, group=self._group(step))
        return numbers.tolist()

    def sum_tensors(self, step: int, tensors: list[torch.Tensor]) -> None:
        """Sum `tensors` (this node's summed gradients, on self.device) over the nodes, in place, in flat
        buckets of one dtype."""
        group = self._group(step)
        start = self._mark()
        for bucket in _buckets(tensors, _BUCKET_BYTES):
            flat = torch._utils._flatten_dense_tensors(bucket)
            self._collective(f"step {step + 1}'s gradient all-reduce", dist.all_reduce, flat, group=group)
            for tensor, summed in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                tensor.copy_(summed)
        self._all_reduce_spans.append((start, self._mark()))

    def _mark(self) -> Any:
        """A point in time on this thread's stream (CUDA: the collectives' waits are on it, the host does not
        wait), or on the host's clock."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def take_all_reduce_ms(self) -> float | None:
        """The gradient all-reduce's mean time a step (ms) since the previous call; None when none ran. Called
        after the steps' streams synchronized (every step ends so), so their CUDA events are done."""
        spans, self._all_reduce_spans = self._all_reduce_spans, []
        if not spans:
            return None
        if self.device.type == "cuda":
            return sum(start.elapsed_time(end) for start, end in spans) / len(spans)
        return 1000 * sum(end - start for start, end in spans) / len(spans)

    def gather(self, value: Any, what: str, check: Callable[[int], Callable[[Any], None]]) -> list[Any]:
        """Every node's `value` (small, JSON), in rank order, each passed by `check(rank)` (wire.py's)."""
        payloads = self._all_gather_bytes(encode(value), what, self._step_group)
        return [decode(data, rank, what, check(rank)) for rank, data in enumerate(payloads)]

    def _all_gather_bytes(self, payload: bytes, what: str, group) -> list[bytes]:
        """Every node's `payload`, in rank order: their sizes, then the bytes padded to the largest (tensor
        collectives: nothing is unpickled). A size over MAX_MESSAGE_BYTES is refused before any is sent."""
        mine = torch.tensor([len(payload)], dtype=torch.int64, device=self.comm_device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.comm_device) for _ in range(self.world_size)]
        self._collective(what, dist.all_gather, sizes, mine, group=group)
        lengths = [int(size.item()) for size in sizes]
        for rank, length in enumerate(lengths):
            if not 0 <= length <= MAX_MESSAGE_BYTES:
                raise Malformed(f"node {rank} announced a {what} of {length} bytes (at most {MAX_MESSAGE_BYTES}): "
                                "refusing it (a stranger, or a trainer of another version)")
        padded = torch.zeros(max(lengths), dtype=torch.uint8)
        if payload:
            padded[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows = [torch.empty(max(lengths), dtype=torch.uint8, device=self.comm_device) for _ in lengths]
        self._collective(what, dist.all_gather, rows, padded.to(self.comm_device), group=group)
        return [row[:length].cpu().numpy().tobytes() for row, length in zip(rows, lengths)]

    def _broadcast_bytes(self, payload: bytes | None, what: str) -> bytes:
        """Node 0's `payload` on every node (its size, then its bytes), at most MAX_MESSAGE_BYTES."""
        size = torch.tensor([len(payload) if self.leader else 0], dtype=torch.int64, device=self.comm_device)
        self._collective(what, dist.broadcast, size, src=0, group=self._sync_group)
        length = int(size.item())
        if not 0 <= length <= MAX_MESSAGE_BYTES:
            raise Malformed(f"node 0 announced a {what} of {length} bytes (at most {MAX_MESSAGE_BYTES}): refusing it")
        data = torch.zeros(length, dtype=torch.uint8)
        if self.leader and length:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        data = data.to(self.comm_device)
        self._collective(what, dist.broadcast, data, src=0, group=self._sync_group)
        return data.cpu().numpy().tobytes()

    def wait_for_leader(self, what: str) -> None:
        """Meet every node, with the long timeout: node 0 arrives after its checkpoint, evaluation or export."""
        self._collective(f"waiting for node 0's {what}", dist.barrier, group=self._sync_group)

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


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype, about `limit` bytes a bucket (a larger tensor is a bucket of its own)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or buckets[-1][0].dtype != tensor.dtype or size + nbytes > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += nbytes
    return buckets


def join_nodes(config, on_lost: Callable[[str], None]) -> Nodes | SingleNode:
    """This run's nodes: with WORLD_SIZE > 1 in the environment, node 0's rendezvous joined (Nodes, which calls
    `on_lost(line)` from its heartbeat thread when another node hangs or dies); else the single node."""
    env = node_env()
    if env is None:
        return SingleNode()
    micro_batch_share(config.micro_batches_per_step(), env.rank, env.world_size)  # refused before joining
    secret = read_node_secret()
    say(f"node {env.rank} of {env.world_size}: joining node 0 at {env.master_addr}:{env.master_port}"
        f"{', proving the node secret' if secret else ''}")
    if secret is None:
        warn(NO_SECRET_LINE)
    return Nodes(env, timeouts_of(config), on_lost, secret)
