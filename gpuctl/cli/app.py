"""gpuctl's commands: parse (the options are declared in gpuctl.cli.options), make one call into
gpuctl.commands for the scope resolved once (one container or a node set), render through the invocation's
Output. Nothing else lives here.

Each command imports what it uses when it runs (the core, Rich, paramiko): `gpuctl --help` and `--version` import
none of it, and a command only its own part: a CLI that starts at once.
"""

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpuctl import __version__, commands  # commands: each name imported when first used (PEP 562)
from gpuctl.address import AddressFlags, config_warnings, remember
from gpuctl.address import forget as forget_target
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
    Keep,
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
    Queue,
    RawLog,
    RemoveDryRun,
    RemoveRefs,
    Replace,
    Resume,
    Retry,
    RetryDelay,
    RunName,
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
from gpuctl.errors import ExitCode, GpuctlError, usage_error
from gpuctl.paths import DEFAULT_VENV
from gpuctl.runs import PullWhat, parse_run_ref, parse_signal
from gpuctl.timeouts import timeouts

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

    def __init__(self, out: "Output", container_argv: list[str] | None = None):
        self.out = out
        self.container_argv = container_argv  # gpuctl shell's words after `--`
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


def with_address(func: Callable | None = None, *, target: bool = True) -> Callable:
    """Add TARGET and the target options to a command; it receives them as one `flags: AddressFlags`, and the
    invocation's Output and Stats as `out` and `stats`. target=False: the options only (a command whose own
    positional arguments would be read as TARGET: `runs rm N...`)."""
    if func is None:
        return functools.partial(with_address, target=target)
    kw = inspect.Parameter.KEYWORD_ONLY
    given = ("flags", "stats", "out", "container_argv")
    own = [p.replace(kind=kw) for p in inspect.signature(func).parameters.values() if p.name not in given]
    wants_argv = "container_argv" in inspect.signature(func).parameters
    added = [inspect.Parameter("target", kw, default=None, annotation=AddressArg)] if target else []
    added += [inspect.Parameter(name, kw, default=False if name == "accept_new_host_key" else None,
                                annotation=annotation) for name, annotation in ADDRESS_PARAMS]
    context = inspect.Parameter("ctx", kw, annotation=typer.Context)  # Typer passes it; no option

    @functools.wraps(func)
    def command(ctx: typer.Context, **kwargs):
        flags = AddressFlags(**{p.name: kwargs.pop(p.name) for p in added})
        for line in config_warnings():
            ctx.obj.out.message(line)
        timeouts()  # a mistake in config.toml's [timeouts] is exit 2 before anything is sent
        if wants_argv:  # gpuctl shell's words after `--` (gpuctl.cli.run took them out before Click)
            kwargs["container_argv"] = ctx.obj.container_argv
        try:
            return func(flags=flags, out=ctx.obj.out, stats=ctx.obj.stats, **kwargs)
        except KeyboardInterrupt:  # said here: Typer would turn it into a silent exit 130
            raise GpuctlError("interrupted", ExitCode.INTERRUPTED) from None

    params = [context, *added[:1], *own, *added[1:]] if target else [context, *own, *added]
    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


