"""`gpuctl doctor` and `gpuctl setup`: is the container's Python environment ready to train, and making it so.

doctor runs one script (templates/doctor.sh.j2, one SSH connection) that reports what the container offers, and
makes checks of it here: each ok, warn or fail, with the fix in words. setup installs the trainer's requirements
in a virtual environment, detached like a training run (launch.sh's machinery: the lock, the numbered log, the
record, the wrapper), and records the environment's interpreter where launch and doctor find it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from gpuctl.address import Address
from gpuctl.commands import detached
from gpuctl.commands.detached import LaunchResult
from gpuctl.commands.options import check_python
from gpuctl.commands.session import Notify, Progress, connected
from gpuctl.commands.status import Gpu, parse_gpus
from gpuctl.errors import ExitCode, GpuctlError, usage_error
from gpuctl.paths import DEFAULT_VENV, INTERPRETER_FILE, STAGE_DIR
from gpuctl.remote import scripts, ssh
from gpuctl.remote.container import Container, ContainerNotRunning
from gpuctl.remote.protocol import DoctorReply, LaunchReply
from gpuctl.remote.ssh import ConnectionLost
from gpuctl.requirements import (
    TORCH_CUDA_BUILDS,
    TORCH_INDEX,
    Requirement,
    check_source,
    pip_source_args,
    read_requirements,
    release,
    torch_index,
)
from gpuctl.staging import Package, PackageFile, build_package, file_from_bytes
from gpuctl.timeouts import timeouts

OK, WARN, FAIL = "ok", "warn", "fail"
GIB = 1024**3
DISK_FAIL_BYTES = 1 * GIB  # less free space than this where a run writes: it fails at its first checkpoint
DISK_WARN_BYTES = 20 * GIB  # a long run's checkpoints and logs may not fit
GPU_FREE_WARN = 0.25  # a GPU with less than this share of its memory free is busy with something else
COMPILE_CACHE_WARN_BYTES = 10 * GIB
PROBE_TIMEOUT_S = 300  # importing torch on a cold disk is slow; a hung CUDA initialisation is not
MIN_PYTHON = (3, 10)
SETUP_FIX = "gpuctl setup (a virtual environment with the trainer's packages, which launch then uses)"
DRIVER = re.compile(r"Driver Version:\s*([0-9.]+)")
DRIVER_CUDA = re.compile(r"CUDA Version:\s*([0-9.]+)")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    detail: str
    fix: str = ""

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


@dataclass
class DoctorReport:
    ctid: int
    host: str
    checks: list[Check]
    error: str | None = None  # the one line for exit 3 or 4: the checks stop at the host or the container
    code: ExitCode = ExitCode.OK
    python: str | None = None
    gpus: list[Gpu] = field(default_factory=list)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    def to_json(self) -> dict[str, Any]:
        return {"checks": [c.to_json() for c in self.checks], "ok": self.code == ExitCode.OK,
                "exit_code": int(self.code), "python": self.python, "gpus": [g.to_json() for g in self.gpus],
                "container": {"ctid": self.ctid, "host": self.host}}


# doctor ---------------------------------------------------------------------------------------------------

def doctor(address: Address, stats: ssh.Stats | None, python: str | None) -> DoctorReport:
    """Connect and check; an unreachable host (exit 3) or a container that is missing or stopped (exit 4) ends
    the checks there, with one line of error."""
    try:
        with connected(address, stats, timeouts().command_bound) as ct:
            return examine(ct, python)
    except GpuctlError as e:
        if e.code != ExitCode.HOST:
            raise
        check = Check("host", FAIL, str(e), "check the host's address and port (--host, --port, ~/.ssh/config), "
                      "its key (--accept-new-host-key for a new host) and the login key (--identity)")
        return DoctorReport(address.ct, address.host, [check], error=str(e), code=ExitCode.HOST)


def examine(ct: Container, python: str | None) -> DoctorReport:
    """The checks, over an open connection (doctor's own, or setup's at its end)."""
    checks = [Check("host", OK, f"{ct.session.endpoint.describe()}: reachable, key accepted")]
    required = read_requirements()
    try:
        reply = ct.call("doctor", DoctorReply, "doctor", python=python or "", interpreter_file=INTERPRETER_FILE,
                        stage_dir=STAGE_DIR, modules=json.dumps({r.name: r.module for r in required}),
                        probe_timeout_s=PROBE_TIMEOUT_S)
    except ConnectionLost:
        raise
    except GpuctlError as e:
        if e.code == ExitCode.HOST:  # the host has no pct
            checks.append(Check("pct", FAIL, str(e), "run gpuctl against the Proxmox VE host itself"))
        elif e.code == ExitCode.CONTAINER:
            fix = (f"pct start {ct.ctid} on the host, or the right --ct" if isinstance(e, ContainerNotRunning)
                   else "the right --ct (pct list on the host shows its containers)")  # no such container
            checks += [Check("pct", OK, "present"), Check("container", FAIL, str(e), fix)]
        else:
            raise
        return DoctorReport(ct.ctid, ct.host, checks, error=str(e), code=e.code)
    checks += [Check("pct", OK, "present"), Check("container", OK, f"CT {ct.ctid} running")]
    checks += evaluate(reply, required)
    code = ExitCode.ENV_NOT_READY if any(c.status == FAIL for c in checks) else ExitCode.OK
    return DoctorReport(ct.ctid, ct.host, checks, code=code, python=reply.python, gpus=parse_gpus(reply.gpus_csv))


def evaluate(reply: DoctorReply, required: list[Requirement]) -> list[Check]:
    """The checks of what doctor.sh reported (everything after the host and the container)."""
    gpus = parse_gpus(reply.gpus_csv)
    driver_cuda = _first(DRIVER_CUDA, reply.smi)
    return [
        _python_check(reply),
        _packages_check(reply, required),
        _gpus_check(reply, gpus, driver_cuda),
        *([_cuda_check(reply, driver_cuda), _gpu_memory_check(gpus)] if gpus else []),
        _space_check("workspace", "/workspace", reply.workspace),
        _output_dir_check(reply),
        _active_check(reply),
        _compile_cache_check(reply.compile_cache_bytes, reply.compile_cache_error),
    ]


def _first(pattern: re.Pattern, text: str) -> str | None:
    m = pattern.search(text)
    return m[1] if m else None


def _size(n: float) -> str:
    """Bytes for a check's detail (render.size is a layer above; this one also says TiB, as disks are)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _python_check(reply: DoctorReply) -> Check:
    where = {"option": "--python", "recorded": f"made by gpuctl setup, recorded in {INTERPRETER_FILE}",
             "default": "python3 on the container's PATH"}.get(reply.python_from, reply.python_from)
    if not reply.python_found:
        if reply.python_from == "option":
            return Check("python", FAIL, f"{reply.python} not found in the container",
                         "pass --python PATH of an interpreter in the container, or run gpuctl setup")
        return Check("python", FAIL, f"{reply.python} ({where}) not found in the container", SETUP_FIX)
    probe = reply.probe
    if probe is None:
        return Check("python", FAIL, f"{reply.python} ({where}) did not run: {reply.probe_error}", SETUP_FIX)
    detail = f"{probe.executable or reply.python}: Python {probe.version} ({where})"
    if release(probe.version)[:2] < MIN_PYTHON:
        return Check("python", FAIL, f"{detail}; the trainer needs Python {'.'.join(map(str, MIN_PYTHON))} or "
                     "newer", "gpuctl setup --python PATH (a newer interpreter in the container)")
    return Check("python", OK, detail)


