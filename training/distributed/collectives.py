"""The process groups of a multi-node run and the collectives over them: the pipeline's three a step (`agree`,
`sum_numbers`, `sum_tensors`), the barriers around node 0's slow work, and small messages as bytes (tensor
collectives: nothing is unpickled). A failed collective raises NodeLost naming the node that went, when the
heartbeats tell (ARCHITECTURE §8)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from training.config import ConfigError
from training.distributed.env import NodeLost
from training.distributed.heartbeat import describe_ranks
from training.distributed.rendezvous import Rendezvous
from training.distributed.wire import MAX_MESSAGE_BYTES, Malformed, decode, encode

_NAMING_S = 3.0  # after a failed collective: a node silent this long is the one that went
_BUCKET_BYTES = 256 * 2**20  # gradients are all-reduced in flat buckets of this size


class Collectives:
    """The collectives over the rendezvous' nodes, once `form_group` made the process groups. Every collective
    is called in the same order on every node."""

    def __init__(self, rendezvous: Rendezvous):
        self.rendezvous = rendezvous
        self.rank, self.world_size, self.env = rendezvous.rank, rendezvous.world_size, rendezvous.env
        self.timeouts, self.store, self.heartbeat = rendezvous.timeouts, rendezvous.store, rendezvous.heartbeat
        self.device, self.backend = torch.device("cpu"), "gloo"  # form_group's
        self.first_step: int | None = None  # begin's: that step's collectives wait out everyone's warm-up
        self._sync_group: Any = None  # form_group's: the long timeout (start, checkpoints, the first step)
        self._step_group: Any = None  # form_group's: the steady-state timeout
        self._all_reduce_spans: list[tuple[Any, Any]] = []  # per step since the last take: (start, end) marks

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

    # Collectives.
    def begin(self, first_step: int) -> None:
        """Training starts at `first_step`: its collectives wait out every node's warm-up and compile."""
        self.first_step = first_step

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
