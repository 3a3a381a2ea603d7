"""All of gpuctl's output, in one place: Rich text for people, JSON for scripts.

With --json, stdout carries exactly one JSON document and human messages go to stderr.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from gpuctl.commands.status import ContainerRuns, StatusReport
from gpuctl.runs import Run, State
from gpuctl.ui.output import Output, one_line, visible

if TYPE_CHECKING:  # the results rendered here; each command's own module comes with the command
    from rich.progress import Progress

    from gpuctl.commands.detached import LaunchResult
    from gpuctl.commands.doctor import DoctorReport
    from gpuctl.commands.kill import Killed, KillResult
    from gpuctl.commands.nodes import ClusterLaunch, ClusterRun, ClusterRuns, ClusterStatus, NodesRemoved
    from gpuctl.commands.pull import PullResult
    from gpuctl.commands.remove import Removed

SPARK = "▁▂▃▄▅▆▇█"
PROGRESS_AFTER_S = 0.5  # a transfer shows a progress bar only once it has taken this long
CHECK_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red"}
STATE_STYLE = {State.STARTING: "yellow", State.RUNNING: "green", State.SUCCEEDED: "bold green",
               State.FAILED: "bold red", State.KILLED: "magenta", State.LOST: "red", State.RETRYING: "yellow",
               State.QUEUED: "cyan"}


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    days, rem = divmod(seconds, 86400)
    hours, rem = divmod(rem, 3600)
    minutes, secs = divmod(rem, 60)
    parts = [f"{days}d"] * bool(days) + [f"{hours}h"] * bool(hours) + [f"{minutes}m"] * bool(minutes)
    return " ".join(parts[:2]) if parts else f"{secs}s"


def size(n: int | None) -> str:
    if n is None or n < 0:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def local_time(epoch: float | None) -> str:
    return datetime.fromtimestamp(epoch).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z") if epoch else "-"


def state_text(run: Run) -> Text:
    label = run.state.value
    signal = run.record.get("killed_signal") if run.state == State.KILLED else None
    if signal and run.exit_code is not None:  # exit 0 (it stopped cleanly on TERM) or 143 (it did not catch it)
        label += f" (by {one_line(signal)}, exit {run.exit_code})"
    elif run.state in (State.FAILED, State.KILLED) and run.exit_code is not None:
        label += f" (exit {run.exit_code})"
    if run.record.get("retried_as"):
        label += f", retried as tl{run.record['retried_as']}"
    return Text(label, style=STATE_STYLE[run.state])


def progress_text(run: Run) -> str:
    p = run.progress
    if p is None:
        return "-"
    unit = "records" if run.task == "regenerate" else "step"  # a regeneration counts the records written
    parts = [f"{unit} {p.step}/{p.total_steps}" if p.total_steps else f"{unit} {p.step}"]
    if p.total_steps:
        parts[0] += f" ({100 * p.step / p.total_steps:.0f}%)"
    if p.loss is not None:
        parts.append(f"loss {p.loss:.4f}")
    if p.tokens_per_s is not None:
        parts.append(f"{p.tokens_per_s:,.0f} tok/s")
    if p.eta_s is not None:
        parts.append(f"ETA {duration(p.eta_s)}")
    return ", ".join(parts)


def sparkline(values: list[float], width: int = 40) -> str:
    """One line of block characters: values averaged into at most `width` buckets, low to high."""
    if len(values) < 2:
        return ""
    buckets = min(width, len(values))
    means = []
    for i in range(buckets):
        chunk = values[i * len(values) // buckets:(i + 1) * len(values) // buckets] or [values[-1]]
        means.append(sum(chunk) / len(chunk))
    low, high = min(means), max(means)
    span = (high - low) or 1.0
    if not all(math.isfinite(x) for x in (low, high, span)):  # losses near the float limits: no picture
        return ""
    return "".join(SPARK[min(int((m - low) / span * len(SPARK)), len(SPARK) - 1)] for m in means)


def _run_grid(run: Run, losses: list[float]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("run", Text.assemble((run.run_id, "bold"), f" ({one_line(run.name)})" if run.name else "", "  ",
                                      state_text(run)))
    if run.problem:
        grid.add_row("record", Text(one_line(f"malformed: {run.problem}"), style="red"))
    pid = run.record.get("pid")
    grid.add_row("pid", f"{pid} (process group {run.record.get('pgid')})" if pid else "-")
    if run.never_started:  # launch --queue: when it queued, and how long it has waited (or waited)
        queued_at = run.record.get("launched_at")
        end = run.record.get("ended_at", run.now)
        waited = duration(end - queued_at) if queued_at is not None and end is not None else "-"
        grid.add_row("queued", f"{local_time(queued_at)}, waiting for {waited}" if run.state.active else
                     f"{local_time(queued_at)}, waited {waited}, never started")
    else:
        started = local_time(run.started_at)
        elapsed = f"{duration(run.elapsed_s)} ago" if run.state.active else f"ran {duration(run.elapsed_s)}"
        grid.add_row("started", f"{started}, {elapsed}")
    grid.add_row("log", f"{run.log_path} ({size(run.log_size)})")
    grid.add_row("progress", progress_text(run))
    if run.failure:
        grid.add_row("failure", one_line(run.failure))  # why it ended: its exit, last step, the log's last line
    if spark := sparkline(losses):
        grid.add_row("loss", Text.assemble((spark, "cyan"), f"  {losses[0]:.4g} → {losses[-1]:.4g}"))
    if run.task == "setup":  # gpuctl setup's installation: no config
        grid.add_row("task", f"{run.task} (venv {run.record.get('venv', '-')}, from {run.record.get('python', '-')})")
        return grid
    notes = [f"task {run.task}"] * (run.task != "train")
    if run.resumed_from:
        notes.append(f"resumed tl{run.resumed_from}")
    config = launch_text(run) + (f" ({', '.join(notes)})" if notes else "")
    grid.add_row("config", one_line(config))
    if retry := _retry_text(run):
        grid.add_row("attempt", visible(retry))  # before Text drops BEL, BS, VT, FF and CR unseen
    return grid


def launch_text(run: Run) -> str:
    """The run's config and its --set values, as the command line gave them."""
    return " ".join([str(run.record.get("config") or "-"), *(f"--set {item}" for item in run.sets)])


