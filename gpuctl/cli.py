"""The gpuctl command line: parse, call gpuctl.commands, render. Nothing else lives here.

main() turns every outcome into one exit code (gpuctl.errors.ExitCode) and every error into one line on
stderr, never a traceback (GPUCTL_DEBUG=1 shows it).
"""

import functools
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from gpuctl import __version__, cluster, commands, doctor, render, ssh
from gpuctl.errors import ExitCode, GpuctlError, usage_error
from gpuctl.runs import RUN_REF, State, parse_run_ref, parse_signal
from gpuctl.target import Target, TargetFlags, remember, remembered_nodes, resolve, resolve_nodes

# Newer Typer releases vendor their own click: take its exceptions from the module Typer's own come from.
click_exceptions = sys.modules[typer.BadParameter.__module__]
NoArgsIsHelp = getattr(click_exceptions, "NoArgsIsHelpError", ())

app = typer.Typer(
    name="gpuctl",
    help="Launch, follow and control training runs inside Proxmox LXC containers over SSH.",
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

TARGET_HELP = "Target options"
# The target options every command accepts (ARCHITECTURE §2); with_target adds them to each command.
TARGET_PARAMS = [
    ("host", Annotated[str | None, typer.Option(metavar="HOST", help="Proxmox host: address, name or ~/.ssh/config alias "
                                                        "[env GPUCTL_HOST]", rich_help_panel=TARGET_HELP)]),
    ("port", Annotated[int | None, typer.Option(metavar="N", help="SSH port [env GPUCTL_PORT; default 22]",
                                                   rich_help_panel=TARGET_HELP)]),
    ("user", Annotated[str | None, typer.Option(metavar="USER", help="SSH user [env GPUCTL_USER; default root]",
                                                   rich_help_panel=TARGET_HELP)]),
    ("identity", Annotated[str | None, typer.Option(metavar="PATH", help="private key file [env GPUCTL_IDENTITY]",
                                                       rich_help_panel=TARGET_HELP)]),
    ("ct", Annotated[int | None, typer.Option(metavar="CTID", help="container id [env GPUCTL_CT]",
                                                 rich_help_panel=TARGET_HELP)]),
    ("ssh_config", Annotated[str | None, typer.Option(metavar="PATH", help="ssh_config file [env GPUCTL_SSH_CONFIG; default "
                                                              "~/.ssh/config]", rich_help_panel=TARGET_HELP)]),
    ("accept_new_host_key", Annotated[bool, typer.Option("--accept-new-host-key", help="record an unknown host's key in known_hosts",
                                                         rich_help_panel=TARGET_HELP)]),
    ("connect_timeout", Annotated[float | None, typer.Option(metavar="SECONDS", help="seconds to wait for the host [default 10]",
                                                                rich_help_panel=TARGET_HELP)]),
    ("profile", Annotated[str | None, typer.Option(metavar="NAME", help="a [profiles.NAME] table of "
                                                   "$XDG_CONFIG_HOME/gpuctl/config.toml [env GPUCTL_PROFILE]",
                                                   rich_help_panel=TARGET_HELP)]),
]
TargetArg = Annotated[str | None, typer.Argument(metavar="TARGET", help="[USER@]HOST[:PORT][/CTID], instead of the options",
                                                    show_default=False)]
NODES_HELP = "Multi-node runs"
RunOpt = Annotated[str | None, typer.Option("--run", metavar="N", help="run number (7 or tl7); default: the latest")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON document on stdout, nothing else there")]


def _version(value: bool) -> None:
    if value:
        print(f"gpuctl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="print gpuctl's version and exit")] = False) -> None:
    """Launch, follow and control training runs inside Proxmox LXC containers over SSH."""


def with_target(func: Callable) -> Callable:
    """Add TARGET and the target options to a command; it receives them as one `flags: TargetFlags`, and as
    `stats` the Stats its connection counts into (run() gives them, for GPUCTL_TRACE)."""
    kw = inspect.Parameter.KEYWORD_ONLY
    own = [p.replace(kind=kw) for p in inspect.signature(func).parameters.values()
           if p.name not in ("flags", "stats")]
    added = [inspect.Parameter("target", kw, default=None, annotation=TargetArg)]
    added += [inspect.Parameter(name, kw, default=False if name == "accept_new_host_key" else None,
                                annotation=annotation) for name, annotation in TARGET_PARAMS]
    context = inspect.Parameter("ctx", kw, annotation=typer.Context)  # Typer passes it; no option

    @functools.wraps(func)
    def command(ctx: typer.Context, **kwargs):
        flags = TargetFlags(**{p.name: kwargs.pop(p.name) for p in added})
        return func(flags=flags, stats=ctx.obj, **kwargs)

    params = [context, *added[:1], *own, *added[1:]]
    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


@app.command()
@with_target
def launch(
    flags: TargetFlags,
    stats: ssh.Stats,
    task: Annotated[commands.LaunchTask | None, typer.Option(help="what to run: train (python -m training.train) or "
                                                             "regenerate (python -m training.regenerate) [default: "
                                                             "train, or the resumed run's]")] = None,
    config: Annotated[str | None, typer.Option(metavar="PRESET|PATH", help="preset name, or a config file (a local "
                                                    "file is staged) [default: tiny (regenerate: tiny-regenerate), "
                                                    "or the resumed run's]")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE", help="override a config value: KEY=VALUE "
                                                                    "(repeatable)")] = None,
    python: Annotated[str | None, typer.Option(metavar="PATH", help="Python interpreter in the container "
                                                 "[default: the one gpuctl setup made, else python3]")] = None,
    workdir: Annotated[str | None, typer.Option(metavar="DIR", help="the run's working directory in the container "
                                                  "[default: /workspace]")] = None,
    log_dir: Annotated[str | None, typer.Option(metavar="DIR", help="where train_tlN.log goes in the container "
                                                  "[default: /workspace]")] = None,
    keep_compile_cache: Annotated[bool, typer.Option("--keep-compile-cache", help="keep /tmp/torchinductor_root")] = False,
    replace: Annotated[bool, typer.Option("--replace", help="kill the active run first instead of refusing")] = False,
    resume: Annotated[str | None, typer.Option("--resume", metavar="[RUN]", help="continue RUN (default: the latest "
                                               "run, of --task when given) from its checkpoints: its task, config, sets and "
                                               "directories, the trainer's --resume (a regenerate run: the same "
                                               "command, which skips the records done), a new log")] = None,
    retry: Annotated[int, typer.Option("--retry", metavar="N", help="restart a failed run with the trainer's "
                                       "--resume (a regenerate run: the same command) up to N times, each attempt a new run number and log (not after "
                                       "gpuctl kill, nor after two attempts that fail alike)")] = 0,
    retry_delay: Annotated[float, typer.Option("--retry-delay", metavar="SECONDS", help="wait before a retry; doubled "
                                               "for each attempt in a row that failed before its first step")] = 10.0,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="stream the log until the run ends; exit "
                                                                "with its outcome")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print what would run, run nothing")] = False,
    json_: JsonOpt = False,
    env: Annotated[list[str] | None, typer.Option("--env", metavar="KEY=VALUE", help="an environment variable for "
                                                  "the trainer (repeatable), e.g. NCCL_SOCKET_IFNAME=eth0")] = None,
    node: Annotated[list[str] | None, typer.Option("--node", metavar="TARGET", rich_help_panel=NODES_HELP,
                                                   help="a node of a multi-node run: [USER@]HOST[:PORT]/CTID or a "
                                                        "profile name (repeatable; node 0 first)")] = None,
    cluster_name: Annotated[str | None, typer.Option("--cluster", metavar="NAME", rich_help_panel=NODES_HELP,
                                                     help="the nodes of config.toml's [clusters.NAME] (nodes = "
                                                          "[...])")] = None,
    master_addr: Annotated[str | None, typer.Option(metavar="ADDR", rich_help_panel=NODES_HELP,
                                                    help="where every node reaches node 0 (MASTER_ADDR) [default: "
                                                         "node 0's address, found in its container]")] = None,
    master_port: Annotated[int | None, typer.Option(metavar="N", rich_help_panel=NODES_HELP,
                                                    help="node 0's rendezvous port (MASTER_PORT), reachable from "
                                                         "every node [default: 29500]")] = None,
) -> int:
    """Start a training run (or, with --task regenerate, a data regeneration) in the container, detached; print
    its id, pid and log. With --node (or --cluster), one run across several containers: one trainer each."""
    if json_ and follow:
        raise usage_error("--json and --follow cannot be combined (the log goes to stdout)")
    if resume is not None and dry_run:
        raise usage_error("--dry-run cannot show a --resume (the resumed run's record is in the container)")
    resumed = None if resume is None else parse_run_ref(resume or None)
    if node or cluster_name:
        nodes = resolve_nodes(flags, node, cluster_name)
    else:  # after a multi-node run, a launch without options is on its nodes again (--resume: that run)
        nodes, last = remembered_nodes(flags) or ([], 0)
        resumed = last if resumed == 0 and nodes else resumed
    opts = commands.LaunchOptions(config=config, sets=set_ or [], python=python, workdir=workdir,
                                  log_dir=log_dir, keep_compile_cache=keep_compile_cache, replace=replace,
                                  resume=resumed, task=task, retry=retry, retry_delay=retry_delay, env=env or [])
    if len(nodes) > 1:
        return _launch_nodes(nodes, opts, stats, master_addr, master_port, follow, dry_run, json_)
    if master_addr is not None or master_port is not None:
        raise usage_error("--master-addr and --master-port are for a multi-node run (two --node or more)")
    target = nodes[0] if nodes else resolve(flags)
    if dry_run:
        sys.stdout.write(commands.plan_launch(target, opts))
        return ExitCode.OK
    progress = None if json_ else (lambda total: render.TransferProgress(total, "staging"))
    with commands.connected(target, stats) as ct:
        result = commands.launch(ct, target, opts, notify=render.message, progress=progress)
        remember(target)
        render.launch_result(result, as_json=json_, to_stderr=follow, show_tail=not follow)
        if follow:  # the whole log, even when the run already ended during the start check
            return _follow(ct, result.run.number, lines=None, offset=0)
    if result.run.state in (State.FAILED, State.KILLED, State.LOST) and not result.run.record.get("retried_as"):
        return ExitCode.RUN_FAILED  # a failed first attempt that --retry restarts is no failure of the launch yet
    return ExitCode.OK


def _launch_nodes(nodes: list[Target], opts: commands.LaunchOptions, stats: ssh.Stats, master_addr: str | None,
                  master_port: int | None, follow: bool, dry_run: bool, json_: bool) -> int:
    port = cluster.DEFAULT_MASTER_PORT if master_port is None else master_port
    cluster.check_cluster_options(nodes, opts, master_addr, port)
    if dry_run:
        sys.stdout.write(cluster.plan_launch(nodes, opts, master_addr, port))
        return ExitCode.OK
    with cluster.connected(nodes, stats) as connections:
        result = cluster.launch(connections, opts, master_addr, port, notify=render.message)
        remember(nodes[0], nodes=nodes, run=result.number)
        render.cluster_launch(result, as_json=json_, to_stderr=follow)
        if follow:  # node 0's log
            return _follow(connections[0].ct, result.number, lines=None, offset=0)
    if any(r.run.state in (State.FAILED, State.KILLED, State.LOST) for r in result.results):
        return ExitCode.RUN_FAILED
    return ExitCode.OK


def _follow(ct: commands.Container, run_number: int, lines: int | None, offset: int | None) -> int:
    try:
        run = commands.follow_log(ct, run_number, lines, render.write_bytes, offset=offset, notify=render.message)
    except KeyboardInterrupt:
        raise GpuctlError("detached; the run goes on (gpuctl logs -f follows it again)",
                          ExitCode.INTERRUPTED) from None
    render.run_ended(run)
    return commands.follow_exit_code(run)


@app.command()
@with_target
def logs(
    flags: TargetFlags,
    stats: ssh.Stats,
    run: RunOpt = None,
    tail: Annotated[int | None, typer.Option("--tail", "-n", help="only the last LINES lines",
                                                metavar="LINES", min=0)] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="stream until the run ends; exit with its "
                                                                "outcome (0 succeeded, 1 otherwise)")] = False,
    node: Annotated[int | None, typer.Option("--node", metavar="K", min=0, help="a multi-node run: node K's log "
                                             "[default: node 0's]")] = None,
) -> int:
    """Print a run's log (the latest run's by default); only the log's own lines go to stdout."""
    number = parse_run_ref(run)
    remembered = remembered_nodes(flags)
    if remembered:
        targets, last = remembered
        if (node or 0) >= len(targets):
            raise usage_error(f"--node {node}: the run has nodes 0 to {len(targets) - 1}")
        target, number = targets[node or 0], number or last
    elif node:
        raise usage_error("--node K is for the nodes of a multi-node run (the last launch was not one)")
    else:
        target = resolve(flags)
    with commands.connected(target, stats) as ct:
        if follow:
            return _follow(ct, number, lines=tail, offset=None)
        commands.print_log(ct, number, tail, render.write_bytes)
    return ExitCode.OK