def _packages_check(reply: DoctorReply, required: list[Requirement]) -> Check:
    if reply.probe is None:
        return Check("packages", FAIL, "no interpreter ran to import them", SETUP_FIX)
    found, problems = [], []
    for req in required:
        facts = reply.probe.packages.get(req.name, {})
        version, error = facts.get("version"), facts.get("error")
        if error and not version:
            problems.append(f"{req.name} not installed (needs {req.text})")
        elif error:
            problems.append(f"{req.name} {version} does not import ({error})")
        elif version and not req.satisfied_by(version):
            problems.append(f"{req.name} {version} is too old (needs {req.text})")
        else:
            found.append(f"{req.name} {version or '(version unknown)'}")
    if problems:
        return Check("packages", FAIL, "; ".join(problems), SETUP_FIX)
    return Check("packages", OK, ", ".join(found))


def _gpus_check(reply: DoctorReply, gpus: list[Gpu], driver_cuda: str | None) -> Check:
    torch = reply.probe.torch if reply.probe else None
    if reply.gpus_csv is None:
        seen = "no nvidia-smi in the container"
    elif not gpus:
        said = reply.gpus_csv.decode(errors="replace").strip().splitlines()
        seen = f"nvidia-smi shows no GPU ({said[0] if said else 'no output'})"
    else:
        seen = f"nvidia-smi shows {len(gpus)} GPU{'s' * (len(gpus) != 1)} ({', '.join(sorted({g.name for g in gpus}))})"
    if torch is None:
        if gpus:
            return Check("gpus", FAIL, f"{seen}, but torch does not import", SETUP_FIX)
        return Check("gpus", WARN, f"{seen}: a run would train on the CPU",
                     "pass the GPUs through to the container (its /dev/nvidia* devices and the driver's tools)")
    sees = torch["device_count"] if torch.get("available") else 0
    build = f"torch {torch['version']}"
    if not gpus:
        return Check("gpus", WARN, f"{seen}; {build} trains on the CPU",
                     "pass the GPUs through to the container (its /dev/nvidia* devices and the driver's tools)")
    if sees == 0:
        why = ("a CPU-only build" if torch.get("cuda") is None else
               f"built for CUDA {torch['cuda']}: {torch.get('error') or 'torch.cuda.is_available() is False'}")
        return Check("gpus", FAIL, f"{seen}, but {build} sees none ({why})", _torch_fix(reply, driver_cuda))
    if sees < len(gpus):
        return Check("gpus", WARN, f"{seen}, but {build} sees only {sees}",
                     "check CUDA_VISIBLE_DEVICES in the container's environment")
    return Check("gpus", OK, f"{seen}; {build} sees {sees}")


