"""The compile discipline of the shared flex_attention (training/compile/flex.py, ARCHITECTURE §6), on the CPU.

Each test asserts invariants (no compile and no FX trace after warm-up, no eager run, the FX flag ends
False) instead of hoping that a race shows. Grad modes: flex_attention's public API refuses backward on
the CPU, so grad-mode tests compile `flex_attention_cpu_backward`, the very higher-order-op call that
flex_attention makes under torch.compile, minus that device check. With the aot_eager backend a compiled
call runs graphs traced once at compile time, while an eager call runs make_fx on every call (it sets
torch.fx's process-global tracing flag): the race's mechanism. The inductor test compiles the public
flex_attention (the trainer's default), forward only.

More than the default 8 cache entries on one device: every thread shares the CPU, so the entries come from
3 context lengths x 2 batch sizes (6 shapes) x 2 grad modes = 12.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop
from torch.nn.attention.flex_attention import _apply_kernel_options, flex_attention

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from training.compile.flex import (
    AttentionShape,
    CallAudit,
    CompileDisciplineError,
    CompileEventCounter,
    EagerFallbackError,
    RecompileLimitTooSmall,
    SharedFlexAttention,
    UnwarmedShapeError,
    compile_accepts_recompile_limit,
    fx_tracing_flag,
    projected_qkv,
)
from training.compile.stages import CompiledStage
from training.model.mask import build_block_mask, dense_mask

BLOCK = 16
NUM_BLOCKS = 2
HEADS = 2
HEAD_DIM = 16
CONTEXTS = (32, 64, 96)
SHAPES = [
    AttentionShape(batch, HEADS, HEADS, NUM_BLOCKS * BLOCK, context + NUM_BLOCKS * BLOCK, HEAD_DIM)
    for context in CONTEXTS
    for batch in (1, 2)
]
DEFAULT_LIMIT = 8
THREAD_TIMEOUT_S = 120


def _identity_score(score, b, h, q_idx, kv_idx):
    return score


def flex_attention_cpu_backward(query, key, value, block_mask, enable_gqa=False):
    """flex_attention's compiled-path call of its higher-order op, without the public CPU-backward refusal."""
    kernel_options = _apply_kernel_options(query, key, value, False, None, None)
    out, _lse, _max = flex_attention_hop(
        query, key, value, _identity_score, block_mask.as_tuple(), 1.0 / math.sqrt(query.size(-1)), kernel_options
    )
    return out


def context_len(shape: AttentionShape) -> int:
    return shape.kv_len - shape.q_len


def dflash_inputs(shape: AttentionShape, generator: torch.Generator):
    """Anchors and padding like the trainer's: random anchors in the context, the last block sometimes padding."""
    anchors = torch.randint(1, context_len(shape) + 1, (shape.batch, NUM_BLOCKS), generator=generator)
    block_valid = torch.ones(shape.batch, NUM_BLOCKS, dtype=torch.bool)
    block_valid[:, -1] = torch.rand(shape.batch, generator=generator) < 0.5
    return anchors, block_valid


def warmup_block_mask(shape: AttentionShape, device: torch.device):
    anchors, block_valid = dflash_inputs(shape, torch.Generator().manual_seed(0))
    return build_block_mask(anchors.to(device), block_valid.to(device), context_len(shape), BLOCK)


