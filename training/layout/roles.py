"""Where the pipeline's threads run, and the model `topology = "auto"` chooses a layout with.

A layout gives each device entry a role (training/pipeline/): target (the frozen target's forward; features
through the queue), drafter (a drafter replica on those features) or colocated (both, one after the other, in
one thread: the serial loop). `topology` names one over `devices`: "colocated" (every entry), "T:D" (the first
T entries targets, the other D drafters; or all T + D threads on a single entry), or "auto".

"auto" measures, at warm-up on the run's own shapes, a target forward and a drafter step per sequence (t_t,
t_d), their memory, and a target thread and a drafter thread running at once on the first device, each on its
own stream (t_p per sequence at the pair's steady rate: `RoleProfile`), predicts every candidate's throughput
and memory with the model below, and takes the fastest that fits (on a tie, the one with fewest replicas, then
the one listed first: all colocated comes first). Candidates give each device one role: C colocated + T targets
+ D drafters = the number of devices (T and D both 0 or both at least 1); on GPUs, one more gives every device
a target thread and a drafter thread ("1:1" on one GPU, "N:N" on N): their kernels overlap on the card, which
the serial loop's cannot.

The throughput model, per step of M micro-batches of r sequences:
- the M micro-batches are shared out among the replicas, which meet at the step's end: a colocated replica
  spends r (t_t + t_d) on one, a drafter r t_d; the step lasts as long as the most loaded replica, with the
  micro-batches split between the two kinds as evenly as their costs allow;
- target threads read ahead across steps, so they bound the rate only on average: a step lasts at least
  M r t_t / T;
- sequences/s = M r / (step time). With many micro-batches per step this is C / (t_t + t_d) + min(T / t_t,
  D / t_d): the two kinds of capacity add up, and a T:D split is at best as fast as all colocated (equal
  when T / t_t = D / t_d). With few (the recipe's batch_size = 1: one micro-batch a step) only one replica
  works per step, and a 1:1 split beats any number of colocated replicas.
- a device holding a pair works like a colocated replica whose micro-batch costs r t_p: the contention between
  the two threads is in the measured t_p.
Left out: the optimizer step, the gradient sum and the data work (every layout pays them once a step), and
the copies of features between devices (a pair's drafter may take another device's features).

Memory per device: the static bytes of each replica on it (target: its weights; drafter: fp32 weights, AdamW's
two moments, the frozen embedding and LM head) plus each thread's peak above them, as measured in the trial (a
colocated thread holds a micro-batch's features through its drafter step), plus the queue's features on
target devices (queue_depth micro-batches) and one micro-batch's features on drafter devices; a pair's device
needs both threads' (their peaks may coincide). A layout fits
when every device's estimate is at most `MEMORY_BUDGET` of its memory. CPU devices are not checked.

    python -m training.layout --gpus 8 --target-ms 84 --drafter-ms 168 --batch-size 8 [--shared-ms 209]

prints the model's ranking for other machines from per-sequence times measured on one GPU.
"""

from __future__ import annotations

import argparse
import itertools
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from training.config import TOPOLOGY, ConfigError, check_topology, parse_devices
from training.layout.devices import on_own_stream

MEMORY_BUDGET = 0.90  # of a device's memory: room for the allocator's fragmentation and the CUDA context


@dataclass(frozen=True)
class Layout:
    """Device strings ("cuda:0", "cpu") per role; an entry is one thread, so a device may repeat."""

    targets: tuple[str, ...] = ()
    drafters: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()

    @property
    def replica_devices(self) -> tuple[str, ...]:
        """Drafter replicas in pipeline order: drafter threads, then colocated ones."""
        return (*self.drafters, *self.colocated)

    @property
    def target_replica_devices(self) -> tuple[str, ...]:
        """Where target replicas live: target threads, then colocated ones."""
        return (*self.targets, *self.colocated)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.colocated, *self.targets, *self.drafters)))

    @property
    def threads(self) -> int:
        return len(self.targets) + len(self.drafters) + len(self.colocated)

    @property
    def name(self) -> str:
        """"colocated", "T:D", or "T:D + C colocated"."""
        parts = [f"{len(self.targets)}:{len(self.drafters)}"] if self.targets else []
        if self.colocated:
            parts.append(f"{len(self.colocated)} colocated" if parts else "colocated")
        return " + ".join(parts)

    def describe(self) -> str:
        roles = [name + " " + ",".join(devices) for name, devices in
                 (("colocated", self.colocated), ("targets", self.targets), ("drafters", self.drafters)) if devices]
        return f"{self.name} ({'; '.join(roles)})"

    def as_dict(self) -> dict:
        return {"name": self.name, **{key: list(value) for key, value in asdict(self).items()}}


