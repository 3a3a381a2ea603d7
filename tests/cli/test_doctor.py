"""gpuctl doctor: the trainer's requirements in one place, the checks, and the command against the stand-in host."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from dataclasses import replace

import pytest

from gpuctl import requirements
from gpuctl.commands import doctor
from gpuctl.errors import GpuctlError
from gpuctl.remote.protocol import DoctorReply, Probe, section
from tests.cli.conftest import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def test_the_train_extra_is_the_bundles_requirements():
    """pyproject.toml's [train] extra and training/requirements.txt (what gpuctl setup installs) are one set."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    declared = requirements.read_requirements(REPO / "training" / "requirements.txt")
    assert sorted(r.text for r in declared) == sorted(requirements.parse_requirement(line).text for line in extra)
    assert [r.name for r in declared][:1] == ["torch"]


@pytest.mark.parametrize("line, version, ok", [
    ("torch>=2.11", "2.13.0+cpu", True),
    ("torch>=2.11", "2.10.1", False),
    ("torch>=2.11", "2.11", True),
    ("x>=1.0,<2", "1.9.9", True),
    ("x>=1.0,<2", "2.0.0", False),
    ("x~=1.4", "1.9", True),
    ("x~=1.4", "2.0", False),
    ("x==2.*", "2.7.1", True),
    ("x!=1.5.*", "1.5.2", False),
    ("torch==2.13.0+cu128", "2.13.0+cpu", False),
    ("torch==2.13.0", "2.13.0+cpu", True),
])
def test_versions_against_specifiers(line, version, ok):
    assert requirements.parse_requirement(line).satisfied_by(version) is ok


@pytest.mark.parametrize("line", ["torch >= x", "git+https://x/y", "-r other.txt", "torch; python_version<'3'"])
def test_requirement_lines_are_names_and_specifiers_only(line, tmp_path):
    with pytest.raises(ValueError):
        requirements.parse_requirement(line)
    bad = tmp_path / "requirements.txt"
    bad.write_text(f"torch>=2.11\n{line}\n")
    with pytest.raises(GpuctlError, match="requirements.txt:2"):
        requirements.read_requirements(bad)


@pytest.mark.parametrize("cuda, index", [
    (None, "cpu"), ("13.1", "cu130"), ("12.9", "cu129"), ("12.8", "cu128"), ("12.7", "cu126"), ("12.4", None),
])
def test_torch_index_by_the_drivers_cuda_version(cuda, index):
    found = requirements.torch_index(cuda)
    assert found == (index and f"https://download.pytorch.org/whl/{index}")


def test_package_sources_become_pip_options():
    assert requirements.pip_source_args([]) == []
    assert requirements.pip_source_args(["https://a/simple", "/wheels", "https://b/simple"]) == [
        "--index-url", "https://a/simple", "--extra-index-url", "https://b/simple", "--find-links", "/wheels"]
    assert requirements.pip_source_args(["file:///w", "/v"]) == [
        "--find-links", "file:///w", "--find-links", "/v", "--no-index"]
    for bad in ("wheels", "ftp://x", "/a b", ""):
        with pytest.raises(GpuctlError, match="--index-url"):
            requirements.check_source(bad)


# The checks, from a reply as doctor.sh would give it -----------------------------------------------------

GPUS_CSV = b"0, NVIDIA H200, 0, 1000, 143771\n1, NVIDIA H200, 0, 140000, 143771\n"
SMI = "| NVIDIA-SMI 570.133.20  Driver Version: 570.133.20  CUDA Version: 12.8 |"