def _torch_fix(reply: DoctorReply, driver_cuda: str | None) -> str:
    """How to get a torch the driver runs; a setup that was given --torch is told to choose again (a plain
    `gpuctl setup` would replace the user's choice)."""
    index = torch_index(driver_cuda) if driver_cuda else None
    chosen = _setup_torch(reply)
    if chosen is not None:
        source = f"--index-url {index}" if index else "--index-url URL"
        return (f"gpuctl setup --torch SPEC {source} (a CUDA build the driver runs: the last setup's --torch "
                f"{chosen!r} is not one)")
    if index:
        return f"gpuctl setup (installs torch from {index}, for the driver's CUDA {driver_cuda})"
    if driver_cuda:
        return (f"update the NVIDIA driver (its CUDA {driver_cuda} is older than the CUDA builds of torch gpuctl "
                "knows), or gpuctl setup --torch SPEC --index-url URL")
    return "gpuctl setup --torch SPEC --index-url URL (a CUDA build of torch the driver runs)"


def _setup_torch(reply: DoctorReply) -> str | None:
    """The --torch the last gpuctl setup was given, when the interpreter checked is the one it made."""
    if reply.python_from != "recorded" or not reply.last_setup:
        return None
    torch = reply.last_setup.get("torch")
    return torch if isinstance(torch, str) and torch else None


def _cuda_check(reply: DoctorReply, driver_cuda: str | None) -> Check:
    driver = _first(DRIVER, reply.smi)
    torch = reply.probe.torch if reply.probe else None
    torch_cuda = torch.get("cuda") if torch else None
    built = (f"torch built for CUDA {torch_cuda}" if torch_cuda else
             "torch is a CPU-only build" if torch else "no torch")
    if driver is None or driver_cuda is None:
        said = reply.smi.strip().splitlines()
        return Check("cuda", WARN, f"nvidia-smi names no driver ({said[0] if said else 'no output'}); {built}",
                     "check the NVIDIA driver on the host and its tools in the container")
    detail = f"driver {driver} (CUDA {driver_cuda}); {built}"
    if torch_cuda and release(torch_cuda)[:2] > release(driver_cuda)[:2]:
        return Check("cuda", WARN, f"{detail}: newer than the driver supports", _torch_fix(reply, driver_cuda))
    return Check("cuda", OK, detail)