def _retry_text(run: Run) -> str:
    """`launch --retry`: the attempt, the retries left, the attempts before it, how the last one failed (a line
    each, every remote field kept to its line)."""
    r = run.retry_json()
    if r["attempt"] == 1 and not r["attempts_left"] and not r["retried_as"]:
        return ""
    text = f"{r['attempt']} ({r['attempts_left']} retries left"
    text += f"; after {one_line(', '.join(r['attempts']))})" if r["attempts"] else ")"
    if r["last_failure"]:
        text += f"\nlast failure: {one_line(r['last_failure'])}"
    if r["retried_as"]:
        text += f"\nretried as {r['retried_as']}"
    if r["retry_stopped"]:
        text += f"\n{one_line(r['retry_stopped'])}"
    return text


def status_renderable(report: StatusReport | ClusterStatus) -> RenderableType:
    if not isinstance(report, StatusReport):  # a multi-node run's ClusterStatus: a row per node
        return cluster_status_renderable(report)
    running = report.container_status == "running"
    parts: list[RenderableType] = [Text.assemble(
        ("CT ", "bold"), (str(report.ctid), "bold"), f" on {report.host}: ",
        (report.container_status, "green" if running else "bold red"))]
    if not running:
        parts.append(Text(f"the container is {report.container_status}: its runs cannot be read (pct start "
                          f"{report.ctid} starts it)"))
        return Group(*parts)
    parts.append(_run_grid(report.run, report.losses) if report.run else Text("no runs yet (gpuctl launch starts one)"))
    if report.queue:
        queue = ", ".join(f"tl{n}" for n in report.queue)
        parts.append(Text(f"queue: {queue} (launch --queue: each starts when the runs ahead of it end)"))
    if report.gpus:
        table = Table(box=None, pad_edge=False)
        for name, justify in (("GPU", "right"), ("name", "left"), ("util", "right"), ("memory", "right")):
            table.add_column(name, justify=justify, header_style="bold")
        for gpu in report.gpus:
            util = f"{gpu.utilization}%" if gpu.utilization is not None else "-"
            memory = f"{gpu.memory_used_mib} / {gpu.memory_total_mib} MiB"
            table.add_row(str(gpu.index), one_line(gpu.name), util, memory)
        parts.append(table)
    elif report.gpus_error:
        parts.append(Text(f"GPUs: unknown ({report.gpus_error})"))
    else:
        parts.append(Text("no GPUs visible in the container (nvidia-smi found none)"))
    return Group(*parts)


def status_report(out: Output, report: StatusReport | ClusterStatus, as_json: bool) -> None:
    if as_json:
        out.json_doc(report.to_json())
    else:
        out.show(status_renderable(report))


