"""The core's pure parts, without a host: address resolution, script rendering, run states, remote output."""

from __future__ import annotations

import os
import re

import jinja2
import pytest

from gpuctl import __version__ as gpuctl_version
from gpuctl import address, commands, paths, timeouts
from gpuctl.commands.options import check_env
from gpuctl.errors import ExitCode, GpuctlError
from gpuctl.remote import scripts, ssh
from gpuctl.remote.protocol import (
    LAUNCH_WAITING,
    FollowStart,
    KillReply,
    LaunchReply,
    MetricsChain,
    ScriptExit,
    parse_follow_start,
    parse_sections,
    section,
)
from gpuctl.runs import Run, State, check_run_name, parse_progress, parse_run_ref, parse_signal
from tests.conftest import command_line


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path


def write_config(xdg, text: str) -> None:
    (xdg / "config" / "gpuctl").mkdir(parents=True)
    (xdg / "config" / "gpuctl" / "config.toml").write_text(text)


def test_resolution_order_flag_env_remembered_config(xdg):
    write_config(xdg, 'host = "cfg-host"\nct = 300\nuser = "cfg-user"\nport = 2200\n')
    assert address.resolve(address.AddressFlags(), env={}) == address.Address(host="cfg-host", ct=300, user="cfg-user",
                                                                          port=2200)
    address.remember(address.Address(host="cfg-host", ct=301, user="launch-user"))
    remembered = address.resolve(address.AddressFlags(), env={})
    assert (remembered.ct, remembered.user, remembered.port) == (301, "launch-user", 2200)
    from_env = address.resolve(address.AddressFlags(), env={"GPUCTL_CT": "302", "GPUCTL_USER": "env-user"})
    assert (from_env.ct, from_env.user) == (302, "env-user")
    from_flag = address.resolve(address.AddressFlags(ct=303), env={"GPUCTL_CT": "302"})
    assert from_flag.ct == 303
    # Another host: the remembered container is not carried over to it, the config's still is.
    elsewhere = address.resolve(address.AddressFlags(host="other"), env={})
    assert (elsewhere.host, elsewhere.ct) == ("other", 300)


def test_positional_target(xdg):
    t = address.resolve(address.AddressFlags(target="me@pve1:2222/205"), env={})
    assert (t.user, t.host, t.port, t.ct) == ("me", "pve1", 2222, 205)
    assert address.resolve(address.AddressFlags(target="[::1]/205"), env={}).host == "::1"
    with pytest.raises(GpuctlError, match="TARGET says ct 205 but --ct says 206"):
        address.resolve(address.AddressFlags(target="pve1/205", ct=206), env={})


@pytest.mark.parametrize("env, message", [
    ({"GPUCTL_HOST": "h", "GPUCTL_CT": "x"}, "GPUCTL_CT: container id must be a number"),
    ({"GPUCTL_HOST": "h", "GPUCTL_CT": "200", "GPUCTL_PORT": "0"}, "GPUCTL_PORT: port must be"),
    ({"GPUCTL_CT": "200"}, "no host"),
])
def test_bad_target_values_are_usage_errors(xdg, env, message):
    with pytest.raises(GpuctlError, match=message) as e:
        address.resolve(address.AddressFlags(), env=env)
    assert e.value.code == ExitCode.USAGE


def test_broken_config_file_is_a_usage_error(xdg):
    write_config(xdg, "host = [unterminated\n")
    with pytest.raises(GpuctlError, match="cannot read .*config.toml") as e:
        address.resolve(address.AddressFlags(host="h", ct=200), env={})
    assert e.value.code == ExitCode.USAGE


def test_an_unknown_config_key_is_one_warning_naming_the_nearest(xdg, capsys):
    from gpuctl import cli

    write_config(xdg, 'host = "h"\nct = 200\nhots = "typo"\n[profiles.a]\nct = 201\n')
    assert cli.run(["launch", "--dry-run"]) == ExitCode.OK
    captured = capsys.readouterr()
    said = " ".join(captured.err.split())  # (Rich wraps a long message)
    assert said == (f"gpuctl: warning: {xdg}/config/gpuctl/config.toml: unknown key 'hots' is ignored "
                    "(did you mean 'host'?)")
    assert "pct exec 200 -- /bin/bash -s" in captured.out  # the rest of the file still counts
    (xdg / "config" / "gpuctl" / "config.toml").write_text('host = "h"\nct = 200\nzzz = 1\n')
    assert cli.run(["launch", "--dry-run"]) == ExitCode.OK
    said = " ".join(capsys.readouterr().err.split())
    assert said.count("gpuctl: ") == 1 and "unknown key 'zzz' is ignored (known keys: clusters, connect_timeout" in said