@app.command()
@with_target
def status(
    flags: TargetFlags,
    stats: ssh.Stats,
    run: RunOpt = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="refresh in place until Ctrl-C")] = False,
    interval: Annotated[float, typer.Option(metavar="SECONDS", help="seconds between refreshes with --watch",
                                            min=0.1)] = 2.0,
    json_: JsonOpt = False,
) -> int:
    """The container, the run (state, pid, log, progress, loss) and the GPUs; exit 4 if the container is not
    running (after showing that)."""
    if watch and json_:
        raise usage_error("--watch is for a terminal; --json gives one document (run it again to refresh)")
    number = parse_run_ref(run)
    remembered = remembered_nodes(flags)
    if remembered:
        return _status_nodes(*remembered, number, stats, watch, interval, json_)
    with commands.connected(resolve(flags), stats) as ct:
        if watch:
            _watch(lambda: render.status_renderable(commands.reconnecting(ct, lambda: commands.status(ct, number),
                                                                          render.message)), interval)
        report = commands.status(ct, number)
        render.status_report(report, as_json=json_)
    if report.container_status != "running":
        raise GpuctlError(f"container {report.ctid} on {report.host} is not running ({report.container_status}; "
                          f"start it: pct start {report.ctid})", ExitCode.CONTAINER)
    return ExitCode.OK