def watch_status(out: Output, fetch: Callable[[], RenderableType], interval: float) -> None:
    """Refresh the status (fetch() draws it) in place every `interval` seconds until Ctrl-C (KeyboardInterrupt
    goes to the caller). Not to a terminal (a pipe, a file): each refresh is printed, a block after the last."""
    console = out.console(stderr=False)

    def frame() -> Group:
        footer = Text(f"every {interval:g} s, last {datetime.now().strftime('%H:%M:%S')}; Ctrl-C stops",
                      style="dim")
        return Group(fetch(), footer)

    if not console.is_terminal:
        while True:
            console.print(frame())
            console.file.flush()
            time.sleep(interval)
    from rich.live import Live

    with Live(console=console, auto_refresh=False, redirect_stderr=False) as live:
        while True:
            live.update(frame(), refresh=True)
            time.sleep(interval)


class TransferProgress:
    """A progress bar on stderr for a transfer that takes longer than a moment (never for a short one, never
    when stderr is not a terminal)."""

    def __init__(self, out: Output, total: int, description: str):
        self.out, self.total, self.description, self.done = out, total, description, 0
        self.started = time.monotonic()
        self._bar: Progress | None = None
        self._task = None

    def __call__(self, sent: int) -> None:
        self.done += sent
        if self._bar is None and time.monotonic() - self.started >= PROGRESS_AFTER_S:
            console = self.out.console(stderr=True)
            if not console.is_terminal:
                return
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            self._bar = Progress("{task.description}", BarColumn(), DownloadColumn(binary_units=True),
                                 TransferSpeedColumn(),
                                 console=console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total)
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def runs_table(out: Output, runs: list[Run], ctid: int, host: str, as_json: bool) -> None:
    if as_json:
        out.json_doc([dict(r.to_json(), container={"ctid": ctid, "status": "running", "host": host}) for r in runs])
        return
    console = out.console(stderr=False)
    if not runs:
        console.print(f"no runs in CT {ctid} yet")
        return
    table = Table(box=None, pad_edge=False)
    for name in ("run", "name", "task", "state", "exit", "started", "duration", "log", "size", "resumed", "config"):
        table.add_column(name, header_style="bold", no_wrap=name != "config")  # the launch wraps, not the log
    for run in runs:
        exit_code = "-" if run.exit_code is None else str(run.exit_code)
        table.add_row(run.run_id, one_line(run.name or "-"), one_line(run.task), state_text(run), exit_code,
                      local_time(run.started_at), duration(run.elapsed_s), one_line(run.log_path or "-"),
                      size(run.log_size),
                      f"tl{run.resumed_from}" if run.resumed_from else "-", one_line(launch_text(run)))
    console.print(table)
    for run in runs:
        if run.problem_line:
            out.message(one_line(run.problem_line))


def launch_result(out: Output, result: LaunchResult, as_json: bool, to_stderr: bool, show_tail: bool) -> None:
    run = result.run
    if as_json:
        queued = {"queued_behind": [f"tl{n}" for n in result.queued_behind]} if result.queued_behind else {}
        out.json_doc(dict(run.to_json(), staging=result.staging_json(), **queued))
    console = out.console(stderr=to_stderr or as_json)  # with --json, the human lines go to stderr
    resumed = f", resuming tl{result.resumed_from}" if result.resumed_from else ""
    task = {"train": "", "setup": "gpuctl setup, "}.get(run.task, f"task {run.task}, ")
    if run.state == State.QUEUED:
        behind = ", ".join(f"tl{n}" for n in result.queued_behind)
        notes = ", ".join(filter(None, [task.removesuffix(", "), resumed.removeprefix(", ")]))
        notes = f" ({notes})" if notes else ""
        console.print(Text.assemble("queued ", (run.label, "bold"), f" behind {behind}{notes}: it starts, detached, "
                                    f"when they end; gpuctl kill --run {run.number} takes it out of the queue"))
    else:
        console.print(Text.assemble("started ", (run.label, "bold"), f" ({task}pid {run.record.get('pid')}, "
                                    f"process group {run.record.get('pgid')}{resumed}): ", state_text(run)))
    plan = result.plan
    changed = len(plan.changed)
    sent = (f"sent {changed} changed file{'s' * (changed != 1)}, {size(result.sent_file_bytes)}" if changed
            else "unchanged, nothing sent")
    console.print(Text(f"log: {run.log_path}   (package: {len(result.package.files)} files, "
                   f"{size(result.package.size)}; {sent})"))
    if result.python_from == "recorded":
        console.print(Text(f"python: {result.python} (made by gpuctl setup)"))
    if result.tail and show_tail:
        out.message(f"{run.run_id} ended during its start ({run.state.value}, exit {run.exit_code}); the log's end:")
        out.log_tail(result.tail)
    if run.record.get("retried_as"):
        out.message(f"{run.run_id} failed; --retry: attempt 2 is tl{run.record['retried_as']} (gpuctl status shows it)")


