"""What the container prints never takes over the terminal (issues 24, 38): every remote text gpuctl shows has its
control characters made visible (\\xNN), however deep a table or group nests it; `logs` writes the log's bytes
unchanged to a pipe, and to a terminal only with --raw."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import signal
import subprocess
import sys
import time

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


# What a container's nvidia-smi may call a GPU: a window title (OSC ended by BEL), a clear screen, a C1 CSI.
ESCAPES = "\x1b]0;PWNED\x07\x1b[2J\u009b31m"
ESCAPES_SHOWN = "\\x1b]0;PWNED\\x07\\x1b[2J\\x9b31m"
OSC52 = "\x1b]52;c;cm0gLXJmIH4K\x07"  # a clipboard write ("rm -rf ~")
# Rich's own sequences on a terminal (styles, a live display's cursor moves), which carry no remote text.
RICH_OWN = re.compile(rb"\x1b\[(?:[0-9;]*m|\?25[hl]|[0-9]*[ABCDGK])")


def assert_inert(data: bytes, terminal: bool = False) -> str:
    """Byte by byte: no ESC, no BEL, no C1 CSI (neither U+009B, UTF-8 c2 9b, nor a lone 0x9b byte, which the
    strict decode refuses) beyond Rich's own sequences on a terminal. The text, decoded."""
    rest = RICH_OWN.sub(b"", data) if terminal else data
    text = rest.decode()
    assert b"\x1b" not in rest and b"\x07" not in rest and "\x9b" not in text, rest
    return data.decode()


def run_bytes(gpuctl, *args: str) -> tuple[int, bytes, bytes]:
    proc = subprocess.run([sys.executable, "-m", "gpuctl", *args], cwd=gpuctl.source, env=gpuctl.env,
                          capture_output=True, timeout=120, check=False)
    return proc.returncode, proc.stdout, proc.stderr


def watched(gpuctl, *args: str, terminal: bool) -> bytes:
    """`status --watch` until it has drawn three frames, then Ctrl-C: every byte it wrote on stdout, a pipe or a
    pty."""
    read_end, write_end = pty.openpty() if terminal else os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "gpuctl", "status", "--watch", "--interval", "0.2", *args],
                            cwd=gpuctl.source, env=gpuctl.env, stdout=write_end, stderr=subprocess.DEVNULL)
    os.close(write_end)
    chunks, deadline, stopped = [], time.monotonic() + 60, False
    while True:
        if not stopped and (b"".join(chunks).count(b"Ctrl-C stops") >= 3 or time.monotonic() > deadline):
            proc.send_signal(signal.SIGINT)
            stopped = True
        try:
            data = os.read(read_end, 65536)
        except OSError:  # EIO: the pty's other side closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(read_end)
    assert proc.wait(timeout=30) == 130
    return b"".join(chunks)


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


def test_logs_are_made_visible_to_a_terminal_and_a_pipe_alike_unless_raw(gpuctl):
    """`gpuctl logs | tail` on a terminal shows what the pipe got: the gate applies wherever the output goes;
    --raw is the one way to the bytes as they are."""
    launched = gpuctl.launch_fake("steps=1", SAY)
    assert launched.code == 0, launched.stderr
    assert gpuctl("logs", "-f").code == 0  # the run has ended
    log = gpuctl.path("/workspace/train_tl1.log").read_bytes()
    assert PAYLOAD.encode() in log

    for args in (["logs"], ["logs", "-f"]):
        piped = subprocess.run([sys.executable, "-m", "gpuctl", *args], cwd=gpuctl.source, env=gpuctl.env,
                               capture_output=True, check=False)
        assert piped.returncode == 0 and SHOWN in assert_inert(piped.stdout), args
    raw = subprocess.run([sys.executable, "-m", "gpuctl", "logs", "--raw"], cwd=gpuctl.source, env=gpuctl.env,
                         capture_output=True, check=False)
    assert raw.returncode == 0 and raw.stdout == log  # --raw: `cat`
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


def test_no_remote_field_reaches_the_terminal_through_status_runs_or_watch(gpuctl, standin, ctid):
    """A GPU's name, a record's config (an OSC 52 clipboard write), log path and pid, a setup's venv: visible in
    status (a Group of a grid and a table), runs, and status --watch to a pipe and to a pty; exact in --json."""
    gpus = [{"name": f"H200{ESCAPES}", "utilization": 1, "memory_used_mib": 2, "memory_total_mib": 3}]
    standin.set_gpus(ctid, gpus)
    assert gpuctl.launch_fake("steps=1").code == 0
    assert gpuctl("logs", "-f").code == 0  # ended
    records = gpuctl.path("/workspace/.gpuctl")
    record = json.loads((records / "tl1.json").read_text())
    record.update(config=OSC52, log_path=f"/workspace/train_tl1.log{ESCAPES}", pid=f"7{ESCAPES}")
    (records / "tl1.json").write_text(json.dumps(record))
    setup = dict(record, task="setup", venv=f"/opt/venv{ESCAPES}", python=f"python3{ESCAPES}")
    (records / "tl2.json").write_text(json.dumps(setup))

    for args in (["status"], ["status", "--run", "1"], ["runs"]):
        code, out, err = run_bytes(gpuctl, *args)
        assert code == 0, err
        shown = assert_inert(out)
        assert_inert(err)
        assert ESCAPES_SHOWN in shown, (args, shown)
    code, out, _ = run_bytes(gpuctl, "status", "--run", "1")
    assert "\\x1b]52;c;cm0gLXJmIH4K\\x07" in out.decode()  # the config, visibly
    for args in (["status", "--json", "--run", "1"], ["runs", "--json"]):
        code, out, err = run_bytes(gpuctl, *args)
        assert code == 0, err
        assert_inert(out)  # json.dumps escapes them: \u001b
    doc = json.loads(run_bytes(gpuctl, "status", "--json", "--run", "1")[1])
    assert (doc["config"], doc["gpus"][0]["name"]) == (OSC52, f"H200{ESCAPES}")
    # a pid that is no integer is a malformed record: left out, and named (JSON-escaped) in the record's problem
    assert doc["pid"] is None and doc["record_problem"].startswith('pid is "7\\u001b]0;PWNED')

    piped = assert_inert(watched(gpuctl, "--run", "1", terminal=False))
    assert ESCAPES_SHOWN in piped and "\\x1b]52;c;" in piped
    drawn = assert_inert(watched(gpuctl, "--run", "1", terminal=True), terminal=True)
    assert "PWNED" in drawn and "\\x1b]52;c;" in drawn