@app.command()
@with_address
def launch(flags: AddressFlags, out: "Output", stats: "ssh.Stats", task: Task = None, config: Config = None,
           set_: Sets = None, python: LaunchPython = None, workdir: Workdir = None, log_dir: LogDir = None,
           keep_compile_cache: KeepCompileCache = False, name: RunName = None, replace: Replace = False,
           queue: Queue = False, resume: Resume = None,
           retry: Retry = 0, retry_delay: RetryDelay = 10.0, follow: LaunchFollow = False, dry_run: DryRun = False,
           json_: JsonOpt = False, env: Env = None, node: NodeAddresses = None, cluster_name: Cluster = None,
           master_addr: MasterAddr = None, master_port: MasterPort = None) -> int:
    """Start a training run (or, with --task regenerate, a data regeneration) in the container, detached; print
    its id, pid and log. With --node (or --cluster), one run across several containers: one trainer each."""
    from gpuctl.ui import render

    if json_ and follow:
        raise usage_error("--json and --follow cannot be combined (the log goes to stdout)")
    if resume is not None and dry_run:
        raise usage_error("--dry-run cannot show a --resume (the resumed run's record is in the container)")
    scope, resumed = commands.resolve_launch(flags, node, cluster_name, None if resume is None else
                                             parse_run_ref(resume or None, "--resume"), master_addr,
                                             master_port)
    opts = scope.checked(commands.LaunchOptions(
        config=config, sets=set_ or [], python=python, workdir=workdir, log_dir=log_dir,
        keep_compile_cache=keep_compile_cache, name=name, replace=replace, queue=queue, resume=resumed, task=task,
        retry=retry, retry_delay=retry_delay, env=env or []))
    if dry_run:
        out.write(scope.plan_launch(opts))
        return ExitCode.OK
    progress = None if json_ else (lambda total: render.TransferProgress(out, total, "staging"))
    with contextlib.ExitStack() as connection:
        try:
            connection.enter_context(scope.connected(stats))
        except KeyboardInterrupt:
            raise GpuctlError("interrupted while connecting: nothing was started", ExitCode.INTERRUPTED) from None
        try:
            result = scope.launch(opts, notify=out.message, progress=progress)
        except commands.Finished as done:  # --resume of a run that did all its steps: said, exit 0, nothing started
            if json_:
                out.json_doc({"run_id": None, "finished": done.run.run_id, "step": done.step})
            raise
        render.launched(out, result, as_json=json_, to_stderr=follow, show_tail=not follow)
        scope.remember(result, warn=out.message)  # after the run is shown: it has started, whatever happens here
        if follow:  # the whole log (node 0's), even when the run already ended during the start check
            return _follow(out, scope.first, result.number, lines=None, offset=0)
    return ExitCode.RUN_FAILED if result.failed else ExitCode.OK


def _follow(out: "Output", ct: "Container", run_number: int, lines: int | None, offset: int | None,
            raw: bool = False) -> int:
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

    if watch and json_:
        raise usage_error("--watch is for a terminal; --json gives one document (run it again to refresh)")
    number = parse_run_ref(run)
    scope = commands.resolve(flags)
    with scope.connected(stats, bound_s=timeouts().command_bound, meanwhile=_ready_to_show_status):
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
    from gpuctl.ui import plot as plotting  # matplotlib only when asked for

    plotting.check_output(output)
    with commands.connected(resolve_address(flags), stats) as ct:
        history = commands.metrics_history(ct, parse_run_ref(run))
    points, taus = plotting.draw(history, output)
    evaluated = f", τ at {taus} evaluations" if taus else ""
    out.message(f"wrote {output} ({points} points of {history.runs[-1].run_id}{evaluated})")
    return ExitCode.OK