def _watch(fetch: Callable[[], Any], interval: float) -> None:
    try:
        render.watch_status(fetch, interval)
    except KeyboardInterrupt:
        raise GpuctlError("stopped watching", ExitCode.INTERRUPTED) from None


def _status_nodes(targets: list[Target], last: int, number: int, stats: ssh.Stats, watch: bool, interval: float,
                  json_: bool) -> int:
    """status over a multi-node run's nodes: a row each, the run's state over all of them."""
    with cluster.connected(targets, stats) as nodes:
        if watch:
            _watch(lambda: render.status_renderable(cluster.status(nodes, number or last)), interval)
        report = cluster.status(nodes, number or last)
    render.status_report(report, as_json=json_)
    unreadable = report.unreadable()
    if unreadable:
        raise unreadable
    return ExitCode.OK


@app.command()
@with_target
def plot(
    flags: TargetFlags,
    stats: ssh.Stats,
    output: Annotated[Path, typer.Option("--output", "-o", metavar="FILE.png", help="the image to write (.png, "
                                         ".svg or .pdf)")],
    run: RunOpt = None,
) -> int:
    """Draw a run's loss and tokens/s against step (with the runs it resumed) into an image."""
    from gpuctl import plot as plotting  # matplotlib only when asked for

    plotting.check_output(output)
    with commands.connected(resolve(flags), stats) as ct:
        history = commands.metrics_history(ct, parse_run_ref(run))
    points = plotting.draw(history, output)
    render.message(f"wrote {output} ({points} points of {history.runs[-1].run_id})")
    return ExitCode.OK


