"""Long runs that survive (issue 14), end to end on the tiny preset: non-finite steps skipped and counted, or
stopping the run; checkpoints on a full disk; bad data skipped and counted; out of memory in a stage."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from faults import with_nan_loss

from training.train import TrainExit, main
from training.trainer import Trainer, cosine_schedule

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
SMALL = ["num_threads=1", "eval_every=0"]


def tiny_args(world, output_dir: Path, *overrides: str) -> list[str]:
    sets = [*world.overrides(output_dir), *SMALL, *overrides]
    return ["--config", "tiny"] + [a for s in sets for a in ("--set", s)]


def run_trainer(args: list[str], timeout: int = 180, module: str = "training.train") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, check=False)


def error_line(stderr: str) -> str:
    """The one `error:` line of a run's stderr."""
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def read_metrics(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


# Non-finite steps.


def test_a_nan_step_is_skipped_and_counted_and_the_run_succeeds(tiny_world, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Trainer, "build_pipeline", with_nan_loss(Trainer.build_pipeline, [3]))
    args = tiny_args(tiny_world, tmp_path, "max_steps=6", "log_every=1")
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=3e-3)  # the tiny preset's lr
    schedule = cosine_schedule(optimizer, max_steps=6, warmup_ratio=0.05)
    rates = []
    for _ in range(5):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert main(args) == TrainExit.OK
    err = capsys.readouterr().err
    assert "warning: step 3: non-finite loss (nan): update skipped (1 in a row, max_bad_steps=20)" in err
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert sorted(records) == [1, 2, 3, 4, 5, 6]
    assert "loss" not in records[3] and "grad_norm" not in records[3]  # JSON has no NaN
    assert [records[s]["skipped_steps"] for s in range(1, 7)] == [0, 0, 1, 0, 0, 0]
    assert [records[s]["skipped_steps_total"] for s in range(1, 7)] == [0, 0, 1, 1, 1, 1]
    # Neither did the LR schedule step: the 5 updates took its first 5 rates (a skipped step shows the last one).
    assert [records[s]["lr"] for s in (1, 2, 3, 4, 5, 6)] == [rates[0], rates[1], rates[1], *rates[2:]]
    assert all(records[s]["loss"] > 0 for s in (1, 2, 4, 5, 6))


def test_nan_forever_stops_the_run_with_its_exit_code_and_one_line(tiny_world, tmp_path):
    result = run_trainer([str(list(range(4, 51))), *tiny_args(tiny_world, tmp_path, "max_steps=50", "log_every=1",
                                                             "max_bad_steps=3")], module="tests.training.faults")
    assert result.returncode == TrainExit.NON_FINITE == 3, result.stdout + result.stderr
    assert error_line(result.stderr) == ("error: step 6: non-finite loss (nan); 3 steps in a row skipped "
                                         "(max_bad_steps=3); the weights are those after step 3, the latest "
                                         "checkpoint is intact")
    assert "Traceback" not in result.stderr
    assert max(read_metrics(tmp_path / "metrics.jsonl")) == 6
    assert "done:" not in result.stdout


# Checkpoints on a full disk: the checkpoint directory is a small tmpfs in a private mount namespace.


def private_mounts_or_skip() -> None:
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "true"], capture_output=True,
                           check=False) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("needs unshare --mount (root, or user namespaces) for a private tmpfs")


@pytest.fixture(scope="module")
def checkpoint_bytes(tiny_world, tmp_path_factory) -> int:
    """Bytes of one tiny-preset checkpoint, measured by a 2-step run."""
    out = tmp_path_factory.mktemp("measure")
    assert main(tiny_args(tiny_world, out, "max_steps=2", "save_every=2")) == TrainExit.OK
    return sum(f.stat().st_size for f in (out / "checkpoints" / "step_00000002").iterdir())