def reply(torch: dict | None = None, packages: dict | None = None, version: str = "3.11.7",
          gpus: bytes | None = GPUS_CSV) -> DoctorReply:
    probe = Probe(version=version, executable="/root/gpuctl/venv/bin/python", prefix="/root/gpuctl/venv",
                  packages=packages or {"torch": {"version": "2.13.0+cu128", "error": None},
                                        "transformers": {"version": "5.24.0", "error": None},
                                        "safetensors": {"version": "0.8.0", "error": None}},
                  torch=torch or {"version": "2.13.0+cu128", "cuda": "12.8", "available": True, "device_count": 2},
                  output_dir=None)
    return DoctorReply(python="/root/gpuctl/venv/bin/python", python_from="recorded", python_found=True,
                       probe=probe, probe_error="", active=[], last_run=None, workspace=(500 * 2**30, 2**40),
                       compile_cache_bytes=None, gpus_csv=gpus, smi=SMI)


def statuses(r: DoctorReply) -> dict[str, str]:
    return {c.name: c.status for c in doctor.evaluate(r, requirements.read_requirements())}


def test_checks_of_a_ready_container():
    found = statuses(reply())
    assert set(found.values()) == {"ok", "warn"} and found["gpu_memory"] == "warn"  # GPU 1 is nearly full
    assert {k for k, v in found.items() if v == "warn"} == {"gpu_memory"}


def test_checks_name_what_fails_and_the_fix():
    checks = {c.name: c for c in doctor.evaluate(reply(
        torch={"version": "2.13.0+cpu", "cuda": None, "available": False, "device_count": 0},
        packages={"torch": {"version": "2.13.0+cpu", "error": None},
                  "transformers": {"version": "4.40.0", "error": None},
                  "safetensors": {"version": None, "error": "ModuleNotFoundError: No module named 'safetensors'"}},
        version="3.9.18"), requirements.read_requirements())}
    assert checks["python"].status == "fail" and "3.10 or newer" in checks["python"].detail
    assert checks["packages"].status == "fail" and "gpuctl setup" in checks["packages"].fix
    assert "transformers 4.40.0 is too old" in checks["packages"].detail
    assert "safetensors not installed" in checks["packages"].detail
    assert checks["gpus"].status == "fail" and "a CPU-only build" in checks["gpus"].detail
    assert "https://download.pytorch.org/whl/cu128" in checks["gpus"].fix


def test_a_torch_newer_than_the_driver_is_named():
    found = {c.name: c for c in doctor.evaluate(reply(torch={"version": "2.13.0+cu130", "cuda": "13.0",
                                                              "available": False, "device_count": 0}),
                                                requirements.read_requirements())}
    assert found["gpus"].status == "fail" and found["cuda"].status == "warn"
    assert "newer than the driver supports" in found["cuda"].detail


def test_the_torch_fix_keeps_the_choice_the_last_setup_was_given():
    """After `gpuctl setup --torch 'torch==2.13.0+cpu'`, a plain `gpuctl setup` would replace that torch: the fix
    says to choose again with --torch (from the index for the driver's CUDA)."""
    cpu = {"version": "2.13.0+cpu", "cuda": None, "available": False, "device_count": 0}

    def fixes(r: DoctorReply) -> str:
        return {c.name: c for c in doctor.evaluate(r, requirements.read_requirements())}["gpus"].fix

    chosen = replace(reply(torch=cpu), last_setup={"task": "setup", "torch": "torch==2.13.0+cpu"})
    assert fixes(chosen) == ("gpuctl setup --torch SPEC --index-url https://download.pytorch.org/whl/cu128 (a CUDA "
                             "build the driver runs: the last setup's --torch 'torch==2.13.0+cpu' is not one)")
    plain = "gpuctl setup (installs torch from https://download.pytorch.org/whl/cu128, for the driver's CUDA 12.8)"
    assert fixes(replace(chosen, last_setup={"task": "setup", "torch": None})) == plain
    assert fixes(replace(chosen, python_from="option")) == plain  # --python's interpreter is not setup's


