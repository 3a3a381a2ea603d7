"""`gpuctl plot`: a run's loss and tokens/s against step, and its acceptance length τ on the held-out prompts
where the trainer evaluated it, drawn with matplotlib (the optional extra `plot`).

A resumed run is drawn with the runs it continued, a dashed line where each resumed run took over (the
metrics are fetched over SSH; the figure is drawn here).
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpuctl import paths
from gpuctl.commands.status import MetricsHistory
from gpuctl.errors import ExitCode, GpuctlError, usage_error

FORMATS = {".png", ".svg", ".pdf"}


def install_hint() -> str:
    """How to get matplotlib into the environment gpuctl runs in: the package itself, or this project's own
    extra from its checkout. Never `pip install 'gpuctl[plot]'`: on the package index `gpuctl` is an unrelated
    project, so that would install someone else's package."""
    hint = "pip install matplotlib"
    if (paths.SOURCE_ROOT / "pyproject.toml").is_file():  # running from a checkout (an editable install too)
        hint += f" (or this project's extra: pip install '{paths.SOURCE_ROOT}[plot]')"
    return f"{hint}, with the python that runs gpuctl ({sys.executable})"


def check_output(path: Path) -> None:
    """Before connecting: matplotlib is there, and the output path makes sense."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise usage_error(f"gpuctl plot needs matplotlib: {install_hint()}") from None
    if path.suffix.lower() not in FORMATS:
        raise usage_error(f"-o must end in {', '.join(sorted(FORMATS))}, got {str(path)!r}")
    if not path.parent.is_dir():
        raise usage_error(f"-o: no such directory: {path.parent}")


def series(history: MetricsHistory, key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], float(r[key])) for r in history.records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def draw(history: MetricsHistory, path: Path) -> tuple[int, int]:
    """Write the figure; returns the number of loss points and of τ points drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: no global state, no display
    from matplotlib.figure import Figure

    steps, losses = series(history, "loss")
    if not steps:
        latest = history.runs[-1].run_id if history.runs else "the run"
        raise GpuctlError(f"{latest} has no loss in its metrics yet: nothing to plot", ExitCode.RUN_FAILED)
    rate_steps, rates = series(history, "tokens_per_s")
    tau_steps, taus = series(history, "acceptance_length")
    figure = Figure(figsize=(8, 7.5 if taus else 5.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(3 if taus else 2, 1, sharex=True)
    loss_ax, rate_ax = axes[0], axes[-1]
    loss_ax.plot(steps, losses, marker="." if len(steps) < 60 else None, color="tab:blue")
    loss_ax.set_ylabel("loss")
    rate_ax.plot(rate_steps, rates, marker="." if len(rate_steps) < 60 else None, color="tab:green")
    rate_ax.set_ylabel("tokens/s")
    rate_ax.set_xlabel("step")
    if taus:
        axes[1].plot(tau_steps, taus, marker=".", color="tab:red")
        axes[1].set_ylabel("τ (held-out)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        for step in history.resumed_at:
            ax.axvline(step, color="gray", linestyle="--", linewidth=1)
    for step, run in zip(history.resumed_at, history.runs[1:]):
        loss_ax.text(step, 0.97, f" {run.run_id} resumed", transform=loss_ax.get_xaxis_transform(), va="top",
                     color="gray", fontsize=9)
    runs = " → ".join(run.run_id for run in history.runs)
    latest = history.runs[-1]
    total = next((r.get("total_steps") for r in reversed(history.records) if r.get("total_steps")), None)
    config = latest.record.get("config", "?")
    # The config's name is the record's text, shown as typed: never mathtext nor TeX (a `$` would parse it).
    figure.suptitle(f"{runs}  ({config}; step {steps[-1]}" + (f" of {total})" if total else ")"), parse_math=False,
                    usetex=False)
    figure.savefig(path)
    return len(steps), len(taus)