@pytest.mark.parametrize("args", [[], ["--version"], ["--help"], ["status", "--help"], ["launch", "--help"]])
def test_the_cli_starts_without_what_its_commands_use(args):
    """Importing the CLI, --version and --help import neither the SSH layer (paramiko) nor torch, Rich, jinja2 or
    tenacity: each command imports what it uses when it runs (a CLI that starts at once)."""
    import subprocess
    import sys

    from tests.cli.conftest import REPO

    heavy = ("paramiko", "torch", "rich", "jinja2", "tenacity", "invoke")
    code = ("import sys; from gpuctl import cli; sys.argv[1:] and cli.run(sys.argv[1:]); "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})), file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, check=True,
                          timeout=60)
    assert done.stderr.splitlines()[-1] == "[]", done.stderr
    if args == ["--version"]:
        assert done.stdout == f"gpuctl {gpuctl_version}\n"


def _cli(*args: str) -> str:
    import subprocess
    import sys

    from tests.cli.conftest import REPO

    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("GPUCTL_")} | {"COLUMNS": "80"}
    done = subprocess.run([sys.executable, "-m", "gpuctl", *args], cwd=REPO, capture_output=True, text=True,
                          check=True, timeout=60, env=env)
    return done.stdout


def test_help_lines_are_whole_and_launch_help_lists_the_presets():
    """Issue 39: `gpuctl --help` cut each command's line with "..."; `launch --help` named no preset."""
    import inspect as inspecting

    from gpuctl.cli.app import app
    from gpuctl.config_schema import load_schema

    top = " ".join(_cli("--help").split("Commands:")[1].split())
    assert "..." not in top and "…" not in top
    for info in app.registered_commands:
        first = " ".join(inspecting.cleandoc(info.callback.__doc__).split("\n\n")[0].split())
        assert re.split(r"(?<=\.)\s", first, maxsplit=1)[0] in top, info.callback.__name__
    lines = _cli("launch", "--help").splitlines()
    schema = load_schema()
    for name in schema["presets"]:
        summary = schema["preset_summaries"][name]
        assert summary and any(line.split() == [name, *summary.split()] for line in lines), (name, lines[-8:])


def test_presets_prints_each_preset_with_its_key_settings():
    import json

    text = _cli("presets")
    assert "tiny\n    A tiny random Qwen3 target and its data" in text
    assert 'tiny-regenerate  (--task regenerate)\n' in text
    assert 'random_target = "qwen3-8b", devices = [0], dtype = "bfloat16", max_steps = 100,' in text
    doc = {p["name"]: p for p in json.loads(_cli("presets", "--json"))}
    assert doc["tiny"]["task"] == "train" and doc["tiny"]["settings"]["max_steps"] == 60
    assert doc["smollm2-135m-regenerate"]["task"] == "regenerate"


def test_the_ssh_layer_imports_invoke_only_for_a_match_exec(tmp_path):
    """paramiko imports invoke (a third of its import time) only to run `Match exec`: gpuctl's SSH layer comes
    without it, and an ssh_config with a `Match exec` still works (invoke is brought in for it)."""
    import subprocess
    import sys

    from tests.cli.conftest import REPO

    plain, matching = tmp_path / "plain", tmp_path / "matching"
    plain.write_text("Host pve\n    User plain\n")
    matching.write_text("Match exec true\n    User matched\nHost *\n    User other\n")
    code = ("import sys; from gpuctl.remote import ssh; print('invoke' in sys.modules); "
            "print(ssh.load_ssh_config(sys.argv[1]).lookup('pve').get('user'), 'invoke' in sys.modules); "
            "print(ssh.load_ssh_config(sys.argv[2]).lookup('pve').get('user'), 'invoke' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(plain), str(matching)], cwd=REPO, capture_output=True,
                          text=True, check=True, timeout=60)
    assert done.stdout.splitlines() == ["False", "plain False", "matched True"]