@app.command()
@with_target
def runs(flags: TargetFlags, stats: ssh.Stats, json_: JsonOpt = False) -> int:
    """Every run in the container: id, state, exit code, start, duration, log size (a multi-node run's: every
    node's, each run with its nodes)."""
    remembered = remembered_nodes(flags)
    if remembered:
        with cluster.connected(remembered[0], stats) as nodes:
            found, errors = cluster.list_runs(nodes)
        render.cluster_runs(found, as_json=json_)
        for error in errors[1:]:
            render.error(str(error))
        if errors:
            raise errors[0]
        return ExitCode.OK
    target = resolve(flags)
    with commands.connected(target, stats) as ct:
        render.runs_table(commands.list_runs(ct), target.ct, target.host, as_json=json_)
    return ExitCode.OK


@app.command()
@with_target
def kill(
    flags: TargetFlags,
    stats: ssh.Stats,
    run: RunOpt = None,
    signal: Annotated[str, typer.Option(metavar="NAME", help="first signal: TERM, INT, HUP, QUIT, USR1, USR2 or KILL")] = "TERM",
    grace: Annotated[float, typer.Option(metavar="SECONDS", help="seconds to wait before SIGKILL", min=0)] = 30.0,
) -> int:
    """Signal a run's whole process group, escalate to SIGKILL after --grace, check nothing is left."""
    number, signal_name = parse_run_ref(run), parse_signal(signal)
    remembered = remembered_nodes(flags)
    if remembered:
        with cluster.connected(remembered[0], stats) as nodes:
            done = cluster.kill(nodes, number or remembered[1], signal_name, grace, notify=render.message)
        for each in done:
            if each.result:
                render.kill_result(each.result, each.node.describe())
        errors = [each.error for each in done if each.error]
        for error in errors[1:]:
            render.error(str(error))
        if errors:
            raise errors[0]
        return ExitCode.OK
    with commands.connected(resolve(flags), stats) as ct:
        render.kill_result(commands.kill(ct, number, signal_name, grace, notify=render.message))
    return ExitCode.OK