class RunsGroup(typer.core.TyperGroup):
    """`gpuctl runs [TARGET] [--json]` lists, as it did when it was a command of its own; `runs rm`, `runs prune`
    remove. Whatever does not start with a subcommand's name (TARGET, an option) is `runs list`'s."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ctx.help_option_names):
            args = ["list", *args]
        return super().parse_args(ctx, args)


runs_app = typer.Typer(cls=RunsGroup, name="runs", rich_markup_mode=None, pretty_exceptions_enable=False,
                       help="Every run in the container (runs list, the default), and removing finished ones "
                            "(runs rm, runs prune).")
app.add_typer(runs_app)


@runs_app.command("list")
@with_address
def runs(flags: AddressFlags, out: "Output", stats: "ssh.Stats", json_: JsonOpt = False) -> int:
    """Every run in the container: id, name, state, exit code, start, duration, log size, the run it resumed, its
    config and --set values (a multi-node run's: every node's, each run with its nodes)."""
    from gpuctl.ui import render

    scope = commands.resolve(flags)
    with scope.connected(stats, bound_s=timeouts().command_bound):
        found = scope.runs()
    render.runs(out, found, as_json=json_)
    _raise_first(found.errors, out)
    return ExitCode.OK


@runs_app.command("rm")
@with_address(target=False)
def runs_rm(flags: AddressFlags, out: "Output", stats: "ssh.Stats", refs: RemoveRefs, dry_run: RemoveDryRun = False,
            json_: JsonOpt = False) -> int:
    """Remove finished runs from the container: each one's log, record, checkpoints and export (a directory
    another run uses too stays). An active run is refused, and then nothing is removed (exit 5)."""
    return _remove(flags, out, stats, [parse_run_ref(ref, "runs rm") for ref in refs], None, dry_run, json_)


@runs_app.command("prune")
@with_address
def runs_prune(flags: AddressFlags, out: "Output", stats: "ssh.Stats", keep: Keep, dry_run: RemoveDryRun = False,
               json_: JsonOpt = False) -> int:
    """Remove every finished run but the newest --keep K finished ones (as runs rm does); active runs stay."""
    return _remove(flags, out, stats, [], keep, dry_run, json_)


def _remove(flags: AddressFlags, out: "Output", stats: "ssh.Stats", refs: list, keep: int | None, dry_run: bool,
            json_: bool) -> int:
    from gpuctl.ui import render

    scope = commands.resolve(flags)
    with scope.connected(stats, bound_s=timeouts().command_bound):
        removed = scope.remove(refs, keep, dry_run)
    render.removed(out, removed, as_json=json_)
    _raise_first(removed.errors, out)  # a multi-node run's nodes that could not remove
    return ExitCode.OK


@app.command()
@with_address
def kill(flags: AddressFlags, out: "Output", stats: "ssh.Stats", run: RunOpt = None, signal: Signal = "TERM",
         grace: Grace = 30.0) -> int:
    """Signal a run's whole process group, escalate to SIGKILL after --grace, check nothing is left."""
    from gpuctl.ui import render

    number, signal_name = parse_run_ref(run), parse_signal(signal)
    scope = commands.resolve(flags)
    with scope.connected(stats, bound_s=timeouts().command_bound + 2 * grace):  # the grace, then SIGKILL's wait
        done = scope.kill(number, signal_name, grace, notify=out.message)
    render.killed(out, done)
    _raise_first(done.errors, out)
    return ExitCode.OK


@app.command()
@with_address
def shell(flags: AddressFlags, out: "Output", stats: "ssh.Stats", container_argv: list[str] | None) -> int:
    """Open a shell in the container, or run one command there: `gpuctl shell [TARGET] -- CMD ARGS`.

    A login bash through the same SSH connection and pct exec as every command, on a pty when gpuctl runs on a
    terminal (raw mode, the window's size; the terminal is given back as it was); from a pipe, plain streams.
    gpuctl exits with the shell's (or the command's) exit status."""
    from gpuctl.commands.shell import shell as open_shell

    if container_argv == []:
        raise usage_error("`--` must be followed by a command (gpuctl shell -- CMD ARGS...)")
    with commands.connected(resolve_address(flags), stats) as ct:
        out.stdout.flush()
        out.stderr.flush()  # what gpuctl said comes before the shell's bytes, which go to the descriptors
        return open_shell(ct, container_argv, sys.stdin.fileno(), out.stdout.fileno(), out.stderr.fileno())


@app.command()
@with_address
def pull(flags: AddressFlags, out: "Output", stats: "ssh.Stats", dest: Dest = None, run: RunOpt = None,
         what: What = PullWhat.EXPORT, with_optimizer: WithOptimizer = False, json_: JsonOpt = False) -> int:
    """Copy a run's export, newest checkpoint, metrics or regenerated data to DEST over SSH, every file checked by sha256; an
    interrupted pull leaves nothing at DEST, and running it again continues where it stopped."""
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


@app.command("presets")
def presets_command(ctx: typer.Context, json_: JsonOpt = False) -> int:
    """The bundled presets (launch --config NAME): each one's task, what it is for and its key settings."""
    import json

    from gpuctl.config_schema import preset_listing

    out = ctx.obj.out
    listing = preset_listing()
    if json_:
        out.json_doc(listing)
        return ExitCode.OK
    for preset in listing:
        task = "" if preset["task"] == "train" else f"  (--task {preset['task']})"
        settings = ", ".join(f"{key} = {json.dumps(value)}" for key, value in preset["settings"].items())
        out.write(f"{preset['name']}{task}\n    {preset['summary']}\n    {settings}\n")
    return ExitCode.OK


