"""Checkpoints: old ones are deleted only after the new one is complete on disk; one that cannot be written
leaves nothing of itself and every earlier one as it was."""

from __future__ import annotations

import errno
import hashlib
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.durable import writer_tag
from training.model.drafter import Drafter, DrafterConfig
from training.output import checkpoint
from training.output.checkpoint import (
    CheckpointWriteError,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG = DrafterConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                       rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       vocab_size=50, num_layers=2, num_features=3, block_size=4, target_layers=[1, 2, 3],
                       mask_token_id=49, num_target_layers=6, max_position_embeddings=128)


def make_training_state():
    torch.manual_seed(0)
    drafter = Drafter(CONFIG, torch.randn(50, 32), torch.randn(50, 32))
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()  # the optimizer's state exists, as in any checkpoint after a step
    scheduler.step()
    return drafter, optimizer, scheduler


def save(out: Path, step: int, keep: int = 2) -> Path:
    drafter, optimizer, scheduler = make_training_state()
    return save_checkpoint(out, step, drafter, optimizer, scheduler, {"seed": 0, "epoch": 0, "position": step},
                           {"note": "test"}, keep)


def fingerprint(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_keep_deletes_an_old_checkpoint_only_after_the_new_one_is_complete_on_disk(tmp_path, monkeypatch):
    save(tmp_path, 1)
    save(tmp_path, 2)
    events = []
    real_replace, real_fsync, real_rmtree = checkpoint.os.replace, checkpoint.fsync_path, checkpoint.shutil.rmtree

    def replace(src, dst):
        events.append(("rename", Path(dst).name))
        real_replace(src, dst)

    def fsync(path):
        events.append(("fsync", Path(path).name))
        real_fsync(path)

    def rmtree(path, *args, **kwargs):
        if checkpoint.STEP_DIR.match(Path(path).name):
            new = Path(path).parent / "step_00000003"
            assert checkpoint.FILES == tuple(f for f in checkpoint.FILES if (new / f).is_file())
            events.append(("delete", Path(path).name))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    monkeypatch.setattr(checkpoint, "fsync_path", fsync)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    save(tmp_path, 3)

    # Every file and the new directory fsynced, renamed into place, the rename fsynced: then the deletion.
    assert events[-3:] == [("rename", "step_00000003"), ("fsync", "checkpoints"), ("delete", "step_00000001")]
    temporary = f".tmp-{writer_tag()}-step_00000003"  # named by its writer: host and pid
    assert {name for kind, name in events[:-3] if kind == "fsync"} >= {*checkpoint.FILES, temporary}
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]


def test_the_same_step_written_again_replaces_the_old_one_only_once_the_new_one_is_in_place(tmp_path,
                                                                                           monkeypatch):
    first = save(tmp_path, 5)
    before = fingerprint(first)
    drafter, optimizer, scheduler = make_training_state()
    with torch.no_grad():
        next(p for p in drafter.parameters() if p.requires_grad).add_(1.0)
    deleted, real_rmtree = [], checkpoint.shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path).name.startswith(".stale-"):  # the old copy goes only once the new one is in its place
            deleted.append(fingerprint(Path(path)) == before and fingerprint(first) != before)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    save_checkpoint(tmp_path, 5, drafter, optimizer, scheduler, {}, {}, 2)
    assert deleted == [True]
    assert fingerprint(first) != before
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000005"]  # no stale copy left


@pytest.mark.parametrize("failing", ["_save_weights", "_save_state", "fsync_path"])
def test_a_checkpoint_that_cannot_be_written_leaves_the_earlier_ones_as_they_were(tmp_path, monkeypatch, failing):
    earlier = [save(tmp_path, 1), save(tmp_path, 2)]
    prints = [fingerprint(path) for path in earlier]

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, failing, disk_full)
    with pytest.raises(CheckpointWriteError) as caught:
        save(tmp_path, 3, keep=1)  # keep=1 would delete both earlier ones after a successful write
    assert str(caught.value) == (f"cannot write the checkpoint {tmp_path}/checkpoints/step_00000003: No space "
                                 "left on device (ENOSPC); the earlier checkpoints are intact")
    assert caught.value.cause.errno == errno.ENOSPC
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    assert [fingerprint(path) for path in earlier] == prints
    monkeypatch.undo()
    drafter, optimizer, scheduler = make_training_state()
    assert load_checkpoint(earlier[-1], drafter, optimizer, scheduler)["step"] == 2


