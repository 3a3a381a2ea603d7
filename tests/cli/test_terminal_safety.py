"""What the container prints never takes over the terminal (issue 24): every remote text gpuctl shows has its
control characters made visible (\\xNN); `logs` writes the log's bytes unchanged to a pipe, and to a terminal
only with --raw."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest

from tests.cli.test_multinode import status_until

pytestmark = pytest.mark.sshd

# A window title, a clear screen, the cursor home, fake red text, a C1 CSI, and a progress bar's carriage return.
PAYLOAD = "\x1b]0;PWNED\x07\x1b[2J\x1b[H\x1b[31mfake\x1b[0m \x9b 50%\r100%"
SAY = f"say={PAYLOAD.encode().hex()}"
SHOWN = "\\x1b]0;PWNED\\x07\\x1b[2J\\x1b[H\\x1b[31mfake\\x1b[0m \\x9b 50%"  # as gpuctl shows it


def raw_controls(text: str) -> list[str]:
    """The control characters a terminal would act on: C0 but newline and tab, DEL, C1."""
    return [c for c in text if (ord(c) < 32 and c not in "\n\t") or 0x7f <= ord(c) <= 0x9f]


def on_terminal(gpuctl, *args: str) -> tuple[int, bytes]:
    """Run gpuctl with its stdout on a pty: its exit code and every byte the terminal got."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "gpuctl", *args], cwd=gpuctl.source, env=gpuctl.env,
                            stdout=slave, stderr=subprocess.DEVNULL)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the slave side closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=60), b"".join(chunks)


def test_a_run_dying_at_start_shows_its_escapes_visibly(gpuctl):
    launched = gpuctl("launch", "--python", "fake-trainer", "--set", "fake.exit_seq=3", "--set", f"fake.{SAY}")
    assert launched.code == 1, launched.stderr
    assert "ended during its start" in launched.stderr
    assert raw_controls(launched.stderr) == [] and raw_controls(launched.stdout) == []
    assert SHOWN in launched.stderr and "\n100%" in launched.stderr  # the carriage return ends a line

    as_json = gpuctl("launch", "--python", "fake-trainer", "--json", "--set", "fake.exit_seq=3", "--set",
                     f"fake.{SAY}")
    assert raw_controls(as_json.stdout) == []  # json.dumps escapes them: the document stays exact data
    assert json.loads(as_json.stdout)["state"] == "failed"


def test_status_shows_a_nodes_last_line_visibly(two_containers):
    nodes = two_containers
    launched = nodes.launch_fake("steps=100000", "step_s=0.2", "fail_rank=1", SAY,
                                 extra=tuple(nodes.rendezvous_args()))
    assert launched.code == 0, launched.stderr
    doc = status_until(nodes, state="failed")
    assert doc["nodes"][1]["last_line"] == PAYLOAD.split("\r")[0] + "\r100%"  # --json: exact
    human = nodes.gpuctl("status")
    assert raw_controls(human.stdout) == [] and raw_controls(human.stderr) == []
    assert "\\x1b]0;PWNED" in human.stdout and "\\x9b" in human.stdout


def test_logs_to_a_terminal_are_made_visible_unless_raw_and_to_a_pipe_unchanged(gpuctl):
    launched = gpuctl.launch_fake("steps=1", SAY)
    assert launched.code == 0, launched.stderr
    assert gpuctl("logs", "-f").code == 0  # the run has ended
    log = gpuctl.path("/workspace/train_tl1.log").read_bytes()
    assert PAYLOAD.encode() in log

    piped = subprocess.run([sys.executable, "-m", "gpuctl", "logs"], cwd=gpuctl.source, env=gpuctl.env,
                           capture_output=True, check=False)
    assert piped.returncode == 0 and piped.stdout == log  # a pipe: `cat`
    for args in (["logs"], ["logs", "-f"]):
        code, shown = on_terminal(gpuctl, *args)
        text = shown.decode()
        assert code == 0 and raw_controls(text.replace("\r\n", "\n")) == [], (args, text)
        assert SHOWN in text and "\n100%" in text.replace("\r\n", "\n")
        code, raw = on_terminal(gpuctl, *args, "--raw")
        assert code == 0 and PAYLOAD.split("\r")[0].encode() in raw


def test_remote_strings_in_a_table_keep_their_emoji_codes():
    """Rich would turn `:smile:` in a table cell (a config's name, a GPU's) into an emoji: gpuctl shows it as is."""
    import io

    from rich.table import Table

    from gpuctl.ui.output import Output

    stdout = io.StringIO()
    table = Table(box=None)
    table.add_row("config", ":smile: :thumbs_up:")
    Output(stdout=stdout).show(table)
    assert ":smile: :thumbs_up:" in stdout.getvalue()
