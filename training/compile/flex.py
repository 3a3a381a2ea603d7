"""One compiled flex_attention shared by every thread of the process, race-free by design (ARCHITECTURE §6).

Why: dynamo keeps one cache entry per device x shape x grad mode. Past the recompile limit (default 8)
a compiled function silently runs flex_attention uncompiled: dense scores, and with gradients a `make_fx`
trace on every call, which sets the process-global FX tracing flag under the other threads' compiled
calls ("Detected that you are using FX to symbolically trace a dynamo-optimized function").

The discipline, enforced here:
- one `torch.compile(fn, dynamic=False, fullgraph=True)` whose recompile limit is sized to
  devices x shapes x grad modes + slack, so an overflow is a loud error, never an eager fallback;
- every thread warms every shape and grad mode (forward, and backward for the grad mode) on its own
  device under ONE process-wide lock, building its block masks there, then waits at a barrier;
- after the barrier nothing compiles: calls outside the warmed keys raise `UnwarmedShapeError` before
  dynamo sees them, and `torch.compiler.set_stance("fail_on_recompile")` (process-global) catches the rest;
- counters prove it: compiled calls, compiles after warm-up, eager runs and FX traces (`CallAudit`).
- a layout trial (`trial`), in one thread before the others start, warms its device's keys the same way and may
  call them: its keys are counted in the limit like every thread's (its device is one of `devices`).
Nothing here switches a PyTorch check off or patches a PyTorch function: it only reads and observes.

One instance per process: dynamo keeps its cache on the compiled function's code object, so every
torch.compile of flex_attention in the process shares those entries and their limit.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx._symbolic_trace as fx_symbolic_trace
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Every compile of this process happens under this lock, whichever instance asks for it; re-entrant, so that
# one warm-up (a drafter's training step) can warm several stages at once (training/compile/stages.py).
COMPILE_LOCK = threading.RLock()

LimitVia = Literal["auto", "compile_kwarg", "thread_config"]

_CALL_LOCKS: dict[object, threading.RLock] = {}
_CALL_LOCKS_GUARD = threading.Lock()


def call_lock(fn: Callable) -> threading.RLock:
    """The lock every call of a compiled `fn` holds, one per code object (where dynamo keeps the cache).

    Dynamo's cache lookup is not thread-safe: a thread checking the entries' guards can let another thread run
    (the GIL changes hands), which moves the entry it hit to the front of the list; the first thread then walks
    past the key it needs and misses a warmed entry: a recompile, which fail_on_recompile makes an error (about 2%
    of the calls of 4 threads over 24 warmed keys, torch 2.13 and 2.11; ARCHITECTURE §6). Single-file lookups cost
    little: the GIL already serializes them, and on a GPU the call behind the lookup only launches kernels."""
    code = getattr(fn, "__code__", fn)
    with _CALL_LOCKS_GUARD:
        return _CALL_LOCKS.setdefault(code, threading.RLock())


def locked_compile(fn: Callable, **options) -> Callable:
    """`torch.compile(fn, **options)` whose every call, warm-up and steady state alike, holds `call_lock(fn)`."""
    compiled, lock = torch.compile(fn, **options), call_lock(fn)

    def call(*args, **kwargs):
        with lock:
            return compiled(*args, **kwargs)

    return call


class CompileDisciplineError(RuntimeError):
    """The shared compiled attention was used against its discipline."""


class UnwarmedShapeError(CompileDisciplineError):
    """A call whose shape, layout, dtype, device or grad mode was not warmed (it would recompile)."""


class RecompileLimitTooSmall(CompileDisciplineError):
    """Warm-up needed more dynamo cache entries than the recompile limit allows."""


class EagerFallbackError(CompileDisciplineError):
    """The compiled function ran its own Python code: dynamo fell back to eager."""


@dataclass(frozen=True)
class AttentionShape:
    """One shape bucket: q is [batch, heads, q_len, head_dim]; k and v are [batch, kv_heads, kv_len, head_dim]."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int


@dataclass(frozen=True)
class CompileStats:
    compiled_calls: int  # steady-state calls handed to the compiled function
    compiles_after_warmup: int  # dynamo compiles (and lazy backward compiles) anywhere in the process
    eager_runs: int  # runs of the attention function's own code in audited threads (0 = always compiled)
    fx_traces_after_warmup: int  # FX traces (`Tracer.trace`, what make_fx runs) in audited threads
    fx_tracing_flag: bool  # torch.fx's process-global "a trace is running" flag, now


