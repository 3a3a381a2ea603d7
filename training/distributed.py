"""One run over several trainer processes (nodes), through torch.distributed alone (ARCHITECTURE §8).

Each node is one process running the threaded pipeline over its own devices. The pipeline sums its own
replicas' gradients first; `Nodes` then all-reduces that sum across the processes (gloo on the CPU, NCCL on
GPUs) before the one clip and the optimizer step, so every replica on every node takes the same step.

A run is multi-node when WORLD_SIZE > 1: the env:// variables RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
(gpuctl sets them, one process per node; torchrun sets the same). Node 0 hosts the rendezvous (a TCPStore on
MASTER_PORT) and is the only one that writes checkpoints, the run's metrics and the export.

Timeouts: joining waits `node_start_timeout_s` for every node (a node that never starts does not hold the
others for ten minutes); collectives around slow, uneven work (start, the first step after warm-up, node 0's
checkpoints, evaluations and export) wait `node_sync_timeout_s`; steady-state steps wait `node_timeout_s`.
Each node also beats a counter in the store every second; a node whose counter stops for a minute (or
`node_timeout_s`, if shorter: hung or dead), or a store that stops answering as long (node 0 gone), makes every
other node stop with a line naming it, before any collective's own timeout. On NCCL, TORCH_NCCL_BLOCKING_WAIT
makes a failed collective raise in the thread that waits on it (a line, exit 6) rather than abort the process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training.config import ConfigError

ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Config keys each node may set for itself: where things are on its disk and how it uses its own devices.
PER_NODE_KEYS = frozenset({"target_path", "data_path", "eval_data_path", "output_dir", "build_tiny",
                           "overwrite_output", "devices", "topology", "target_devices", "drafter_devices",
                           "colocated_devices", "num_threads", "queue_depth"})
_BEAT_S = 1.0  # how often a node beats its counter in the store
_NAMING_S = 3.0  # after a failed collective: a node silent this long is the one that went
HEARTBEAT_LOST_S = 60.0  # a node silent this long (or node_timeout_s, if shorter) is lost: hung or dead
_BUCKET_BYTES = 256 * 2**20  # gradients are all-reduced in flat buckets of this size
_FILE_CHUNK_BYTES = 64 * 2**20  # checkpoint files go from node 0 to the others in chunks of this size


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


class Heartbeat:
    """Every node adds 1 to its own counter in the store every second and reads everyone's. A node whose
    counter has not moved for `lost_after_s` is hung or dead; a store that fails is node 0 gone. Either way
    `on_lost(line)` is called once, from this thread."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, lost_after_s: float,
                 on_lost: Callable[[str], None]):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.lost_after_s, self.on_lost = lost_after_s, on_lost
        self.keys = [f"gpuctl/beat/{r}" for r in range(world_size)]
        self._counts: list[int | None] = [None] * world_size
        self._heard = [time.monotonic()] * world_size  # when each node's counter last moved
        self.gone: str | None = None  # why the store stopped answering, once for lost_after_s
        self.unreachable_since: float | None = None  # the store fails (node 0 gone, or the network)
        self._stop = threading.Event()
        self.store.add(self.keys[rank], 1)
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self, wait: bool = True) -> None:
        """No more beats or verdicts (this node is ending); with `wait`, returns once the thread is done with
        the store."""
        self._stop.set()
        if wait and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(_BEAT_S):
            try:
                self.store.add(self.keys[self.rank], 1)
                counts = [int(value) for value in self.store.multi_get(self.keys)]
            except Exception as err:  # noqa: BLE001 - the store is node 0's: a failure is node 0 or the network
                now = time.monotonic()
                self.unreachable_since = self.unreachable_since or now
                if self._stop.is_set():
                    return
                if now - self.unreachable_since < self.lost_after_s:
                    continue  # a blip: try again
                self.gone = (f"node 0 (the rendezvous) stopped answering for {self.lost_after_s:.0f} s "
                             f"({type(err).__name__}: {err})")
                self.on_lost(self.gone)
                return
            self.unreachable_since = None
            now = time.monotonic()
            for rank, count in enumerate(counts):
                if count != self._counts[rank]:
                    self._counts[rank], self._heard[rank] = count, now
            silent = self.silent(self.lost_after_s)
            if silent and not self._stop.is_set():
                self.on_lost(f"{_nodes(silent)} stopped answering (no heartbeat for {self.lost_after_s:.0f} s): "
                             "hung or dead")
                return

    def silent(self, for_s: float) -> list[int]:
        """Other nodes not heard from for `for_s` seconds."""
        now = time.monotonic()
        return [r for r in range(self.world_size) if r != self.rank and now - self._heard[r] > for_s]


def _nodes(ranks: Sequence[int]) -> str:
    return ("node " if len(ranks) == 1 else "nodes ") + ", ".join(str(r) for r in ranks)


