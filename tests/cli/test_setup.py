"""gpuctl setup: a virtual environment in the container with the trainer's packages, installed detached like a
run, from a local package source (a wheel directory the test builds: no network), then used by launch."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from gpuctl import requirements
from gpuctl.commands import doctor
from gpuctl.remote import scripts
from gpuctl.requirements import TORCH_CUDA_BUILDS
from tests.cli.conftest import REPO, Gpuctl
from tests.sandbox.wheels import build_wheel

STANDIN_REQ = "gpuctl-standin-req==1.0"  # a requirement no interpreter here has: only its wheel, built below
VENV_PYTHON = "/root/gpuctl/venv/bin/python"


@pytest.fixture
def copy(gpuctl, tmp_path) -> Gpuctl:
    """gpuctl run from a copy of the checkout whose trainer also requires the stand-in requirement."""
    source = tmp_path / "src"
    for folder in ("gpuctl", "templates", "training"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    declared = source / "training" / "requirements.txt"
    declared.write_text(declared.read_text() + f"{STANDIN_REQ}\n")
    return Gpuctl(gpuctl.host, gpuctl.ctid, gpuctl.home, source)


def the_log(g: Gpuctl, number: int) -> str:
    return g.path(f"/workspace/setup_tl{number}.log").read_text()


@pytest.mark.sshd
@pytest.mark.e2e
def test_setup_from_a_local_source_then_nothing_to_install_then_launch_uses_it(copy, standin, tiny_cache):
    standin.set_gpus(copy.ctid, [])  # the image's torch is a CPU build: right for a container without GPUs
    build_wheel(copy.path("/workspace/wheels"), "gpuctl-standin-req", "1.0", "WHERE = 'the stand-in wheel'\n")
    # A config whose report_to names wandb, which this interpreter lacks: setup installs it (a stand-in wheel).
    build_wheel(copy.path("/workspace/wheels"), "wandb", "0.0.1", "WHERE = 'a stand-in wandb'\n")

    first = copy("setup", "--system-site-packages", "--index-url", "/workspace/wheels", "--config", "tiny",
                 "--set", 'report_to=["wandb"]', timeout=300)
    assert first.code == 0, first.stdout[-3000:] + first.stderr
    assert "started tl1 (gpuctl setup, " in first.stderr and "tl1 ended: succeeded, exit 0" in first.stderr
    log = the_log(copy, 1)
    assert first.stdout.startswith(log)  # the log streamed, then doctor's checks
    assert "making the virtual environment /root/gpuctl/venv" in log
    assert "Successfully installed gpuctl-standin-req-1.0 wandb-0.0.1" in log
    assert list(copy.path("/root/gpuctl/venv/lib").glob("python3.*/site-packages/wandb/__init__.py"))
    checks = {line.split()[1]: line.split()[0] for line in first.stdout[len(log):].splitlines()}
    assert checks["python"] == "ok" and checks["packages"] == "ok" and "fail" not in checks.values()
    assert f"{VENV_PYTHON}: Python" in first.stdout and "gpuctl-standin-req 1.0" in first.stdout
    assert copy.path("/root/gpuctl/interpreter").read_text() == f"{VENV_PYTHON}\n"
    installed = list(copy.path("/root/gpuctl/venv/lib").glob("python3.*/site-packages/gpuctl_standin_req"))
    assert installed, "the stand-in requirement is not in the environment"
    runs = copy("runs", "--json").json()
    assert [(r["run_id"], r["task"], r["state"]) for r in runs] == [("tl1", "setup", "succeeded")]
    assert runs[0]["log_path"] == "/workspace/setup_tl1.log"

    started = time.monotonic()
    second = copy("setup", "--system-site-packages", "--index-url", "/workspace/wheels", timeout=300)
    assert second.code == 0, second.stdout[-3000:] + second.stderr
    log = the_log(copy, 2)
    assert "virtual environment /root/gpuctl/venv: there already" in log
    assert log.count("installed already: nothing to install") == 2  # torch, then the others
    assert "Successfully installed" not in log and "Collecting" not in log
    assert time.monotonic() - started < 60

    # The next launch, without --python, runs the trainer with the environment's interpreter.
    launched = copy("launch", "--config", "tiny", "--set", "max_steps=2", "--set", "eval_every=0", "--follow",
                    timeout=600)
    assert launched.code == 0, launched.stderr[-3000:]
    assert f"python: {VENV_PYTHON} (made by gpuctl setup)" in launched.stderr
    assert launched.stdout.startswith(f"python {VENV_PYTHON} (")  # the trainer's own word: sys.executable
    record = json.loads(copy.path("/workspace/.gpuctl/tl3.json").read_text())
    assert (record["task"], record["python"], record["exit_code"]) == ("train", VENV_PYTHON, 0)
    assert f"exec {VENV_PYTHON} -m training.train" in copy.path("/root/gpuctl/run.sh").read_text()
    # --python still wins.
    assert copy("launch", "--python", "fake-trainer", "--set", "fake.steps=1", "--follow").code == 0
    assert json.loads(copy.path("/workspace/.gpuctl/tl4.json").read_text())["python"] == "fake-trainer"
    # What the README says gpuctl leaves in the container under /root/gpuctl is there after a setup and launches.
    listed = layout_paths("/root/gpuctl/")
    assert "/root/gpuctl/run.sh" in listed and "/root/gpuctl/venv/" in listed
    gone = [path for path in listed if not os.path.lexists(copy.path(path))]
    assert not gone, f"the README's layout table lists what is not left in the container: {gone}"


def layout_paths(prefix: str) -> list[str]:
    """The paths the README's table "What gpuctl leaves in the container" names in its first column."""
    text = (REPO / "README.md").read_text()
    table = text.split("## What gpuctl leaves in the container", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    return [path for row in rows for path in re.findall(r"`([^`]+)`", row) if path.startswith(prefix)]


@pytest.mark.sshd
def test_setup_that_cannot_install_fails_and_records_nothing(gpuctl, tmp_path):
    """Two GPUs and the image's CPU-only torch: setup wants a CUDA build, which an empty source does not have."""
    gpuctl.path("/workspace/empty").mkdir()
    result = gpuctl("setup", "--system-site-packages", "--index-url", "file:///workspace/empty", timeout=300)
    assert result.code == 1
    log = gpuctl.path("/workspace/setup_tl1.log").read_text()
    assert "the installed torch cannot use the GPUs: 2." in log
    assert "installing: pip install --ignore-installed torch>=2.11 --find-links file:///workspace/empty --no-index" \
        in log
    assert "gpuctl setup: pip could not install torch>=2.11" in log
    assert result.stderr.strip().endswith("gpuctl: error: setup (tl1) did not finish: its log above says why "
                                          "(gpuctl logs --run 1)")
    assert not gpuctl.path("/root/gpuctl/interpreter").exists()
    assert gpuctl.status()["task"] == "setup" and gpuctl.status()["state"] == "failed"
    # A setup is a run, but not one to resume.
    latest = gpuctl("launch", "--resume")
    assert latest.code == 2 and f"no runs in CT {gpuctl.ctid} to resume" in latest.stderr
    named = gpuctl("launch", "--resume", "1")
    assert named.code == 2 and "tl1 is a gpuctl setup, not a training run" in named.stderr


@pytest.mark.sshd
def test_setup_dry_run_sends_nothing(gpuctl):
    result = gpuctl("setup", "--dry-run", "--torch", "torch==2.11.0", "--index-url", "https://mirror/simple",
                    "--index-url", "/wheels", env={"GPUCTL_TRACE": "1"})
    assert result.code == 0, result.stderr
    assert result.stderr.strip().endswith("0 remote commands, sent: nothing; received 0 B")
    assert f"pct exec {gpuctl.ctid} -- /bin/bash -s" in result.stdout
    assert "TORCH=torch==2.11.0\nTORCH_GIVEN=1" in result.stdout
    assert "SOURCES=( --index-url https://mirror/simple --find-links /wheels )" in result.stdout
    assert not gpuctl.path("/workspace/.gpuctl").exists() and not gpuctl.path("/root/gpuctl/venv").exists()


@pytest.mark.sshd
def test_setup_installs_what_the_configs_report_to_needs(gpuctl):
    """--config's report_to (after --set) adds its packages to what setup installs and checks it imports."""
    result = gpuctl("setup", "--dry-run", "--config", "tiny", "--set", 'report_to=["tensorboard", "mlflow"]')
    assert result.code == 0, result.stderr
    assert "REQUIREMENTS=( 'transformers>=4.56' 'safetensors>=0.4' tensorboard mlflow )" in result.stdout
    assert "MODULES=( torch transformers safetensors tensorboard mlflow )" in result.stdout
    plain = gpuctl("setup", "--dry-run", "--config", "tiny")  # the preset asks for none
    assert "REQUIREMENTS=( 'transformers>=4.56' 'safetensors>=0.4' )" in plain.stdout


@pytest.mark.sshd
def test_setup_waits_for_an_active_run(gpuctl):
    assert gpuctl.launch_fake("steps=100000").code == 0
    result = gpuctl("setup")
    assert result.code == 5 and "run tl1 is active" in result.stderr
    assert gpuctl("kill", "--grace", "5").code == 0


@pytest.mark.parametrize("args, expected", [
    (["--venv", "relative"], "--venv must be an absolute path"),
    (["--venv", "/root/my venv"], "--venv must be an absolute path"),
    (["--index-url", "wheels"], "--index-url takes"),
    (["--torch", ""], "--torch takes a pip requirement"),
    (["--set", 'report_to=["tensorboard"]'], "--set is for --config"),
    (["--config", "tiny", "--set", 'report_to=["tb"]'], "report_to takes tensorboard, wandb, mlflow, got 'tb'"),
    (["--config", "tiny", "--set", "report_to=tensorboard"], "report_to must be list, got 'tensorboard'"),
    (["--config", "nosuch"], "no preset named 'nosuch'"),
])
def test_bad_setup_options_are_usage_errors(args, expected, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCTL_", "XDG_"))} | {"HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "gpuctl", "setup", "--host", "h", "--ct", "200", "--dry-run",
                             *args], cwd=REPO, capture_output=True, text=True, check=False, env=env)
    assert result.returncode == 2 and expected in result.stderr and "Traceback" not in result.stderr


def test_setup_picks_the_same_torch_index_as_doctor(tmp_path):
    """setup.sh chooses PyTorch's index in the container, doctor names it in its fix: one table, one answer."""
    script = tmp_path / "setup.sh"
    script.write_text(doctor.setup_script(doctor.SetupOptions(), "python3"))
    versions = ["11.8", "12.4", "12.6", "12.7", "12.8", "12.9", "13.0", "13.2", "14.1"]
    functions = f"eval \"$(sed -n '/^TORCH_CUDA_BUILDS=/p; /^version_ge()/,/^}}/p; /^torch_index()/,/^}}/p' {script})\""
    calls = "; ".join(f"echo \"$(torch_index {v} || echo none)\"" for v in versions)
    found = subprocess.run(["bash", "-c", f"{functions}; {calls}"], capture_output=True, text=True, check=True)
    assert found.stdout.split() == [requirements.torch_index(v) or "none" for v in versions]
    assert len(TORCH_CUDA_BUILDS) >= 2 and "exit 1" not in scripts.render("pct_exec", ctid=200)