def layout_from_topology(topology: str, devices: Sequence[str]) -> Layout:
    """The layout `topology` names over `devices` (torch device strings); not for "auto"."""
    check_topology(topology)
    devices = tuple(devices)
    if topology == "colocated":
        return Layout(colocated=devices)
    if topology == "auto":
        raise ValueError("auto has no fixed layout: choose_layout picks one")
    match = TOPOLOGY.fullmatch(topology)
    targets, drafters = int(match[1]), int(match[2])
    if len(devices) == 1:  # every thread on the one device
        return Layout(targets=devices * targets, drafters=devices * drafters)
    if targets + drafters != len(devices):
        raise ConfigError(f"topology {topology} needs {targets + drafters} devices (or one), devices has "
                          f"{len(devices)}; set target_devices and drafter_devices for other layouts")
    return Layout(targets=devices[:targets], drafters=devices[targets:])


def explicit_layout(target_devices, drafter_devices, colocated_devices) -> Layout | None:
    """The layout the explicit keys give, or None when none of them is set. One of target_devices and
    drafter_devices alone means "cpu" for the other (their default before layouts had a topology)."""
    if not (target_devices or drafter_devices or colocated_devices):
        return None
    targets = parse_devices(target_devices, "target_devices") if target_devices else []
    drafters = parse_devices(drafter_devices, "drafter_devices") if drafter_devices else []
    if bool(targets) != bool(drafters):
        targets, drafters = targets or ["cpu"], drafters or ["cpu"]
    colocated = parse_devices(colocated_devices, "colocated_devices") if colocated_devices else []
    return Layout(tuple(targets), tuple(drafters), tuple(colocated))


def candidate_layouts(devices: Sequence[str]) -> list[Layout]:
    """Every way to give each device one role (all colocated first, then fewer colocated; targets first)."""
    devices = tuple(devices)
    found = []
    for colocated in range(len(devices), -1, -1):
        rest = len(devices) - colocated
        if rest == 0:
            found.append(Layout(colocated=devices))
            continue
        for targets in range(1, rest):
            split = colocated + targets
            found.append(Layout(targets=devices[colocated:split], drafters=devices[split:],
                                colocated=devices[:colocated]))
    return found


@dataclass(frozen=True)
class RoleProfile:
    """What the trial measured on one device (times per sequence; bytes)."""

    target_s: float  # target forward, per sequence
    drafter_s: float  # drafter forward + backward, per sequence
    rows: int  # sequences per micro-batch
    tokens_per_sequence: float  # real (unpadded) tokens
    target_static: int = 0  # a target replica's weights
    target_peak: int = 0  # a target forward's peak above what was allocated before it (features included)
    drafter_static: int = 0  # a drafter replica: weights, AdamW moments, frozen embedding and LM head
    drafter_peak: int = 0  # a drafter step's peak above what was allocated before it (gradients included)
    features: int = 0  # one micro-batch's features
    device_memory: dict[str, int] = field(default_factory=dict)  # device -> total bytes (GPUs only)
    # A target thread and a drafter thread sharing the device, each on its own stream, per sequence at the
    # pair's steady rate (measure_shared); None when not measured.
    shared_s: float | None = None


def step_seconds(layout: Layout, profile: RoleProfile, micro_batches: int) -> float:
    """The model's time for one step of `micro_batches` micro-batches (see the module doc)."""
    rows = profile.rows
    colocated_cost = rows * (profile.target_s + profile.drafter_s)
    drafter_cost = rows * profile.drafter_s
    c, d, t = len(layout.colocated), len(layout.drafters), len(layout.targets)
    best = math.inf
    for to_colocated in range(micro_batches + 1):
        to_drafters = micro_batches - to_colocated
        if (to_colocated and not c) or (to_drafters and not d):
            continue
        load = max(math.ceil(to_colocated / c) * colocated_cost if c else 0.0,
                   math.ceil(to_drafters / d) * drafter_cost if d else 0.0)
        if to_drafters:  # the targets must produce what the drafters consume, on average
            load = max(load, to_drafters * rows * profile.target_s / t)
        best = min(best, load)
    return best


def shared_step_seconds(pairs: int, profile: RoleProfile, micro_batches: int) -> float:
    """The model's step time when each of `pairs` devices holds a target thread and a drafter thread: every
    pair works like a colocated replica whose micro-batch costs what the trial's pair took for one."""
    return math.ceil(micro_batches / pairs) * profile.rows * profile.shared_s