def compile_accepts_recompile_limit() -> bool:
    """torch >= 2.13 takes `recompile_limit=` in torch.compile; 2.11 only has the dynamo config."""
    return "recompile_limit" in inspect.signature(torch.compile).parameters


def as_device(device: torch.device | str | int) -> torch.device:
    """An int is a CUDA index; a bare "cuda" is the current CUDA device (tensors always carry an index)."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def fx_tracing_flag() -> bool:
    return bool(fx_symbolic_trace._is_fx_tracing_flag)


def contiguous_qkv(shape: AttentionShape, device: torch.device, dtype: torch.dtype, requires_grad: bool):
    """Warm-up inputs laid out [batch, heads, seq, head_dim], contiguous."""

    def make(heads: int, length: int) -> torch.Tensor:
        x = torch.randn(shape.batch, heads, length, shape.head_dim, device=device, dtype=dtype)
        return x.requires_grad_(requires_grad)

    return make(shape.heads, shape.q_len), make(shape.kv_heads, shape.kv_len), make(shape.kv_heads, shape.kv_len)


def projected_qkv(shape: AttentionShape, device: torch.device, dtype: torch.dtype, requires_grad: bool):
    """Warm-up inputs laid out like a projection's output: [batch, seq, heads, head_dim] viewed transposed."""

    def make(heads: int, length: int) -> torch.Tensor:
        x = torch.randn(shape.batch, length, heads, shape.head_dim, device=device, dtype=dtype)
        return x.requires_grad_(requires_grad).transpose(1, 2)

    return make(shape.heads, shape.q_len), make(shape.kv_heads, shape.kv_len), make(shape.kv_heads, shape.kv_len)


def spread_anchors(rows: int, context: int, block: int, count: int, device: torch.device) -> torch.Tensor:
    """`count` anchors spread evenly over a context of `context` tokens, the same in every row: the warm-ups'
    made-up batches and masks."""
    return torch.linspace(1, context - block, count, device=device).long().expand(rows, -1).contiguous()


def _is_recompile_limit_hit(error: BaseException) -> bool:
    limit_errors = tuple(
        cls
        for name in ("FailOnRecompileLimitHit", "RecompileLimitExceeded", "FailOnCacheLimitHit", "CacheLimitExceeded")
        if (cls := getattr(torch._dynamo.exc, name, None)) is not None
    )
    chain: list[BaseException] = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return any(isinstance(e, limit_errors) for e in chain)


