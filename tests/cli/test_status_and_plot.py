"""status tells the truth about a dead trainer, shows a loss sparkline, refreshes in place with --watch; plot
draws the metrics; --version, shell completion and NO_COLOR."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

import gpuctl as gpuctl_package
from gpuctl.address import tomllib
from tests.cli.conftest import REPO, Output
from tests.cli.test_lifecycle import LONG, wait_for_state

pytestmark = pytest.mark.sshd

TERMINAL = {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}  # Rich takes the pipe for a terminal
COLOR = re.compile(r"\x1b\[[0-9;]*(3[0-7]|9[0-7]|38;)")


def test_sigkill_of_the_trainer_is_failed_and_of_the_whole_run_lost(gpuctl):
    run = gpuctl.launch_fake(*LONG).json()
    wait_for_state(gpuctl, "running")
    os.kill(run["pid"], signal.SIGKILL)  # the trainer alone: its wrapper records the signal
    doc = gpuctl.status()  # at once: never "running" once the trainer is gone
    assert (doc["state"], doc["exit_code"]) == ("failed", 128 + signal.SIGKILL)
    assert "failed (exit 137)" in gpuctl("status").stdout
    assert gpuctl("logs", "--follow").code == 1

    run = gpuctl.launch_fake(*LONG).json()
    wait_for_state(gpuctl, "running")
    os.killpg(run["pgid"], signal.SIGKILL)  # wrapper and trainer: nobody left to record an exit code
    doc = gpuctl.status()
    assert (doc["run_id"], doc["state"], doc["exit_code"]) == ("tl2", "lost", None)
    assert doc["container"]["status"] == "running" and len(doc["gpus"]) == 2  # the container, as ever


def test_status_sparkline_and_plot(gpuctl, tmp_path):
    assert gpuctl("launch", "--python", "fake-trainer", "--set", "fake.steps=5", "--follow").code == 0
    human = gpuctl("status").stdout
    assert re.search(r"^loss\s+█\S*▁  10 → 2\s*$", human, re.MULTILINE), human  # losses 10, 5, 3.3, 2.5, 2

    image = tmp_path / "tl1.png"
    result = gpuctl("plot", "-o", str(image))
    assert result.code == 0, result.stderr
    assert "5 points of tl1" in result.stderr and result.stdout == ""
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.stat().st_size > 10_000

    gpuctl.launch_fake("steps=0")  # a run that logged nothing
    nothing = gpuctl("plot", "-o", str(image))
    assert nothing.code == 1 and "tl2 has no loss in its metrics yet" in nothing.stderr
    assert gpuctl("plot", "-o", str(tmp_path / "x.jpg")).code == 2


def test_plot_draws_tau_where_the_trainer_evaluated(tmp_path):
    """A run whose metrics carry acceptance lengths gets a τ panel with one point per evaluation."""
    from gpuctl.commands.status import MetricsHistory
    from gpuctl.runs import Run
    from gpuctl.ui.plot import draw

    records = [{"step": s, "loss": 10 / s, "tokens_per_s": 1000.0, **({"acceptance_length": 1 + s / 50}
                                                                       if s % 50 == 0 else {})}
               for s in range(10, 201, 10)]
    history = MetricsHistory([Run(1, {"config": "smollm2-135m"}, alive=False)], records, [])
    with_tau, without = tmp_path / "tau.png", tmp_path / "plain.png"
    assert draw(history, with_tau) == (20, 4)
    assert draw(MetricsHistory(history.runs, [{k: v for k, v in r.items() if k != "acceptance_length"}
                                              for r in records], []), without) == (20, 0)
    from matplotlib.image import imread
    assert imread(with_tau).shape[0] > imread(without).shape[0]  # the third panel makes the figure taller


def test_plot_without_matplotlib_is_one_clear_line(gpuctl, tmp_path):
    hide = "import sys; sys.modules['matplotlib'] = None; from gpuctl.cli import main; main()"
    result = subprocess.run([sys.executable, "-c", hide, "plot", "-o", str(tmp_path / "x.png")], cwd=REPO,
                            env=gpuctl.env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    # this project's own install: on the package index `gpuctl` is an unrelated package (issue 39)
    assert result.stderr == ("gpuctl: error: gpuctl plot needs matplotlib: pip install matplotlib (or this project's "
                             f"extra: pip install '{REPO}[plot]'), with the python that runs gpuctl ({sys.executable})\n")
    assert "gpuctl[plot]" not in result.stderr


def test_status_watch_refreshes_in_place_until_ctrl_c(gpuctl):
    gpuctl.launch_fake("steps=60", "step_s=0.05")
    watcher = gpuctl.popen("status", "--watch", "--interval", "0.2", env=TERMINAL)
    screen = Output(watcher)
    screen.wait_for("succeeded", timeout=60)  # the watcher's own screen, not another connection's status
    watcher.send_signal(signal.SIGINT)
    out, err = screen.finish()
    assert watcher.returncode == 130 and "Traceback" not in err, err
    assert err.endswith("gpuctl: stopped watching\n") and "error" not in err, err  # asked for: not an error
    assert 0 <= out.find("running") < out.rfind("succeeded")  # the same screen, refreshed
    assert "\x1b[2K" in out or "\x1b[1A" in out  # in place: cursor moved back over the previous table
    assert gpuctl("status", "--watch", "--json").code == 2


def test_status_watch_to_a_pipe_prints_each_refresh_as_a_block(gpuctl):
    """Not a terminal: every refresh is written, whole and newline-terminated (a log of the watch, not one frame
    drawn over and over)."""
    gpuctl.launch_fake("steps=40", "step_s=0.05")
    watcher = gpuctl.popen("status", "--watch", "--interval", "0.2")
    screen = Output(watcher)
    seen = screen.wait_for("succeeded", timeout=60)
    screen.wait_for_more(len(seen))  # one more block after it
    watcher.send_signal(signal.SIGINT)
    out, err = screen.finish()
    assert watcher.returncode == 130 and err == "gpuctl: stopped watching\n", err
    blocks = [b for b in re.split(r"(?<=Ctrl-C stops\n)", out) if b]
    assert len(blocks) >= 3 and all(b.endswith("Ctrl-C stops\n") for b in blocks), out[-2000:]
    assert "running" in blocks[0] and "succeeded" in blocks[-1]
    assert "\x1b[" not in out  # no cursor moves into a pipe


def test_version_completion_and_no_color(gpuctl):
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    result = gpuctl("--version")
    assert (result.code, result.stdout) == (0, f"gpuctl {version}\n") and gpuctl_package.__version__ == version

    completion = gpuctl(env={"_GPUCTL_COMPLETE": "complete_bash", "COMP_WORDS": "gpuctl sta", "COMP_CWORD": "1"})
    assert completion.stdout.split() == ["status"]
    options = gpuctl(env={"_GPUCTL_COMPLETE": "complete_bash", "COMP_WORDS": "gpuctl launch --res",
                          "COMP_CWORD": "2"})
    assert options.stdout.split() == ["--resume"]
    assert "_GPUCTL_COMPLETE" in gpuctl("--show-completion", "bash").stdout

    gpuctl("launch", "--python", "fake-trainer", "--set", "fake.steps=1", "--set", "fake.exit=3", "--follow")
    colored = gpuctl("status", env=TERMINAL | {"NO_COLOR": ""})
    plain = gpuctl("status", env=TERMINAL | {"NO_COLOR": "1"})
    assert COLOR.search(colored.stdout) and "failed (exit 3)" in colored.stdout
    assert not COLOR.search(plain.stdout) and "failed (exit 3)" in plain.stdout


def test_plot_shows_record_text_as_typed_never_as_mathtext(tmp_path):
    """A config's name is the record's text: `$x^2$` stays those characters, and a TeX macro matplotlib does not
    know (`$\\undefinedmacro{$`) draws instead of failing with a traceback (issue 38)."""
    import matplotlib

    from gpuctl.commands.status import MetricsHistory
    from gpuctl.runs import Run
    from gpuctl.ui.plot import draw

    config = r"$x^2$ $\undefinedmacro{$"
    history = MetricsHistory([Run(1, {"config": config}, alive=False)],
                             [{"step": s, "loss": 1 / s, "tokens_per_s": 10.0} for s in (1, 2, 3)], [])
    figure = tmp_path / "tl1.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text as <text> elements, not paths
        assert draw(history, figure) == (3, 0)
    assert f"tl1  ({config}; step 3)" in figure.read_text()
