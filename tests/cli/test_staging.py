"""Staging: only files the container lacks travel (bytes counted in the SSH layer); the new package is assembled
beside the current one and switched to atomically, so a stage cut short leaves the old package runnable."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
from pathlib import Path

import pytest
from tenacity import retry, stop_after_delay, wait_fixed

from gpuctl import cli, config_schema
from gpuctl.ui import render
from tests.cli.conftest import REPO, Gpuctl
from tests.sandbox.host import with_fake_keys

pytestmark = pytest.mark.sshd

FAKE = ("--python", "fake-trainer", "--set", "fake.steps=1")


@pytest.fixture
def copy(gpuctl, tmp_path) -> Gpuctl:
    """gpuctl run from a copy of the checkout, so a test can edit the training/ it stages."""
    source = tmp_path / "src"
    for folder in ("gpuctl", "templates", "training"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return Gpuctl(gpuctl.host, gpuctl.ctid, gpuctl.home, source)


@retry(stop=stop_after_delay(20), wait=wait_fixed(0.05), reraise=True)
def ended(g: Gpuctl) -> None:
    assert g.status()["state"] == "succeeded"


def launch(g: Gpuctl) -> tuple[dict, str]:
    """Launch the fake trainer, wait for its end; the launch's staging report and its trace line."""
    result = g("launch", *FAKE, "--json", env={"GPUCTL_TRACE": "1"})
    assert result.code == 0, result.stderr
    ended(g)
    return result.json()["staging"], result.stderr.splitlines()[-1]


def staged_manifest(g: Gpuctl) -> dict[str, str]:
    """The container's current package, hashed here: {name: sha256}."""
    current = g.path("/root/gpuctl/current")
    return {p.relative_to(current).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(current.rglob("*")) if p.is_file() and p.name != ".gpuctl-manifest"}


def test_relaunch_sends_only_the_changed_files(copy):
    first, _ = launch(copy)
    assert first["sent_files"] and len(first["sent_files"]) == first["files"]
    assert first["sent_bytes"] > 10_000

    unchanged, trace = launch(copy)
    assert (unchanged["sent_files"], unchanged["sent_bytes"]) == ([], 0)
    assert unchanged["digest"] == first["digest"]
    assert "files" not in trace.split("sent:")[1]  # the SSH layer wrote no file bytes at all

    metrics = copy.source / "training" / "output" / "metrics.py"
    metrics.write_text(metrics.read_text() + "# edited\n")
    (copy.source / "training" / "target" / "tiny.py").unlink()
    one, trace = launch(copy)
    assert one["sent_files"] == ["training/output/metrics.py"]
    assert 0 < one["sent_bytes"] < first["sent_bytes"] / 5
    assert f"files {one['sent_bytes']} B" in trace  # what the SSH layer counted
    assert copy.path("/root/gpuctl/training/output/metrics.py").read_text().endswith("# edited\n")
    assert not copy.path("/root/gpuctl/training/target/tiny.py").exists()  # removed here, removed there
    assert staged_manifest(copy) == {name: line.split()[0] for line in
                                     copy.path("/root/gpuctl/current/.gpuctl-manifest").read_text().splitlines()
                                     for name in [line.split("  ", 1)[1]]}
    assert [p.name for p in copy.path("/root/gpuctl").glob(".pkg.*")] == [
        os.readlink(copy.path("/root/gpuctl/current"))]  # the old packages are gone


def test_interrupted_stage_leaves_the_old_package_runnable(copy, standin):
    launch(copy)
    stage = copy.path("/root/gpuctl")
    before_link, before = os.readlink(stage / "current"), staged_manifest(copy)
    (copy.source / "training" / "big.bin").write_bytes(os.urandom(24 << 20))  # takes a while to send

    launcher = copy.popen("launch", *FAKE)

    @retry(stop=stop_after_delay(60), wait=wait_fixed(0.005), reraise=True)
    def receiving() -> None:
        assert list(stage.glob(".pkg.*.tgz"))

    receiving()
    os.kill(launcher.pid, signal.SIGSTOP)  # mid-transfer
    try:
        assert standin.drop_connections(launcher.pid)
    finally:
        os.kill(launcher.pid, signal.SIGCONT)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 3, err

    assert os.readlink(stage / "current") == before_link
    assert staged_manifest(copy) == before  # every file as it was, big.bin nowhere
    ran = standin.pct("exec", str(copy.ctid), "--", "/root/gpuctl/run.sh")  # the old package still runs
    assert ran.returncode == 0 and ran.stdout.rstrip().endswith("done, exit 0"), ran.stderr

    (copy.source / "training" / "big.bin").unlink()
    again, _ = launch(copy)
    assert again["sent_bytes"] == 0  # the container's package is exactly the old one
    assert not list(stage.glob(".pkg.*.tgz")) and len(list(stage.glob(".pkg.*"))) == 1


def test_progress_bar_for_a_long_transfer_never_with_json(copy, standin, monkeypatch, capsys):
    """In-process, with stderr taken for a terminal and 'a moment' shortened to nothing."""
    monkeypatch.setattr(render, "PROGRESS_AFTER_S", 0.0)
    for key, value in copy.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("TTY_INTERACTIVE", "1")
    monkeypatch.chdir(copy.source)
    monkeypatch.setattr("gpuctl.paths.SOURCE_ROOT", Path(copy.source))
    bundled = config_schema.load_schema  # the stand-in trainer's fake.* keys, as tests.sandbox.cli gives them
    monkeypatch.setattr(config_schema, "load_schema", lambda: with_fake_keys(bundled()))
    assert cli.run(["launch", *FAKE]) == 0
    err = capsys.readouterr().err
    assert "staging" in err and "KiB" in err
    ended(copy)

    (copy.source / "training" / "output" / "metrics.py").write_text("# changed\n")
    assert cli.run(["launch", *FAKE, "--json"]) == 0
    out, err = capsys.readouterr()
    assert "staging" not in err and out.startswith("{")