class Nodes:
    """This process's place in a multi-node run, and the collectives the trainer uses (the pipeline's three a
    step: `agree`, `sum_numbers`, `sum_tensors`; the rest at start, at log steps and around node 0's slow work).
    Every collective is called in the same order on every node; a failed one raises NodeLost naming the node
    that went, when the heartbeats tell."""

    def __init__(self, env: NodeEnv, timeouts: Timeouts, on_lost: Callable[[str], None]):
        """Join node 0's rendezvous (every node within timeouts.start_s) and start beating. The process group
        comes later (`form_group`), once this node knows the device its collectives run on."""
        self.rank, self.world_size, self.env = env.rank, env.world_size, env
        self.timeouts = timeouts
        self.device, self.backend = torch.device("cpu"), "gloo"  # form_group's
        self.first_step: int | None = None  # the first step's collectives wait out everyone's warm-up
        self._all_reduce_spans: list[tuple[Any, Any]] = []  # per step since the last take: (start, end) marks
        try:
            self.store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, env.rank == 0,
                                       timeout=timedelta(seconds=timeouts.start_s), wait_for_workers=True)
            # Its own connection: the heartbeat thread never waits behind the process group's use of the store.
            beat_store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, False,
                                       timeout=timedelta(seconds=30), wait_for_workers=False)
            self.heartbeat = Heartbeat(beat_store, env.rank, env.world_size, min(HEARTBEAT_LOST_S, timeouts.step_s),
                                       on_lost)
            beat_store.wait(self.heartbeat.keys, timedelta(seconds=timeouts.start_s))  # every node has beaten
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
            torch.cuda.set_device(self.device)  # the object collectives use the current device
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
                return f"{_nodes(silent)} stopped answering"
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

    def gather(self, value: Any, what: str) -> list[Any]:
        """Every node's `value` (small, picklable), in rank order."""
        values: list[Any] = [None] * self.world_size
        self._collective(what, dist.all_gather_object, values, value, group=self._step_group)
        return values

    def wait_for_leader(self, what: str) -> None:
        """Meet every node, with the long timeout: node 0 arrives after its checkpoint, evaluation or export."""
        self._collective(f"waiting for node 0's {what}", dist.barrier, group=self._sync_group)

    def check_same(self, fingerprint: dict[str, Any]) -> None:
        """Refuse (ConfigError, on every node alike) a run whose nodes differ in config, data, target or drafter
        from node 0: `fingerprint` maps each to what this node has (see run_fingerprint)."""
        everyone: list[Any] = [None] * self.world_size
        self._collective("the start's check of config, data and target", dist.all_gather_object, everyone,
                         fingerprint, group=self._sync_group)
        first = everyone[0]
        for rank, theirs in enumerate(everyone[1:], 1):
            difference = fingerprint_difference(first, theirs)
            if difference is not None:
                raise ConfigError(f"node {rank} {difference}: every node must train the same drafter on the same "
                                  "data with the same config (only devices, topology, paths and num_threads may "
                                  "differ)")

    def share_checkpoint(self, checkpoint: Path | None, into: Path) -> Path | None:
        """Node 0's checkpoint to resume from, for every node: node 0 sends its files (other hosts do not share
        its disk) and gets `checkpoint` back; the others write them under `into` and get that copy's path.
        None on every node when node 0 has none."""
        files = None
        if self.leader and checkpoint is not None:
            files = {"name": checkpoint.name,
                     "files": [[p.name, p.stat().st_size] for p in sorted(checkpoint.iterdir()) if p.is_file()]}
        listing = [files]
        self._collective("the checkpoint listing", dist.broadcast_object_list, listing, src=0,
                         group=self._sync_group)
        files = listing[0]
        if files is None:
            return None
        copy = into / files["name"]
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


def tensor_sums(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, tuple[float, float]]:
    """Each tensor's sum and sum of magnitudes, in float64: equal weights give sums equal within a rounding
    bound whatever the device and its order of addition, a different model does not (read where the weights
    live: an 8 B target is milliseconds on a GPU, where hashing its files is minutes)."""
    return {name: (float(t.detach().sum(dtype=torch.float64)),
                   float(torch.linalg.vector_norm(t.detach(), 1, dtype=torch.float64))) for name, t in named}


def run_fingerprint(config: dict[str, Any], data_id: dict[str, Any], target_config: dict,
                    target_weights: dict[str, tuple[float, float]],
                    drafter_weights: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """What must be alike on every node of a run (Nodes.check_same)."""
    shared = {key: value for key, value in config.items() if key not in PER_NODE_KEYS}
    target = hashlib.sha256(json.dumps(target_config, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"config": shared, "data": data_id, "target": target, "target_weights": target_weights,
            "drafter_weights": drafter_weights}


def fingerprint_difference(first: dict[str, Any], theirs: dict[str, Any], rel_tol: float = 1e-7) -> str | None:
    """How `theirs` differs from node 0's `first`, in words; None when alike."""
    for key in sorted(set(first["config"]) | set(theirs["config"])):
        if first["config"].get(key) != theirs["config"].get(key):
            return (f"has {key}={theirs['config'].get(key)!r} where node 0 has {first['config'].get(key)!r} "
                    "in its training config")
    for key in sorted(set(first["data"]) | set(theirs["data"])):
        if first["data"].get(key) != theirs["data"].get(key):
            return (f"reads other training data than node 0 ({key}: {theirs['data'].get(key)!r} vs "
                    f"{first['data'].get(key)!r})")
    if first["target"] != theirs["target"]:
        return "has another target model config than node 0"
    for what in ("target_weights", "drafter_weights"):
        if list(first[what]) != list(theirs[what]):
            return f"has other {what.replace('_', ' ')} than node 0 (other tensor names)"
        for name, (value, magnitude) in first[what].items():
            other, other_magnitude = theirs[what][name]
            # Float64 sums of the same values in another order differ by far less than 1e-7 of their magnitude.
            if abs(other - value) > rel_tol * max(magnitude, other_magnitude, 1e-30):
                return f"has other {what.replace('_', ' ')} than node 0 ({name}: sum {other!r} vs {value!r})"
    return None


def timeouts_of(config) -> Timeouts:
    return Timeouts(config.node_start_timeout_s, config.node_sync_timeout_s, config.node_timeout_s)