@app.command()
@with_target
def pull(
    flags: TargetFlags,
    stats: ssh.Stats,
    dest: Annotated[str | None, typer.Argument(metavar="DEST", show_default=False,
                                               help="where the files go: a directory (export, checkpoint), a "
                                                    "file or a directory (metrics)")] = None,
    run: RunOpt = None,
    what: Annotated[commands.PullWhat, typer.Option(help="the run's export (made from its newest checkpoint "
                                                         "when it has none), its newest checkpoint, its "
                                                         "metrics file, or a regenerate run's data file (its "
                                                         "output_path)")] = commands.PullWhat.EXPORT,
    with_optimizer: Annotated[bool, typer.Option("--with-optimizer", help="with --what checkpoint: state.pt "
                                                 "too (optimizer, schedule, data position)")] = False,
    json_: JsonOpt = False,
) -> int:
    """Copy a run's export, newest checkpoint, metrics or regenerated data to DEST over SSH, every file checked by sha256; an
    interrupted pull leaves nothing at DEST, and running it again continues where it stopped."""
    if dest is None:  # one positional argument is DEST, not TARGET
        flags, dest = replace(flags, target=None), flags.target
    if dest is None:
        raise usage_error("missing DEST (see gpuctl pull --help)")
    destination = commands.pull_destination(dest, what, with_optimizer)
    progress = None if json_ else (lambda total: render.TransferProgress(total, "pulling"))
    with commands.connected(resolve(flags), stats) as ct:
        result = commands.pull(ct, parse_run_ref(run), what, destination, with_optimizer, notify=render.message,
                               progress=progress)
    render.pull_result(result, as_json=json_)
    return ExitCode.OK


PythonOpt = Annotated[str | None, typer.Option(metavar="PATH", help="the interpreter to check [default: the one "
                                             "gpuctl setup made, else python3]")]


@app.command("doctor")
@with_target
def doctor_command(flags: TargetFlags, stats: ssh.Stats, python: PythonOpt = None, json_: JsonOpt = False) -> int:
    """Check that the container can train: host, pct, container, the interpreter launch would use and its
    packages, the GPUs against torch's, CUDA, free space and GPU memory, an active run. Exit 6 when a check
    fails."""
    if python is not None:
        commands.check_python(python)
    report = doctor.doctor(resolve(flags), stats, python)
    render.doctor_report(report, as_json=json_)
    if report.error:
        raise GpuctlError(report.error, report.code)
    _not_ready(report)
    return ExitCode.OK


