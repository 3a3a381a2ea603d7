"""The stand-in host behaves like the Proxmox host the tests stand for (ARCHITECTURE §3-4), through real ssh."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import uuid
from pathlib import Path

import pytest
from tenacity import retry, stop_after_delay, wait_fixed

from tests.cli.conftest import REPO
from tests.sandbox import StandInHost

pytestmark = pytest.mark.sshd


def ssh(standin, command: str) -> subprocess.CompletedProcess:
    """OpenSSH's own client, with HOME in the stand-in's dir: the user's ~/.ssh stays out of it."""
    env = {"PATH": os.environ["PATH"], "HOME": str(standin.root / "home")}
    return subprocess.run(["ssh", "-F", str(standin.ssh_config), "-o", "BatchMode=yes", "gpuctl-standin", command],
                          capture_output=True, text=True, timeout=60, check=False, env=env)


def test_pct_list_status_and_errors(standin, ctid):
    listed = ssh(standin, "pct list")
    assert listed.returncode == 0
    assert listed.stdout.splitlines()[0].split() == ["VMID", "Status", "Lock", "Name"]
    assert any(line.split()[:2] == [str(ctid), "running"] for line in listed.stdout.splitlines())
    assert ssh(standin, f"pct status {ctid}").stdout == "status: running\n"

    missing = ssh(standin, "pct exec 999 -- true")
    assert missing.returncode == 255
    assert missing.stderr.strip() == "Configuration file 'nodes/pve/lxc/999.conf' does not exist"
    assert ssh(standin, f"pct stop {ctid}").returncode == 0
    stopped = ssh(standin, f"pct exec {ctid} -- true")
    assert (stopped.returncode, stopped.stderr.strip()) == (255, f"container '{ctid}' not running!")
    assert ssh(standin, f"pct start {ctid}").returncode == 0


def test_pct_exec_sees_the_container_and_passes_the_exit_code(standin, ctid):
    standin.path_in(ctid, "/workspace/marker").write_text("mine\n")
    result = ssh(standin, f"pct exec {ctid} -- /bin/bash -c 'cat /workspace/marker; echo $PATH; exit 7'")
    assert result.returncode == 7
    marker, path = result.stdout.splitlines()
    assert marker == "mine"
    assert path.endswith(":/sbin:/bin:/usr/sbin:/usr/bin")
    script = ssh(standin, f"pct exec {ctid} -- /bin/bash -s <<'EOF'\necho from-stdin > /tmp/x\nEOF")
    assert script.returncode == 0
    assert standin.path_in(ctid, "/tmp/x").read_text() == "from-stdin\n"


