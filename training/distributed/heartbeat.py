"""Each node's heartbeat in node 0's store: how a hung or dead node is told within HEARTBEAT_LOST_S."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

_BEAT_S = 1.0  # how often a node beats its counter in the store
# A node silent this long (or node_timeout_s, if shorter) is lost: hung or dead. Short enough that every other
# node has ended within 30 s of a node's death even when nothing else tells (a host gone, a network cut).
HEARTBEAT_LOST_S = 20.0


class Heartbeat:
    """Every node sets its own counter in the store one higher every second and reads everyone's. A node whose
    counter has not risen for `lost_after_s` is hung or dead; a store that fails is node 0 gone. Either way
    `on_lost(line)` is called once, from this thread. The counters are values the node sets (with a node secret
    the store seals them: secret.SealedStore), not the store's own counters, which anyone could add to: a value
    that is not the node's, or not higher than the last, is not a beat."""

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
        self._beats = 1
        self.store.set(self.keys[rank], str(self._beats))
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
                self._beats += 1
                self.store.set(self.keys[self.rank], str(self._beats))
                counts = [_count(value) for value in self.store.multi_get(self.keys)]
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
                if count is not None and (self._counts[rank] is None or count > self._counts[rank]):
                    self._counts[rank], self._heard[rank] = count, now
            silent = self.silent(self.lost_after_s)
            if silent and not self._stop.is_set():
                self.on_lost(f"{describe_ranks(silent)} stopped answering (no heartbeat for {self.lost_after_s:.0f} s): "
                             "hung or dead")
                return

    def silent(self, for_s: float) -> list[int]:
        """Other nodes not heard from for `for_s` seconds."""
        now = time.monotonic()
        return [r for r in range(self.world_size) if r != self.rank and now - self._heard[r] > for_s]


def _count(value: bytes | None) -> int | None:
    try:
        return int(value) if value is not None and len(value) <= 20 else None
    except ValueError:
        return None


def describe_ranks(ranks: Sequence[int]) -> str:
    return ("node " if len(ranks) == 1 else "nodes ") + ", ".join(str(r) for r in ranks)
