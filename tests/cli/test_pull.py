"""`gpuctl pull`: a run's export, checkpoint or metrics to the workstation, byte for byte (sha256 checked), never
complete-looking when cut, continued at the byte offset by the next pull; the bytes counted by the SSH layer."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from tenacity import retry, stop_after_delay, wait_fixed

from gpuctl import cli
from gpuctl.errors import GpuctlError
from gpuctl.remote import transfer
from gpuctl.ui import render
from tests.cli.conftest import Gpuctl
from tests.sandbox.forwarder import Forwarder

pytestmark = pytest.mark.sshd

OUT = "/workspace/runs/fake"  # the fake trainer's output_dir (runs/fake under the default workdir)
BIG = 48 << 20  # bytes of drafter.safetensors (and so of the export's model.safetensors) for the cut test


@retry(stop=stop_after_delay(30), wait=wait_fixed(0.05), reraise=True)
def ended(g: Gpuctl, state: str = "succeeded") -> None:
    assert g.status()["state"] == state


def train(g: Gpuctl, *sets: str) -> None:
    """A fake run to its end (checkpoint, export)."""
    assert g.launch_fake(*sets).code == 0
    ended(g)


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def pull(g: Gpuctl, *args: str, env: dict[str, str] | None = None) -> dict:
    result = g("pull", *args, "--json", env=env)
    assert result.code == 0, result.stderr
    return result.json()


def test_pull_brings_the_export_byte_for_byte_and_then_skips_it(gpuctl, tmp_path):
    train(gpuctl, "steps=3", "weights_bytes=300000")
    dest = tmp_path / "models" / "drafter"  # its parent does not exist yet either
    doc = pull(gpuctl, str(dest))
    container = tree(gpuctl.path(f"{OUT}/export"))
    assert tree(dest) == container and set(container) == {"config.json", "model.safetensors"}
    assert (doc["run_id"], doc["what"], doc["source"], doc["export_made_from"], doc["dest"]) == (
        "tl1", "export", f"{OUT}/export", None, str(dest))
    total = sum(map(len, container.values()))
    assert doc["bytes"] == {"total": total, "sent": total, "resumed": 0, "skipped": 0}
    assert {f["name"]: f["sha256"] for f in doc["files"]} == {
        name: hashlib.sha256(data).hexdigest() for name, data in container.items()}
    assert total < doc["received_bytes"] < total + 20_000  # the files, and the script's few sections
    assert not list(dest.parent.glob(".*"))  # no staging left behind

    again = pull(gpuctl, str(dest))  # the same files: nothing travels
    assert again["bytes"] == {"total": total, "sent": 0, "resumed": 0, "skipped": total}
    assert again["received_bytes"] < 5_000

    human = gpuctl("pull", str(dest))
    assert human.code == 0 and human.stdout.startswith("pulled tl1's export (2 files"), human.stderr
    assert "already there" in human.stdout and human.stderr == ""
    assert ": received 0 B, " in human.stdout and "sent" not in human.stdout  # the files came here (issue 39)


def test_a_cut_pull_leaves_nothing_complete_and_the_next_sends_only_the_rest(gpuctl, standin, tmp_path):
    train(gpuctl, "steps=1", f"weights_bytes={BIG}")
    forwarder = Forwarder(standin.port)
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(standin.known_hosts_line(forwarder.port))
    config = tmp_path / "ssh_config"
    config.write_text(standin.ssh_config_entry("through-forwarder", known_hosts, forwarder.port))
    through = {"GPUCTL_SSH_CONFIG": str(config), "GPUCTL_HOST": "through-forwarder"}
    dest = tmp_path / "drafter"
    part = tmp_path / ".drafter.partial" / "model.safetensors.part"
    try:
        puller = gpuctl.popen("pull", str(dest), env=through)

        @retry(stop=stop_after_delay(60), wait=wait_fixed(0.005), reraise=True)
        def receiving() -> None:
            assert part.is_file() and part.stat().st_size > 0

        receiving()
        os.kill(puller.pid, signal.SIGSTOP)  # mid-transfer
        try:
            assert forwarder.cut() == 1
        finally:
            os.kill(puller.pid, signal.SIGCONT)
        _, err = puller.communicate(timeout=60)
    finally:
        forwarder.close()
    assert puller.returncode == 3, err
    assert "Traceback" not in err and "the same pull continues from there" in err
    assert not dest.exists()  # nothing at DEST looks complete
    kept = part.stat().st_size
    assert 0 < kept < BIG

    result = gpuctl("pull", str(dest), "--json", env={"GPUCTL_TRACE": "1"})
    assert result.code == 0, result.stderr
    doc = result.json()
    model = next(f for f in doc["files"] if f["name"] == "model.safetensors")
    assert (model["action"], model["resumed_bytes"], model["sent_bytes"]) == ("resumed", kept, BIG - kept)
    assert doc["bytes"]["sent"] < doc["bytes"]["total"]
    received = int(result.stderr.rsplit("received ", 1)[1].split(" B")[0])  # what the SSH layer read
    assert received == doc["received_bytes"] < BIG - kept + 20_000  # only the rest travelled
    assert tree(dest) == tree(gpuctl.path(f"{OUT}/export"))  # byte for byte
    assert not (tmp_path / ".drafter.partial").exists()


def test_a_killed_run_is_exported_on_demand_once_and_reused(gpuctl, tmp_path):
    """No export (the run was killed): the run's interpreter (the fake stands in for `-m training.export`) makes
    one from the newest checkpoint into <output_dir>/exports/step_N, which the next pull reuses; a checkpoint
    newer than an export makes a new one, and the older one goes."""
    assert gpuctl.launch_fake("steps=100000", "step_s=0.02", "term_exit=0").code == 0

    @retry(stop=stop_after_delay(30), wait=wait_fixed(0.05), reraise=True)
    def stepping() -> None:
        assert (gpuctl.status()["progress"] or {}).get("step", 0) >= 3

    stepping()
    assert gpuctl("kill", "--grace", "20").code == 0
    checkpoint = max(gpuctl.path(f"{OUT}/checkpoints").iterdir())
    assert not gpuctl.path(f"{OUT}/export").exists()

    first = gpuctl("pull", str(tmp_path / "a"), "--json")
    assert first.code == 0, first.stderr
    made = f"{OUT}/exports/{checkpoint.name}"
    assert f"making one from {checkpoint.name}" in first.stderr
    assert (first.json()["export_made_from"], first.json()["source"]) == (f"{OUT}/checkpoints/{checkpoint.name}", made)
    assert tree(tmp_path / "a") == tree(gpuctl.path(made))
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (checkpoint / "drafter.safetensors").read_bytes()

    second = gpuctl("pull", str(tmp_path / "b"), "--json")
    assert second.code == 0 and "making" not in second.stderr, second.stderr
    assert (second.json()["export_made_from"], second.json()["source"]) == (None, made)

    newer = checkpoint.with_name("step_99999999")
    shutil.copytree(checkpoint, newer)
    (newer / "drafter.safetensors").write_bytes(os.urandom(5000))
    third = pull(gpuctl, str(tmp_path / "a"))  # an update of an earlier pull's DEST
    assert third["source"] == f"{OUT}/exports/step_99999999"
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (newer / "drafter.safetensors").read_bytes()
    assert [p.name for p in gpuctl.path(f"{OUT}/exports").iterdir()] == ["step_99999999"]


def test_a_failed_export_is_one_line_and_leaves_nothing(gpuctl, tmp_path):
    train(gpuctl, "steps=2", "export=0")
    gpuctl.path(f"{OUT}/exports").write_text("in the way")  # the exporter cannot write under it
    result = gpuctl("pull", str(tmp_path / "model"))
    assert result.code == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        "gpuctl: error: making the export of step_00000002 in CT ") and "error: writing" in result.stderr
    assert not (tmp_path / "model").exists() and not list(tmp_path.glob(".model*"))


def test_a_runs_own_export_older_than_its_newest_checkpoint_is_not_pulled(gpuctl, tmp_path):
    train(gpuctl, "steps=2")
    checkpoints = gpuctl.path(f"{OUT}/checkpoints")
    # A newer checkpoint (e.g. the run resumed, then killed), written after the export: fresh mtimes.
    shutil.copytree(checkpoints / "step_00000002", checkpoints / "step_00000007", copy_function=shutil.copyfile)
    doc = pull(gpuctl, str(tmp_path / "model"))
    assert (doc["export_made_from"], doc["source"]) == (f"{OUT}/checkpoints/step_00000007",
                                                        f"{OUT}/exports/step_00000007")
    assert gpuctl.path(f"{OUT}/export/config.json").is_file()  # the run's own export stays as it was


def test_pull_checkpoint_weights_only_then_with_the_optimizer(gpuctl, tmp_path):
    train(gpuctl, "steps=4", "save_every=2")
    newest = gpuctl.path(f"{OUT}/checkpoints/step_00000004")
    dest = tmp_path / "ckpt"
    doc = pull(gpuctl, "--what", "checkpoint", str(dest))
    assert doc["source"] == f"{OUT}/checkpoints/step_00000004"
    assert tree(dest) == {name: data for name, data in tree(newest).items() if name != "state.pt"}

    doc = pull(gpuctl, "--what", "checkpoint", "--with-optimizer", str(dest))
    assert {f["name"]: f["action"] for f in doc["files"]} == {
        "config.json": "skipped", "drafter.safetensors": "skipped", "state.pt": "sent"}
    assert tree(dest) == tree(newest)

    wrong = gpuctl("pull", "--with-optimizer", str(tmp_path / "x"))
    assert wrong.code == 2 and "--with-optimizer is for --what checkpoint" in wrong.stderr


def test_pull_metrics_to_a_file_or_into_a_directory(gpuctl, tmp_path):
    train(gpuctl, "steps=3")
    metrics = gpuctl.path("/workspace/.gpuctl/tl1.metrics.jsonl").read_bytes()
    doc = pull(gpuctl, "--what", "metrics", str(tmp_path / "m.jsonl"))
    assert (tmp_path / "m.jsonl").read_bytes() == metrics and doc["bytes"]["sent"] == len(metrics)
    assert [json.loads(line)["step"] for line in metrics.splitlines()] == [1, 2, 3]
    pull(gpuctl, "--what", "metrics", str(tmp_path))
    assert (tmp_path / "tl1.metrics.jsonl").read_bytes() == metrics
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "m.jsonl", "tl1.metrics.jsonl"]
    # DEST ending in a slash is a directory, made if missing (metrics and data are one file each, pulled alike).
    doc = pull(gpuctl, "--what", "metrics", f"{tmp_path / 'new'}/")
    assert doc["dest"] == str(tmp_path / "new") and (tmp_path / "new" / "tl1.metrics.jsonl").read_bytes() == metrics
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["tl1.metrics.jsonl"]
    (tmp_path / "plain").write_text("a file")
    wrong = gpuctl("pull", "--what", "metrics", f"{tmp_path / 'plain'}/")
    assert wrong.code == 2 and "exists and is not a directory" in wrong.stderr


def test_pull_exit_codes(gpuctl, standin, tmp_path):
    dest = str(tmp_path / "model")
    none_yet = gpuctl("pull", dest)
    assert none_yet.code == 2 and "no runs in this container yet" in none_yet.stderr

    train(gpuctl, "steps=0")  # said where its output goes, wrote nothing there
    nothing = gpuctl("pull", dest)
    assert nothing.code == 1 and nothing.stderr.count("\n") == 1, nothing.stderr
    assert f"nothing to pull: tl1 has no export and no checkpoint to make one from in {OUT}" in nothing.stderr
    assert gpuctl("pull", "--what", "checkpoint", dest).code == 1
    assert "tl1 has no metrics yet" in gpuctl("pull", "--what", "metrics", dest).stderr
    data = gpuctl("pull", "--what", "data", dest)
    assert data.code == 1 and "tl1 is a training run: --what data is a regenerate run's output" in data.stderr
    assert not Path(dest).exists()

    unknown = gpuctl("pull", "--run", "9", dest)
    assert unknown.code == 2 and "no run tl9" in unknown.stderr

    a_file = tmp_path / "file"
    a_file.write_text("x")
    for bad in (a_file, a_file / "sub"):
        result = gpuctl("pull", str(bad))
        assert result.code == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result
    assert a_file.read_text() == "x"

    assert standin.pct("stop", str(gpuctl.ctid)).returncode == 0
    stopped = gpuctl("pull", dest)
    assert stopped.code == 4 and "not running" in stopped.stderr
    assert gpuctl("pull", dest, env={"GPUCTL_PORT": "1"}).code == 3


def test_runs_sharing_an_output_dir_never_hand_out_each_others_weights(gpuctl, tmp_path):
    """The fake trainer writes one output_dir for every run (as a user's explicit output_dir): tl2's export
    replaced tl1's, so `pull --run 1` refuses in one line instead of handing out tl2's weights under tl1's name;
    a run that failed at its start (tl3) has nothing of its own either."""
    train(gpuctl, "steps=2")
    train(gpuctl, "steps=2")
    gpuctl.launch_fake("require=/nope")  # exits 3 before any step
    ended(gpuctl, "failed")
    export = json.loads(gpuctl.path(f"{OUT}/export/config.json").read_text())
    assert export["gpuctl"]["home"] == "tl2"  # what the export says of its writer
    for run in ("1", "3"):
        refused = gpuctl("pull", "--run", run, str(tmp_path / f"drafter-tl{run}"))
        assert refused.code == 1 and refused.stderr.count("\n") == 1, refused.stderr
        assert f"{OUT} holds tl2's export, not tl{run}'s: tl{run} has none of its own" in refused.stderr
        assert not (tmp_path / f"drafter-tl{run}").exists()
    doc = pull(gpuctl, "--run", "2", str(tmp_path / "drafter-tl2"))
    assert doc["run_id"] == "tl2" and tree(tmp_path / "drafter-tl2") == tree(gpuctl.path(f"{OUT}/export"))
    checkpoint = gpuctl("pull", "--run", "1", "--what", "checkpoint", str(tmp_path / "ckpt-tl1"))
    assert checkpoint.code == 1 and "holds tl2's checkpoint, not tl1's" in checkpoint.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_pull_into_a_directory_it_cannot_write_is_refused(gpuctl, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    result = gpuctl("pull", str(locked / "model"))
    assert result.code == 2 and "cannot write in" in result.stderr


def test_progress_bar_for_a_long_pull_never_with_json(gpuctl, monkeypatch, capsys, tmp_path):
    """In-process, with stderr taken for a terminal and 'a moment' shortened to nothing."""
    train(gpuctl, "steps=1", "weights_bytes=200000")
    monkeypatch.setattr(render, "PROGRESS_AFTER_S", 0.0)
    for key, value in gpuctl.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("TTY_INTERACTIVE", "1")
    assert cli.run(["pull", str(tmp_path / "a")]) == 0
    out, err = capsys.readouterr()
    assert "pulling" in err and "KiB" in err and out.startswith("pulled tl1's export")

    assert cli.run(["pull", str(tmp_path / "b"), "--json"]) == 0
    out, err = capsys.readouterr()
    assert "pulling" not in err and json.loads(out)["bytes"]["sent"] > 200000


def test_a_second_pull_to_the_same_dest_is_refused_while_the_first_goes_on(gpuctl, tmp_path):
    """Two pulls to one DEST: the second, started while the first is receiving, is refused (exit 5, one line)
    and touches nothing; the first ends with every file, checked."""
    train(gpuctl, "steps=1", f"weights_bytes={BIG}")
    dest = tmp_path / "drafter"
    part = tmp_path / ".drafter.partial" / "model.safetensors.part"
    first = gpuctl.popen("pull", str(dest))

    @retry(stop=stop_after_delay(60), wait=wait_fixed(0.005), reraise=True)
    def receiving() -> None:
        assert part.is_file() and part.stat().st_size > 0

    receiving()
    os.kill(first.pid, signal.SIGSTOP)  # the first holds the staging directory, mid-transfer
    try:
        kept = part.stat().st_size
        second = gpuctl("pull", str(dest))
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, err = first.communicate(timeout=60)
    assert second.code == 5, second.stderr
    assert f"another pull to {dest} is running" in second.stderr and len(second.stderr.splitlines()) == 1
    assert first.returncode == 0, err
    assert tree(dest) == tree(gpuctl.path(f"{OUT}/export"))  # byte for byte: nothing of the second mixed in
    assert not (tmp_path / ".drafter.partial").exists() and kept < BIG


def test_a_staging_directory_that_is_a_link_is_refused(gpuctl, tmp_path):
    """`.DEST.partial` a link to another directory: refused (exit 2), nothing written through it, no DEST."""
    train(gpuctl, "steps=1", "weights_bytes=1000")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / ".drafter.partial").symlink_to(elsewhere)
    result = gpuctl("pull", str(tmp_path / "drafter"))
    assert result.code == 2, result.stderr
    assert "is not a plain directory of yours (a link?)" in result.stderr
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "drafter").exists()


def test_names_where_one_is_a_directory_of_another_are_refused(tmp_path):
    files = [transfer.RemoteFile("a", 1, "0" * 64), transfer.RemoteFile("a/b", 1, "0" * 64)]
    with pytest.raises(GpuctlError, match="offered both 'a' and 'a/b'"):
        transfer.plan(transfer.destination(str(tmp_path / "dest"), directory=True), files)
    assert list(tmp_path.iterdir()) == []


def test_bytes_after_the_last_file_are_counted_not_kept(tmp_path):
    plan = transfer.plan(transfer.destination(str(tmp_path / "dest"), directory=True), [])
    receiver = transfer.Receiver(plan)
    for _ in range(100):
        receiver(b"x" * 100_000)
    plan.release()
    assert receiver.extra == 10_000_000 and len(receiver.trailer) == transfer.TRAILER_CAP


@pytest.mark.e2e
def test_pull_metrics_into_a_directory_brings_the_tensorboard_events(gpuctl, tiny_cache, tmp_path):
    """A tiny run with report_to = ["tensorboard"]: `pull --what metrics DIR/` brings its JSON lines and its event
    files (tensorboard/ in DIR), which TensorBoard's own reader reads back with the logged loss at the logged
    steps; a file DEST takes the JSON lines alone and says where the events stayed."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (scripts/install.sh installs it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    launched = gpuctl("launch", "--config", "tiny", "--set", 'report_to=["tensorboard"]', "--set", "max_steps=4",
                      "--set", "log_every=2", "--set", "eval_every=0", "--follow", timeout=600)
    assert launched.code == 0, launched.stderr[-3000:]
    doc = pull(gpuctl, "--what", "metrics", f"{tmp_path / 'm'}/")
    names = [f["name"] for f in doc["files"]]
    assert names[0] == "tl1.metrics.jsonl" and names[1:] and all(n.startswith("tensorboard/") for n in names[1:])
    logged = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "m" / "tl1.metrics.jsonl").open())}
    assert sorted(logged) == [2, 4]
    events = EventAccumulator(str(tmp_path / "m" / "tensorboard"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("train/loss")} == pytest.approx(logged, rel=1e-6)

    to_file = gpuctl("pull", "--what", "metrics", str(tmp_path / "alone.jsonl"))
    assert to_file.code == 0, to_file.stderr
    assert "TensorBoard event files stay in CT" in to_file.stderr and "(DEST/)" in to_file.stderr
    assert (tmp_path / "alone.jsonl").read_bytes() == (tmp_path / "m" / "tl1.metrics.jsonl").read_bytes()
    assert not (tmp_path / "tensorboard").exists()