def _gpu_memory_check(gpus: list[Gpu]) -> Check:
    parts, busy = [], []
    for gpu in gpus:
        if gpu.memory_total_mib is None or gpu.memory_used_mib is None:
            parts.append(f"GPU {gpu.index} ?")
            continue
        free = gpu.memory_total_mib - gpu.memory_used_mib
        parts.append(f"GPU {gpu.index} {_size(free * 1024**2)} free of {_size(gpu.memory_total_mib * 1024**2)}")
        if free < GPU_FREE_WARN * gpu.memory_total_mib:
            busy.append(str(gpu.index))
    if busy:
        return Check("gpu_memory", WARN, "; ".join(parts),
                     f"GPU {', '.join(busy)} is mostly in use: nvidia-smi on the host shows by what")
    return Check("gpu_memory", OK, "; ".join(parts))


def _space_check(name: str, path: str, free_total: tuple[int, int] | None, what: str = "") -> Check:
    if free_total is None:
        return Check(name, WARN, f"{path} does not exist", f"mount the storage runs write to at {path}")
    free, total = free_total
    detail = f"{path}{what}: {_size(free)} free of {_size(total)}"
    fix = f"free space in {path} (old checkpoints and logs), or write elsewhere (--set output_dir=...)"
    if free < DISK_FAIL_BYTES:
        return Check(name, FAIL, detail, fix)
    if free < DISK_WARN_BYTES:
        return Check(name, WARN, detail, fix)
    return Check(name, OK, detail)


def _output_dir_check(reply: DoctorReply) -> Check:
    if reply.last_run is None:
        return Check("output_dir", OK, "no training run yet: nothing to check")
    where = reply.probe.output_dir if reply.probe else None
    run = reply.last_run.get("id", "the last run")
    if not where:
        return Check("output_dir", WARN, f"cannot tell where {run} writes: no interpreter ran to read its config",
                     "gpuctl doctor again once the interpreter works")
    if where.get("error") or "free" not in where:
        return Check("output_dir", WARN, f"cannot tell where {run} writes: its config does not load here "
                     f"({where.get('error')})", f"check {run}'s config and --set values (gpuctl status --run {run})")
    return _space_check("output_dir", where["path"], (where["free"], where["total"]), f" ({run}'s output_dir)")


def _active_check(reply: DoctorReply) -> Check:
    if not reply.active:
        return Check("active_run", OK, "no run active")
    runs = ", ".join(f"{r.run_id} ({r.task})" for r in reply.active)
    first = reply.active[0].number
    return Check("active_run", WARN, f"{runs} running: launch and setup wait for it",
                 f"let it end (gpuctl logs -f --run {first}) or stop it (gpuctl kill --run {first})")


def _compile_cache_check(cache: int | None, error: str = "") -> Check:
    if error:
        return Check("compile_cache", WARN, f"/tmp/torchinductor_root: {error}")
    if cache is None:
        return Check("compile_cache", OK, "/tmp/torchinductor_root: none")
    detail = f"/tmp/torchinductor_root: {_size(cache)} (launch removes it unless --keep-compile-cache)"
    if cache > COMPILE_CACHE_WARN_BYTES:
        return Check("compile_cache", WARN, detail, "rm -rf /tmp/torchinductor_root in the container, or launch")
    return Check("compile_cache", OK, detail)


# setup ----------------------------------------------------------------------------------------------------

# The environment's directory: its interpreter's path is recorded as one line and read back by a plain pattern
# (lib.sh's resolve_python), and pip's scripts need a shebang without spaces.
VENV_PATH = re.compile(r"^/[A-Za-z0-9._+@/-]+$")
SETUP_LOG_DIR = "/workspace"


@dataclass
class SetupOptions:
    python: str | None = None  # the interpreter the environment is made from (None: python3)
    venv: str = DEFAULT_VENV
    torch: str | None = None  # a pip requirement for torch instead of the bundle's (and its CUDA choice)
    index_urls: list[str] = field(default_factory=list)  # package sources; none: PyPI, torch from PyTorch's
    system_site_packages: bool = False  # the environment sees the interpreter's packages (an image with torch)
    report_packages: list[str] = field(default_factory=list)  # what --config's report_to needs (tensorboard, ...)