SAVE_ON_A_SMALL_DISK = """
import sys
sys.path.insert(0, {tests!r})
from test_checkpoint import save
from training.output.checkpoint import CheckpointWriteError
for directory in sys.argv[1:]:
    try:
        save(directory, 1)
        print("saved")
    except CheckpointWriteError as err:
        print(err)
"""


def test_real_write_errors_are_named_with_their_cause(tmp_path):
    """A full tmpfs (16 KiB: the weights do not fit) and a read-only one, in a private mount namespace."""
    if not shutil.which("unshare") or subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                                                     capture_output=True, check=False).returncode:
        pytest.skip("needs unshare --mount (root, or user namespaces) for a private tmpfs")
    full, read_only = tmp_path / "full", tmp_path / "ro"
    full.mkdir()
    read_only.mkdir()
    script = SAVE_ON_A_SMALL_DISK.format(tests=str(Path(__file__).parent))
    command = (f"mount -t tmpfs -o size=16k tmpfs {full} && mount -t tmpfs -o ro tmpfs {read_only} && "
               f"{shlex.join([sys.executable, '-c', script, str(full), str(read_only)])} && ls -A {full} {read_only}")
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", command], cwd=REPO,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    intact = "the earlier checkpoints are intact"
    assert lines[:2] == [
        f"cannot write the checkpoint {full}/checkpoints/step_00000001: No space left on device (ENOSPC); {intact}",
        f"cannot write the checkpoint {read_only}/checkpoints/step_00000001: Read-only file system (EROFS); {intact}",
    ]
    assert lines[2:] == [f"{full}:", "checkpoints", "", f"{read_only}:"]  # the temporary directory is gone


# A save killed by SIGKILL at a chosen point (as `gpuctl kill` escalates while the SIGTERM checkpoint is being
# written): the child kills itself there, so the point is exact and no sleep is involved.
KILLED_SAVE = """
import os, signal, sys
from pathlib import Path
from tests.training.test_checkpoint import save
from training.output import checkpoint
out, at = Path(sys.argv[1]), sys.argv[2]
save(out, 1)
save(out, 2)
if at == "writing":  # the new checkpoint's files are half-made in its temporary directory
    checkpoint.fsync_path = lambda path: os.kill(os.getpid(), signal.SIGKILL)
    save(out, 3)
else:  # step 2 written again: killed between moving the old step_2 aside and renaming the new one in
    real = checkpoint.os.replace
    def replace(src, dst):
        real(src, dst)
        os.kill(os.getpid(), signal.SIGKILL)
    checkpoint.os.replace = replace
    save(out, 2)
"""


def killed_save(out: Path, at: str) -> list[str]:
    """What is in the checkpoints directory after a save was SIGKILLed at `at`."""
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(out), at], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == -9, proc.stderr
    return sorted(p.name for p in checkpoint.checkpoints_dir(out).iterdir())


def test_a_save_killed_while_writing_leaves_nothing_after_the_next_save(tmp_path):
    left = killed_save(tmp_path, "writing")
    assert [n for n in left if n.startswith(".tmp-")], left  # what the kill left
    save(tmp_path, 4, keep=3)
    assert sorted(p.name for p in checkpoint.checkpoints_dir(tmp_path).iterdir()) == [
        "step_00000001", "step_00000002", "step_00000004"]


def test_a_save_killed_between_its_renames_puts_the_step_back_at_start(tmp_path):
    left = killed_save(tmp_path, "renaming")
    assert "step_00000002" not in left and [n for n in left if n.startswith(".stale-")], left
    checkpoint.recover_checkpoints(tmp_path)  # what a run does at its start (prepare_output_dir)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]
    assert sorted(p.name for p in checkpoint.checkpoints_dir(tmp_path).iterdir()) == [
        "step_00000001", "step_00000002"]
    state = torch.load(checkpoint.checkpoints_dir(tmp_path) / "step_00000002" / "state.pt", weights_only=True)
    assert state["step"] == 2
