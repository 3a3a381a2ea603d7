"""Threads sharing one compiled flex_attention: cold launches with and without the compile discipline.

Each run is a fresh process with a fresh compile cache (inductor and triton caches in a new temp dir).
Its threads (--threads-per-device on each of --devices) warm every bucket x grad mode, then run
--steps DFlash-masked attention calls, forward and backward, with a fresh block mask each step.
Printed per run: warm-up time, steady-state step time, compiles and FX traces after warm-up, eager
(uncompiled) flex_attention runs, FX errors, other errors, hang. A run that hangs is killed by its
watchdog, reported, and makes the script exit non-zero, like any run that breaks an invariant.

--undisciplined is the negative control: the seed's torch.compile(flex_attention, dynamic=False) with the
default recompile limit, no fullgraph, no warm-up lock, no stance (a barrier only marks "after warm-up").

  python bench/compile_race.py --devices 0,1 --threads-per-device 1 --repeat 5    # 2 x 3 x 2 = 12 entries
  python bench/compile_race.py --devices 0 --threads-per-device 4 --contexts 512,1024,1536,2048,3072 --repeat 5
  python bench/compile_race.py --devices 0,1 --undisciplined --watchdog-s 90 --repeat 3   # negative control
  python bench/compile_race.py --devices cpu --modes forward --backend aot_eager --heads 2 --kv-heads 2 \
      --head-dim 16 --blocks 2 --contexts 32,64,96,128,160 --steps 5          # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FX_ERROR = "symbolically trace a dynamo-optimized function"
BLOCK = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="0", help="comma-separated CUDA indices, or 'cpu'")
    parser.add_argument("--threads-per-device", type=int, default=1)
    parser.add_argument("--contexts", default="1024,2048,3072", help="context-length buckets (tokens)")
    parser.add_argument("--blocks", type=int, default=64, help="DFlash blocks of 16 tokens per sequence")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--modes", choices=["both", "grad", "forward"], default="both",
                        help="grad modes warmed and run: both = no-grad forward and forward+backward")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=50, help="steady-state calls per thread")
    parser.add_argument("--repeat", type=int, default=1, help="cold launches, each a fresh process and cache")
    parser.add_argument("--watchdog-s", type=float, default=180.0,
                        help="a run (warm-up included) still going after this is a hang")
    parser.add_argument("--undisciplined", action="store_true", help="the negative control (see above)")
    parser.add_argument("--no-stance", action="store_true", help="skip set_stance('fail_on_recompile')")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.context_list = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        parser.error(f"--contexts must be comma-separated integers, got {args.contexts!r}")
    if args.devices != "cpu" and not all(d.strip().isdigit() for d in args.devices.split(",")):
        parser.error(f"--devices must be 'cpu' or comma-separated CUDA indices, got {args.devices!r}")
    return args


# ---- one run (the child process) ------------------------------------------------------------------------


def run_once(args: argparse.Namespace) -> dict:
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    from training.compile.flex import (
        AttentionShape,
        CallAudit,
        CompileEventCounter,
        SharedFlexAttention,
        compile_accepts_recompile_limit,
        fx_tracing_flag,
        projected_qkv,
    )
    from training.model.mask import build_block_mask

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    on_cpu = args.devices == "cpu"
    devices = [torch.device("cpu")] if on_cpu else [torch.device("cuda", int(d)) for d in args.devices.split(",")]
    dtype = torch.float32 if on_cpu else torch.bfloat16
    grad_modes = {"both": (False, True), "grad": (True,), "forward": (False,)}[args.modes]
    q_len = args.blocks * BLOCK
    shapes = [
        AttentionShape(args.batch, args.heads, args.kv_heads, q_len, context + q_len, args.head_dim)
        for context in args.context_list
    ]
    thread_devices = [d for d in devices for _ in range(args.threads_per_device)]
    entries = len(devices) * len(shapes) * len(grad_modes)

    def block_mask_for(shape: AttentionShape, device, generator=None):
        context = shape.kv_len - shape.q_len
        anchors = torch.randint(1, context + 1, (shape.batch, args.blocks), generator=generator).to(device)
        block_valid = torch.ones(shape.batch, args.blocks, dtype=torch.bool, device=device)
        return build_block_mask(anchors, block_valid, context, BLOCK)

    report: dict = {
        "mode": "undisciplined" if args.undisciplined else "disciplined",
        "torch": torch.__version__,
        "threads": len(thread_devices),
        "devices": len(devices),
        "cache_entries_needed": entries,
        "fx_errors": 0,
        "other_errors": 0,
        "first_error": None,
        "hang": False,
    }
    lock = threading.Lock()
    warm_times: list[float] = []
    step_times: list[float] = []

    if args.undisciplined:
        compiled = torch.compile(flex_attention, dynamic=False, backend=args.backend)
        audit, events = CallAudit(flex_attention), CompileEventCounter()
        baseline: dict = {}

        def mark_warm() -> None:
            baseline.update(compiles=events.count, traces=audit.fx_traces, eager=audit.eager_runs)

        barrier = threading.Barrier(len(thread_devices), action=mark_warm, timeout=args.watchdog_s)
        abort_warmup = barrier.abort

        def attention(q, k, v, block_mask):
            return compiled(q, k, v, block_mask=block_mask, enable_gqa=q.size(1) != k.size(1))

        def warm_up(device) -> None:
            for shape in shapes:
                for grad in grad_modes:
                    q, k, v = projected_qkv(shape, device, dtype, grad)
                    with torch.set_grad_enabled(grad):
                        out = attention(q, k, v, block_mask_for(shape, device))
                        if grad:
                            out.sum().backward()
            barrier.wait()

        report.update(recompile_limit=int(torch._dynamo.config.recompile_limit), limit_via="default config")
    else:
        shared = SharedFlexAttention(
            shapes=shapes, devices=devices, threads=len(thread_devices), dtype=dtype, grad_modes=grad_modes,
            backend=args.backend, fail_on_recompile=not args.no_stance, audit_steady_state=True,
            barrier_timeout_s=args.watchdog_s,
        )
        audit = shared.audit
        abort_warmup = None  # SharedFlexAttention aborts its own barrier

        def attention(q, k, v, block_mask):
            return shared(q, k, v, block_mask)

        def warm_up(device) -> None:
            shared.warm_up(device, block_mask_for, qkv_for=projected_qkv)

        report.update(recompile_limit=shared.recompile_limit, limit_via=shared.limit_via,
                      compile_takes_recompile_limit=compile_accepts_recompile_limit())

    def count_error(error: BaseException) -> None:
        with lock:
            report["fx_errors" if FX_ERROR in str(error) else "other_errors"] += 1
            report["first_error"] = report["first_error"] or f"{type(error).__name__}: {str(error)[:300]}"

    def worker(index: int) -> None:
        device = thread_devices[index]
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if args.undisciplined:
            audit.install()
        generator = torch.Generator().manual_seed(index)
        try:
            started = time.perf_counter()
            warm_up(device)
            with lock:
                warm_times.append(time.perf_counter() - started)
        except BaseException as error:  # noqa: BLE001 - counted and reported
            count_error(error)
            if abort_warmup is not None:
                abort_warmup()
            return
        started = time.perf_counter()
        for step in range(args.steps):
            shape = shapes[(index + step) % len(shapes)]
            grad = grad_modes[step % len(grad_modes)]
            try:
                block_mask = block_mask_for(shape, device, generator)
                q, k, v = projected_qkv(shape, device, dtype, grad)
                with torch.set_grad_enabled(grad):
                    out = attention(q, k, v, block_mask)
                    if grad:
                        out.sum().backward()
            except Exception as error:  # noqa: BLE001 - counted: this is what the bench measures
                count_error(error)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        with lock:
            step_times.append((time.perf_counter() - started) / max(1, args.steps))

    def finish(hang: bool) -> dict:
        if args.undisciplined:
            report.update(
                compiles_after_warmup=events.count - baseline.get("compiles", events.count),
                fx_traces_after_warmup=audit.fx_traces - baseline.get("traces", audit.fx_traces),
                eager_runs=audit.eager_runs,
                eager_runs_after_warmup=audit.eager_runs - baseline.get("eager", audit.eager_runs),
                compiled_calls=None,
            )
        else:
            stats = shared.stats()
            report.update(
                compiles_after_warmup=stats.compiles_after_warmup,
                fx_traces_after_warmup=stats.fx_traces_after_warmup,
                eager_runs=stats.eager_runs,
                compiled_calls=stats.compiled_calls,
            )
        report.update(
            hang=hang,
            fx_tracing_flag=fx_tracing_flag(),
            warmup_s=round(max(warm_times), 2) if warm_times else None,
            step_ms=round(1000 * sum(step_times) / len(step_times), 3) if step_times else None,
        )
        return report

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(thread_devices))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + args.watchdog_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return finish(hang=any(t.is_alive() for t in threads))


def run_child(args: argparse.Namespace) -> None:
    report = run_once(args)
    print(json.dumps(report), flush=True)
    os._exit(3 if report["hang"] else 0)  # a hung daemon thread must not keep the process alive


# ---- the driver: one fresh process and compile cache per cold launch --------------------------------------


COLUMNS = [
    ("run", 4), ("mode", 13), ("threads", 7), ("entries", 7), ("limit", 5), ("warmup_s", 8), ("step_ms", 8),
    ("compiles_after_warmup", 9), ("fx_traces_after_warmup", 9), ("eager_runs", 6), ("fx_errors", 9),
    ("other_errors", 6), ("hang", 5),
]
HEADERS = {"compiles_after_warmup": "compiles*", "fx_traces_after_warmup": "traces*", "eager_runs": "eager",
           "fx_errors": "fx_errors", "other_errors": "other", "cache_entries_needed": "entries",
           "recompile_limit": "limit"}


def launch(args: argparse.Namespace, argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="compile_race_") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
        try:
            done = subprocess.run([sys.executable, __file__, *argv, "--child"], check=False, capture_output=True,
                                  text=True, env=env, timeout=args.watchdog_s + 60)
        except subprocess.TimeoutExpired:
            return {"hang": True, "first_error": "killed: the run outlived its own watchdog by 60 s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"hang": False, "other_errors": 1, "first_error": f"exit {done.returncode}: {done.stderr[-500:]}"}
    return json.loads(lines[-1])


def broken(report: dict) -> bool:
    counts = ("compiles_after_warmup", "fx_traces_after_warmup", "eager_runs", "fx_errors", "other_errors")
    return bool(report.get("hang") or report.get("fx_tracing_flag") or any(report.get(c) for c in counts))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        run_child(args)
    child_argv = [a for a in argv if a != "--child"]
    reports = []
    print("  ".join(HEADERS.get(name, name).rjust(width) for name, width in COLUMNS))
    for run in range(1, args.repeat + 1):
        report = {"run": run, **launch(args, child_argv)}
        reports.append(report)
        row = {"entries": report.get("cache_entries_needed"), "limit": report.get("recompile_limit"), **report}
        print("  ".join(str(row.get(name, "-")).rjust(width) for name, width in COLUMNS), flush=True)
        if report.get("first_error"):
            print(f"      first error: {report['first_error']}")
    first = reports[0]
    print(f"torch {first.get('torch')}, limit via {first.get('limit_via')}; * = after warm-up; "
          "step_ms = one call (fresh block mask, forward, backward in grad mode) per thread, audit hook on")
    bad = [r["run"] for r in reports if broken(r)]
    print(f"{len(reports) - len(bad)}/{len(reports)} runs clean" + (f"; broken: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
