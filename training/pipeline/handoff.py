"""Between the pipeline's threads: the bounded, ordered handoff of micro-batches, and each thread's busy clock."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

# How long a blocked wait sleeps before re-checking the stop flags (waits are also woken on every change).
_POLL_S = 0.5


class Handoff:
    """Micro-batches from the source to the threads that compute them, bounded and in order.

    The source is read in order, under one lock, by target threads (which publish features for drafter
    threads) and by colocated threads (which keep what they read). A micro-batch's key (step, index) follows
    from its position in the source, whoever reads it."""

    def __init__(self, source: Iterable[Any], total: int, per_step: int, start_step: int, bound: int):
        self._source: Iterator[Any] = iter(source)
        self._source_lock = threading.Lock()
        self._total = total
        self._per_step = per_step
        self._start_step = start_step
        self.bound = bound
        self.cond = threading.Condition()
        self.stopping = False  # no new work: a requested stop or an abort
        self.aborted = False
        self._source_position = 0  # micro-batches read from the source so far
        self._live = 0  # reserved or published by a target thread and not yet taken by a drafter
        self._ready: dict[tuple[int, int], Any] = {}
        self._readers: dict[tuple[int, int], str] = {}  # key -> "target" or "colocated", once read
        self._next_index: dict[int, int] = {}  # step -> next index drafters look at
        self._done: dict[int, int] = {}  # step -> micro-batches whose backward finished
        self._depth_area = 0.0
        self._depth_since = self._depth_window_start = time.perf_counter()
        self._depth_max = 0

    def _note_depth_change(self) -> None:
        now = time.perf_counter()
        self._depth_area += len(self._ready) * (now - self._depth_since)
        self._depth_since = now

    def take_depth_window(self) -> tuple[float, int]:
        """The time-weighted mean and the peak of the ready micro-batches since the last call. The mean is over
        the handoff's own window (not the thread clocks', taken a moment apart), so it never exceeds the peak."""
        with self.cond:
            self._note_depth_change()
            window_s = self._depth_since - self._depth_window_start
            mean = self._depth_area / window_s if window_s > 0 else 0.0
            peak = self._depth_max
            self._depth_area, self._depth_max = 0.0, len(self._ready)
            self._depth_window_start = self._depth_since
            return mean, peak

    def _wait(self) -> None:
        self.cond.wait(_POLL_S)

    def stop(self, abort: bool) -> None:
        with self.cond:
            self.stopping = True
            self.aborted = self.aborted or abort
            self.cond.notify_all()

    def _key(self, ordinal: int) -> tuple[int, int]:
        return self._start_step + ordinal // self._per_step, ordinal % self._per_step

    def _read(self, reader: str, only_step: int | None = None) -> tuple[tuple[int, int], Any] | None:
        """The next micro-batch of the source and its key; None when the run's share is read (or, with
        `only_step`, when the next one belongs to a later step). The source lock, not the handoff's,
        serialises data work, so drafters are not held up by it."""
        with self._source_lock:
            ordinal = self._source_position
            if ordinal >= self._total or self.stopping:
                return None
            key = self._key(ordinal)
            if only_step is not None and key[0] != only_step:
                return None
            try:
                batch = next(self._source)
            except StopIteration:
                raise RuntimeError(
                    f"the micro-batch source ended after {ordinal} micro-batches; "
                    f"{self._total} were needed ({self._per_step} per step)"
                ) from None
            self._source_position += 1
        with self.cond:
            self._readers[key] = reader
            self.cond.notify_all()
        return key, batch

    # Target side.
    def claim_for_target(self) -> tuple[tuple[int, int], Any] | None:
        """The next micro-batch in source order, once there is room; None when there is no more work."""
        with self.cond:
            while not self.stopping and self._source_position < self._total and self._live >= self.bound:
                self._wait()
            if self.stopping or self._source_position >= self._total:
                return None
            self._live += 1
        claim = None
        try:
            claim = self._read("target")
        finally:
            if claim is None:
                with self.cond:
                    self._live -= 1
                    self.cond.notify_all()
        return claim

    def publish(self, key: tuple[int, int], item: Any) -> None:
        with self.cond:
            self._note_depth_change()
            self._ready[key] = item
            self._depth_max = max(self._depth_max, len(self._ready))
            self.cond.notify_all()

    # Colocated side.
    def claim_own(self, step: int) -> tuple[tuple[int, int], Any] | None:
        """The next micro-batch of the source while it belongs to `step`; None once the step's are all read
        (or work stops)."""
        return self._read("colocated", only_step=step)

    # Drafter side.
    def claim_for_drafter(self, step: int) -> int | None:
        """The next index of `step` that a target thread read, in index order (waiting until the next one is
        read); None once every index of the step is claimed or read by a colocated thread, or work stops."""
        with self.cond:
            while True:
                index = self._next_index.get(step, 0)
                if self.stopping or index >= self._per_step:
                    return None
                reader = self._readers.get((step, index))
                if reader is None:
                    self._wait()
                    continue
                self._next_index[step] = index + 1
                if reader == "target":
                    return index

    def take(self, key: tuple[int, int]) -> Any | None:
        """The published item for `key`; None when work stops first (the step is then dropped)."""
        with self.cond:
            while key not in self._ready and not self.stopping:
                self._wait()
            if key not in self._ready or self.aborted:
                return None
            self._note_depth_change()
            item = self._ready.pop(key)
            self._live -= 1
            self.cond.notify_all()
            return item

    def mark_done(self, step: int) -> None:
        with self.cond:
            self._done[step] = self._done.get(step, 0) + 1
            for key in [k for k in self._readers if k[0] < step]:
                del self._readers[key]

    def step_complete(self, step: int) -> bool:
        with self.cond:
            return self._done.get(step, 0) == self._per_step


class BusyClocks:
    """Busy time per thread, read as fractions of a window (spans still open count up to now)."""

    def __init__(self, names: Sequence[str]):
        self._lock = threading.Lock()
        self._busy = dict.fromkeys(names, 0.0)
        self._open: dict[str, float] = {}
        self.window_start = time.perf_counter()

    def start(self, name: str) -> None:
        with self._lock:
            self._open[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        with self._lock:
            self._busy[name] += time.perf_counter() - self._open.pop(name)

    def take_window(self) -> tuple[float, dict[str, float]]:
        with self._lock:
            now = time.perf_counter()
            window = now - self.window_start
            fractions = {}
            for name in self._busy:
                busy = self._busy[name]
                if name in self._open:
                    busy += now - self._open[name]
                    self._open[name] = now
                fractions[name] = min(1.0, busy / window) if window > 0 else 0.0
                self._busy[name] = 0.0
            self.window_start = now
            return window, fractions
