"""`gpuctl launch` on one container: the trainer's (or the regeneration's) run.sh and package, started through
gpuctl.commands.detached; a multi-node launch (gpuctl.commands.nodes) makes each node's the same way."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from gpuctl.address import Address
from gpuctl.commands import detached
from gpuctl.commands.detached import LaunchResult
from gpuctl.commands.options import TASK_MODULES, LaunchOptions, LaunchTask, check_env, completed
from gpuctl.commands.resume import resuming
from gpuctl.commands.session import Notify, Progress
from gpuctl.paths import INTERPRETER_FILE, STAGE_DIR
from gpuctl.remote import scripts
from gpuctl.remote.container import Container
from gpuctl.remote.protocol import LaunchReply
from gpuctl.staging import Package, PackageFile, build_package, file_from_bytes


def launch_values(address: Address, opts: LaunchOptions) -> dict[str, Any]:
    """launch.sh's values for a run of the trainer (or the regeneration), from completed options."""
    fields: dict[str, Any] = {"config": opts.config, "sets": opts.sets, "workdir": opts.workdir}
    if opts.name:
        fields.update(name=opts.name)  # a --retry attempt's record carries it over: --run NAME is its latest
    if opts.resume:
        fields.update(resumed_from=opts.resume)
    if opts.retry:
        fields.update(retries=opts.retry, retry_delay=opts.retry_delay)
    if opts.env:
        fields.update(env=opts.env)  # a --resume of the run sets them again
    if opts.node:
        fields.update(opts.node.record_fields())
    return detached.values(address, opts.task.value, fields, python=opts.python, use_recorded_python=True,
                           log_dir=opts.log_dir, workdir=opts.workdir, keep_compile_cache=opts.keep_compile_cache,
                           replacing=opts.replace,
                           find_address=bool(opts.node and opts.node.rank == 0 and not opts.node.master_addr),
                           run_home=opts.home or "", name=opts.name)


def _package(config_file: Path | None, opts: LaunchOptions) -> Package:
    """The trainer (and local config), this launch's run.sh, and the wrapper."""
    # A regenerate run resumes by running again: the module itself skips every record already written.
    run_sh = scripts.render("run.sh", stage_dir=STAGE_DIR, workdir=opts.workdir, python=opts.python,
                            module=TASK_MODULES[opts.task], config=opts.config, sets=opts.sets,
                            resume=opts.resume is not None and opts.task == LaunchTask.TRAIN,
                            takes_resume=opts.task == LaunchTask.TRAIN,  # a --retry attempt's --resume
                            env=check_env(opts.env), rendezvous=opts.node.rendezvous() if opts.node else [])
    run_file = file_from_bytes("run.sh", run_sh.encode(), 0o755)
    return build_package(config_file).with_files([run_file, detached.wrapper_file()])


def _kept_config(package: Package, opts: LaunchOptions, remote: dict[str, str]) -> Package:
    """A resumed run whose config is a staged file: keep the container's copy (it is not on this machine)."""
    name = opts.config.removeprefix(f"{STAGE_DIR}/")
    if opts.resume is None or name == opts.config or name in package.files:
        return package
    return package.with_files([PackageFile(name, remote.get(name, ""), None)])


def plan_launch(address: Address, opts: LaunchOptions) -> str:
    """What `launch --dry-run` shows: a summary (what would be staged, the command, the log), then the script sent
    to the container and the run.sh it would stage."""
    opts, config_file = completed(opts)
    interpreter = opts.python or f"the one gpuctl setup recorded in {INTERPRETER_FILE}, else python3"
    package = _package(config_file, replace(opts, python=opts.python or "<interpreter>"))
    files = package.files
    run_sh = files["run.sh"].data.decode()
    command = next(line for line in run_sh.splitlines() if line.startswith("exec "))
    command = command.removeprefix("exec ").removesuffix(' "$@"')
    tops = sorted({name.split("/")[0] + ("/" if "/" in name else "") for name in files})
    summary = (f"# gpuctl launch --dry-run: nothing is sent to CT {address.ct} on {address.host}, nothing runs.\n"
               f"# stage:   {', '.join(tops)} in {STAGE_DIR} ({len(files)} files, {package.size} bytes, sha256 "
               f"{package.digest[:12]}; only the files the container lacks travel)\n"
               f"# command: {command}   (in {opts.workdir}; <interpreter>: {interpreter})\n"
               f"# log:     {opts.log_dir.rstrip('/')}/{opts.task.value}_tlN.log (N: one more than any run there)\n"
               "# Below: the script sent on stdin, then the run.sh it stages.\n\n")
    return (summary + detached.shown(address, launch_values(address, opts)) +
            f"# then {STAGE_DIR}/run.sh will be:\n{run_sh}")


def launch(ct: Container, address: Address, opts: LaunchOptions, notify: Notify,
           progress: Progress | None = None) -> LaunchResult:
    """Start a run with checked options (check_launch_options). progress(total bytes) gives the tracker of the
    changed files' transfer."""
    opts, config_file = completed(resuming(ct, opts))
    result = detached.start(ct, launch_values(address, opts), launch_package(opts, config_file), opts.task.value,
                            opts.replace, notify, progress, queue=opts.queue)
    return replace(result, resumed_from=opts.resume)


def launch_package(opts: LaunchOptions, config_file: Path | None) -> detached.PackageFor:
    """The package a launch stages, once the container's report says which interpreter run.sh names."""

    def package(report: LaunchReply) -> Package:
        ran = replace(opts, python=report.python)
        return _kept_config(_package(config_file, ran), ran, report.manifest)

    return package