def test_doctor_reply_decodes_the_scripts_sections():
    data = b"".join(section(k, v) for k, v in [
        ("python", b"python3"), ("python_from", b"default"), ("active", b"3"),
        ("active_record", b'{"id": "tl3", "task": "setup"}'), ("last_run", b'{"id": "tl2"}'),
        ("workspace", b"/dev/vda 1000 400 600 40% /workspace"), ("compile_cache", b"4096"), ("python_found", b"1"),
        ("probe_rc", b"1"), ("probe", b""), ("probe_stderr", b"Traceback\nSyntaxError: bad"),
        ("last_setup", b'{"id": "tl1", "task": "setup", "torch": "torch==2.13.0+cpu"}')])
    got = DoctorReply.parse(data)
    assert (got.python, got.python_from, got.workspace, got.compile_cache_bytes) == ("python3", "default",
                                                                                      (600, 1000), 4096)
    assert [r.run_id for r in got.active] == ["tl3"] and got.active[0].task == "setup"
    assert got.last_run == {"id": "tl2"} and got.gpus_csv is None
    assert got.probe is None and got.probe_error == "exit 1: SyntaxError: bad"
    assert got.last_setup == {"id": "tl1", "task": "setup", "torch": "torch==2.13.0+cpu"}


# gpuctl doctor against the stand-in host -----------------------------------------------------------------

def checks_of(result) -> dict[str, dict]:
    return {c["name"]: c for c in result.json()["checks"]}


def lines_of(result) -> dict[str, str]:
    """The human output: a line per check, `STATUS  NAME  DETAIL[; fix: FIX]`."""
    found = {}
    for line in result.stdout.splitlines():
        status, name, rest = line.split(None, 2)
        found[name] = f"{status} {rest}"
    return found


@pytest.mark.sshd
def test_cpu_torch_against_the_standins_gpus_fails_and_passes_without_gpus(gpuctl, standin):
    result = gpuctl("doctor")
    assert result.code == 6, result.stderr
    lines = lines_of(result)
    assert lines["packages"].startswith("ok torch 2.") and "transformers" in lines["packages"]
    assert lines["gpus"].startswith("fail nvidia-smi shows 2 GPUs (NVIDIA H200), but torch ")
    assert "sees none (a CPU-only build); fix: gpuctl setup" in lines["gpus"]
    assert lines["cuda"].startswith("ok driver 570.133.20 (CUDA 12.8)")
    assert result.stderr.strip() == f"gpuctl: error: CT {gpuctl.ctid} is not ready to train: gpus failed (the " \
                                    "fix is on each line)"

    standin.set_gpus(gpuctl.ctid, [])
    passed = gpuctl("doctor")
    assert passed.code == 0, passed.stdout + passed.stderr
    lines = lines_of(passed)
    assert lines["gpus"].startswith("warn nvidia-smi shows no GPU") and "trains on the CPU" in lines["gpus"]
    assert not [line for line in lines.values() if line.startswith("fail")]
    assert passed.stderr == ""


@pytest.mark.sshd
def test_doctor_reads_the_torch_the_last_setup_was_given(gpuctl):
    """The interpreter a setup recorded, given `--torch 'torch==2.13.0+cpu'` (its record says so), against the
    stand-in's two fake GPUs: the fix line keeps the user's --torch instead of a plain `gpuctl setup`."""
    gpuctl.path("/root/gpuctl").mkdir(parents=True, exist_ok=True)
    gpuctl.path("/root/gpuctl/interpreter").write_text("/run/gpuctl-standin-bin/python3\n")
    records = gpuctl.path("/workspace/.gpuctl")
    records.mkdir(parents=True)
    (records / "tl1.json").write_text(json.dumps({"id": "tl1", "task": "setup", "torch": "torch==2.13.0+cpu",
                                                  "index_urls": [], "exit_code": 0}))
    result = gpuctl("doctor", "--json")
    assert result.code == 6, result.stdout + result.stderr
    checks = checks_of(result)
    assert checks["python"]["detail"].endswith("(made by gpuctl setup, recorded in /root/gpuctl/interpreter)")
    assert checks["gpus"]["status"] == "fail" and "a CPU-only build" in checks["gpus"]["detail"]
    assert checks["gpus"]["fix"].startswith("gpuctl setup --torch SPEC --index-url https://download.pytorch.org/")
    assert "the last setup's --torch 'torch==2.13.0+cpu' is not one" in checks["gpus"]["fix"]