def test_what_a_command_gets_ready_while_connecting_is_done_with_the_connection():
    """session.alongside: the work (status's imports and script compiling) runs in its own thread while the body
    (the connection) runs, and has ended when the body has; a failure in it is not raised there but met again
    where the thing is used, with its own error (a failed import is not cached)."""
    import importlib
    import threading

    from gpuctl.commands.session import alongside

    ran = []
    with alongside(lambda: ran.append(threading.current_thread() is not threading.main_thread())):
        pass
    assert ran == [True]
    with alongside(lambda: importlib.import_module("gpuctl_no_such_module")):
        pass  # not raised here
    with pytest.raises(ImportError, match="gpuctl_no_such_module"):
        importlib.import_module("gpuctl_no_such_module")
    with pytest.raises(GpuctlError, match="the body's own"), alongside(lambda: None):
        raise GpuctlError("the body's own", ExitCode.HOST)


def test_scripts_quote_every_value_and_refuse_missing_ones():
    rendered = scripts.render("run.sh", stage_dir="/root/gpuctl", workdir="/w d", python="py",
                              module="training.train", config="a'b", sets=["k=$(x)"], resume=False, takes_resume=True,
                              env=[("NCCL_DEBUG", "$(y) z")], rendezvous=[])
    assert "cd '/w d'" in rendered
    assert "export NCCL_DEBUG='$(y) z'" in rendered
    assert "--config 'a'\"'\"'b' --set 'k=$(x)' \"$@\"" in rendered  # "$@": a --retry attempt's --resume
    with pytest.raises(jinja2.UndefinedError):
        scripts.render("run.sh", stage_dir="/root/gpuctl")
    with pytest.raises(TypeError):
        scripts.shquote(None)


def test_scripts_exit_with_the_one_definition_of_their_codes():
    """ScriptExit is where the scripts' exit codes are written: the templates name them, the rendering gives the
    numbers gpuctl compares against."""
    sources = {p.name: p.read_text() for p in paths.templates_dir().glob("*.sh.j2")}
    for name, text in sources.items():
        if name != "run.sh.j2":  # the trainer's command: its exit code is the run's, not a script's answer
            assert not re.findall(r"\bexit [1-9]", text), name
    assert {code for text in sources.values() for code in re.findall(r"exits\.(\w+)", text)} == \
        {code.name for code in ScriptExit}
    rendered = (scripts.render("logs.sh", records_dir="/r", run_number=0, follow=False, lines=None, offset=0,
                               heartbeat_s=5)
                + commands.plan_launch(address.Address(host="h", ct=200), commands.LaunchOptions())
                + scripts.render("pull.sh", records_dir="/r", stage_dir="/s", what="export", skip="", run_number=0,
                                 reply_timeout=5))
    for code in ScriptExit:
        assert f"exit {int(code)}" in rendered, code


def test_parse_sections_round_trips_any_bytes():
    data = b"noise\n@@now 4\n12.5\n@@rest 9\n@@x 3\nab\n\n@@empty 0\n\n"
    assert parse_sections(data) == [("now", b"12.5"), ("rest", b"@@x 3\nab\n"), ("empty", b"")]
    assert parse_sections(b"".join(section(name, value) for name, value in parse_sections(data))) == \
        parse_sections(data)


def test_script_replies_decode_into_typed_results():
    digest = "a" * 64
    offer = LaunchReply.parse(section("recovered", b"ada@ws") + section("active", b"3")
                              + section("active_record", b'{"launched_by": "ada@ws"}')
                              + section("manifest", f"{digest}  ./run.sh\n".encode()) + LAUNCH_WAITING)
    assert (offer.recovered, offer.holder, offer.manifest, offer.record) == ("ada@ws", None, {"run.sh": digest}, None)
    assert [(run.number, run.record, run.alive) for run in offer.active] == [(3, {"launched_by": "ada@ws"}, True)]
    assert LaunchReply.parse(section("record", b'{"number": 4}')).record == {"number": 4}

    assert KillReply.parse(b"") == KillReply(run=None, pids=[])
    left = KillReply.parse(section("run", b"4") + section("pids", b"10\n11") + section("record", b'{"pgid": 10}'))
    assert (left.run.number, left.run.record, left.run.alive, left.pids) == (4, {"pgid": 10}, True, [10, 11])

    chain = MetricsChain.parse(section("run", b"5") + section("record", b'{"resumed_from": 4}')
                               + section("metrics", b'{"step": 3}') + section("run", b"4") + section("record", b"{}")
                               + section("metrics", b'{"step": 1}\n{"step": 2}'))
    assert [(run.number, [r["step"] for r in records]) for run, records in chain.links] == [(4, [1, 2]), (5, [3])]

    assert parse_follow_start(b"@@alive\n@@follow 7 120\n") == FollowStart(run=7, offset=120)
    assert parse_follow_start(b"@@follow 7") is None