@app.command("target")
def target_command(ctx: typer.Context, forget: Annotated[bool, typer.Option(
        "--forget", help="forget it: the next command takes its target from the options, GPUCTL_* or "
        "config.toml only")] = False, json_: JsonOpt = False) -> int:
    """The remembered target (the last successful launch's, used where no host or container is given); --forget
    clears it."""
    from gpuctl.address import remembered_target

    out = ctx.obj.out
    path, doc = remembered_target()
    if forget:
        gone = forget_target()
        if json_:
            out.json_doc({"path": str(path), "forgot": doc if gone else None})
        out.message(f"forgot the remembered target {_target_line(doc)} ({path})" if gone else
                    "no remembered target to forget")
        return ExitCode.OK
    if json_:
        out.json_doc({"path": str(path), "target": doc})
        return ExitCode.OK
    if doc is None:
        out.message("no remembered target (a successful launch remembers its target for the next command)")
        return ExitCode.OK
    lines = [f"{_target_line(doc)}  (the last launch's, from {path}; gpuctl target --forget clears it)"]
    lines += [f"  {key}: {doc[key]}" for key in ("identity", "ssh_config") if doc.get(key)]
    out.write("\n".join(lines) + "\n")
    return ExitCode.OK


def _target_line(doc: "dict | None") -> str:
    """A remembered target as TARGET specs: [USER@]HOST[:PORT]/CTID, each node's for a multi-node run."""
    from gpuctl.address import Address

    def spec(entry: dict) -> str:
        try:
            return Address(host=str(entry["host"]), ct=int(entry["ct"]), port=entry.get("port"),
                           user=entry.get("user")).spec()
        except (KeyError, TypeError, ValueError):
            return "(unreadable)"

    if not isinstance(doc, dict):
        return "(unreadable)"
    if isinstance(doc.get("nodes"), list):
        return f"run tl{doc.get('run')} on " + ", ".join(spec(node) for node in doc["nodes"])
    return spec(doc)


def click_command(help_asked: bool):
    """The Click command gpuctl runs: each command's line in `gpuctl --help` whole (its docstring's first
    sentence, never cut with "..."), and with help asked for, `launch --help` ends with the presets."""
    import re

    command = typer.main.get_command(app)
    subs = list(command.commands.values())
    subs += [inner for sub in subs for inner in getattr(sub, "commands", {}).values()]  # runs rm, runs prune
    for sub in subs:
        if not sub.short_help and sub.help:
            paragraph = " ".join(inspect.cleandoc(sub.help).split("\n\n")[0].split())
            sub.short_help = re.split(r"(?<=\.)\s", paragraph, maxsplit=1)[0]
    if help_asked and "launch" in command.commands:
        command.commands["launch"].epilog = _presets_epilog()
    return command


def _presets_epilog() -> str:
    """The presets, one line each (\\b: Click keeps the lines as they are)."""
    from gpuctl.config_schema import preset_listing

    try:
        listing = preset_listing()
    except GpuctlError as err:
        return f"Presets: {err}"
    width = max(len(p["name"]) for p in listing)
    lines = [f"  {p['name']:<{width}}  {p['summary']}" for p in listing]
    return "\b\nPresets (--config NAME; gpuctl presets shows their key settings):\n" + "\n".join(lines)


def _ready(report: "DoctorReport") -> None:
    """A report whose checks stopped at the host or container (its error), or found a failing check, is the
    exit code."""
    if report.error:
        raise GpuctlError(report.error, report.code)
    if report.failed:
        names = ", ".join(c.name for c in report.failed)
        raise GpuctlError(f"CT {report.ctid} is not ready to train: {names} failed (the fix is on each line)",
                          ExitCode.ENV_NOT_READY)
