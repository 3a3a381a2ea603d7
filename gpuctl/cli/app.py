"""gpuctl's commands: parse (the options are declared in gpuctl.cli.options), make one call into
gpuctl.commands for the scope resolved once (one container or a node set), render through the invocation's
Output. Nothing else lives here.

Each command imports what it uses when it runs (the core, Rich, paramiko): `gpuctl --help` and `--version` import
none of it, and a command only its own part (issue 29: a CLI that starts at once).
"""

import functools
import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpuctl import __version__
from gpuctl.address import AddressFlags, config_warnings
from gpuctl.address import resolve as resolve_address
from gpuctl.cli.options import (
    ADDRESS_PARAMS,
    AddressArg,
    Cluster,
    Config,
    Dest,
    DoctorPython,
    DryRun,
    Env,
    Grace,
    IndexUrl,
    Interval,
    JsonOpt,
    KeepCompileCache,
    LaunchFollow,
    LaunchPython,
    LogDir,
    LogNode,
    LogsFollow,
    MasterAddr,
    MasterPort,
    NodeAddresses,
    PlotOutput,
    RawLog,
    Replace,
    Resume,
    Retry,
    RetryDelay,
    RunOpt,
    Sets,
    SetupConfig,
    SetupDryRun,
    SetupPython,
    SetupSets,
    Signal,
    SystemSitePackages,
    Tail,
    Task,
    Torch,
    Venv,
    Watch,
    What,
    WithOptimizer,
    Workdir,
)
from gpuctl.commands.options import PullWhat
from gpuctl.errors import ExitCode, GpuctlError, usage_error
from gpuctl.paths import DEFAULT_VENV
from gpuctl.runs import parse_run_ref, parse_signal

if TYPE_CHECKING:
    from gpuctl.commands.doctor import DoctorReport
    from gpuctl.remote import ssh
    from gpuctl.remote.container import Container
    from gpuctl.ui.output import Output