def run_with(record: dict, alive: bool) -> Run:
    return Run(number=1, record=record, alive=alive)


@pytest.mark.parametrize("record, alive, state", [
    ({}, True, State.STARTING),
    ({"pid": 5}, True, State.RUNNING),
    ({"pid": 5, "exit_code": 0}, False, State.SUCCEEDED),
    ({"pid": 5, "exit_code": 2}, False, State.FAILED),
    ({"pid": 5, "exit_code": 0, "killed_signal": "TERM"}, False, State.KILLED),
    ({"pid": 5}, False, State.LOST),
    ({"pid": 5, "killed_signal": "KILL"}, False, State.KILLED),
])
def test_run_states(record, alive, state):
    assert run_with(record, alive).state == state


def test_progress_and_eta_from_the_metrics_lines():
    first = b'{"step": 0, "total_steps": 100, "time": 1000.0}'
    last = b'{"step": 10, "total_steps": 100, "time": 1020.0, "loss": 1.5, "tokens_per_s": 900.0}'
    progress = parse_progress(first, last, active=True)
    assert (progress.step, progress.loss, progress.tokens_per_s, progress.eta_s) == (10, 1.5, 900.0, 180.0)
    assert parse_progress(first, last, active=False).eta_s is None
    assert parse_progress(first, b'{"step": 1', active=True) is None  # a line caught half-written
    assert parse_progress(None, None, active=True) is None


def test_run_refs_and_signals():
    assert (parse_run_ref(None), parse_run_ref("7"), parse_run_ref("tl12")) == (0, 7, 12)
    assert parse_run_ref("x") == "x"  # a run's name (launch --name): the container looks it up
    assert [parse_signal(s) for s in ("term", "SIGINT", "9")] == ["TERM", "INT", "KILL"]
    for bad in ("tl0", "X", "-1", "a.b", "a*"):
        with pytest.raises(GpuctlError):
            parse_run_ref(bad)


@pytest.mark.parametrize("bad", ["exp\n", "tl7", "7", "../x", "a/b", "Exp", "a" * 33])
def test_a_run_name_is_the_whole_text_a_final_newline_included(bad):
    """Patterns check input whole: `$` alone lets a final newline through (two runs named 'exp')."""
    assert check_run_name("exp") == "exp"
    with pytest.raises(GpuctlError, match="--name takes a short slug"):
        check_run_name(bad)


@pytest.mark.parametrize("bad", ["FOO\n=bar", "FOO", "1X=y", "A B=c", "=x"])
def test_an_env_key_is_the_whole_text_a_final_newline_included(bad):
    assert check_env(["FOO=bar", "X_1="]) == [("FOO", "bar"), ("X_1", "")]
    with pytest.raises(GpuctlError, match="--env takes KEY=VALUE"):
        check_env([bad])


def test_an_address_is_the_whole_text_too():
    assert address.parse_address_arg("root@host/200")["ct"] == 200
    with pytest.raises(GpuctlError):
        address.parse_address_arg("root@host/200\n")