def test_pct_push_and_pull(standin, ctid, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("payload")
    assert ssh(standin, f"pct push {ctid} {src} /workspace/in.txt").returncode == 0
    assert standin.path_in(ctid, "/workspace/in.txt").read_text() == "payload"
    assert ssh(standin, f"pct pull {ctid} /workspace/in.txt {tmp_path}/out.txt").returncode == 0
    assert (tmp_path / "out.txt").read_text() == "payload"


@retry(stop=stop_after_delay(10), wait=wait_fixed(0.1), reraise=True)
def processes_become(standin, ctid, expected: int) -> None:
    assert len(standin.container_processes(ctid)) == expected


def test_only_setsid_with_redirected_streams_survives_the_exec(standin, ctid):
    """The failure that motivated gpuctl: `nohup ... &` dies with the exec session; setsid survives."""
    ssh(standin, f"pct exec {ctid} -- /bin/bash -c 'nohup sleep 300 >/dev/null 2>&1 &'")
    processes_become(standin, ctid, 0)
    pid = standin.start_detached(ctid, "sleep 300")
    processes_become(standin, ctid, 1)
    assert standin.container_processes(ctid) == [pid]
    standin.kill_container_processes(ctid)


@pytest.mark.parametrize("fmt, expected", [
    ("csv,noheader,nounits", "0, NVIDIA H200, 97, 81234, 143771"),
    ("csv", "index, name, utilization.gpu [%], memory.used [MiB], memory.total [MiB]"),
])
def test_nvidia_smi_query(standin, ctid, fmt, expected):
    query = "index,name,utilization.gpu,memory.used,memory.total"
    result = ssh(standin, f"pct exec {ctid} -- nvidia-smi --query-gpu={query} --format={fmt}")
    assert result.stdout.splitlines()[0] == expected
    standin.set_gpus(ctid, [])
    none = ssh(standin, f"pct exec {ctid} -- nvidia-smi")
    assert (none.returncode, none.stdout.strip()) == (6, "No devices were found")


def clean_env(home) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCTL_", "SSH_", "XDG_"))}
    env.update(HOME=str(home), XDG_STATE_HOME=str(home / "state"), PYTHONPATH=str(REPO), NO_COLOR="1")
    return env


def run_with(python: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([python, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          check=False)


def up(python: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """`python -m tests.sandbox up ARGS`; its exports go into env."""
    started = run_with(python, env, "-m", "tests.sandbox", "up", *args)
    assert started.returncode == 0, started.stderr
    env.update(line.removeprefix("export ").split("=", 1) for line in started.stdout.splitlines())
    env.update((k, v.strip("'")) for k, v in list(env.items()) if k.startswith("GPUCTL_"))
    return started


def test_an_interpreter_under_tmp_runs_a_launch_to_its_end(tmp_path):
    """The CLI tests do not depend on where Python lives: with a virtual environment under /tmp (a path the
    container has its own of), the stand-in host still runs a launch to its end."""
    venv = tmp_path / "venv"  # pytest's tmp_path is under /tmp
    assert str(venv).startswith("/tmp/")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # And this interpreter's packages, ahead of those: where it is a virtual environment itself,
    # --system-site-packages gives only the packages of the Python that one was made from.
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], check=True,
                          capture_output=True, text=True).stdout.strip()
    ours = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    Path(site, "test-interpreter.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in ours))
    env = clean_env(tmp_path)
    standin = tmp_path / "standin"
    up(python, env, "--dir", str(standin))
    try:
        launched = run_with(python, env, "-m", "tests.sandbox.cli", "launch", "--python", "fake-trainer", "--set",
                            "fake.steps=2", "--follow")
        assert launched.returncode == 0, launched.stderr
        assert launched.stdout.rstrip().endswith("done, exit 0")
    finally:
        run_with(python, env, "-m", "tests.sandbox", "down", "--dir", str(standin))


def test_up_makes_the_containers_and_gpus_asked_for(tmp_path):
    """`up --containers 2` makes CT 200 and 201; with no fake GPUs (the default, a CPU machine) doctor passes on
    each with the CPU torch the container has; `--gpus 3` gives nvidia-smi three."""
    env = clean_env(tmp_path)
    standin = tmp_path / "standin"
    started = up(sys.executable, env, "--dir", str(standin), "--containers", "2")
    try:
        assert "CT 200, 201 running without GPUs (a CPU machine" in started.stderr
        assert env["GPUCTL_CT"] == "200"
        for ctid in ("200", "201"):
            checked = run_with(sys.executable, env | {"GPUCTL_CT": ctid}, "-m", "gpuctl", "doctor", "--json")
            assert checked.returncode == 0, checked.stdout + checked.stderr
            checks = {c["name"]: c for c in json.loads(checked.stdout)["checks"]}
            assert checks["container"]["detail"] == f"CT {ctid} running"
            assert checks["gpus"]["status"] == "warn" and "shows no GPU" in checks["gpus"]["detail"]
    finally:
        run_with(sys.executable, env, "-m", "tests.sandbox", "down", "--dir", str(standin))
    assert not standin.exists()
    up(sys.executable, env, "--dir", str(standin), "--ct", "300", "--gpus", "3")
    try:
        listed = StandInHost(standin).pct("exec", "300", "--", "nvidia-smi", "-L")
        assert [line.split(":")[0] for line in listed.stdout.splitlines()] == ["GPU 0", "GPU 1", "GPU 2"]
        assert StandInHost(standin).containers() == [300]
    finally:
        run_with(sys.executable, env, "-m", "tests.sandbox", "down", "--dir", str(standin))


@pytest.mark.parametrize("args, said", [
    (["--gpus", "-1"], "--gpus must be 0 to 64, got -1"),
    (["--containers", "0"], "--containers must be 1 to 100, got 0"),
    (["--ct", "abc"], "--ct must be a whole number, got 'abc'"),
])
def test_up_refuses_bad_counts_in_one_line(tmp_path, args, said):
    refused = run_with(sys.executable, clean_env(tmp_path), "-m", "tests.sandbox", "up", "--dir",
                       str(tmp_path / "standin"), *args)
    assert refused.returncode == 2 and said in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "standin").exists()


@pytest.mark.e2e
def test_a_run_writes_nothing_outside_the_standin_dir(gpuctl):
    """A demo-like run (the tiny preset) naming a data_path no machine has: what it writes (the data it builds
    there, the tiny target in HOME's cache, the staged package, the log) lands in the container's own root under
    the stand-in's directory; none of those paths appears on this machine."""
    unique = f"/gpuctl-nonexistent-{uuid.uuid4().hex[:12]}"
    named = [unique, "/workspace", "/root/gpuctl", "/root/.cache/gpuctl", "/run/gpuctl-standin-bin"]
    already = {path for path in named if os.path.lexists(path)}  # a machine's own; the unique one never is
    try:
        result = gpuctl("launch", "--config", "tiny", "--set", f"data_path={unique}/train.jsonl",
                        "--set", "max_steps=2", "--set", "eval_every=0", "--follow", timeout=600)
        assert result.code == 0, result.stderr[-3000:]
        assert [path for path in named if path not in already and os.path.lexists(path)] == []
        # Where they went: the container's root.
        assert gpuctl.path(f"{unique}/train.jsonl").is_file()
        assert gpuctl.path("/root/.cache/gpuctl/tiny-v2/target").is_dir()
        assert gpuctl.path("/workspace/train_tl1.log").is_file()
    finally:
        if os.path.isdir(unique):  # the old stand-in wrote there: leave the machine as it was
            shutil.rmtree(unique)