def run_on_small_disk(tmp_path: Path, size: int, runs: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Each trainer run in turn, in one private mount namespace whose <tmp_path>/run/checkpoints is a tmpfs of
    `size` bytes; before each run after the first, the tmpfs grows to 64 MiB (space freed). Each run's output,
    exit code and a listing of the checkpoint directory after it come back."""
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    lines = ["set -u", f"mount -t tmpfs -o size={size} tmpfs {checkpoints}"]
    for n, args in enumerate(runs):
        if n:
            lines.append(f"mount -o remount,size=64m {checkpoints}")
        command = shlex.join([sys.executable, "-m", "training.train", *args])
        lines += [f"{command} > {tmp_path}/out{n} 2> {tmp_path}/err{n}; echo $? > {tmp_path}/rc{n}",
                  f"ls -A {checkpoints} > {tmp_path}/ls{n}"]
    subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "bash", "-c", "\n".join(lines)],
                   cwd=REPO, timeout=600, check=True)
    return [subprocess.CompletedProcess(args, int((tmp_path / f"rc{n}").read_text()),
                                        (tmp_path / f"out{n}").read_text(),
                                        (tmp_path / f"err{n}").read_text() + "\nls: " + (tmp_path / f"ls{n}").read_text())
            for n, args in enumerate(runs)]


def test_a_full_disk_stops_the_run_and_the_earlier_checkpoint_resumes_to_the_end(tiny_world, tmp_path,
                                                                                  checkpoint_bytes):
    private_mounts_or_skip()
    # Room for one checkpoint and the next one's weights, not its state.pt (torch.save's failed write).
    size = checkpoint_bytes * 3 // 2
    args = tiny_args(tiny_world, tmp_path / "run", "max_steps=6", "save_every=2", "log_every=1")
    first, resumed = run_on_small_disk(tmp_path, size, [args, args + ["--resume"]])

    checkpoints = tmp_path / "run" / "checkpoints"
    assert first.returncode == TrainExit.CHECKPOINT_WRITE == 4, first.stdout + first.stderr
    assert error_line(first.stderr) == (f"error: cannot write the checkpoint {checkpoints}/step_00000004: "
                                       "No space left on device (ENOSPC); the earlier checkpoints are intact")
    assert "Traceback" not in first.stderr
    assert first.stderr.endswith("ls: step_00000002\n")  # intact, and no temporary directory left
    assert "done:" not in first.stdout

    assert resumed.returncode == TrainExit.OK, resumed.stdout + resumed.stderr
    assert f"resumed from {checkpoints}/step_00000002 at step 2" in resumed.stdout
    assert resumed.stdout.rstrip().endswith("done: 6 steps")
    assert resumed.stderr.endswith("ls: step_00000004\nstep_00000006\n")


def test_warn_goes_on_past_a_checkpoint_it_cannot_write_but_not_past_the_last(tiny_world, tmp_path,
                                                                              checkpoint_bytes):
    private_mounts_or_skip()
    size = checkpoint_bytes * 6 // 5  # room for one checkpoint, not even the next one's weights (safetensors)
    args = tiny_args(tiny_world, tmp_path / "run", "max_steps=6", "save_every=2", "log_every=1",
                     "on_checkpoint_error=warn")
    (result,) = run_on_small_disk(tmp_path, size, [args])

    checkpoints = tmp_path / "run" / "checkpoints"
    assert result.returncode == TrainExit.CHECKPOINT_WRITE, result.stdout + result.stderr
    assert (f"warning: cannot write the checkpoint {checkpoints}/step_00000004: No space left on device (ENOSPC); "
            "the earlier checkpoints are intact; the run goes on (on_checkpoint_error=warn), the next save tries "
            "again") in result.stderr
    assert "step 6/6" in result.stdout  # it went on
    assert error_line(result.stderr) == (f"error: cannot write the checkpoint {checkpoints}/step_00000006: "
                                       "No space left on device (ENOSPC); the earlier checkpoints are intact")
    assert result.stderr.endswith("ls: step_00000002\n")


# Metrics on a full disk: records are left out whole, the run goes on.

METRICS_ON_A_FULL_DISK = """
import json, sys
from pathlib import Path
from training.output.metrics import MetricsLog
disk = Path(sys.argv[1])
log = MetricsLog(disk / "metrics.jsonl", total_steps=9)
pad = "x" * 900  # about 1 KB a record: four fill the file's 4 KiB page, the fifth is cut short by the full disk
for step in range(1, 7):
    log.write(step, pad=pad)
(disk / "filler").unlink()  # room again
log.write(7, pad=pad)
"""


def test_metrics_on_a_full_disk_leave_records_out_whole_and_resume_when_there_is_room(tmp_path):
    private_mounts_or_skip()
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (f"mount -t tmpfs -o size=8k tmpfs {disk} && head -c 4096 /dev/zero > {disk}/filler && "
              f"{shlex.join([sys.executable, '-c', METRICS_ON_A_FULL_DISK, str(disk)])}; rc=$?; "
              f"cp {disk}/metrics.jsonl {tmp_path}/kept; exit $rc")
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "bash", "-c", script],
                            cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == (f"warning: cannot write {disk}/metrics.jsonl: No space left on device; the run goes "
                             "on, its records are left out until there is room (each still prints in the log)\n")
    assert f"{disk}/metrics.jsonl is written again; 2 record(s) were left out" in result.stdout
    assert [line.split()[1] for line in result.stdout.splitlines() if line.startswith("step")] == [
        f"{step}/9" for step in range(1, 8)]  # every record's line printed
    kept = [json.loads(line) for line in (tmp_path / "kept").read_text().splitlines()]  # whole lines only
    assert [record["step"] for record in kept] == [1, 2, 3, 4, 7]


def test_a_run_whose_metrics_cannot_be_written_trains_to_the_end(tiny_world, tmp_path):
    env_args = tiny_args(tiny_world, tmp_path / "run", "max_steps=3", "log_every=1")
    result = subprocess.run([sys.executable, "-m", "training.train", *env_args], cwd=REPO, capture_output=True,
                            text=True, timeout=180, check=False, env={**os.environ, "GPUCTL_METRICS": "/dev/full"})
    assert result.returncode == TrainExit.OK, result.stdout + result.stderr
    assert result.stderr.count("warning: cannot write /dev/full: No space left on device") == 1
    assert "step 3/3" in result.stdout and result.stdout.rstrip().endswith("done: 3 steps")
    assert (tmp_path / "run" / "checkpoints" / "step_00000003").is_dir()


# Bad data.

SHAPE = 'not a {"messages": [{"role", "content"}]} line'


def data_with_bad_lines(world, tmp_path: Path) -> Path:
    """The tiny world's training data with bad lines at 3, 5 and 6 and two too short conversations."""
    good = world.train.read_text().splitlines()
    short = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]})
    lines = good[:2] + ["{not json"] + good[2:3] + ['{"text": "no messages"}', '{"messages": 7}', short, short]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines + good[3:]) + "\n")
    return path