def projected(x: torch.Tensor, weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A projection's output viewed as [batch, heads, seq, head_dim]: the layout `projected_qkv` warms."""
    batch, length, _ = x.shape
    return (x @ weight).view(batch, length, heads, HEAD_DIM).transpose(1, 2)


def reference_attention(q, k, v, anchors, block_valid, shape):
    """SDPA with the dense mask; rows that see nothing (padding blocks) are 0, as in flex_attention."""
    mask = dense_mask(anchors, block_valid, context_len(shape), BLOCK)[:, None]
    return torch.nan_to_num(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def steady_step(attention, shape: AttentionShape, grad: bool, generator: torch.Generator) -> None:
    """One call like the trainer's (fresh mask, projected inputs), checked against the SDPA reference."""
    anchors, block_valid = dflash_inputs(shape, generator)
    block_mask = build_block_mask(anchors, block_valid, context_len(shape), BLOCK)
    width = HEADS * HEAD_DIM
    weight = torch.randn(width, width, generator=generator).requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        q = projected(torch.randn(shape.batch, shape.q_len, width, generator=generator), weight, HEADS)
        k = projected(torch.randn(shape.batch, shape.kv_len, width, generator=generator), weight, HEADS)
        v = projected(torch.randn(shape.batch, shape.kv_len, width, generator=generator), weight, HEADS)
        out = attention(q, k, v, block_mask)
        expected = reference_attention(q, k, v, anchors, block_valid, shape)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
        if grad:
            grads = torch.autograd.grad(out.sum(), (q, k, v))
            expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
            for got, want in zip(grads, expected_grads):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def run_threads(target, count: int) -> list[BaseException | None]:
    """Run target(index) in `count` threads; fail (never hang) if one is still running after the timeout."""
    errors: list[BaseException | None] = [None] * count

    def guarded(index: int) -> None:
        try:
            target(index)
        except BaseException as error:  # noqa: BLE001 - reported to the test
            errors[index] = error

    hung = start_and_join(guarded, count, THREAD_TIMEOUT_S)
    assert not hung, f"threads still running after {THREAD_TIMEOUT_S} s (a hang)"
    return errors


def stats_after_threads(attention, worker, threads: int):
    """Run worker(index) in `threads` threads, none failing, and the shared attention's counters after them
    (the attention is closed either way)."""
    try:
        errors = run_threads(worker, threads)
        assert errors == [None] * threads, errors
        return attention.stats()
    finally:
        attention.close()


def start_and_join(target, count: int, timeout_s: float) -> bool:
    """Run target(index) in `count` daemon threads; True if any is still running after `timeout_s` (a hang)."""
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return any(t.is_alive() for t in threads)


def cache_entries(fn) -> int:
    return len(_debug_get_cache_entry_list(fn.__code__))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts and ends with empty dynamo caches and the default stance."""
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch.compiler.set_stance("default")
    torch._dynamo.reset()


def make_attention(threads: int, **overrides) -> SharedFlexAttention:
    options = {
        "shapes": SHAPES,
        "devices": ["cpu"],
        "threads": threads,
        "dtype": torch.float32,
        "backend": "aot_eager",
        "attention_fn": flex_attention_cpu_backward,
    }
    return SharedFlexAttention(**{**options, **overrides})


def test_a_trial_before_the_threads_warms_its_keys_and_nothing_compiles_after_the_barrier():
    """The trainer's layout trial: the main thread warms and calls its device's keys before the threads exist
    (their number is decided by the trial); the threads' warm-up then finds them compiled."""
    threads, steps = 2, 6
    attention = make_attention(None, audit_steady_state=True)
    generator = torch.Generator().manual_seed(0)
    with attention.trial("cpu", warmup_block_mask, qkv_for=projected_qkv):
        for step in range(steps):
            steady_step(attention, SHAPES[step % len(SHAPES)], grad=step % 2 == 0, generator=generator)
    with pytest.raises(CompileDisciplineError, match="before every thread finished warm_up"):
        steady_step(attention, SHAPES[0], grad=False, generator=generator)  # the trial is over
    entries_after_trial = cache_entries(flex_attention_cpu_backward)
    assert entries_after_trial == 12
    with pytest.raises(CompileDisciplineError, match="expect_threads"):
        attention.warm_up("cpu", warmup_block_mask, qkv_for=projected_qkv)
    attention.expect_threads(threads)

    def worker(index: int) -> None:
        attention.warm_up("cpu", warmup_block_mask, qkv_for=projected_qkv)
        for step in range(steps):
            steady_step(attention, SHAPES[(index + step) % len(SHAPES)], grad=step % 2 == 1,
                        generator=torch.Generator().manual_seed(index))

    stats = stats_after_threads(attention, worker, threads)
    assert cache_entries(flex_attention_cpu_backward) == entries_after_trial  # within the limit, nothing new
    assert (stats.compiles_after_warmup, stats.fx_traces_after_warmup, stats.eager_runs) == (0, 0, 0)
    assert stats.compiled_calls == threads * steps  # the trial's calls come before the count starts


def test_threads_share_the_warm_cache_without_tracing_or_eager_runs():
    threads, steps = 4, 12
    attention = make_attention(threads, audit_steady_state=True)
    assert attention.entries_needed == 12 > DEFAULT_LIMIT
    assert attention.recompile_limit >= attention.entries_needed

    def worker(index: int) -> None:
        attention.warm_up("cpu", warmup_block_mask, qkv_for=projected_qkv)
        generator = torch.Generator().manual_seed(index)
        for step in range(steps):  # every thread cycles through all 12 keys, concurrently with the others
            shape = SHAPES[(index + step) % len(SHAPES)]
            steady_step(attention, shape, grad=step % 2 == 0, generator=generator)

    stats = stats_after_threads(attention, worker, threads)
    assert cache_entries(flex_attention_cpu_backward) == 12  # past the default limit of 8, all compiled
    assert stats.compiled_calls == threads * steps
    assert stats.compiles_after_warmup == 0
    assert stats.fx_traces_after_warmup == 0
    assert stats.eager_runs == 0
    assert stats.fx_tracing_flag is False


def scaled_sum(x, y):
    return (x * y).sum(-1)


def scaled_sum_unlocked(x, y):  # the same function, its own code object: its own dynamo cache, no call lock
    return (x * y).sum(-1)


def test_threads_calling_warmed_keys_never_miss_dynamo_s_cache():
    """Dynamo's cache lookup races: a thread that lets another run while it checks guards can walk past its
    entry as the other moves that entry to the list's front, miss a warmed key and, under fail_on_recompile,
    fail. CompiledStage (and the shared flex_attention) make each code object's lookups single-file; the same
    function compiled without the lock is the negative control, in the same threads."""
    shapes = [(batch, width) for batch in (1, 2, 3) for width in (8, 16, 24, 32)]
    stage = CompiledStage("scaled sum", scaled_sum, keys_expected=2 * len(shapes), backend="eager")
    unlocked = torch.compile(scaled_sum_unlocked, dynamic=False, fullgraph=True, backend="eager",
                             **({"recompile_limit": 32} if compile_accepts_recompile_limit() else {}))

    def inputs(shape, grad: bool):
        return torch.randn(*shape, requires_grad=grad), torch.randn(*shape)

    # torch 2.11 takes the limit from the config only; this thread warms (patched: no later test sees it).
    with torch._dynamo.config.patch(recompile_limit=32), stage.warming():
        for shape in shapes:
            for grad in (False, True):
                with torch.set_grad_enabled(grad):
                    stage(*inputs(shape, grad))
                    unlocked(*inputs(shape, grad))
    stage.seal()
    torch.compiler.set_stance("fail_on_recompile")
    misses = {"stage": 0, "unlocked": 0}
    lock = threading.Lock()

    def worker(index: int) -> None:
        for step in range(1500):
            grad = step % 2 == 0
            for name, fn in (("stage", stage), ("unlocked", unlocked)):
                with torch.set_grad_enabled(grad):
                    try:
                        fn(*inputs(shapes[(index + step) % len(shapes)], grad))
                    except RuntimeError as error:
                        assert "fail_on_recompile" in str(error), error
                        with lock:
                            misses[name] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the GIL changes hands more often: the race shows in a second, not a day
    try:
        assert run_threads(worker, 4) == [None] * 4
    finally:
        sys.setswitchinterval(interval)
    print("misses of warmed keys:", misses)
    assert misses["stage"] == 0
    assert misses["unlocked"] > 0  # the race is real in this torch: the lock is what keeps it out


def test_undisciplined_compile_overflows_into_eager_tracing_calls():
    """Negative control: the seed's compile (default limit, no fullgraph, a main-thread warm-up) runs the
    keys past the 8th uncompiled, and with gradients every such call traces with make_fx. Counted, in a
    subprocess (a race may crash or hang it; its watchdog bounds it)."""
    result = subprocess.run(
        [sys.executable, __file__, "undisciplined"],
        check=False,
        capture_output=True,
        text=True,
        timeout=THREAD_TIMEOUT_S + 60,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print("negative control:", report)
    assert report["keys"] == 12 and report["cache_entries"] == DEFAULT_LIMIT
    assert report["eager_runs_after_warmup"] > 0  # the silent dense fallback
    assert report["fx_traces_after_warmup"] > 0  # make_fx during steady state: the crash's precondition


def run_undisciplined(threads: int = 4, steps: int = 12, watchdog_s: float = THREAD_TIMEOUT_S) -> dict:
    torch.set_num_threads(1)
    compiled = torch.compile(flex_attention_cpu_backward, backend="aot_eager", dynamic=False)
    audit = CallAudit(flex_attention_cpu_backward)
    events = CompileEventCounter()

    def call(q, k, v, block_mask):
        return compiled(q, k, v, block_mask=block_mask)

    # The warm-up the seed tried: every key once, in the main thread, before the threads start.
    for shape in SHAPES:
        for grad in (False, True):
            q, k, v = projected_qkv(shape, torch.device("cpu"), torch.float32, grad)
            with torch.set_grad_enabled(grad):
                out = call(q, k, v, warmup_block_mask(shape, torch.device("cpu")))
                if grad:
                    out.sum().backward()
    compiles_at_warmup, outcome = events.count, {"fx_errors": 0, "other_errors": 0}
    lock = threading.Lock()

    def worker(index: int) -> None:
        audit.install()
        generator = torch.Generator().manual_seed(index)
        for step in range(steps):
            try:
                steady_step(call, SHAPES[(index + step) % len(SHAPES)], grad=step % 2 == 0, generator=generator)
            except Exception as error:  # noqa: BLE001 - counted, this is the failure being shown
                kind = "fx_errors" if "symbolically trace a dynamo-optimized" in str(error) else "other_errors"
                with lock:
                    outcome[kind] += 1

    hung = start_and_join(worker, threads, watchdog_s)
    return {
        "keys": len(SHAPES) * 2,
        "cache_entries": cache_entries(flex_attention_cpu_backward),
        "eager_runs_after_warmup": audit.eager_runs,
        "fx_traces_after_warmup": audit.fx_traces,
        "compiles_after_warmup": events.count - compiles_at_warmup,
        "hang": hung,
        "fx_tracing_flag": fx_tracing_flag(),
        **outcome,
    }


def test_too_small_a_limit_fails_loudly_in_every_thread():
    threads = 3
    attention = make_attention(threads, recompile_limit=4)
    started = time.monotonic()
    try:
        errors = run_threads(lambda _: attention.warm_up("cpu", warmup_block_mask, projected_qkv), threads)
        stats = attention.stats()
    finally:
        attention.close()
    assert time.monotonic() - started < THREAD_TIMEOUT_S
    assert all(isinstance(e, CompileDisciplineError) for e in errors), errors
    too_small = [e for e in errors if isinstance(e, RecompileLimitTooSmall)]
    assert len(too_small) == 1 and "recompile_limit=4" in str(too_small[0])
    assert "needs 12 cache entries" in str(too_small[0])
    assert not any("symbolically trace" in str(e) for e in errors)
    assert stats.eager_runs == 0  # never a dense fallback
    assert stats.fx_tracing_flag is False
    assert cache_entries(flex_attention_cpu_backward) == 4


def test_stray_shape_layout_or_grad_mode_is_a_clear_error_not_a_recompile():
    shapes = SHAPES[:2]
    attention = make_attention(1, shapes=shapes, grad_modes=(False,))
    q, k, v = projected_qkv(shapes[0], torch.device("cpu"), torch.float32, False)
    mask = warmup_block_mask(shapes[0], torch.device("cpu"))
    try:
        with pytest.raises(CompileDisciplineError, match="before every thread finished warm_up"):
            attention(q, k, v, mask)
        attention.warm_up("cpu", warmup_block_mask, projected_qkv)
        with torch.no_grad():
            attention(q, k, v, mask)  # a warmed key
            stray = AttentionShape(1, HEADS, HEADS, NUM_BLOCKS * BLOCK, 48 + NUM_BLOCKS * BLOCK, HEAD_DIM)
            sq, sk, sv = projected_qkv(stray, torch.device("cpu"), torch.float32, False)
            with pytest.raises(UnwarmedShapeError, match=r"k \(1, 2, 80, 16\).*warmed: \[AttentionShape"):
                attention(sq, sk, sv, warmup_block_mask(stray, torch.device("cpu")))
            with pytest.raises(UnwarmedShapeError, match="stride"):
                attention(q.contiguous(), k, v, mask)  # same shape, another layout: another cache entry
        gq, gk, gv = (t.detach().requires_grad_(True) for t in (q, k, v))
        with pytest.raises(UnwarmedShapeError, match="grad=True"):
            attention(gq, gk, gv, mask)  # only the no-grad mode was warmed
        stats = attention.stats()
    finally:
        attention.close()
    assert stats.compiles_after_warmup == 0
    assert stats.compiled_calls == 1


def test_a_caller_under_autocast_hits_the_entries_warmed_without_it():
    """The trainer calls attention inside autocast, the warm-up does not; dynamo guards on the autocast state,
    so without one fixed state per call every steady-state call would recompile (stance: a loud failure)."""
    shapes = SHAPES[:1]
    attention = make_attention(1, shapes=shapes, grad_modes=(False,))
    q, k, v = projected_qkv(shapes[0], torch.device("cpu"), torch.float32, False)
    mask = warmup_block_mask(shapes[0], torch.device("cpu"))
    try:
        attention.warm_up("cpu", warmup_block_mask, projected_qkv)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = attention(q, k, v, mask)
        stats = attention.stats()
    finally:
        attention.close()
    assert out.dtype == torch.float32
    assert stats.compiles_after_warmup == 0
    assert stats.compiled_calls == 1


def test_a_recompile_past_the_shape_check_fails_loudly_after_warmup():
    """The second net: a recompile the shape check cannot see (k and v the same tensor: dynamo guards on
    aliasing) meets the fail_on_recompile stance, set process-wide once every thread passed the barrier."""
    attention = make_attention(2, shapes=SHAPES[:1], grad_modes=(False,))
    outcome: dict[str, BaseException] = {}

    def worker(index: int) -> None:
        if index == 1:  # arrive last, so the barrier action (the stance) runs in this thread, not thread 0
            while attention._barrier.n_waiting < 1:
                time.sleep(0.01)
        attention.warm_up("cpu", warmup_block_mask, projected_qkv)
        if index == 0:
            q, k, _ = projected_qkv(SHAPES[0], torch.device("cpu"), torch.float32, False)
            with torch.no_grad(), pytest.raises(Exception, match="fail_on_recompile") as raised:
                attention(q, k, k, warmup_block_mask(SHAPES[0], torch.device("cpu")))
            outcome["error"] = raised.value

    try:
        assert run_threads(worker, 2) == [None, None]
        stats = attention.stats()
    finally:
        attention.close()
    assert "error" in outcome
    assert stats.eager_runs == 0


def test_a_silent_eager_run_during_warmup_is_refused():
    """If dynamo runs the compiled function eagerly without raising (here: a force_eager stance left by
    someone else), warm-up's second, audited call sees the function's own code run and refuses."""
    attention = make_attention(1, shapes=SHAPES[:1], grad_modes=(False,))
    torch.compiler.set_stance("force_eager")
    try:
        with pytest.raises(EagerFallbackError, match="ran uncompiled"):
            attention.warm_up("cpu", warmup_block_mask, projected_qkv)
    finally:
        torch.compiler.set_stance("default")
        attention.close()


def test_per_thread_config_path_sizes_the_limit_in_each_worker():
    threads = 2
    attention = make_attention(threads, limit_via="thread_config", audit_steady_state=True)
    assert attention.entries_needed > DEFAULT_LIMIT

    def worker(index: int) -> None:
        attention.warm_up("cpu", warmup_block_mask, qkv_for=projected_qkv)
        generator = torch.Generator().manual_seed(index)
        for step, shape in enumerate(SHAPES):
            steady_step(attention, shape, grad=(index + step) % 2 == 0, generator=generator)

    stats = stats_after_threads(attention, worker, threads)
    assert cache_entries(flex_attention_cpu_backward) == 12
    assert (stats.compiles_after_warmup, stats.fx_traces_after_warmup, stats.eager_runs) == (0, 0, 0)
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 12):
        assert torch._dynamo.config.recompile_limit == DEFAULT_LIMIT  # set in the workers only: per thread


def test_inductor_compiles_the_public_flex_attention_forward_for_threads():
    """The trainer's default path, forward only (its CPU backward is refused): 2 shapes, 2 threads."""
    threads, shapes = 2, [SHAPES[0], SHAPES[3]]
    attention = SharedFlexAttention(
        shapes=shapes, devices=["cpu"], threads=threads, dtype=torch.float32, grad_modes=(False,)
    )
    assert attention.attention_fn is flex_attention

    def worker(index: int) -> None:
        attention.warm_up("cpu", warmup_block_mask, qkv_for=projected_qkv)
        generator = torch.Generator().manual_seed(index)
        for step in range(4):
            steady_step(attention, shapes[(index + step) % 2], grad=False, generator=generator)

    stats = stats_after_threads(attention, worker, threads)
    assert stats.compiled_calls == threads * 4
    assert (stats.compiles_after_warmup, stats.eager_runs, stats.fx_tracing_flag) == (0, 0, False)


TINY_BENCH = [
    "--devices", "cpu", "--threads-per-device", "2", "--modes", "forward", "--backend", "aot_eager",
    "--heads", "2", "--kv-heads", "2", "--head-dim", "16", "--blocks", "2", "--steps", "4",
    "--contexts", ",".join(str(c) for c in range(32, 320, 32)),  # 9 buckets x 1 mode > 8 entries
]


@pytest.mark.parametrize("undisciplined", [False, True], ids=["disciplined", "undisciplined"])
def test_bench_compile_race_runs_on_the_cpu(undisciplined: bool):
    """The GPU bench's own code paths, tiny and on the CPU: clean with the discipline, eager runs without."""
    command = [sys.executable, "bench/compile_race.py", *TINY_BENCH] + (["--undisciplined"] if undisciplined else [])
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300, cwd=REPO)
    header, row = done.stdout.splitlines()[:2]
    columns = dict(zip(header.split(), row.split()))
    assert columns["hang"] == "False", done.stdout + done.stderr[-2000:]
    if undisciplined:  # eager runs; the FX error they cause may show too (it did on a 16-core GPU machine)
        assert done.returncode == 1 and int(columns["eager"]) > 0, done.stdout
    else:
        assert done.returncode == 0 and columns["fx_errors"] == "0", done.stdout + done.stderr[-2000:]
        assert (columns["compiles*"], columns["traces*"], columns["eager"]) == ("0", "0", "0")


if __name__ == "__main__" and sys.argv[1:] == ["undisciplined"]:
    report = run_undisciplined()
    print(json.dumps(report), flush=True)
    os._exit(0)  # a hung daemon thread must not keep the process alive


def test_the_audit_leaves_the_thread_s_profiler_as_it_found_it():
    """A warm-up proves each key with the audit's profile hook on, then takes it off: left on, it would run on
    every Python call of that thread for the whole run (and slow each later compile ~3x)."""
    audit = CallAudit(flex_attention_cpu_backward)

    def earlier_hook(frame, event, arg):
        return None

    sys.setprofile(earlier_hook)
    try:
        audit.install()
        assert sys.getprofile() != earlier_hook
        audit.uninstall()
        assert sys.getprofile() is earlier_hook
    finally:
        sys.setprofile(None)
    audit.install()
    audit.uninstall()
    assert sys.getprofile() is None