def check_setup_options(opts: SetupOptions) -> SetupOptions:
    if opts.python is not None:
        if not opts.python:
            raise usage_error("--python must not be empty")
        check_python(opts.python)
    venv = opts.venv.rstrip("/") or opts.venv
    if not VENV_PATH.fullmatch(venv) or ".." in venv.split("/") or venv == "/":
        raise usage_error(f"--venv must be an absolute path in the container of letters, digits and ._+@/-, "
                          f"got {opts.venv!r}")
    if opts.torch is not None and (not opts.torch.strip() or any(ord(c) < 32 for c in opts.torch)):
        raise usage_error(f"--torch takes a pip requirement such as 'torch==2.11.0', got {opts.torch!r}")
    return replace(opts, venv=venv, index_urls=[check_source(u) for u in opts.index_urls])


def _setup_values(address: Address, opts: SetupOptions) -> dict[str, Any]:
    fields = {"venv": opts.venv, "torch": opts.torch, "index_urls": opts.index_urls,
              "system_site_packages": opts.system_site_packages, "report_to_packages": opts.report_packages,
              "workdir": "/"}
    return detached.values(address, "setup", fields, python=opts.python, use_recorded_python=False,
                           log_dir=SETUP_LOG_DIR, workdir=SETUP_LOG_DIR, keep_compile_cache=True, replacing=False)


def setup_script(opts: SetupOptions, python: str) -> str:
    """setup.sh: what the detached setup runs in the container, with python the interpreter it starts from."""
    required = read_requirements()
    torch = next((r for r in required if r.key == "torch"), None)
    return scripts.render(
        "setup.sh", python=python, venv=opts.venv, system_site_packages=opts.system_site_packages,
        min_python=".".join(map(str, MIN_PYTHON)), interpreter_file=INTERPRETER_FILE,
        torch_spec=opts.torch or (torch.text if torch else ""), torch_given=opts.torch is not None,
        # report_to's packages import by their own names (tensorboard, wandb, mlflow)
        requirements=[r.text for r in required if r is not torch] + opts.report_packages,
        modules=[r.module for r in required] + opts.report_packages,
        source_args=pip_source_args(opts.index_urls),
        torch_cuda_builds=[(".".join(map(str, version)), f"{TORCH_INDEX}/{tag}") for version, tag in
                           TORCH_CUDA_BUILDS],
        torch_cpu=f"{TORCH_INDEX}/cpu")


def _setup_package(opts: SetupOptions, python: str, remote: dict[str, str]) -> Package:
    """The trainer and setup.sh; the container's run.sh and configs stay as they are (a later --resume needs them)."""
    package = build_package().with_files([file_from_bytes("setup.sh", setup_script(opts, python).encode(), 0o755),
                                          detached.wrapper_file()])
    kept = [PackageFile(name, digest, None) for name, digest in remote.items()
            if name not in package.files and (name == "run.sh" or name.startswith("configs/"))]
    return package.with_files(kept)


def plan_setup(address: Address, opts: SetupOptions) -> str:
    """What `setup --dry-run` shows: the command, the launch script, and the setup script it would start."""
    return (detached.shown(address, _setup_values(address, opts)) +
            f"# then, staged with the trainer and started detached (its log: {SETUP_LOG_DIR}/setup_tlN.log), "
            f"{STAGE_DIR}/setup.sh:\n{setup_script(opts, opts.python or 'python3')}")


def setup(ct: Container, address: Address, opts: SetupOptions, notify: Notify,
          progress: Progress | None = None) -> LaunchResult:
    """Start the installation detached, like a training run (the launch lock, a numbered log, a record with
    task "setup"); the caller follows its log, then checks (examine)."""

    def package(report: LaunchReply) -> Package:
        return _setup_package(opts, report.python or "python3", report.manifest)

    return detached.start(ct, _setup_values(address, opts), package, "setup", False, notify, progress)