def test_proxyjump_chains_resolve_through_ssh_config(tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text("Host final\n  HostName 10.0.0.5\n  Port 2222\n  ProxyJump alice@hop1:2200,hop2\n"
                      "Host hop2\n  HostName 10.0.0.3\n  User bob\n  ProxyJump ignored-when-chained\n"
                      "Host loop-a\n  ProxyJump loop-b\nHost loop-b\n  ProxyJump loop-a\n"
                      "Host piped\n  ProxyCommand nc %h %p\n")
    endpoint = ssh.resolve_endpoint(address.Address(host="final", ct=200, ssh_config=str(config)))
    hops = []
    while endpoint:
        hops.append((endpoint.hostname, endpoint.port, endpoint.user))
        endpoint = endpoint.jump
    assert hops == [("10.0.0.5", 2222, "root"), ("10.0.0.3", 22, "bob"), ("hop1", 2200, "alice")]
    with pytest.raises(GpuctlError, match="more than 8 hops"):
        ssh.resolve_endpoint(address.Address(host="loop-a", ct=200, ssh_config=str(config)))
    with pytest.raises(GpuctlError, match="ProxyCommand .* is not supported"):
        ssh.resolve_endpoint(address.Address(host="piped", ct=200, ssh_config=str(config)))


def test_profiles_count_where_they_are_named(xdg):
    write_config(xdg, 'host = "cfg-host"\nct = 300\n[profiles.a]\nhost = "a-host"\nct = 301\nuser = "a-user"\n'
                      '[profiles.b]\nct = 302\n')
    assert address.resolve(address.AddressFlags(profile="a"), env={}).host == "a-host"
    from_env = address.resolve(address.AddressFlags(), env={"GPUCTL_PROFILE": "a", "GPUCTL_CT": "310"})
    assert (from_env.host, from_env.ct, from_env.user) == ("a-host", 310, "a-user")  # the env's own value wins
    flag_over_env = address.resolve(address.AddressFlags(profile="b"), env={"GPUCTL_CT": "310"})
    assert (flag_over_env.host, flag_over_env.ct) == ("cfg-host", 302)  # --profile beats the environment
    assert address.resolve(address.AddressFlags(profile="a", ct=303), env={}).ct == 303
    with pytest.raises(GpuctlError, match=r"no profile 'c' .*\(profiles: a, b\)"):
        address.resolve(address.AddressFlags(profile="c"), env={})


def test_resume_takes_an_optional_run_number():
    from gpuctl.cli import _bare_resume

    assert _bare_resume(["launch", "--resume"]) == ["launch", "--resume="]
    assert _bare_resume(["launch", "--resume", "--follow"]) == ["launch", "--resume=", "--follow"]
    assert _bare_resume(["launch", "--resume", "tl3", "pve/200"]) == ["launch", "--resume", "tl3", "pve/200"]
    assert _bare_resume(["launch", "--resume", "7"]) == ["launch", "--resume", "7"]
    assert _bare_resume(["status", "--resume"]) == ["status", "--resume"]  # not launch's: left to the parser


def test_nodes_from_options_profiles_and_clusters(xdg, monkeypatch, capsys):
    """`launch --node`/`--cluster`: each node a target or a profile; the node set is remembered; --dry-run shows
    each node's rendezvous; bad node sets are one-line usage errors."""
    from gpuctl import cli

    for var in address.ENV.values():
        monkeypatch.delenv(var, raising=False)
    write_config(xdg, 'user = "ada"\n[profiles.second]\nhost = "pve2"\nct = 201\nport = 2222\n'
                      '[clusters.big]\nnodes = ["pve1/200", "second"]\n[clusters.bad]\nnodes = "pve1/200"\n')
    flags = address.AddressFlags(identity="/k")
    nodes = address.resolve_nodes(flags, [], "big", env={})
    assert [(t.host, t.ct, t.port, t.user, t.identity) for t in nodes] == [
        ("pve1", 200, None, "ada", "/k"), ("pve2", 201, 2222, "ada", "/k")]
    assert [t.spec() for t in nodes] == ["ada@pve1/200", "ada@pve2:2222/201"]
    assert address.resolve_nodes(flags, ["pve1/200", "second"], None, env={}) == nodes
    for nodes_, cluster, message in ([["pve1"], None, "names no container"], [[], "nope", "no cluster 'nope'"],
                                     [[], "bad", "nodes must be a list"], [["a/200", "a/200"], None, "named twice"]):
        with pytest.raises(GpuctlError, match=message) as e:
            address.resolve_nodes(address.AddressFlags(), nodes_, cluster, env={})
        assert e.value.code == ExitCode.USAGE
    with pytest.raises(GpuctlError, match="leave out TARGET"):
        address.resolve_nodes(address.AddressFlags(ct=300), ["a/200"], None, env={})

    address.remember(nodes[0], nodes=nodes, run=7)
    assert address.remembered_nodes(address.AddressFlags(), env={}) == (nodes, 7)
    assert address.remembered_nodes(address.AddressFlags(), env={"GPUCTL_CT": "300"}) is None  # one container asked for
    assert address.resolve(address.AddressFlags(), env={}).ct == 200  # node 0, for the single-container commands
    address.remember(nodes[1])  # a launch of one container forgets the set
    assert address.remembered_nodes(address.AddressFlags(), env={}) is None

    assert cli.run(["launch", "--cluster", "big", "--dry-run", "--env", "NCCL_SOCKET_IFNAME=eth0",
                    "--master-port", "29600"]) == 0
    plan = capsys.readouterr().out
    assert plan.count("# node ") == 2 and "# node 1 of 2: CT 201 on pve2" in plan
    assert "export RANK=1" in plan and "export WORLD_SIZE=2" in plan and "export MASTER_PORT=29600" in plan
    assert "export NCCL_SOCKET_IFNAME=eth0" in plan and "export MASTER_ADDR='<node 0'\"'\"'s address>'" in plan
    for args, message in ((["--cluster", "big", "--retry", "1"], "--retry is not supported for multi-node"),
                          (["--cluster", "big", "--master-port", "0"], "--master-port must be"),
                          (["--node", "a/200", "--cluster", "big"], "cannot be combined"),
                          (["--cluster", "big", "--env", "WORLD_SIZE=3"], "--env cannot set WORLD_SIZE")):
        assert cli.run(["launch", *args, "--dry-run"]) == ExitCode.USAGE
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_timeouts_come_from_the_config_files_table(xdg):
    assert timeouts.timeouts() == timeouts.Timeouts()  # no config file: the defaults
    write_config(xdg, "[timeouts]\nheartbeat = 10\nprobe = 1.5\n")
    timeouts.timeouts.cache_clear()
    limits = timeouts.timeouts()
    assert (limits.heartbeat, limits.probe, limits.start) == (10.0, 1.5, 30.0)
    assert limits.idle == 40.0  # not given: at least 4 heartbeats, so a link is not taken for dead between two
    assert timeouts.from_table({"heartbeat": 0.3, "idle": 2}, "x").idle == 2.0  # given: as given


@pytest.mark.parametrize("table, message", [
    ("heartbeet = 1", "unknown key timeouts.heartbeet (did you mean 'heartbeat'?)"),
    ("idle = -1", "timeouts.idle must be seconds in (0, 86400], got -1"),
    ('probe = "10"', "timeouts.probe must be seconds in (0, 86400], got '10'"),
])
def test_a_mistake_in_the_timeouts_table_is_exit_2_before_anything_is_sent(xdg, capsys, table, message):
    from gpuctl import cli

    write_config(xdg, f'host = "h"\nct = 200\n[timeouts]\n{table}\n')
    timeouts.timeouts.cache_clear()
    assert cli.run(["launch", "--dry-run"]) == ExitCode.USAGE
    captured = capsys.readouterr()
    said = " ".join(captured.err.split())
    assert said == f"gpuctl: error: {xdg}/config/gpuctl/config.toml: {message}", said
    assert captured.out == ""


def test_characters_that_reorder_or_hide_text_are_shown_and_one_line_fields_stay_one_line():
    """Bidi overrides and isolates, zero-width characters, the BOM and the line separators are escaped like
    controls; a name, task, path or config holding a newline cannot forge the next row of `runs`."""
    import io

    from gpuctl.ui.output import Output, one_line, visible
    from gpuctl.ui.render import runs_table

    tricky = "a\u202eb\u2066c\u2069d\u200be\ufefff\u2028g\u2029h\u061ci"
    assert visible(tricky) == "a\\u202eb\\u2066c\\u2069d\\u200be\\ufefff\\u2028g\\u2029h\\u061ci"
    assert visible("x\ny\tz\x1b") == "x\ny\tz\\x1b" and one_line("x\ny\tz") == "x\\ny\\tz"
    forged = "exp\ntl9 (real) (succeeded)"
    record = {"pid": 5, "exit_code": 1, "name": forged, "task": "train\u202e", "sets": ["lr=1\nx"],
              "log": "/root/gpuctl/train_tl1.log\n"}
    stdout = io.StringIO()
    runs_table(Output(stdout, io.StringIO()), [run_with(record, False)], 200, "pve", as_json=False)
    lines = stdout.getvalue().splitlines()
    assert len(lines) == 2 and "exp\\ntl9 (real) (succeeded)" in lines[1] and "train\\u202e" in lines[1]
    assert not any(c in stdout.getvalue() for c in "\u202e\u2028")
    assert not any(line.endswith((" ", "\t")) for line in lines)  # a pipe gets no padding after the last cell


@pytest.mark.parametrize("name", ["w\x1b]2;pwned\x07\u202ecod.exe", "a\nb", "tab\there", "zero\u200bwidth",
                                  "bom\ufeff", "../up", "/abs", "a/../b"])
def test_pull_refuses_a_file_name_with_controls_or_a_way_out(name):
    """What `pull` would write under DEST: plain relative names only, as the nodes' wire refuses them."""
    from gpuctl.remote import transfer
    from gpuctl.remote.protocol import RemoteFile

    transfer._check_names([RemoteFile("export/model.safetensors", 1, "0" * 64), RemoteFile("a b.json", 1, "0" * 64)])
    with pytest.raises(GpuctlError, match="the container offered a file gpuctl will not write") as refused:
        transfer._check_names([RemoteFile(name, 1, "0" * 64)])
    assert refused.value.code == ExitCode.RUN_FAILED and "\x1b" not in str(refused.value)


def test_a_killed_run_says_by_which_signal_beside_its_exit_and_a_removal_has_one_pair_of_parentheses():
    import io

    from gpuctl.commands.remove import Removed
    from gpuctl.remote.protocol import Removal
    from gpuctl.ui.output import Output
    from gpuctl.ui.render import removed, state_text

    clean = run_with({"pid": 5, "exit_code": 0, "killed_signal": "TERM"}, False)
    forced = run_with({"pid": 5, "exit_code": 143, "killed_signal": "TERM"}, False)
    failed = run_with({"pid": 5, "exit_code": 2}, False)
    assert [state_text(r).plain for r in (clean, forced, failed)] == [
        "killed (by TERM, exit 0)", "killed (by TERM, exit 143)", "failed (exit 2)"]
    named = Run(number=5, record={"pid": 5, "exit_code": 0, "killed_signal": "TERM", "name": "long-one"}, alive=False)
    stdout = io.StringIO()
    removed(Output(stdout, io.StringIO()), Removed([Removal(named, ["/workspace/train_tl5.log"], [])], dry_run=True,
                                                   ctid=200, host="pve"), as_json=False)
    assert stdout.getvalue().splitlines()[0] == "would remove tl5 (long-one), killed: 1 path"


def test_an_error_names_only_the_settings_that_came_from_the_remembered_target():
    from gpuctl.address import FORGET, FROM_REMEMBERED, Address

    keys = ("host", "port", "user", "identity", "ssh_config")
    typed = Address(host="127.0.0.1", ct=200, port=1, identity="/k", sources=(("identity", FROM_REMEMBERED),))
    assert typed.remembered(*keys) == f" (identity from {FROM_REMEMBERED}; {FORGET})"
    everything = Address(host="pve", ct=200, identity="/k",
                         sources=(("host", FROM_REMEMBERED), ("identity", FROM_REMEMBERED), ("ct", FROM_REMEMBERED)))
    assert everything.remembered(*keys) == f" (from {FROM_REMEMBERED}; {FORGET})"
    assert Address(host="pve", ct=200).remembered(*keys) == ""


def test_a_scripts_heartbeat_takes_its_sleep_with_it_when_the_script_ends(tmp_path):
    """The heartbeat of every script gpuctl talks to: stopped at the script's end, it leaves no `sleep` behind in
    the container (one was left after every status and runs, until its sleep ran out)."""
    import subprocess
    import time

    alive_s = "37.25"  # a value no other process sleeps for
    script = scripts.render("lib.sh", records_dir=str(tmp_path), alive_s=alive_s) + "\nsleep 0.2\n"

    def sleepers() -> list[str]:
        return [pid for pid in os.listdir("/proc") if pid.isdigit() and command_line(pid) == f"sleep {alive_s}"]

    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0 and done.stderr.startswith("@@alive"), done.stderr
    deadline = time.monotonic() + 5
    while sleepers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sleepers()