def removed(out: Output, result: Removed | NodesRemoved, as_json: bool) -> None:
    """runs rm, runs prune: each run and its paths (with --dry-run, what would go), and what of it stays, and why;
    over the nodes of a multi-node run, each node's."""
    if as_json:
        out.json_doc(result.to_json())
        return
    console = out.console(stderr=False)
    from gpuctl.commands.remove import Removed  # (the command imported it)

    for where, one in [("", result)] if isinstance(result, Removed) else [
            (f"{node.describe()}: ", one) for node, one in result.results]:
        if not one.removals:
            kept = f" (--keep {one.keep})" if one.keep is not None else ""
            console.print(f"{where}nothing to remove in CT {one.ctid}{kept}")
        verb = "would remove" if one.dry_run else "removed"
        for removal in one.removals:
            count = len(removal.paths)
            console.print(Text.assemble(f"{where}{verb} ", (one_line(removal.run.label), "bold"),
                                        f", {removal.run.state.value}: {count} path{'s' * (count != 1)}"))
            for path in removal.paths:
                console.print(Text(f"  {one_line(path)}"))
            for path, why in removal.kept:
                console.print(Text(f"  kept {one_line(path)}: {one_line(why)}"))
    if result.dry_run:
        out.message("--dry-run: nothing was removed")


def kill_result(out: Output, result: KillResult, where: str = "") -> None:
    """where: a multi-node run's node ("node 1 (CT 201 on pve2)")."""
    prefix = f"{where}: " if where else ""
    if result.run is None:
        out.message(f"{prefix}no runs in this container; nothing to kill")
    elif not result.signalled:
        out.message(f"{prefix}{result.run.run_id} is not running ({result.run.state.value}); nothing to kill")
    elif result.run.never_started:  # launch --queue: it waited in the queue
        out.show(Text(f"{prefix}took {result.run.run_id} out of the queue: it never started (state "
                      f"{result.run.state.value}, exit {result.run.exit_code})"))
    else:
        how = " (SIGKILL after the grace period)" if result.escalated else ""
        out.show(Text(
            f"{prefix}killed {result.run.run_id}{how} in {result.seconds:.1f} s; none of its processes is left "
            f"(state {result.run.state.value}, exit {result.run.exit_code})"))


def run_ended(out: Output, run: Run) -> None:
    out.message(f"{run.run_id} ended: {run.state.value}, exit {run.exit_code}")


def pull_result(out: Output, result: PullResult, as_json: bool) -> None:
    if as_json:
        out.json_doc(result.to_json())
        return
    o = result.outcome
    count = len(o.files)
    made = f", exported now from {result.export_from.rsplit('/', 1)[-1]}" if result.export_from else ""
    parts = [f"received {size(o.sent)}"]
    if o.resumed:
        parts.append(f"{size(o.resumed)} resumed from an earlier pull")
    if o.skipped:
        parts.append(f"{size(o.skipped)} already there")
    out.show(Text(
        f"pulled {result.run.run_id}'s {result.what.value} ({count} file{'s' * (count != 1)}, {size(o.total)}"
        f"{made}) to {result.dest}: {', '.join(parts)}; every file's sha256 matches the container's"))


def doctor_report(out: Output, report: DoctorReport, as_json: bool, to_stderr: bool = False) -> None:
    """A line per check: ok, warn or fail, the check, what was found, and for a problem the fix. When the checks
    stopped at the host or the container (report.error), the caller's one error line says it all."""
    if as_json:
        out.json_doc(report.to_json())
        return
    if report.error:
        return
    console = out.console(stderr=to_stderr)
    width = max(len(c.name) for c in report.checks)
    for check in report.checks:
        line = Text.assemble((f"{check.status:<4}", CHECK_STYLE[check.status]), f"  {check.name:<{width}}  ",
                             check.detail)
        if check.fix:
            line.append(f"; fix: {check.fix}", style="bold" if check.status == "fail" else "")
        console.print(line, soft_wrap=True)


# multi-node runs (gpuctl.commands.nodes) -------------------------------------------------------------------

def _state_label(state: State | None, reason: str | None) -> Text:
    if state is None:
        return Text("no run", style="red")
    return Text.assemble((state.value, STATE_STYLE[state]), f" ({one_line(reason)})" if reason else "")