@app.command("setup")
@with_target
def setup_command(
    flags: TargetFlags,
    stats: ssh.Stats,
    python: Annotated[str | None, typer.Option(metavar="PATH", help="the interpreter (>= 3.10) to make the "
                                               "environment from [default: python3]")] = None,
    venv: Annotated[str, typer.Option(metavar="DIR", help="the virtual environment in the container")]
    = doctor.DEFAULT_VENV,
    torch: Annotated[str | None, typer.Option(metavar="SPEC", help="a pip requirement for torch instead of the "
                                              "trainer's, e.g. 'torch==2.11.0' [default: a CUDA build for the "
                                              "driver, from PyTorch's index]")] = None,
    index_url: Annotated[list[str] | None, typer.Option("--index-url", metavar="URL", help="where pip gets packages "
                                                        "(repeatable; the first is pip's --index-url, the others "
                                                        "--extra-index-url): an index URL, or a directory of wheels "
                                                        "in the container (/DIR, file:///DIR)")] = None,
    system_site_packages: Annotated[bool, typer.Option("--system-site-packages", help="let the environment see "
                                                       "the interpreter's packages (an image that has torch "
                                                       "already)")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print what would run, send nothing")] = False,
) -> int:
    """Make the container ready to train: a virtual environment with the trainer's packages (a CUDA build of torch
    for the driver), installed detached like a run (its own log; logs -f, kill, status), then doctor's checks.
    Launch uses that environment from then on."""
    opts = doctor.check_setup_options(doctor.SetupOptions(
        python=python, venv=venv, torch=torch, index_urls=index_url or [], system_site_packages=system_site_packages))
    target = resolve(flags)
    if dry_run:
        sys.stdout.write(doctor.plan_setup(target, opts))
        return ExitCode.OK
    with commands.connected(target, stats) as ct:
        result = doctor.setup(ct, target, opts, notify=render.message,
                              progress=lambda total: render.TransferProgress(total, "staging"))
        remember(target)
        render.launch_result(result, as_json=False, to_stderr=True, show_tail=False)
        code = _follow(ct, result.run.number, lines=None, offset=0)
        if code != ExitCode.OK:
            raise GpuctlError(f"setup ({result.run.run_id}) did not finish: its log above says why (gpuctl logs "
                              f"--run {result.run.number})", code)
        report = commands.reconnecting(ct, lambda: doctor.examine(ct, None), render.message)
    render.doctor_report(report, as_json=False)
    if report.error:
        raise GpuctlError(report.error, report.code)
    _not_ready(report)
    return ExitCode.OK


def _not_ready(report: doctor.DoctorReport) -> None:
    if report.failed:
        names = ", ".join(c.name for c in report.failed)
        raise GpuctlError(f"CT {report.ctid} is not ready to train: {names} failed (the fix is on each line)",
                          ExitCode.ENV_NOT_READY)


def _bare_resume(argv: list[str]) -> list[str]:
    """Typer has no option with an optional value: `launch --resume` not followed by a run number becomes
    `--resume=` (the latest run)."""
    if "launch" not in argv:
        return argv
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        following = argv[i + 1] if i + 1 < len(argv) else None
        out.append("--resume=" if arg == "--resume" and not (following and RUN_REF.match(following)) else arg)
    return out


def run(argv: list[str] | None = None) -> int:
    """Run gpuctl with these arguments; return its exit code (tests call this in-process)."""
    command = typer.main.get_command(app)
    argv = _bare_resume(sys.argv[1:] if argv is None else list(argv))
    stats = ssh.Stats()  # what this invocation's connection costs: its session counts into it
    try:
        return int(command.main(args=argv, prog_name="gpuctl", standalone_mode=False, obj=stats) or 0)
    except GpuctlError as e:
        render.error(str(e))
        return int(e.code)
    except NoArgsIsHelp as e:
        print(e.ctx.get_help())
        return int(ExitCode.USAGE)
    except click_exceptions.UsageError as e:
        where = f"gpuctl {e.ctx.info_name} --help" if e.ctx and e.ctx.parent else "gpuctl --help"
        render.error(f"{e.format_message()} (see {where})")
        return int(ExitCode.USAGE)
    except (KeyboardInterrupt, typer.Abort):
        render.error("interrupted")
        return int(ExitCode.INTERRUPTED)
    except BrokenPipeError:
        # The reader went away (gpuctl logs | head): not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return int(ExitCode.OK)
    except Exception as e:  # a bug: still one line, with the way to see more
        if os.environ.get("GPUCTL_DEBUG"):
            raise
        render.error(f"internal error: {type(e).__name__}: {e} (GPUCTL_DEBUG=1 shows the traceback)")
        return int(ExitCode.RUN_FAILED)
    finally:
        if ssh.tracing():
            print(ssh.trace_line(stats), file=sys.stderr)


def main() -> None:
    sys.exit(run(sys.argv[1:]))