def estimate_memory(layout: Layout, profile: RoleProfile, queue_depth: int) -> dict[str, int]:
    """Bytes per device the layout needs, by the model in the module doc."""
    need: dict[str, int] = {}

    def add(device: str, amount: int) -> None:
        need[device] = need.get(device, 0) + amount

    for device in layout.targets:
        add(device, profile.target_static + profile.target_peak)
    for device in dict.fromkeys(layout.targets):
        add(device, queue_depth * profile.features)
    for device in layout.drafters:
        add(device, profile.drafter_static + profile.features + profile.drafter_peak)
    for device in layout.colocated:
        add(device, profile.target_static + profile.drafter_static
            + max(profile.target_peak, profile.features + profile.drafter_peak))
    return need


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    tokens_per_s: float  # predicted
    memory: dict[str, int]  # bytes per device
    fits: bool

    def as_dict(self) -> dict:
        return {"layout": self.layout.name, "predicted_tokens_per_s": round(self.tokens_per_s, 1),
                "memory_gib": {d: round(b / 2**30, 2) for d, b in self.memory.items()}, "fits": self.fits}


@dataclass(frozen=True)
class Choice:
    chosen: Candidate
    candidates: list[Candidate]  # every candidate, in the order considered
    profile: RoleProfile

    def as_dict(self) -> dict:
        p = self.profile
        return {"chosen": self.chosen.layout.as_dict(),
                "predicted_tokens_per_s": round(self.chosen.tokens_per_s, 1),
                "target_ms_per_sequence": round(1e3 * p.target_s, 3),
                "drafter_ms_per_sequence": round(1e3 * p.drafter_s, 3),
                "shared_ms_per_sequence": None if p.shared_s is None else round(1e3 * p.shared_s, 3),
                "candidates": [c.as_dict() for c in self.candidates]}

    def summary(self) -> str:
        p = self.profile
        fitting = sorted((c for c in self.candidates if c.fits), key=lambda c: -c.tokens_per_s)
        others = ", ".join(f"{c.layout.name} {c.tokens_per_s:.0f}" for c in fitting[1:4])
        memory = ", ".join(f"{d} {b / 2**30:.1f} GiB" for d, b in self.chosen.memory.items()
                           if d in p.device_memory)
        return (f"layout auto: {self.chosen.layout.describe()}, predicted {self.chosen.tokens_per_s:.0f} tokens/s "
                f"from target {1e3 * p.target_s:.1f} ms + drafter {1e3 * p.drafter_s:.1f} ms per sequence"
                + (f" ({1e3 * p.shared_s:.1f} ms as a pair sharing the device)" if p.shared_s is not None else "")
                + (f"; next: {others}" if others else "") + (f"; memory {memory}" if memory else ""))