def _gpus_text(gpus: list) -> str:
    if not gpus:
        return "-"
    util = [g.utilization for g in gpus if g.utilization is not None]
    return f"{len(gpus)}" + (f" ({sum(util) / len(util):.0f}% util)" if util else "")


def cluster_launch(out: Output, result: ClusterLaunch, as_json: bool, to_stderr: bool) -> None:
    first = result.results[0].run
    if as_json:
        states = [(node, r.run, None) for node, r in zip(result.nodes, result.results)]
        from gpuctl.commands.nodes import combined_state

        state, reason = combined_state(states)
        out.json_doc(dict(first.to_json(), state=state.value if state else None, reason=reason,
                      master_addr=result.master_addr, master_port=result.master_port, world_size=len(result.nodes),
                      staging=result.results[0].staging_json(),
                      nodes=[dict(r.run.to_json(), node=node.index, target=node.address.spec(),
                                  staging=r.staging_json()) for node, r in zip(result.nodes, result.results)]))
    console = out.console(stderr=to_stderr or as_json)
    resumed = result.results[0].resumed_from
    console.print(Text.assemble("started ", (result.run_id, "bold"), f" on {len(result.nodes)} nodes (master "
                            f"{result.master_addr}:{result.master_port}{f', resuming tl{resumed}' if resumed else ''})"))
    for node, launched in zip(result.nodes, result.results):
        run = launched.run
        console.print(Text.assemble(f"  node {node.index}: {node.address.describe()}: pid {run.record.get('pid')}, "
                                f"log {run.log_path}: ", state_text(run)))
        if launched.tail:
            out.message(f"node {node.index}: {run.run_id} ended during its start ({run.state.value}, exit "
                    f"{run.exit_code}); the log's end:")
            out.log_tail(launched.tail)


def cluster_status_renderable(report: ClusterStatus) -> RenderableType:
    state, reason = report.state()
    parts: list[RenderableType] = [Text.assemble(("run ", "bold"), (report.run_id, "bold"),
                                                 f" on {len(report.nodes)} nodes: ", _state_label(state, reason))]
    table = Table(box=None, pad_edge=False)
    for name in ("node", "container", "state", "pid", "progress", "GPUs"):
        table.add_column(name, header_style="bold", no_wrap=name != "progress")
    for n in report.nodes:
        where = n.node.address.describe()
        run, problem = n.run, n.problem()
        if run is None:
            table.add_row(str(n.node.index), where, Text(one_line(problem or "-"), style="red"), "-", "-", "-")
            continue
        table.add_row(str(n.node.index), where, state_text(run), str(run.record.get("pid") or "-"),
                      progress_text(run), _gpus_text(n.report.gpus))
    parts.append(table)
    return Group(*parts)


def cluster_runs(out: Output, runs: list[ClusterRun], as_json: bool) -> None:
    if as_json:
        out.json_doc([run.to_json() for run in runs])
        return
    console = out.console(stderr=False)
    if not runs:
        console.print("no runs on these nodes yet")
        return
    table = Table(box=None, pad_edge=False)
    for name in ("run", "task", "state", "started", "duration", "nodes"):
        table.add_column(name, header_style="bold", no_wrap=name != "nodes")
    for run in runs:
        first = run.present[0][1]
        state, reason = run.state()
        nodes = ", ".join(f"{node.index}: {node.address.spec()} {r.state.value}" for node, r in run.present)
        table.add_row(first.label, first.task, _state_label(state, reason), local_time(first.started_at),
                      duration(first.elapsed_s), nodes)
    console.print(table)


# one call whatever the scope (gpuctl.commands.scope): the result's type says how it is shown -----------------

def launched(out: Output, result: LaunchResult | ClusterLaunch, as_json: bool, to_stderr: bool,
             show_tail: bool) -> None:
    from gpuctl.commands.detached import LaunchResult  # (the launch imported it)

    if not isinstance(result, LaunchResult):  # a multi-node run's ClusterLaunch
        cluster_launch(out, result, as_json=as_json, to_stderr=to_stderr)
    else:
        launch_result(out, result, as_json=as_json, to_stderr=to_stderr, show_tail=show_tail)


def runs(out: Output, found: ContainerRuns | ClusterRuns, as_json: bool) -> None:
    if not isinstance(found, ContainerRuns):  # a multi-node run's ClusterRuns
        cluster_runs(out, found.runs, as_json=as_json)
    else:
        runs_table(out, found.runs, found.ctid, found.host, as_json=as_json)


def killed(out: Output, done: Killed) -> None:
    for where, result in done.results:
        kill_result(out, result, where)
