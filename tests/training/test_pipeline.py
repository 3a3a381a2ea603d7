"""The threaded pipeline on CPU threads with toy stages (pipeline_toys.py), and on GPUs where there are."""

from __future__ import annotations

import _thread
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from pipeline_toys import EventLog, ToyDrafter, ToyFailure, ToyTarget, make_batches

from training.output.checkpoint import latest_checkpoint
from training.pipeline import (
    Pipeline,
    PipelineConfig,
    PipelineError,
    PipelineStalled,
    StepReport,
    sum_and_clip_gradients,
)

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def build(targets, drafters, per_step, steps, *, target_options=None, drafter_options=None, on_step=None,
          batches=None, colocated=(), **config):
    """A pipeline of toy stages: `targets`, `drafters` and `colocated` are device lists."""
    config = PipelineConfig(target_devices=targets, drafter_devices=drafters, micro_batches_per_step=per_step,
                            colocated_devices=colocated, **config)
    target_options, drafter_options = target_options or {}, drafter_options or {}
    return Pipeline(
        config,
        [ToyTarget(device, **target_options) for device in targets],
        [ToyDrafter(device, replica=i, **drafter_options) for i, device in enumerate(drafters)],
        batches if batches is not None else make_batches(steps * per_step),
        start_step=0,
        max_steps=steps,
        on_step=on_step,
        colocated=[(ToyTarget(device, **target_options), ToyDrafter(device, replica=len(drafters) + i,
                                                                       **drafter_options))
                   for i, device in enumerate(colocated)],
    )


def reference_parameters(batches, per_step, steps, grad_clip, device=CPU):
    """The plain single-device loop: M micro-batches per step, their losses' gradients summed, then divided by
    the step's total weight (M: a toy's loss has weight 1), clip, one optimizer step."""
    target, drafter = ToyTarget(device), ToyDrafter(device)
    params = drafter.trainable_parameters()
    reports = []
    for step in range(steps):
        loss_sum = mae_sum = 0.0
        for batch in batches[step * per_step:(step + 1) * per_step]:
            with torch.no_grad():
                features = target.features(batch)
            loss, metrics = drafter.loss(features, {**batch, "y": batch["y"].to(device)})
            loss.backward()
            loss_sum, mae_sum = loss_sum + float(loss), mae_sum + float(metrics["mae"])
        torch._foreach_mul_([p.grad for p in params], 1.0 / per_step)
        norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
        reports.append(StepReport(step + 1, loss_sum / per_step, norm, {"mae": mae_sum / per_step}))
        drafter.optimizer_step()
        drafter.optimizer.zero_grad(set_to_none=True)
    return [p.detach().cpu() for p in params], reports


def assert_replicas_identical(pipeline):
    first = pipeline.drafters[0].trainable_parameters()
    for replica in pipeline.drafters[1:]:
        for a, b in zip(first, replica.trainable_parameters()):
            assert torch.equal(a.cpu(), b.cpu())


def test_many_steps_with_several_target_and_drafter_threads():
    log = EventLog()
    reports: list[StepReport] = []
    per_step, steps = 4, 25
    pipeline = build([CPU] * 3, [CPU] * 2, per_step, steps, queue_depth=3, on_step=reports.append,
                     target_options={"log": log}, drafter_options={"log": log})
    result = pipeline.run()

    assert (result.steps_done, result.stopped) == (steps, False)
    assert [r.step for r in reports] == list(range(1, steps + 1))
    assert all(torch.isfinite(torch.tensor([r.loss, r.grad_norm])).all() for r in reports)
    taken = sorted(n for kind, *rest in log.events if kind == "loss" for n in rest[1:])
    assert taken == list(range(steps * per_step))  # every micro-batch exactly once
    # A replica computes step g's micro-batches (n // M == g) only after its own update of step g - 1.
    for replica in range(2):
        updates = 0
        for kind, *rest in log.events:
            if kind == "step" and rest[0] == replica:
                updates = rest[1]
            elif kind == "loss" and rest[0] == replica:
                assert rest[1] // per_step == updates
    assert_replicas_identical(pipeline)