def choose_layout(devices: Sequence[str], profile: RoleProfile, micro_batches: int, queue_depth: int) -> Choice:
    """The fastest candidate that fits (on a tie the one with fewest replicas, then the first listed);
    ConfigError when none fits."""
    timed = [(layout, step_seconds(layout, profile, micro_batches)) for layout in candidate_layouts(devices)]
    if profile.shared_s is not None and all(str(device).startswith("cuda") for device in devices):
        timed.append((Layout(targets=tuple(devices), drafters=tuple(devices)),
                      shared_step_seconds(len(devices), profile, micro_batches)))
    candidates = []
    for layout, seconds in timed:
        memory = estimate_memory(layout, profile, queue_depth)
        fits = all(need <= MEMORY_BUDGET * profile.device_memory[device]
                   for device, need in memory.items() if device in profile.device_memory)
        rate = micro_batches * profile.rows / seconds * profile.tokens_per_sequence
        candidates.append(Candidate(layout, rate, memory, fits))
    fitting = [c for c in candidates if c.fits]
    if fitting:
        fastest = max(c.tokens_per_s for c in fitting)
        # On a tie, fewer replicas (less gradient sum and optimizer work, which the model leaves out), then
        # the first listed.
        best = min((c for c in fitting if c.tokens_per_s >= fastest * (1 - 1e-9)),
                   key=lambda c: len(c.layout.replica_devices))
    else:
        smallest = min(candidates, key=lambda c: max(c.memory.values()))
        raise ConfigError(f"no layout of {', '.join(devices)} fits in memory: the smallest, "
                          f"{smallest.layout.describe()}, needs {max(smallest.memory.values()) / 2**30:.1f} GiB "
                          "on one device")
    return Choice(best, candidates, profile)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_roles(device: torch.device, batches: Sequence[Any], rows: int,
                   target_forward: Callable[[Any], torch.Tensor],
                   drafter_step: Callable[[torch.Tensor, Any], None]) -> dict[str, float]:
    """Time (and on a GPU, peak memory above the start) of the target forward and the drafter step, each on
    every batch in turn; the first batch's calls are warm-up. Returns per-sequence medians and peaks."""
    cuda = device.type == "cuda"
    times: dict[str, list[float]] = {"target": [], "drafter": []}
    peaks = {"target": 0, "drafter": 0}
    features_bytes = 0
    for index, batch in enumerate(batches):
        for role in ("target", "drafter"):
            _synchronize(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            if role == "target":
                with torch.no_grad():
                    features = target_forward(batch)
            else:
                drafter_step(features, batch)
            _synchronize(device)
            if index:
                times[role].append(time.perf_counter() - start)
            if cuda:
                peaks[role] = max(peaks[role], torch.cuda.max_memory_allocated(device) - base)
        features_bytes = features.numel() * features.element_size()
        del features
    median = {role: sorted(values)[len(values) // 2] / rows for role, values in times.items()}
    return {"target_s": median["target"], "drafter_s": median["drafter"], "target_peak": peaks["target"],
            "drafter_peak": peaks["drafter"], "features": features_bytes}


def measure_shared(device: torch.device, batches: Sequence[Any], rows: int,
                   target_forward: Callable[[Any], torch.Tensor],
                   drafter_step: Callable[[torch.Tensor, Any], None], steps: int, depth: int = 2) -> float:
    """A target thread and a drafter thread sharing `device`, as a 1:1 layout on it runs them: the target's
    forwards in a thread of their own, over `batches` again and again, up to `depth` micro-batches ahead; `steps`
    drafter steps in the calling thread (which may call a trial's compiled attention); each thread on its own
    stream, synchronized before features change hands (the pipeline's rule). Returns the time per sequence
    between the first drafter step's end and the last's: the pair's steady rate, the target kept busy
    throughout. Call it after measure_roles, so that nothing is called here for the first time."""
    handed: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    failure: list[BaseException] = []

    def offer(item) -> None:  # until taken, or until the drafter side has stopped
        while not stop.is_set():
            try:
                return handed.put(item, timeout=0.05)
            except queue.Full:
                continue

    def produce() -> None:
        try:
            with on_own_stream(device) as stream, torch.no_grad():
                for batch in itertools.cycle(batches):
                    if stop.is_set():
                        break
                    features = target_forward(batch)
                    if stream is not None:
                        stream.synchronize()
                    offer((features, batch))
        except BaseException as error:  # noqa: BLE001 - re-raised by the calling thread
            failure.append(error)
        finally:
            offer(None)

    producer = threading.Thread(target=produce, name="layout trial: target", daemon=True)
    producer.start()
    ends = []
    try:
        with on_own_stream(device) as stream:
            while len(ends) < steps and (item := handed.get()) is not None:
                drafter_step(*item)
                if stream is not None:
                    stream.synchronize()
                ends.append(time.perf_counter())
                del item
    finally:
        stop.set()
        producer.join()
    if failure:
        raise failure[0]
    return (ends[-1] - ends[0]) / ((len(ends) - 1) * rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.layout",
                                     description="The auto layout model's ranking for a machine of N GPUs.")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--target-ms", type=float, required=True, help="target forward per sequence")
    parser.add_argument("--drafter-ms", type=float, required=True, help="drafter step per sequence")
    parser.add_argument("--shared-ms", type=float, help="a target and a drafter thread sharing a GPU, per sequence")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--tokens", type=float, default=3072, help="tokens per sequence")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args(argv)
    profile = RoleProfile(args.target_ms / 1e3, args.drafter_ms / 1e3, args.micro_batch_size, args.tokens,
                           shared_s=args.shared_ms / 1e3 if args.shared_ms else None)
    choice = choose_layout([f"cuda:{i}" for i in range(args.gpus)], profile,
                           args.batch_size // args.micro_batch_size, queue_depth=4)
    ranked = sorted(choice.candidates, key=lambda c: (-round(c.tokens_per_s, 3), c is not choice.chosen))
    pair = f" ({args.shared_ms} ms as a pair sharing a GPU)" if args.shared_ms else ""
    print(f"{args.gpus} GPUs, target {args.target_ms} ms + drafter {args.drafter_ms} ms per sequence{pair}, "
          f"batch {args.batch_size} (micro-batches of {args.micro_batch_size}):")
    for candidate in ranked[: args.top]:
        marker = "*" if candidate is choice.chosen else " "
        print(f" {marker} {candidate.layout.name:22} {candidate.tokens_per_s:10.0f} tokens/s "
              f"{candidate.tokens_per_s / args.tokens:7.2f} sequences/s")
    return 0