def test_bad_data_stops_the_run_with_file_and_line(tiny_world, tmp_path, capsys):
    data = data_with_bad_lines(tiny_world, tmp_path)
    assert main(tiny_args(tiny_world, tmp_path / "run", f"data_path={data}")) == TrainExit.BAD_INPUT == 2
    assert capsys.readouterr().err.startswith(f"error: {data}:3: {SHAPE} (Expecting property name")


def test_skip_bad_data_skips_and_counts_bad_lines_and_too_short_conversations(tiny_world, tmp_path, capsys):
    from transformers import AutoTokenizer

    from training.data.chat import load_conversations, prepare_sequences

    data = data_with_bad_lines(tiny_world, tmp_path)
    args = tiny_args(tiny_world, tmp_path / "run", f"data_path={data}", "skip_bad_data=true", "max_steps=2")
    assert main(args) == TrainExit.OK
    tokenizer = AutoTokenizer.from_pretrained(tiny_world.target)
    clean = load_conversations(str(tiny_world.train))
    kept = len(prepare_sequences(tokenizer, clean, max_length=96, block_size=8))  # the tiny preset's shapes
    said = capsys.readouterr().out.splitlines()
    lines = [line for line in said if line.startswith("data:")]
    # the mix it trains on, by the records' ids: the tiny world's have no source prefix (a bad line has no id)
    records = sum(bool(line.strip()) for line in data.read_text().splitlines())
    assert [line for line in said if line.startswith("data mix:")] == [f"data mix: other {records:,} (100%)"]
    why = "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    dropped = len(clean) - kept + 2
    assert lines == [f"data: {kept:,} conversations, 3 bad lines skipped (first: {data}:3: {SHAPE} ({why})), "
                     + f"{dropped} too short dropped (under 16 loss tokens, or none with a whole block after it)"]


# Out of memory: torch.OutOfMemoryError raised inside a stage, with several threads of each.

THREADS = ['target_devices=["cpu", "cpu"]', 'drafter_devices=["cpu", "cpu"]', "micro_batch_size=2"]


class OutOfMemoryInBackward(torch.autograd.Function):
    """Passes the loss through; its backward runs out of memory, as a drafter's backward on a GPU can."""

    @staticmethod
    def forward(ctx, loss):
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity")


def pipeline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("target", "drafter"))]


@pytest.mark.parametrize("stage", ["target", "drafter"])
def test_out_of_memory_in_a_stage_stops_every_thread_with_one_line(tiny_world, tmp_path, capsys, monkeypatch,
                                                                 stage):
    from training import train

    calls = []
    if stage == "target":
        features = train.TargetReplica.features

        def out_of_memory(self, batch):
            calls.append(batch)
            if len(calls) == 7:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total")
            return features(self, batch)

        monkeypatch.setattr(train.TargetReplica, "features", out_of_memory)
    else:
        loss = train.DrafterReplica.loss

        def out_of_memory(self, features, batch):
            value, metrics = loss(self, features, batch)
            calls.append(batch)
            return (OutOfMemoryInBackward.apply(value) if len(calls) == 7 else value), metrics

        monkeypatch.setattr(train.DrafterReplica, "loss", out_of_memory)

    start = time.monotonic()
    assert main(tiny_args(tiny_world, tmp_path, *THREADS, "max_steps=1000")) == TrainExit.OUT_OF_MEMORY == 5
    assert time.monotonic() - start < 120
    assert pipeline_threads() == []
    err = capsys.readouterr().err
    assert "Traceback" not in err
    keys = ("lower micro_batch_size (2) or max_length (96, and length_buckets)" if stage == "target" else
            "lower micro_batch_size (2), max_length (96, and length_buckets), num_anchors (8) or loss_chunk_size (256)")
    tried = "2.00 GiB" if stage == "target" else "20.00 MiB"
    assert re.fullmatch(rf"error: out of memory in the {stage} stage \({stage}[01] on cpu\) on a micro-batch of 2 "
                        rf"rows x (64|96) tokens \(length bucket\), 8 anchors \(Tried to allocate {tried}\); "
                        + re.escape(keys), error_line(err)), err