@pytest.mark.parametrize("replicas,per_step", [(1, 5), (2, 5), (3, 5), (3, 2)])
def test_k_replica_step_equals_single_replica_step(replicas, per_step):
    steps, clip = 4, 0.5
    batches = make_batches(steps * per_step)
    reports: list[StepReport] = []
    pipeline = build([CPU] * 3, [CPU] * replicas, per_step, steps, grad_clip=clip, batches=batches,
                     on_step=reports.append)
    pipeline.run()

    expected, expected_reports = reference_parameters(batches, per_step, steps, clip)
    for got, want in zip(reports, expected_reports, strict=True):
        assert got.step == want.step
        assert (got.loss, got.grad_norm, got.metrics["mae"]) == pytest.approx(
            (want.loss, want.grad_norm, want.metrics["mae"]), rel=1e-5)
    assert any(r.grad_norm > clip for r in expected_reports)  # clipping took part
    for got, want in zip(pipeline.drafters[0].trainable_parameters(), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_replicas_identical(pipeline)


@pytest.mark.parametrize("targets,drafters,colocated,per_step", [
    (0, 0, 1, 5),  # the serial loop: one thread, target forward then drafter step
    (0, 0, 3, 5),  # data parallel, each replica feeding itself
    (2, 1, 1, 5),  # a mix: a target:drafter pair and a colocated replica
    (1, 2, 2, 3),
])
def test_colocated_replicas_equal_a_single_replica_step(targets, drafters, colocated, per_step):
    steps, clip = 4, 0.5
    batches = make_batches(steps * per_step)
    reports: list[StepReport] = []
    log = EventLog()
    pipeline = build([CPU] * targets, [CPU] * drafters, per_step, steps, grad_clip=clip, batches=batches,
                     colocated=[CPU] * colocated, on_step=reports.append, target_options={"log": log},
                     drafter_options={"log": log})
    pipeline.run()

    expected, expected_reports = reference_parameters(batches, per_step, steps, clip)
    for got, want in zip(reports, expected_reports, strict=True):
        assert got.step == want.step
        assert (got.loss, got.grad_norm, got.metrics["mae"]) == pytest.approx(
            (want.loss, want.grad_norm, want.metrics["mae"]), rel=1e-5)
    for got, want in zip(pipeline.drafters[0].trainable_parameters(), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_replicas_identical(pipeline)
    taken = sorted(n for kind, *rest in log.events if kind == "loss" for n in rest[1:])
    assert taken == list(range(steps * per_step))  # every micro-batch exactly once, by whichever role
    featured = sorted(rest[0] for kind, *rest in log.events if kind == "features")
    assert featured == taken  # and its features computed once
    assert set(pipeline.utilisation().busy) == {
        *(f"target{i}" for i in range(targets)), *(f"drafter{i}" for i in range(drafters)),
        *(f"colocated{i}" for i in range(colocated))}


def test_one_colocated_thread_is_the_serial_loop_exactly():
    """One colocated thread reads, computes and accumulates in source order: bit-equal to the plain loop."""
    per_step, steps, clip = 3, 5, 0.5
    batches = make_batches(steps * per_step)
    reports: list[StepReport] = []
    pipeline = build([], [], per_step, steps, grad_clip=clip, batches=batches, colocated=[CPU],
                     on_step=reports.append)
    pipeline.run()
    expected, expected_reports = reference_parameters(batches, per_step, steps, clip)
    # (The reference sums losses in Python floats, the pipeline in float32: only the losses' rounding differs.)
    assert [r.loss for r in reports] == pytest.approx([r.loss for r in expected_reports], rel=1e-6)
    for got, want in zip(pipeline.drafters[0].trainable_parameters(), expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("targets,drafters,colocated,message", [
    (1, 0, 1, "need drafter threads"),
    (0, 1, 1, "need target threads"),
    (0, 0, 0, "at least one drafter or colocated"),
])
def test_layouts_without_a_partner_are_refused(targets, drafters, colocated, message):
    with pytest.raises(ValueError, match=message):
        build([CPU] * targets, [CPU] * drafters, 2, 2, colocated=[CPU] * colocated)


def test_queue_depth_is_bounded_and_targets_run_ahead():
    log = EventLog()
    per_step, steps, bound = 2, 8, 3
    pipeline = build([CPU] * 3, [CPU], per_step, steps, queue_depth=bound,
                     target_options={"log": log}, drafter_options={"log": log, "delay_s": 0.02})
    pipeline.run()

    # Slow drafter, fast targets: the queue fills to its bound and never past it.
    assert pipeline.utilisation().queue_depth_max == bound
    # Targets computed features of a later step before the drafter's update of the earlier one (the overlap).
    updates, ran_ahead = 0, False
    for kind, *rest in log.events:
        if kind == "step":
            updates = rest[1]
        elif kind == "features" and rest[0] // per_step > updates:
            ran_ahead = True
    assert ran_ahead


def test_busy_fractions_and_queue_depth_in_metrics():
    windows = []
    pipeline = build([CPU] * 2, [CPU], 2, 6, drafter_options={"delay_s": 0.03},
                     on_step=lambda report: windows.append(pipeline.utilisation()))
    pipeline.run()

    assert len(windows) == 6
    for window in windows:
        metrics = window.as_metrics()
        assert set(metrics["busy"]) == {"target0", "target1", "drafter0"}
        assert all(0.0 <= fraction <= 1.0 for fraction in metrics["busy"].values())
        assert 0 <= metrics["queue_depth"]["mean"] <= metrics["queue_depth"]["max"] <= 4
    # The sleeping drafter is the bottleneck: mostly busy, the targets mostly waiting for room.
    whole = sum(w.busy["drafter0"] for w in windows[1:]) / len(windows[1:])
    assert whole > 0.5
    assert whole > max(sum(w.busy[t] for w in windows[1:]) / len(windows[1:]) for t in ("target0", "target1"))


@pytest.mark.parametrize(
    "where,options",
    [
        ("drafter", {"drafter_options": {"fail_at": 7}}),
        ("target", {"target_options": {"fail_at": 5}}),  # drafters are left waiting for its features
    ],
)
def test_a_failing_thread_stops_the_whole_pipeline(where, options):
    pipeline = build([CPU] * 2, [CPU] * 2, 2, 200, queue_depth=2, **options)
    start = time.monotonic()
    with pytest.raises(PipelineError, match="failed on micro-batch") as caught:
        pipeline.run()

    assert time.monotonic() - start < 10
    assert isinstance(caught.value.error, ToyFailure)
    assert caught.value.thread.startswith(where)
    assert caught.value.device == CPU and caught.value.batch["n"] == options[f"{where}_options"]["fail_at"]
    assert "ToyFailure" in caught.value.traceback_text and "pipeline_toys.py" in caught.value.traceback_text
    assert caught.value.still_running == []
    assert not [t for t in threading.enumerate() if t.name.startswith(("target", "drafter"))]


def test_a_failing_warm_up_releases_the_threads_waiting_at_the_barrier():
    class FailingWarmUp(ToyDrafter):
        def warm_up(self):
            raise ToyFailure("no compile today")

    warmed = []

    class WarmTarget(ToyTarget):
        def warm_up(self):
            warmed.append(self)

    drafters = [ToyDrafter(CPU), FailingWarmUp(CPU)]
    pipeline = Pipeline(PipelineConfig([CPU] * 2, [CPU] * 2, 2), [WarmTarget(CPU), WarmTarget(CPU)], drafters,
                        make_batches(8), start_step=0, max_steps=4)
    with pytest.raises(PipelineError, match="no compile today") as caught:
        pipeline.run()
    assert caught.value.thread == "drafter1" and len(warmed) == 2
    assert caught.value.batch is None  # outside a micro-batch


def test_replicas_must_start_identical():
    drafters = [ToyDrafter(CPU), ToyDrafter(CPU)]
    with torch.no_grad():
        drafters[1].trainable_parameters()[2].add_(1e-6)
    pipeline = Pipeline(PipelineConfig([CPU], [CPU] * 2, 2), [ToyTarget(CPU)], drafters, make_batches(8),
                        start_step=0, max_steps=4)
    with pytest.raises(ValueError, match="replica 1 differs from replica 0 in trainable tensor 2"):
        pipeline.run()


def test_a_stalled_pipeline_is_an_error_with_every_stack():
    release = threading.Event()
    pipeline = build([CPU], [CPU], 2, 4, drafter_options={"block": release}, stall_timeout_s=1.0,
                     abort_grace_s=1.0)
    try:
        with pytest.raises(PipelineError, match="no progress") as caught:
            pipeline.run()
    finally:
        release.set()
    assert isinstance(caught.value.error, PipelineStalled)
    assert "drafter0" in str(caught.value.error) and "in loss" in str(caught.value.error)
    assert caught.value.still_running == ["drafter0"]


def test_a_long_warm_up_is_not_a_stall():
    class SlowWarmUp(ToyDrafter):
        def warm_up(self):
            time.sleep(1.5)  # compiling, say: longer than the stall timeout below

    config = PipelineConfig([CPU], [CPU], 2, stall_timeout_s=0.5)
    pipeline = Pipeline(config, [ToyTarget(CPU)], [SlowWarmUp(CPU)], make_batches(8), start_step=0,
                        max_steps=4)
    assert pipeline.run().steps_done == 4


def test_requested_stop_ends_at_a_step_boundary_without_a_partial_step():
    per_step, clip = 3, 1.0
    batches = make_batches(100 * per_step)

    def stop_at_third(report):
        if report.step == 3:
            pipeline.request_stop()

    pipeline = build([CPU] * 2, [CPU] * 2, per_step, 100, batches=batches, on_step=stop_at_third,
                     drafter_options={"delay_s": 0.005})
    result = pipeline.run()

    # Replica 1 may have finished all of step 4 before it saw the request; a step counts only when complete.
    assert result.stopped and result.steps_done in (3, 4)
    expected, _ = reference_parameters(batches, per_step, result.steps_done, clip)
    for got, want in zip(pipeline.drafters[0].trainable_parameters(), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_replicas_identical(pipeline)


def test_a_reason_from_the_polled_stop_ends_the_run_at_a_step_boundary(capsys):
    reasons = []

    def ask_at_third(report):
        if report.step == 3:
            reasons.append("TEST")

    pipeline = build([CPU], [CPU], 2, 1000, on_step=ask_at_third, drafter_options={"delay_s": 0.005})
    result = pipeline.run(stop=lambda: reasons[0] if reasons else None)
    assert result.stopped and 3 <= result.steps_done < 1000
    assert "pipeline: TEST: stopping at the next step boundary" in capsys.readouterr().err


def test_a_keyboard_interrupt_while_running_aborts_every_thread():
    """Ctrl-C (or the trainer's second stop signal) lands in the thread running the pipeline: no thread may
    go on working once `run` has raised."""

    def interrupt_at_second(report):
        if report.step == 2:
            _thread.interrupt_main()  # a KeyboardInterrupt in the main thread, as from SIGINT

    pipeline = build([CPU] * 2, [CPU] * 2, 2, 1000, on_step=interrupt_at_second, drafter_options={"delay_s": 0.005})
    with pytest.raises(PipelineError, match="KeyboardInterrupt") as caught:
        pipeline.run()
    assert isinstance(caught.value.error, KeyboardInterrupt) and caught.value.still_running == []
    assert 2 <= pipeline._steps_done < 1000


def run_toy_cli(tmp_path, *args, signal_after_step=None, signals=1):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests' / 'training'}"}
    command = [sys.executable, str(REPO / "tests" / "training" / "pipeline_toys.py"),
               "--checkpoint", str(tmp_path / "ckpt.json"), *args]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if signal_after_step is not None:
        for line in process.stdout:
            if line.startswith(f"step {signal_after_step} "):
                for _ in range(signals):
                    process.send_signal(signal.SIGTERM)
                    time.sleep(0.2)
                break
    stdout, stderr = process.communicate(timeout=120)
    return process.returncode, stdout, stderr


def test_cli_exits_non_zero_with_the_failing_threads_traceback(tmp_path):
    code, _, stderr = run_toy_cli(tmp_path, "--fail-at", "6", "--drafter-delay", "0.001")
    assert code == 1
    assert "error: drafter" in stderr and "ToyFailure: drafter failed on micro-batch 6" in stderr
    assert "in loss" in stderr  # the failing thread's own frames
    assert not (tmp_path / "ckpt.json").exists()


def test_cli_sigterm_finishes_cleanly_with_a_checkpoint(tmp_path):
    code, stdout, _ = run_toy_cli(tmp_path, "--drafter-delay", "0.01", signal_after_step=2)
    assert code == 0
    saved = json.loads((tmp_path / "ckpt.json").read_text())
    assert saved["stopped"] and 2 <= saved["steps_done"] < 1000 and saved["signal"] == signal.SIGTERM
    assert f"saved checkpoint at step {saved['steps_done']}" in stdout


def test_cli_second_sigterm_aborts_without_a_checkpoint(tmp_path):
    # A step takes about 2 s here: the second signal comes while the first one's step is still running.
    code, _, stderr = run_toy_cli(tmp_path, "--drafter-delay", "1.0", signal_after_step=1, signals=2)
    assert code == 130, stderr
    assert "pipeline: SIGTERM: stopping at the next step boundary" in stderr
    assert "KeyboardInterrupt: a second stop signal (SIGTERM): aborting without a checkpoint" in stderr
    assert not (tmp_path / "ckpt.json").exists()


# The real trainer through the pipeline (tiny preset, CPU threads).
THREADS = ['target_devices=["cpu", "cpu"]', 'drafter_devices=["cpu", "cpu"]', "micro_batch_size=2",
           "num_threads=1", "eval_every=0"]


def tiny_args(world, output_dir, *overrides):
    sets = [*world.overrides(output_dir), *THREADS, *overrides]
    return ["--config", "tiny"] + [a for s in sets for a in ("--set", s)]


def read_losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


@pytest.mark.e2e
def test_trainer_resume_with_read_ahead_targets_equals_a_straight_run(tiny_world, tmp_path):
    """Targets read micro-batches ahead of the step being checkpointed: the checkpoint must hold the data
    position of its own step, or the resumed run trains on other batches. One drafter: exact equality."""
    from training.train import main

    args = tiny_args(tiny_world, tmp_path, 'drafter_devices=["cpu"]', "max_steps=8", "save_every=4",
                     "log_every=1", "keep_checkpoints=5", "queue_depth=3")
    assert main(args) == 0
    straight = read_losses(tmp_path / "metrics.jsonl")
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000008")
    (tmp_path / "metrics.jsonl").unlink()
    assert main(args + ["--resume"]) == 0
    resumed = read_losses(tmp_path / "metrics.jsonl")
    assert resumed == {step: straight[step] for step in range(5, 9)}


@pytest.mark.e2e
def test_trainer_thread_failure_exits_non_zero_with_its_traceback(tiny_world, tmp_path):
    inject = (
        "import sys, training.train as t\n"
        "original, calls = t.DrafterReplica.loss, []\n"
        "def failing_loss(self, features, batch):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 7:\n"
        "        raise RuntimeError('injected drafter failure')\n"
        "    return original(self, features, batch)\n"
        "t.DrafterReplica.loss = failing_loss\n"
        "sys.exit(t.main(sys.argv[1:]))\n"
    )
    start = time.monotonic()
    command = [sys.executable, "-c", inject, *tiny_args(tiny_world, tmp_path, "max_steps=1000")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert time.monotonic() - start < 120
    assert "Traceback" in result.stderr and "in failing_loss" in result.stderr
    assert "error: drafter" in result.stderr and "RuntimeError: injected drafter failure" in result.stderr


@pytest.mark.e2e
def test_trainer_sigterm_with_several_threads_saves_and_exits_0(tiny_world, tmp_path):
    command = [sys.executable, "-m", "training.train",
               *tiny_args(tiny_world, tmp_path, "max_steps=100000", "log_every=1", "save_every=100000")]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in process.stdout:
            if line.startswith("step 3/"):
                assert "busy target0" in line and "drafter1" in line and "queue" in line
                process.send_signal(signal.SIGTERM)
                break
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert set(last["busy"]) == {"target0", "target1", "drafter0", "drafter1"}
    assert all(0.0 <= fraction <= 1.0 for fraction in last["busy"].values())
    assert last["queue_depth"]["max"] <= last["queue_depth"]["bound"] == 4
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint is not None and int(checkpoint.name.split("_")[1]) >= last["step"]
    assert "stopped at step" in output


def test_pipeline_bench_runs_in_its_smoke_form(tmp_path):
    """The GPU benchmark's own code, on two CPU "devices" with tiny shapes: it runs and writes its table."""
    command = [sys.executable, str(REPO / "bench" / "pipeline_bench.py"), "--smoke", "--steps", "2",
               "--json", str(tmp_path / "bench.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr
    assert "threaded / serial tokens/s:" in result.stdout
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["threaded"]["tokens_per_s"] > 0
    assert set(report["threaded"]["busy"]) == {"target0", "drafter0"}


def test_gradient_sum_without_clipping_is_the_plain_sum():
    grads = [[torch.full((3,), float(r + 1)), torch.full((2, 2), -float(r))] for r in range(3)]
    summed, norm = sum_and_clip_gradients(grads, [CPU] * 3, None)
    for replica in summed:
        torch.testing.assert_close(replica[0], torch.full((3,), 6.0))
        torch.testing.assert_close(replica[1], torch.full((2, 2), -3.0))
    assert summed[1][0] is not summed[0][0]  # each replica owns its copy
    torch.testing.assert_close(norm, torch.tensor((3 * 36.0 + 4 * 9.0) ** 0.5))



@pytest.mark.parametrize("replicas", [1, 3])
def test_a_step_with_a_nan_loss_updates_nothing_and_the_data_moves_on(replicas):
    """A NaN in one micro-batch of step 3: no replica updates (they stay identical), the step still counts, and
    the result is the run without step 3's micro-batches, exactly as if they were never there."""
    steps, per_step, clip, bad_step = 5, 4, 0.5, 3
    batches = make_batches(steps * per_step)
    batches[(bad_step - 1) * per_step + 1]["y"][0, 0] = float("nan")
    reports: list[StepReport] = []
    pipeline = build([CPU] * 2, [CPU] * replicas, per_step, steps, grad_clip=clip, batches=batches,
                     on_step=reports.append)
    result = pipeline.run()

    assert result.steps_done == steps and [r.step for r in reports] == list(range(1, steps + 1))
    assert [r.skipped for r in reports] == [None, None, "loss (nan)", None, None]
    assert [d.steps for d in pipeline.drafters] == [steps - 1] * replicas  # optimizer steps taken
    kept = batches[: (bad_step - 1) * per_step] + batches[bad_step * per_step:]
    expected, _ = reference_parameters(kept, per_step, steps - 1, clip)
    for got, want in zip(pipeline.drafters[0].trainable_parameters(), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_replicas_identical(pipeline)


def test_a_non_finite_gradient_with_a_finite_loss_is_named():
    class NamedToyDrafter(ToyDrafter):
        def parameter_names(self) -> list[str]:
            return [name for name, _ in self.model.named_parameters()]

    drafters = [NamedToyDrafter(CPU, replica=i) for i in range(2)]
    # The last bias gets an inf gradient in every backward; the loss stays finite. On both replicas: which one
    # takes a step's micro-batches is the threads' timing (under load one replica took both of a step's).
    for drafter in drafters:
        drafter.model[2].bias.register_hook(lambda grad: grad + float("inf"))
    reports: list[StepReport] = []
    pipeline = Pipeline(PipelineConfig([CPU], [CPU] * 2, micro_batches_per_step=2), [ToyTarget(CPU)], drafters,
                        make_batches(6), start_step=0, max_steps=3, on_step=reports.append)
    pipeline.run()

    assert [r.skipped for r in reports] == ["gradient of 2.bias"] * 3
    assert all(math.isfinite(r.loss) for r in reports)
    assert [d.steps for d in drafters] == [0, 0]
    assert_replicas_identical(pipeline)


def test_a_non_finite_gradient_sum_is_left_unclipped():
    grads = [[torch.ones(2), torch.tensor([1.0, float("nan")])], [torch.ones(2), torch.ones(2)]]
    summed, norm = sum_and_clip_gradients(grads, [CPU] * 2, 0.5)
    assert norm.isnan()
    torch.testing.assert_close(summed[0][0], torch.full((2,), 2.0))  # not NaN: the bad one stays findable
    assert summed[1][1][1].isnan() and summed[1][1][0] == 2.0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "target_gpus,drafter_gpus",
    # One shared GPU; NCCL across two; a plain sum on one.
    [([0, 0], [0, 0]), ([0, 1], [0, 1]), ([0, 1], [1, 1])],
)
def test_gpu_replicas_match_single_replica_and_stay_identical(target_gpus, drafter_gpus):
    if torch.cuda.device_count() <= max(target_gpus + drafter_gpus):
        pytest.skip(f"needs {max(target_gpus + drafter_gpus) + 1} CUDA GPUs")
    steps, per_step, clip = 4, 5, 0.5
    batches = make_batches(steps * per_step)
    targets = [torch.device("cuda", i) for i in target_gpus]
    drafters = [torch.device("cuda", i) for i in drafter_gpus]
    pipeline = build(targets, drafters, per_step, steps, grad_clip=clip, batches=batches)
    pipeline.run()
    expected, _ = reference_parameters(batches, per_step, steps, clip, device=torch.device("cuda", 0))
    for got, want in zip(pipeline.drafters[0].trainable_parameters(), expected):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
    assert_replicas_identical(pipeline)


@pytest.mark.gpu
@pytest.mark.e2e
@pytest.mark.parametrize("targets,drafters", [([0, 0], [0, 0]), ([0], [1]), ([0, 1], [0, 1])])
def test_gpu_trainer_through_the_pipeline_compiles_nothing_after_warm_up(tiny_world, tmp_path, targets,
                                                                        drafters):
    """The tiny preset on CUDA (compiled flex, bf16): 2+2 threads sharing one GPU, 1+1 and 2+2 on two."""
    if torch.cuda.device_count() <= max(targets + drafters):
        pytest.skip(f"needs {max(targets + drafters) + 1} CUDA GPUs")
    overrides = [f"target_devices={targets}", f"drafter_devices={drafters}", "max_steps=12", "log_every=4"]
    command = [sys.executable, "-m", "training.train", *tiny_args(tiny_world, tmp_path, *overrides)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "attention flex" in result.stdout and "step 12/12" in result.stdout
    assert " 0 compiles after warm-up" in result.stdout


@pytest.mark.gpu
@pytest.mark.e2e
@pytest.mark.parametrize("devices,topology", [([0], "colocated"), ([0], "1:1"), ([0], "auto"), ([0, 1], "auto")])
def test_gpu_trainer_in_topologies_compiles_nothing_after_warm_up(tiny_world, tmp_path, devices, topology):
    """The tiny preset on CUDA in each topology; auto's trial compiles inside the warm-up, never after it."""
    if torch.cuda.device_count() < len(devices):
        pytest.skip(f"needs {len(devices)} CUDA GPUs")
    sets = [*tiny_world.overrides(tmp_path), f"devices={devices}", f"topology={topology}", "max_steps=12",
            "log_every=4", "eval_every=0", "num_threads=1"]
    command = [sys.executable, "-m", "training.train", "--config", "tiny"] + [a for s in sets for a in ("--set", s)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "attention flex" in result.stdout and "step 12/12" in result.stdout
    assert " 0 compiles after warm-up" in result.stdout and " 0 eager runs" in result.stdout
