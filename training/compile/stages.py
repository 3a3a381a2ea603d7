"""Compiled stages beside flex_attention, under the same discipline (ARCHITECTURE §6).

`compile = "all"` compiles the target's decoder layers, and the drafter's fusion layer and layer halves around
attention (`compiled_drafter_stages`, warmed by training/compile/run.py). The target's: the 34 layers of a
Qwen3-8B `features` call share one code object, so one `torch.compile(layer_forward, dynamic=False,
fullgraph=True)` serves them all, and fuses what eager runs as many small kernels (norms, rotary, the MLP's
activation). The discipline is SharedFlexAttention's:

- one CompiledStage per stage for the whole process, its recompile limit sized to the keys it is warmed with
  (devices x length buckets x grad modes, times the layers in case dynamo keeps an entry per layer) plus slack;
- every key is compiled under the process-wide COMPILE_LOCK, in `warming()`, and proven: a second call runs the
  compiled code (no run of the function's own code, no FX trace);
- after `seal()` a call whose key was not warmed raises UnwarmedShapeError before dynamo sees it, and the
  counters (calls, compiles after sealing, eager runs, FX traces) go in the run's log.

A key is what dynamo's guards tell apart for these calls: every tensor's shape, stride, dtype, device and
requires_grad, every other argument's value, the grad mode, and a module's type (not its identity: the layers'
parameters are the graph's inputs). The target's layers are warmed in the main thread, one device after the
other, before any pipeline thread starts, so no compile overlaps a steady-state call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from training.compile.flex import (
    COMPILE_LOCK,
    CallAudit,
    CompileEventCounter,
    EagerFallbackError,
    RecompileLimitTooSmall,
    UnwarmedShapeError,
    _is_recompile_limit_hit,
    compile_accepts_recompile_limit,
    locked_compile,
)
from training.model.drafter import DrafterStages, fuse_features, layer_after_attention, layer_before_attention


def resolve_compile(mode: str, device: torch.device, backend: str) -> str:
    """auto -> all on CUDA; on the CPU, attention where it is flex (never uncompiled), else off."""
    if mode != "auto":
        return mode
    if device.type == "cuda":
        return "all"
    return "attention" if backend == "flex" else "off"


@dataclass(frozen=True)
class StageStats:
    name: str
    keys: int  # warmed keys
    compiled_calls: int  # calls after seal() (the target's layers: one per layer per forward)
    compiles_after_seal: int  # dynamo compiles anywhere in the process since seal()
    eager_runs: int  # runs of the stage function's own code in audited calls (0 = always compiled)
    fx_traces: int  # FX traces seen while proving keys

    def line(self) -> str:
        return (f"compiled {self.name}: {self.keys} keys warmed, {self.compiled_calls} calls, "
                f"{self.compiles_after_seal} compiles after warm-up, {self.eager_runs} eager runs, "
                f"{self.fx_traces} FX traces")


def _describe(value) -> object:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad)
    if isinstance(value, nn.Module):
        return ("module", type(value))
    return ("value", value if isinstance(value, (int, float, bool, str, type(None))) else repr(value))


def _autocast_state() -> tuple:
    """Dynamo guards on the autocast state too: the drafter's stages run under bf16 autocast on a GPU."""
    return tuple((kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda") if torch.is_autocast_enabled(kind))


def stage_key(args: tuple, kwargs: dict) -> tuple:
    leaves, spec = tree_flatten((args, kwargs))
    return (torch.is_grad_enabled(), _autocast_state(), str(spec), tuple(_describe(leaf) for leaf in leaves))


class CompiledStage:
    """One compiled function of the process, called like the function after its keys are warmed."""

    def __init__(self, name: str, fn: Callable, *, keys_expected: int, slack: int = 4, backend: str = "inductor"):
        self.name, self.fn = name, fn
        self.recompile_limit = keys_expected + slack
        limit = {"recompile_limit": self.recompile_limit} if compile_accepts_recompile_limit() else {}
        self._compiled = locked_compile(fn, dynamic=False, fullgraph=True, backend=backend, **limit)
        self.audit = CallAudit(fn)
        self._events = CompileEventCounter()
        self._thread = threading.local()
        self._keys: set[tuple] = set()
        self._sealed = False
        self._lock = threading.Lock()
        self._calls = 0
        self._events_at_seal = 0

    @contextmanager
    def warming(self) -> Iterator[None]:
        """Under the process-wide lock: calls in this thread compile and prove the keys they bring."""
        if self._sealed:
            raise UnwarmedShapeError(f"compiled {self.name}: warming after seal(), when nothing may compile")
        with COMPILE_LOCK:
            self._limit_recompiles()
            self._thread.warming = True
            try:
                yield
            finally:
                self._thread.warming = False

    def seal(self) -> None:
        """Warm-up is over: from now on only warmed keys are called, and compiles are counted (in a run, from
        `steady()`)."""
        self._events_at_seal = self._events.count
        self._sealed = True

    def steady(self) -> None:
        """Every thread of the run has warmed up (the pipeline's barrier): count compiles from here, so that the
        shared flex_attention's own warm-up in the pipeline's threads, after this stage's seal, is not counted."""
        self._events_at_seal = self._events.count

    def __call__(self, *args, **kwargs):
        key = stage_key(args, kwargs)
        if getattr(self._thread, "warming", False):
            return self._warm(key, args, kwargs)
        if key not in self._keys:
            raise UnwarmedShapeError(f"compiled {self.name}: a call outside the warmed keys ({self._say(key)}); "
                                     f"warmed: {len(self._keys)} keys. Pad to a length bucket.")
        if self._sealed:
            with self._lock:
                self._calls += 1
        return self._compiled(*args, **kwargs)

    def _warm(self, key: tuple, args: tuple, kwargs: dict):
        try:
            out = self._compiled(*args, **kwargs)
        except Exception as error:
            if _is_recompile_limit_hit(error):
                raise RecompileLimitTooSmall(f"compiled {self.name} hit recompile_limit={self.recompile_limit} "
                                             f"while warming {self._say(key)}") from error
            raise
        if key not in self._keys:  # prove the key: a second call runs compiled code only
            before = (self.audit.eager_runs, self.audit.fx_traces)
            self.audit.install()
            try:
                out = self._compiled(*args, **kwargs)
            finally:
                self.audit.uninstall()
            if (self.audit.eager_runs, self.audit.fx_traces) != before:
                raise EagerFallbackError(f"compiled {self.name} ran uncompiled or traced while warming "
                                         f"{self._say(key)}: refusing an eager fallback")
            self._keys.add(key)
        return out

    def _limit_recompiles(self) -> None:
        """Dynamo config is per thread since torch 2.12: where torch.compile takes no limit, set this thread's."""
        config = torch._dynamo.config
        if not compile_accepts_recompile_limit():
            config.recompile_limit = max(config.recompile_limit, self.recompile_limit)
        if getattr(config, "accumulated_recompile_limit", self.recompile_limit) < self.recompile_limit:
            config.accumulated_recompile_limit = self.recompile_limit

    @staticmethod
    def _say(key: tuple) -> str:
        grad, autocast, _, leaves = key
        tensors = [f"{tuple(d[1])} {d[3]} on {d[4]}".replace("torch.", "") for d in leaves if d[0] == "tensor"]
        autocast = f", autocast {autocast}".replace("torch.", "") if autocast else ""
        return f"grad={grad}{autocast}, tensors {', '.join(tensors)}"

    def stats(self) -> StageStats:
        with self._lock:
            calls = self._calls
        return StageStats(self.name, len(self._keys), calls,
                          self._events.count - self._events_at_seal if self._sealed else 0,
                          self.audit.eager_runs, self.audit.fx_traces)

    def close(self) -> None:
        self._events.close()


def decoder_layer_forward(layer: nn.Module, *args, **kwargs):
    """A transformers decoder layer's own forward: the function the target's layers stage compiles."""
    return type(layer).forward(layer, *args, **kwargs)


def compiled_drafter_stages(keys_expected: int) -> DrafterStages:
    """compile = "all": the drafter's fusion layer and its layers' halves around attention, each one compiled
    function for every layer and replica (training/model/drafter.py DrafterStages), sized to `keys_expected` each."""
    return DrafterStages(*(CompiledStage(name, fn, keys_expected=keys_expected) for name, fn in (
        ("drafter fusion", fuse_features), ("drafter layers before attention", layer_before_attention),
        ("drafter layers after attention", layer_after_attention))))


def stages_of(stages: DrafterStages) -> list[CompiledStage]:
    return [stages.fusion, stages.before_attention, stages.after_attention]


@contextmanager
def warming_all(stages: list[CompiledStage]) -> Iterator[None]:
    """Warm several stages in one block (one step calls them all): the lock is taken once per stage, re-entrant."""
    with ExitStack() as stack:
        for stage in stages:
            stack.enter_context(stage.warming())
        yield