app = typer.Typer(
    name="gpuctl",
    help="Launch, follow and control training runs inside Proxmox LXC containers over SSH.",
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class Invocation:
    """What one invocation's commands share: where they write, and what their connection costs (GPUCTL_TRACE),
    made when a command first asks for it (with the SSH layer, which --help never needs)."""

    def __init__(self, out: "Output"):
        self.out = out
        self._stats: ssh.Stats | None = None

    @property
    def stats(self) -> "ssh.Stats":
        if self._stats is None:
            from gpuctl.remote import ssh

            self._stats = ssh.Stats()
        return self._stats

    def trace(self) -> str | None:
        """The GPUCTL_TRACE line of a command that had a connection to count; None otherwise."""
        if self._stats is None:
            return None
        from gpuctl.remote import ssh

        return ssh.trace_line(self._stats) if ssh.tracing() else None


def _version(value: bool) -> None:
    if value:
        print(f"gpuctl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="print gpuctl's version and exit")] = False) -> None:
    """Launch, follow and control training runs inside Proxmox LXC containers over SSH."""


def with_address(func: Callable) -> Callable:
    """Add TARGET and the target options to a command; it receives them as one `flags: AddressFlags`, and the
    invocation's Output and Stats as `out` and `stats`."""
    kw = inspect.Parameter.KEYWORD_ONLY
    own = [p.replace(kind=kw) for p in inspect.signature(func).parameters.values()
           if p.name not in ("flags", "stats", "out")]
    added = [inspect.Parameter("target", kw, default=None, annotation=AddressArg)]
    added += [inspect.Parameter(name, kw, default=False if name == "accept_new_host_key" else None,
                                annotation=annotation) for name, annotation in ADDRESS_PARAMS]
    context = inspect.Parameter("ctx", kw, annotation=typer.Context)  # Typer passes it; no option

    @functools.wraps(func)
    def command(ctx: typer.Context, **kwargs):
        flags = AddressFlags(**{p.name: kwargs.pop(p.name) for p in added})
        for line in config_warnings():
            ctx.obj.out.message(line)
        return func(flags=flags, out=ctx.obj.out, stats=ctx.obj.stats, **kwargs)

    params = [context, *added[:1], *own, *added[1:]]
    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


@app.command()
@with_address
def launch(flags: AddressFlags, out: "Output", stats: "ssh.Stats", task: Task = None, config: Config = None,
           set_: Sets = None, python: LaunchPython = None, workdir: Workdir = None, log_dir: LogDir = None,
           keep_compile_cache: KeepCompileCache = False, replace: Replace = False, resume: Resume = None,
           retry: Retry = 0, retry_delay: RetryDelay = 10.0, follow: LaunchFollow = False, dry_run: DryRun = False,
           json_: JsonOpt = False, env: Env = None, node: NodeAddresses = None, cluster_name: Cluster = None,
           master_addr: MasterAddr = None, master_port: MasterPort = None) -> int:
    """Start a training run (or, with --task regenerate, a data regeneration) in the container, detached; print
    its id, pid and log. With --node (or --cluster), one run across several containers: one trainer each."""
    from gpuctl import commands
    from gpuctl.ui import render

    if json_ and follow:
        raise usage_error("--json and --follow cannot be combined (the log goes to stdout)")
    if resume is not None and dry_run:
        raise usage_error("--dry-run cannot show a --resume (the resumed run's record is in the container)")
    scope, resumed = commands.resolve_launch(flags, node, cluster_name, None if resume is None else
                                             parse_run_ref(resume or None), master_addr, master_port)
    opts = scope.checked(commands.LaunchOptions(
        config=config, sets=set_ or [], python=python, workdir=workdir, log_dir=log_dir,
        keep_compile_cache=keep_compile_cache, replace=replace, resume=resumed, task=task, retry=retry,
        retry_delay=retry_delay, env=env or []))
    if dry_run:
        out.write(scope.plan_launch(opts))
        return ExitCode.OK
    progress = None if json_ else (lambda total: render.TransferProgress(out, total, "staging"))
    with scope.connected(stats):
        result = scope.launch(opts, notify=out.message, progress=progress)
        render.launched(out, result, as_json=json_, to_stderr=follow, show_tail=not follow)
        scope.remember(result, warn=out.message)  # after the run is shown: it has started, whatever happens here
        if follow:  # the whole log (node 0's), even when the run already ended during the start check
            return _follow(out, scope.first, result.number, lines=None, offset=0)
    return ExitCode.RUN_FAILED if result.failed else ExitCode.OK


def _follow(out: "Output", ct: "Container", run_number: int, lines: int | None, offset: int | None,
            raw: bool = False) -> int:
    from gpuctl import commands
    from gpuctl.ui import render

    log = out.log_writer(raw)
    try:
        run = commands.follow_log(ct, run_number, lines, log.write, offset=offset, notify=out.message)
    except KeyboardInterrupt:
        raise GpuctlError("detached; the run goes on (gpuctl logs -f follows it again)",
                          ExitCode.INTERRUPTED) from None
    finally:
        log.close()
    render.run_ended(out, run)
    return commands.follow_exit_code(run)


def _raise_first(errors: list[GpuctlError], out: "Output") -> None:
    """The nodes that failed: a line each after the first, which gpuctl exits with."""
    for error in errors[1:]:
        out.error(str(error))
    if errors:
        raise errors[0]


@app.command()
@with_address
def logs(flags: AddressFlags, out: "Output", stats: "ssh.Stats", run: RunOpt = None, tail: Tail = None,
         follow: LogsFollow = False, node: LogNode = None, raw: RawLog = False) -> int:
    """Print a run's log (the latest run's by default); only the log's own lines go to stdout: its bytes as they
    are to a pipe or a file, to a terminal with its control characters made visible (unless --raw)."""
    from gpuctl import commands

    address, number = commands.resolve(flags).log_source(node, parse_run_ref(run))
    with commands.connected(address, stats) as ct:
        if follow:
            return _follow(out, ct, number, lines=tail, offset=None, raw=raw)
        log = out.log_writer(raw)
        try:
            commands.print_log(ct, number, tail, log.write)
        finally:
            log.close()
    return ExitCode.OK


@app.command()
@with_address
def status(flags: AddressFlags, out: "Output", stats: "ssh.Stats", run: RunOpt = None, watch: Watch = False,
           interval: Interval = 2.0, json_: JsonOpt = False) -> int:
    """The container, the run (state, pid, log, progress, loss) and the GPUs; exit 4 if the container is not
    running (after showing that)."""
    from gpuctl import commands

    if watch and json_:
        raise usage_error("--watch is for a terminal; --json gives one document (run it again to refresh)")
    number = parse_run_ref(run)
    scope = commands.resolve(flags)
    with scope.connected(stats, bound_s=commands.BOUND_S, meanwhile=_ready_to_show_status):
        from gpuctl.ui import render  # imported while connecting

        if watch:
            _watch(out, lambda: render.status_renderable(scope.status(number, reconnect=out.message)), interval)
        report = scope.status(number)
    render.status_report(out, report, as_json=json_)
    unreadable = report.unreadable()
    if unreadable:
        raise unreadable
    return ExitCode.OK


def _ready_to_show_status() -> None:
    """What status needs once connected, got ready while the connection is made (mostly a wait for the host):
    its script compiled (jinja2), the renderer and Rich imported."""
    from gpuctl import commands
    from gpuctl.ui import output, render  # noqa: F401 (imported for the table drawn later)

    commands.prepare_status()
    output.visible_console()


def _watch(out: "Output", fetch: Callable[[], Any], interval: float) -> None:
    from gpuctl.ui import render

    try:
        render.watch_status(out, fetch, interval)
    except KeyboardInterrupt:
        raise GpuctlError("stopped watching", ExitCode.INTERRUPTED) from None


@app.command()
@with_address
def plot(flags: AddressFlags, out: "Output", stats: "ssh.Stats", output: PlotOutput, run: RunOpt = None) -> int:
    """Draw a run's loss, tokens/s and τ against step (with the runs it resumed) into an image."""
    from gpuctl import commands
    from gpuctl.ui import plot as plotting  # matplotlib only when asked for

    plotting.check_output(output)
    with commands.connected(resolve_address(flags), stats) as ct:
        history = commands.metrics_history(ct, parse_run_ref(run))
    points, taus = plotting.draw(history, output)
    evaluated = f", τ at {taus} evaluations" if taus else ""
    out.message(f"wrote {output} ({points} points of {history.runs[-1].run_id}{evaluated})")
    return ExitCode.OK


@app.command()
@with_address
def runs(flags: AddressFlags, out: "Output", stats: "ssh.Stats", json_: JsonOpt = False) -> int:
    """Every run in the container: id, state, exit code, start, duration, log size (a multi-node run's: every
    node's, each run with its nodes)."""
    from gpuctl import commands
    from gpuctl.ui import render

    scope = commands.resolve(flags)
    with scope.connected(stats, bound_s=commands.BOUND_S):
        found = scope.runs()
    render.runs(out, found, as_json=json_)
    _raise_first(found.errors, out)
    return ExitCode.OK


@app.command()
@with_address
def kill(flags: AddressFlags, out: "Output", stats: "ssh.Stats", run: RunOpt = None, signal: Signal = "TERM",
         grace: Grace = 30.0) -> int:
    """Signal a run's whole process group, escalate to SIGKILL after --grace, check nothing is left."""
    from gpuctl import commands
    from gpuctl.ui import render

    number, signal_name = parse_run_ref(run), parse_signal(signal)
    scope = commands.resolve(flags)
    with scope.connected(stats, bound_s=commands.BOUND_S + 2 * grace):  # the grace, then SIGKILL's wait
        done = scope.kill(number, signal_name, grace, notify=out.message)
    render.killed(out, done)
    _raise_first(done.errors, out)
    return ExitCode.OK


@app.command()
@with_address
def pull(flags: AddressFlags, out: "Output", stats: "ssh.Stats", dest: Dest = None, run: RunOpt = None,
         what: What = PullWhat.EXPORT, with_optimizer: WithOptimizer = False, json_: JsonOpt = False) -> int:
    """Copy a run's export, newest checkpoint, metrics or regenerated data to DEST over SSH, every file checked by sha256; an
    interrupted pull leaves nothing at DEST, and running it again continues where it stopped."""
    from gpuctl import commands
    from gpuctl.commands import pull as pulling
    from gpuctl.ui import render

    if dest is None:  # one positional argument is DEST, not TARGET
        flags, dest = replace(flags, target=None), flags.target
    if dest is None:
        raise usage_error("missing DEST (see gpuctl pull --help)")
    destination = commands.pull_destination(dest, what, with_optimizer)
    progress = None if json_ else (lambda total: render.TransferProgress(out, total, "pulling"))
    with commands.connected(resolve_address(flags), stats) as ct:
        result = pulling.pull(ct, parse_run_ref(run), what, destination, with_optimizer, notify=out.message,
                               progress=progress)
    render.pull_result(out, result, as_json=json_)
    return ExitCode.OK


@app.command("doctor")
@with_address
def doctor_command(flags: AddressFlags, out: "Output", stats: "ssh.Stats", python: DoctorPython = None,
                   json_: JsonOpt = False) -> int:
    """Check that the container can train: host, pct, container, the interpreter launch would use and its
    packages, the GPUs against torch's, CUDA, free space and GPU memory, an active run. Exit 6 when a check
    fails."""
    from gpuctl import commands
    from gpuctl.commands import doctor
    from gpuctl.ui import render

    if python is not None:
        commands.check_python(python)
    report = doctor.doctor(resolve_address(flags), stats, python)
    render.doctor_report(out, report, as_json=json_)
    _ready(report)
    return ExitCode.OK


@app.command("setup")
@with_address
def setup_command(flags: AddressFlags, out: "Output", stats: "ssh.Stats", python: SetupPython = None,
                  venv: Venv = DEFAULT_VENV, torch: Torch = None, index_url: IndexUrl = None,
                  system_site_packages: SystemSitePackages = False, dry_run: SetupDryRun = False,
                  config: SetupConfig = None, sets: SetupSets = None) -> int:
    """Make the container ready to train: a virtual environment with the trainer's packages (a CUDA build of torch
    for the driver) and those --config's report_to needs, installed detached like a run (its own log; logs -f,
    kill, status), then doctor's checks. Launch uses that environment from then on."""
    from gpuctl import commands
    from gpuctl.address import remember
    from gpuctl.commands import doctor
    from gpuctl.config_schema import report_to_packages
    from gpuctl.ui import render

    if sets and config is None:
        raise usage_error("--set is for --config (setup reads report_to from a training config)")
    opts = doctor.check_setup_options(doctor.SetupOptions(
        python=python, venv=venv, torch=torch, index_urls=index_url or [], system_site_packages=system_site_packages,
        report_packages=report_to_packages(config, sets or []) if config is not None else []))
    address = resolve_address(flags)
    if dry_run:
        out.write(doctor.plan_setup(address, opts))
        return ExitCode.OK
    with commands.connected(address, stats) as ct:
        result = doctor.setup(ct, address, opts, notify=out.message,
                              progress=lambda total: render.TransferProgress(out, total, "staging"))
        render.launch_result(out, result, as_json=False, to_stderr=True, show_tail=False)
        commands.kept(lambda: remember(address), out.message)
        code = _follow(out, ct, result.run.number, lines=None, offset=0)
        if code != ExitCode.OK:
            raise GpuctlError(f"setup ({result.run.run_id}) did not finish: its log above says why (gpuctl logs "
                              f"--run {result.run.number})", code)
        report = commands.reconnecting(ct, lambda: doctor.examine(ct, None), out.message)
    render.doctor_report(out, report, as_json=False)
    _ready(report)
    return ExitCode.OK


def _ready(report: "DoctorReport") -> None:
    """A report whose checks stopped at the host or container (its error), or found a failing check, is the
    exit code."""
    if report.error:
        raise GpuctlError(report.error, report.code)
    if report.failed:
        names = ", ".join(c.name for c in report.failed)
        raise GpuctlError(f"CT {report.ctid} is not ready to train: {names} failed (the fix is on each line)",
                          ExitCode.ENV_NOT_READY)