def test_every_renderer_shows_remote_text_visibly_whatever_nests_it():
    """The renderers themselves, to a pipe and to a terminal (styles on): the fields no stand-in script can set
    (nvidia-smi's error line, a node's pid in the multi-node table, a retry's last failure), errors and messages."""
    from gpuctl.address import Address
    from gpuctl.commands.fanout import Node
    from gpuctl.commands.nodes import ClusterStatus, NodeStatus
    from gpuctl.commands.status import Gpu, StatusReport
    from gpuctl.runs import Run
    from gpuctl.ui import render
    from gpuctl.ui.output import Output

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    record = {"pid": f"7{ESCAPES}", "pgid": 7, "config": OSC52, "log_path": f"/w/tl1.log{ESCAPES}", "exit_code": 1,
              "attempt": 2, "retries_left": 0, "attempts": ["tl0"], "last_failure": f"boom{ESCAPES}",
              "started_at": 1.0, "ended_at": 2.0}
    run = Run(1, record, alive=False, log_size=10)
    report = StatusReport(ctid=200, host="h", container_status="running", run=run,
                          gpus=[Gpu(0, f"H200{ESCAPES}", 1, 2, 3)], last_line=f"said{ESCAPES}")
    no_gpus = StatusReport(ctid=200, host="h", container_status="running",
                           run=Run(2, dict(record, task="setup", venv=f"/v{ESCAPES}"), alive=False), gpus=[],
                           gpus_error=f"nvidia-smi{ESCAPES}")
    nodes = [NodeStatus(Node(k, Address(host="h", ct=200 + k)), report) for k in range(2)]
    for stream in (io.StringIO, Terminal):
        stdout, stderr = stream(), stream()
        out = Output(stdout=stdout, stderr=stderr)
        for shown in (report, no_gpus, ClusterStatus(nodes, 1)):
            out.show(render.status_renderable(shown))
        render.runs_table(out, [run], 200, "h", as_json=False)
        out.error(f"a script said{ESCAPES}")
        out.message(f"a script said{ESCAPES}")
        for text in (stdout.getvalue(), stderr.getvalue()):
            shown = assert_inert(text.encode(), terminal=stream is Terminal)
            assert shown.count("PWNED") >= 2, shown


# One byte that is not UTF-8 (issue 38): it shows as U+FFFD and breaks no command.
NOT_UTF8 = b"bad \xff byte"


def test_a_byte_that_is_not_utf8_in_a_logs_last_line_reaches_the_next_attempts_record_as_utf8(gpuctl):
    """`--retry`: the failed attempt's last line goes into the next attempt's record (last_failure); the wrapper
    writes it as valid UTF-8, so the record stays JSON and every command reads it."""
    launched = gpuctl.launch_fake("exit_seq=3,0", f"say={NOT_UTF8.hex()}",
                                  extra=("--retry", "1", "--retry-delay", "0.2"))
    assert launched.code == 0, launched.stderr
    assert run_bytes(gpuctl, "logs", "-f", "--run", "2")[0] == 0  # the second attempt ends well
    text = gpuctl.path("/workspace/.gpuctl/tl2.json").read_bytes().decode()  # strict: valid UTF-8
    assert json.loads(text)["last_failure"] == "exit 3, no step logged: bad \ufffd byte"
    for args in (["status"], ["status", "--json"], ["runs"], ["runs", "--json"], ["logs"], ["logs", "-f"], ["kill"]):
        code, _, err = run_bytes(gpuctl, *args)
        assert code == 0 and b"internal error" not in err, (args, err)
    assert "last failure: exit 3, no step logged: bad \ufffd byte" in gpuctl("status").stdout
    assert gpuctl("status", "--json").json()["last_failure"].endswith("bad \ufffd byte")


def test_a_byte_that_is_not_utf8_in_a_record_breaks_no_command(gpuctl, tmp_path):
    """A record that holds it raw (written by anything in the container): status, runs, logs, logs -f, kill,
    pull and plot exit 0 as before, and show U+FFFD."""
    assert gpuctl.launch_fake("steps=2").code == 0
    assert gpuctl("logs", "-f").code == 0
    path = gpuctl.path("/workspace/.gpuctl/tl1.json")
    record = path.read_bytes()
    path.write_bytes(record.replace(b'"config": "', b'"config": "' + NOT_UTF8 + b" "))
    for args in (["status"], ["status", "--json"], ["runs"], ["runs", "--json"], ["logs"], ["logs", "-f"],
                 ["kill"], ["pull", str(tmp_path / "pulled")], ["plot", "-o", str(tmp_path / "p.png")]):
        code, _, err = run_bytes(gpuctl, *args)
        assert code == 0 and b"internal error" not in err, (args, err)
    assert gpuctl("status", "--json").json()["config"].startswith("bad \ufffd byte ")
    assert "bad \ufffd byte" in gpuctl("status").stdout
    assert gpuctl("runs", "--json").json()[0]["config"].startswith("bad \ufffd byte ")