@pytest.mark.sshd
def test_an_interpreter_without_the_packages_fails_naming_setup(gpuctl):
    bare = gpuctl.path("/workspace/bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    result = gpuctl("doctor", "--python", "/workspace/bare/bin/python", "--json")
    assert result.code == 6
    checks = checks_of(result)
    assert checks["python"]["status"] == "ok" and checks["python"]["detail"].startswith("/workspace/bare/bin/python")
    assert checks["packages"]["status"] == "fail"
    assert "torch not installed (needs torch>=2.11)" in checks["packages"]["detail"]
    assert checks["packages"]["fix"].startswith("gpuctl setup")
    assert checks["gpus"]["status"] == "fail" and "torch does not import" in checks["gpus"]["detail"]


@pytest.mark.sshd
def test_json_is_one_document_from_one_remote_command(gpuctl, standin):
    standin.set_gpus(gpuctl.ctid, [])
    result = gpuctl("doctor", "--json", env={"GPUCTL_TRACE": "1"})
    assert result.code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["ok"] is True and doc["exit_code"] == 0 and doc["container"]["ctid"] == gpuctl.ctid
    assert [c["name"] for c in doc["checks"]][:5] == ["host", "pct", "container", "python", "packages"]
    assert all(set(c) == {"name", "status", "detail", "fix"} for c in doc["checks"])
    assert all(c["fix"] for c in doc["checks"] if c["status"] != "ok")
    assert " 1 remote commands" in result.stderr.splitlines()[-1]


@pytest.mark.sshd
def test_a_stopped_container_exits_4_and_an_unreachable_host_3(gpuctl, standin):
    assert standin.pct("stop", str(gpuctl.ctid)).returncode == 0
    stopped = gpuctl("doctor")
    assert (stopped.code, stopped.stdout) == (4, "")
    assert stopped.stderr.strip() == f"gpuctl: error: container {gpuctl.ctid} on gpuctl-standin is not running " \
                                     f"(start it: pct start {gpuctl.ctid})"
    doc = gpuctl("doctor", "--json")
    assert doc.code == 4 and doc.json()["exit_code"] == 4
    assert [(c["name"], c["status"]) for c in doc.json()["checks"]] == [("host", "ok"), ("pct", "ok"),
                                                                       ("container", "fail")]

    running_fix = doc.json()["checks"][-1]["fix"]
    assert running_fix == f"pct start {gpuctl.ctid} on the host, or the right --ct"
    missing = gpuctl("doctor", "--ct", "999", "--json")  # no such container: starting it is no fix
    assert missing.code == 4 and "container 999 does not exist" in missing.stderr
    fix = missing.json()["checks"][-1]["fix"]
    assert "pct start" not in fix and "pct list" in fix and "--ct" in fix
    said = gpuctl("doctor", "--ct", "999")  # the one error line names the fix too
    assert said.code == 4 and "pct start" not in said.stdout + said.stderr
    expected = ("gpuctl: error: container 999 does not exist on gpuctl-standin (Configuration file "
                "'nodes/pve/lxc/999.conf' does not exist): pass the right --ct (pct list on the host shows its "
                "containers)")
    assert said.stderr.strip().splitlines() == [expected]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    for extra in ([], ["--json"]):
        unreachable = gpuctl("doctor", "--port", str(closed_port), "--connect-timeout", "2", *extra)
        assert unreachable.code == 3
        assert len(unreachable.stderr.strip().splitlines()) == 1 and "cannot connect" in unreachable.stderr
        if extra:
            assert [(c["name"], c["status"]) for c in unreachable.json()["checks"]] == [("host", "fail")]
        else:
            assert unreachable.stdout == ""