class CallAudit:
    """Counts, through Python's per-thread profile hook (observation only), in the threads it is installed in:
    runs of `fn`'s own code object (dynamo runs a compiled call as transformed code, so the original
    code only runs when dynamo falls back to eager) and `torch.fx.Tracer.trace` runs (every make_fx)."""

    def __init__(self, fn: Callable) -> None:
        self._eager_code = inspect.unwrap(fn).__code__
        # dynamo wraps Tracer.trace in its `disable` decorator: watch the function inside, never the wrapper
        # (whose code every disabled function shares); if it cannot be told apart, FX traces go uncounted.
        trace = inspect.unwrap(torch.fx.Tracer.trace).__code__
        self._trace_code = trace if trace.co_filename.endswith("_symbolic_trace.py") else None
        self._lock = threading.Lock()
        self.eager_runs = 0
        self.fx_traces = 0
        self._previous = threading.local()

    def _on_event(self, frame, event: str, arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code is self._eager_code:
            with self._lock:
                self.eager_runs += 1
        elif code is self._trace_code:
            with self._lock:
                self.fx_traces += 1

    def install(self) -> None:
        """Start counting in the calling thread (replaces that thread's profiler until `uninstall`)."""
        # `==`, not `is`: each `self._on_event` is a new bound-method object, equal to the one installed.
        if sys.getprofile() == self._on_event:
            return
        self._previous.hook = sys.getprofile()
        sys.setprofile(self._on_event)

    def uninstall(self) -> None:
        if sys.getprofile() == self._on_event:
            sys.setprofile(getattr(self._previous, "hook", None))


class CompileEventCounter:
    """Counts compile starts reported by dynamo's compile callbacks (dynamo frames and lazy backward compiles)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        torch._dynamo.callback_handler.register_start_callback(self._on_start)

    def _on_start(self, *_args) -> None:  # torch 2.11 and 2.13 pass a CallbackArgs; older ones nothing
        with self._lock:
            self.count += 1

    def close(self) -> None:
        if self._on_start in torch._dynamo.callback_handler.start_callbacks:  # torch._dynamo.reset() clears them
            torch._dynamo.callback_handler.remove_start_callback(self._on_start)


def attention_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> tuple:
    """What dynamo's guards distinguish for these inputs (static shapes): one key, one cache entry."""
    return (
        q.device,
        q.dtype,
        torch.is_grad_enabled(),
        *((tuple(t.shape), t.stride(), t.dtype, t.requires_grad) for t in (q, k, v)),
        tuple(block_mask.shape),
        getattr(block_mask.mask_mod, "__code__", block_mask.mask_mod),
    )


class LimitedCompile:
    """`torch.compile(fn, dynamic=False, fullgraph=True)` whose recompile limit is sized to the keys it will be
    warmed with (`entries_needed`) plus slack, so an overflow is a loud error, never an eager fallback."""

    def __init__(self, fn: Callable, entries_needed: int, *, backend: str, slack: int, recompile_limit: int | None,
                 limit_via: LimitVia):
        self.attention_fn = fn
        self.entries_needed = entries_needed
        self.recompile_limit = recompile_limit if recompile_limit is not None else entries_needed + slack
        if limit_via == "auto":
            limit_via = "compile_kwarg" if compile_accepts_recompile_limit() else "thread_config"
        if limit_via == "compile_kwarg" and not compile_accepts_recompile_limit():
            raise CompileDisciplineError(f"torch {torch.__version__}: torch.compile takes no recompile_limit")
        self.limit_via = limit_via
        limit_kwarg = {"recompile_limit": self.recompile_limit} if limit_via == "compile_kwarg" else {}
        self._compiled = locked_compile(fn, dynamic=False, fullgraph=True, backend=backend, **limit_kwarg)
        self._thread = threading.local()

    def __call__(self, q, k, v, block_mask) -> torch.Tensor:
        # Dynamo guards on the global autocast state: a trainer under autocast would miss every entry warmed
        # outside it (a recompile per key, seen on an H200). q/k/v arrive in the attention dtype already, so
        # every call, warm-up and steady state alike, runs with autocast off: one state, one entry per key.
        with torch.autocast(q.device.type, enabled=False):
            return self._compiled(q, k, v, block_mask=block_mask, enable_gqa=q.size(1) != k.size(1))

    def limit_in_force(self) -> int:
        if self.limit_via == "compile_kwarg":
            return self.recompile_limit
        return int(torch._dynamo.config.recompile_limit)  # this thread's view of the config

    def limit_this_thread(self) -> None:
        """Dynamo config is per thread since torch 2.12 (global before): set it in each calling thread."""
        if getattr(self._thread, "limited", False):
            return
        config = torch._dynamo.config
        if self.limit_via == "thread_config":
            config.recompile_limit = self.recompile_limit
        if getattr(config, "accumulated_recompile_limit", self.recompile_limit) < self.recompile_limit:
            config.accumulated_recompile_limit = self.recompile_limit
        self._thread.limited = True


class SteadyStateProof:
    """What proves that nothing compiles after warm-up: the compiled calls, dynamo's compiles and the FX traces
    since the barrier, the eager runs (`audit`), and torch's fail_on_recompile stance, set at the barrier."""

    def __init__(self, fn: Callable, fail_on_recompile: bool):
        self.audit = CallAudit(fn)
        self.fail_on_recompile = fail_on_recompile
        self._compile_events = CompileEventCounter()
        self._stance_set = False
        self._lock = threading.Lock()
        self._compiled_calls = 0
        self._compiles_at_barrier = 0
        self._traces_at_barrier = 0

    def at_barrier(self) -> None:
        """In one thread, while every other waits at the warm-up barrier: nobody is compiling."""
        self._compiles_at_barrier = self._compile_events.count
        self._traces_at_barrier = self.audit.fx_traces
        if self.fail_on_recompile:
            torch.compiler.set_stance("fail_on_recompile")  # process-global (torch 2.11 and 2.13)
            self._stance_set = True

    def count_call(self) -> None:
        with self._lock:
            self._compiled_calls += 1

    def stats(self, steady: bool) -> CompileStats:
        with self._lock:
            calls = self._compiled_calls
        return CompileStats(
            compiled_calls=calls,
            compiles_after_warmup=self._compile_events.count - self._compiles_at_barrier if steady else 0,
            eager_runs=self.audit.eager_runs,
            fx_traces_after_warmup=self.audit.fx_traces - self._traces_at_barrier if steady else 0,
            fx_tracing_flag=fx_tracing_flag(),
        )

    def close(self) -> None:
        """Give the process back: default stance, no compile callback, no audit in the calling thread."""
        if self._stance_set:
            torch.compiler.set_stance("default")
            self._stance_set = False
        self._compile_events.close()
        self.audit.uninstall()


class SharedFlexAttention:
    """The one compiled flex_attention of the process, called by several threads after a locked warm-up.

    Usage: build it once before the threads start; each of the `threads` threads calls `warm_up(device, ...)`
    (which returns once every thread has warmed), then calls the instance like flex_attention. When the number
    of threads is not known yet (the trainer's `topology = "auto"` decides it after a `trial`), pass
    threads=None and call `expect_threads(n)` before they start.
    """

    def __init__(
        self,
        *,
        shapes: Sequence[AttentionShape],
        devices: Sequence[torch.device | str | int],
        threads: int | None,
        dtype: torch.dtype = torch.bfloat16,
        grad_modes: Iterable[bool] = (False, True),
        backend: str = "inductor",
        slack: int = 4,
        recompile_limit: int | None = None,
        limit_via: LimitVia = "auto",
        fail_on_recompile: bool = True,
        audit_steady_state: bool = False,
        barrier_timeout_s: float = 1800.0,
        attention_fn: Callable = flex_attention,
    ) -> None:
        self.shapes = tuple(shapes)
        self.devices = tuple(dict.fromkeys(as_device(d) for d in devices))
        self.dtype = dtype
        self.grad_modes = tuple(dict.fromkeys(grad_modes))
        self.compiled = LimitedCompile(attention_fn, len(self.devices) * len(self.shapes) * len(self.grad_modes),
                                       backend=backend, slack=slack, recompile_limit=recompile_limit,
                                       limit_via=limit_via)
        self.entries_needed, self.recompile_limit = self.compiled.entries_needed, self.compiled.recompile_limit
        self.limit_via, self.attention_fn = self.compiled.limit_via, attention_fn
        self.proof = SteadyStateProof(attention_fn, fail_on_recompile)
        self.audit = self.proof.audit
        self.audit_steady_state = audit_steady_state
        self.barrier_timeout_s = barrier_timeout_s
        self._barrier: threading.Barrier | None = None
        if threads is not None:
            self.expect_threads(threads)
        self._thread = threading.local()
        self._warm_keys: set[tuple] = set()
        self._steady = False

    # ---- warm-up -------------------------------------------------------------------------------------

    def expect_threads(self, threads: int) -> None:
        """How many threads will call `warm_up` (and meet at its barrier); once, before any of them starts."""
        if self._barrier is not None:
            raise CompileDisciplineError(f"expect_threads({threads}): already expecting {self._barrier.parties}")
        self._barrier = threading.Barrier(threads, action=self._enter_steady_state)

    @contextmanager
    def trial(
        self,
        device: torch.device | str | int,
        block_mask_for: Callable[[AttentionShape, torch.device], BlockMask],
        qkv_for: Callable = contiguous_qkv,
    ) -> Iterator[None]:
        """In one thread, before any thread's `warm_up`: compile every shape x grad mode on `device` under the
        process-wide lock, as `warm_up` does, and let this thread call the warmed keys until the block ends
        (the trainer measures its stages there). Nothing else compiles meanwhile (the lock is held), the keys
        are within the recompile limit (`device` is one of `devices`), and a thread warming up on `device`
        later finds them compiled."""
        device = as_device(device)
        if device not in self.devices:
            raise CompileDisciplineError(f"trial on {device}: this attention was sized for {self.devices}")
        if self._steady or (self._barrier is not None and self._barrier.n_waiting):
            raise CompileDisciplineError("a trial must come before every thread's warm-up")
        with COMPILE_LOCK:
            self.compiled.limit_this_thread()
            for shape in self.shapes:
                for grad in self.grad_modes:
                    self._warm_one(shape, grad, device, block_mask_for, qkv_for)
            self._thread.in_trial = True
            try:
                yield
            finally:
                self._thread.in_trial = False

    def warm_up(
        self,
        device: torch.device | str | int,
        block_mask_for: Callable[[AttentionShape, torch.device], BlockMask],
        qkv_for: Callable = contiguous_qkv,
    ) -> None:
        """Compile every shape x grad mode on `device` (forward, and backward in grad mode) under the
        process-wide lock, then wait until every thread has done the same. `block_mask_for(shape, device)`
        builds a mask like the steady-state ones; `qkv_for` makes inputs with the steady-state layout."""
        device = as_device(device)
        if device not in self.devices:
            raise CompileDisciplineError(f"warm_up on {device}: this attention was sized for {self.devices}")
        if self._barrier is None:
            raise CompileDisciplineError("warm_up before expect_threads: how many threads meet is not known")
        try:
            with COMPILE_LOCK:
                self.compiled.limit_this_thread()
                for shape in self.shapes:
                    for grad in self.grad_modes:
                        if self._barrier.broken:
                            raise CompileDisciplineError("another thread's warm-up failed")
                        self._warm_one(shape, grad, device, block_mask_for, qkv_for)
        except BaseException:
            self._barrier.abort()  # the other threads stop at the barrier instead of waiting forever
            raise
        if self.audit_steady_state:
            self.audit.install()
        try:
            self._barrier.wait(timeout=self.barrier_timeout_s)
        except threading.BrokenBarrierError:
            raise CompileDisciplineError(
                "warm-up barrier broken: another thread failed its warm-up or did not arrive within "
                f"{self.barrier_timeout_s:.0f} s"
            ) from None

    def _warm_one(self, shape, grad: bool, device, block_mask_for, qkv_for) -> None:
        """Compile one key, then prove a second call runs the compiled code: no eager run, no FX trace."""
        q, k, v = qkv_for(shape, device, self.dtype, grad)
        block_mask = block_mask_for(shape, device)
        with torch.set_grad_enabled(grad):
            key = attention_key(q, k, v, block_mask)
            try:
                self._forward_backward(q, k, v, block_mask, grad)
            except Exception as error:
                if _is_recompile_limit_hit(error):
                    raise RecompileLimitTooSmall(
                        f"compiled flex_attention hit recompile_limit={self.compiled.limit_in_force()} while warming "
                        f"{shape} grad={grad} on {device}: the discipline needs {self.entries_needed} cache "
                        f"entries ({len(self.devices)} devices x {len(self.shapes)} shapes x "
                        f"{len(self.grad_modes)} grad modes) plus slack"
                    ) from error
                raise
            eager_before, traces_before = self.audit.eager_runs, self.audit.fx_traces
            self.audit.install()  # not during the compile above: the profile hook would slow it ~3x
            try:
                self._forward_backward(q, k, v, block_mask, grad)
            finally:
                self.audit.uninstall()
        if (self.audit.eager_runs, self.audit.fx_traces) != (eager_before, traces_before):
            raise EagerFallbackError(
                f"compiled flex_attention ran uncompiled or traced while warming {shape} grad={grad} on "
                f"{device} (recompile_limit={self.recompile_limit}): refusing a dense, tracing fallback"
            )
        self._warm_keys.add(key)

    def _forward_backward(self, q, k, v, block_mask, grad: bool) -> None:
        out = self.compiled(q, k, v, block_mask)
        if grad:
            out.sum().backward()  # inductor compiles the backward lazily: make it happen now

    def _enter_steady_state(self) -> None:
        """Runs once, in one thread, while every other thread waits at the barrier: nobody is compiling."""
        self.proof.at_barrier()
        self._steady = True

    # ---- steady state --------------------------------------------------------------------------------

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, enable_gqa: bool | None = None
    ) -> torch.Tensor:
        """flex_attention(q, k, v, block_mask=..., enable_gqa=...) on a warmed key; grouped-query when the
        head counts differ (an explicit `enable_gqa` must agree: it is a compile-time constant)."""
        if enable_gqa is not None and enable_gqa != (q.size(1) != k.size(1)):
            raise UnwarmedShapeError(f"enable_gqa={enable_gqa} with {q.size(1)} query and {k.size(1)} kv heads")
        if not self._steady and not getattr(self._thread, "in_trial", False):
            raise CompileDisciplineError("shared flex_attention called before every thread finished warm_up")
        key = attention_key(q, k, v, block_mask)
        if key not in self._warm_keys:
            raise UnwarmedShapeError(self._describe_unwarmed(q, k, v))
        self.compiled.limit_this_thread()
        if self._steady:  # a trial's calls are not steady state
            self.proof.count_call()
        return self.compiled(q, k, v, block_mask)

    def _describe_unwarmed(self, q, k, v) -> str:
        return (
            f"flex_attention call outside the warmed buckets: q {tuple(q.shape)} stride {q.stride()}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, {q.dtype} on {q.device}, grad={torch.is_grad_enabled()} "
            f"(requires_grad q/k/v {q.requires_grad}/{k.requires_grad}/{v.requires_grad}); warmed: "
            f"{list(self.shapes)} x grad modes {self.grad_modes} on {list(self.devices)}, {self.dtype}, "
            "same layout and mask_mod as warm-up. Pad to a bucket."
        )

    # ---- proof -----------------------------------------------------------------------------------------

    def stats(self) -> CompileStats:
        return self.proof.stats(self._steady)

    def close(self) -> None:
        """Give the process back: default stance, no compile callback, no audit in the calling thread."""
        self.proof.close()
