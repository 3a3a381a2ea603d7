"""A run's life through the real gpuctl commands against the stand-in host over real SSH."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from tenacity import retry, stop_after_delay, wait_fixed

from tests.sandbox import ALIAS

pytestmark = pytest.mark.sshd

LONG = ("steps=100000", "step_s=0.05")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@retry(stop=stop_after_delay(20), wait=wait_fixed(0.1), reraise=True)
def wait_for_state(gpuctl, state: str) -> dict:
    doc = gpuctl.status()
    assert doc["state"] == state, doc
    return doc


@retry(stop=stop_after_delay(20), wait=wait_fixed(0.1), reraise=True)
def first_step_logged(gpuctl):
    logs = gpuctl("logs")
    assert "step 1/100000" in logs.stdout, logs.stdout
    return logs


def test_full_lifecycle_launch_status_logs_kill(gpuctl, standin, ctid):
    launched = gpuctl.launch_fake(*LONG, "child=1")
    assert launched.code == 0, launched.stderr
    run = launched.json()
    assert run["run_id"] == "tl1" and run["state"] == "running"
    assert run["log_path"] == "/workspace/train_tl1.log"

    doc = gpuctl.status()
    assert doc["run_id"] == "tl1" and doc["state"] == "running" and doc["exit_code"] is None
    assert doc["pid"] == run["pid"] and alive(doc["pid"])
    assert doc["container"] == {"ctid": ctid, "status": "running", "host": "gpuctl-standin"}
    assert [g["name"] for g in doc["gpus"]] == ["NVIDIA H200", "NVIDIA H200"]
    assert doc["gpus"][0]["memory_total_mib"] == 143771

    wait_for_state(gpuctl, "running")
    logs = first_step_logged(gpuctl)
    assert logs.code == 0
    assert logs.stdout.startswith("argv: ")
    assert logs.stdout == gpuctl.path("/workspace/train_tl1.log").read_text()[:len(logs.stdout)]

    human = gpuctl("status")
    assert human.code == 0 and "tl1" in human.stdout and "running" in human.stdout

    killed = gpuctl("kill", "--grace", "10")
    assert killed.code == 0, killed.stderr
    assert "killed tl1" in killed.stdout
    doc = gpuctl.status()
    assert doc["state"] == "killed" and doc["exit_code"] == 128 + signal.SIGTERM
    assert doc["killed_signal"] == "TERM"
    assert not alive(doc["pid"])
    assert standin.container_processes(ctid) == []  # trainer, wrapper, child, grandchild: all gone

    runs = gpuctl("runs", "--json").json()
    assert [(r["run_id"], r["state"]) for r in runs] == [("tl1", "killed")]


def test_run_survives_the_ssh_session(gpuctl, standin, ctid):
    run = gpuctl.launch_fake(*LONG).json()
    # The launching gpuctl process, its SSH connection and its `pct exec` session have ended (the stand-in
    # SIGKILLs whatever stays in an exec session); the trainer and its wrapper live on.
    assert alive(run["pid"]) and alive(run["pgid"])
    assert sorted(standin.container_processes(ctid)) == sorted([run["pid"], run["pgid"]])
    assert gpuctl.status()["state"] == "running"
    assert gpuctl("kill", "--grace", "5").code == 0


def test_run_that_succeeds(gpuctl):
    result = gpuctl("launch", "--python", "fake-trainer", "--set", "fake.steps=3", "--follow")
    assert result.code == 0, result.stderr
    assert result.stdout.splitlines()[1:] == ["step 1/3 loss 10.0000", "step 2/3 loss 5.0000",
                                              "step 3/3 loss 3.3333", "done, exit 0"]
    assert "tl1 ended: succeeded, exit 0" in result.stderr
    doc = gpuctl.status()
    assert (doc["state"], doc["exit_code"]) == ("succeeded", 0)
    assert doc["progress"]["step"] == 3 and doc["progress"]["total_steps"] == 3
    assert doc["progress"]["loss"] == pytest.approx(10 / 3)
    assert doc["ended_at"] is not None and doc["elapsed_s"] >= 0


def test_run_that_fails(gpuctl):
    launched = gpuctl.launch_fake("steps=20", "step_s=0.05", "exit=3", "hold=/workspace/release")  # ends when told
    assert launched.code == 0, launched.stderr
    gpuctl.path("/workspace/release").touch()
    followed = gpuctl("logs", "--follow")
    assert followed.code == 1
    assert followed.stdout.rstrip().endswith("done, exit 3")
    assert followed.stdout == gpuctl.path("/workspace/train_tl1.log").read_text()  # every line, once
    doc = gpuctl.status()
    assert (doc["state"], doc["exit_code"]) == ("failed", 3)
    assert gpuctl("logs", "--follow").code == 1  # following an ended run: its outcome at once


def test_run_that_dies_during_launch_prints_its_tail(gpuctl):
    result = gpuctl("launch", "--python", "fake-trainer", "--set", "fake.steps=0", "--set", "fake.exit=7")
    assert result.code == 1
    assert "done, exit 7" in result.stderr  # the log's tail
    assert gpuctl.status()["exit_code"] == 7


def test_numbering_continues_past_nine_and_overwrites_nothing(gpuctl):
    for n in range(1, 10):
        gpuctl.path(f"/workspace/train_tl{n}.log").write_text(f"old log {n}\n")
    gpuctl.path("/workspace/train_tl04.log").write_text("zero-padded\n")
    first = gpuctl.launch_fake("steps=1").json()
    second = gpuctl.launch_fake("steps=1").json()
    assert (first["run_id"], second["run_id"]) == ("tl10", "tl11")
    assert first["log_path"] == "/workspace/train_tl10.log"
    for n in range(1, 10):
        assert gpuctl.path(f"/workspace/train_tl{n}.log").read_text() == f"old log {n}\n"
    assert gpuctl.path("/workspace/train_tl04.log").read_text() == "zero-padded\n"
    assert gpuctl.path("/workspace/train_tl10.log").read_text().startswith("argv: ")


def test_second_launch_while_one_runs_is_refused_then_replaced(gpuctl, standin, ctid):
    first = gpuctl.launch_fake(*LONG).json()
    again = gpuctl.launch_fake(*LONG)
    assert again.code == 5
    assert "tl1 is active" in again.stderr and "--replace" in again.stderr
    assert again.stdout == ""
    assert alive(first["pid"])

    replaced = gpuctl.launch_fake(*LONG, extra=("--replace",))
    assert replaced.code == 0, replaced.stderr
    assert replaced.json()["run_id"] == "tl2"
    assert not alive(first["pid"])
    runs = {r["run_id"]: r["state"] for r in gpuctl("runs", "--json").json()}
    assert runs == {"tl1": "killed", "tl2": "running"}
    assert gpuctl("kill", "--grace", "5").code == 0


def test_launch_lock_held_elsewhere_is_a_conflict_naming_the_holder(gpuctl, standin, ctid):
    records = gpuctl.path("/workspace/.gpuctl")
    records.mkdir(parents=True)
    (records / "launch.holder").write_text("ada@workstation-2 (gpuctl pid 4242)\n")
    holder = standin.start_detached(ctid, "flock /workspace/.gpuctl/launch.lock sleep 300")
    result = gpuctl.launch_fake("steps=1")
    assert result.code == 5
    assert "another launch holds" in result.stderr and "ada@workstation-2" in result.stderr
    assert not list(records.glob("tl*.json"))  # nothing was started
    os.killpg(holder, signal.SIGKILL)  # flock and its sleep, which holds the lock too
    assert gpuctl.launch_fake("steps=1").code == 0  # the lock died with its holder


def test_round_trips_per_command(gpuctl):
    def remote_commands(*args: str) -> int:
        result = gpuctl(*args, env={"GPUCTL_TRACE": "1"})
        return int(result.stderr.split(" remote commands")[0].rsplit(" ", 1)[1])

    assert remote_commands("launch", "--python", "fake-trainer", "--set", "fake.steps=100000") == 2
    assert remote_commands("status") == 1
    assert remote_commands("logs", "-n", "5") == 1
    assert remote_commands("runs") == 1
    assert gpuctl("kill", "--grace", "5").code == 0


def test_kill_escalates_and_leaves_no_process_of_the_run(gpuctl, standin, ctid):
    # A bystander in the same container, named like a trainer: kill must not touch it.
    bystander_pid = standin.start_detached(ctid, "python3 -c 'import time; time.sleep(300)'")
    run = gpuctl.launch_fake(*LONG, "child=1", "ignore_term=1").json()
    wait_for_state(gpuctl, "running")

    result = gpuctl("kill", "--grace", "0.5")
    assert result.code == 0, result.stderr
    assert "SIGKILL" in result.stdout
    doc = gpuctl.status()
    assert (doc["state"], doc["exit_code"]) == ("killed", 128 + signal.SIGKILL)
    assert not alive(run["pid"])
    assert standin.container_processes(ctid) == [bystander_pid]
    assert alive(bystander_pid)
    os.kill(bystander_pid, signal.SIGKILL)


def test_kill_delivers_the_signal_once_and_records_a_graceful_exit(gpuctl):
    gpuctl.launch_fake(*LONG, "term_exit=0", "child=1")
    wait_for_state(gpuctl, "running")
    result = gpuctl("kill", "--grace", "10")
    assert result.code == 0 and "SIGKILL" not in result.stdout
    log = gpuctl("logs").stdout
    assert "got SIGTERM #1" in log and "#2" not in log  # group signalled once, the wrapper passes nothing on
    assert log.rstrip().endswith("stopping at a step boundary")
    doc = gpuctl.status()
    assert (doc["state"], doc["exit_code"]) == ("killed", 0)


def test_kill_with_nothing_running(gpuctl):
    assert gpuctl("kill").code == 0  # no runs at all
    gpuctl("launch", "--python", "fake-trainer", "--set", "fake.steps=1", "--follow")
    result = gpuctl("kill")
    assert result.code == 0 and "not running (succeeded)" in result.stderr
    assert gpuctl.status()["state"] == "succeeded"


def test_logs_tail_and_run_selection(gpuctl):
    gpuctl("launch", "--python", "fake-trainer", "--set", "fake.steps=4", "--follow")
    gpuctl("launch", "--python", "fake-trainer", "--set", "fake.steps=2", "--follow")
    assert gpuctl("logs", "-n", "2").stdout == "step 2/2 loss 5.0000\ndone, exit 0\n"
    assert gpuctl("logs", "--run", "tl1", "-n", "1").stdout == "done, exit 0\n"
    assert gpuctl("logs", "--run", "1").stdout.count("\n") == 6
    missing = gpuctl("logs", "--run", "9")
    assert missing.code == 2 and "no run tl9" in missing.stderr


def test_ctrl_c_detaches_from_follow_and_leaves_the_run(gpuctl):
    gpuctl.launch_fake(*LONG)
    follower = gpuctl.popen("logs", "--follow")
    assert follower.stdout.readline().startswith("argv: ")
    follower.send_signal(signal.SIGINT)
    _, err = follower.communicate(timeout=20)
    assert follower.returncode == 130
    assert "detached" in err and "Traceback" not in err
    assert err == "gpuctl: detached; the run goes on (gpuctl logs -f follows it again)\n", err  # not an error
    assert gpuctl.status()["state"] == "running"
    assert gpuctl("kill", "--grace", "5").code == 0


def test_launch_follow_streams_until_the_end(gpuctl):
    result = gpuctl("launch", "--python", "fake-trainer", "--set", "fake.steps=30", "--set", "fake.step_s=0.02",
                    "--follow")
    assert result.code == 0
    log = gpuctl.path("/workspace/train_tl1.log").read_text()
    assert result.stdout == log  # stdout is the log and nothing else
    assert "started tl1" in result.stderr


def test_dry_run_runs_nothing(gpuctl):
    result = gpuctl("launch", "--dry-run", "--set", "lr=1e-4", "--log-dir", "/workspace/logs")
    assert result.code == 0
    assert f"pct exec {gpuctl.ctid} -- /bin/bash -s" in result.stdout
    # A summary first (what is staged, the command, the log), the ~300 lines of script after it.
    summary = result.stdout[:result.stdout.index("\n\n")].splitlines()
    assert summary[0] == f"# gpuctl launch --dry-run: nothing is sent to CT {gpuctl.ctid} on {ALIAS}, nothing runs."
    assert summary[1].startswith("# stage:   gpuctl-wrapper.sh, run.sh, training/ in /root/gpuctl (")
    assert summary[2].startswith("# command: '<interpreter>' -m training.train --config tiny --set lr=1e-4   (in "
                                 "/workspace; ")
    assert summary[3].startswith("# log:     /workspace/logs/train_tlN.log ")
    assert len(summary) == 5 and result.stdout.count("\n") > 100
    assert "--set lr=1e-4" in result.stdout
    assert not gpuctl.path("/workspace/.gpuctl").exists()
    assert not gpuctl.path("/root/gpuctl/training").exists()


def test_launch_stages_the_package_and_clears_the_compile_cache(gpuctl):
    cache = gpuctl.path("/tmp/torchinductor_root")
    cache.mkdir(parents=True)
    gpuctl("launch", "--python", "fake-trainer", "--set", "fake.steps=1", "--follow")
    assert not cache.exists()
    assert gpuctl.path("/root/gpuctl/training/__init__.py").is_file()
    assert "-m training.train --config tiny" in gpuctl.path("/root/gpuctl/run.sh").read_text()
    record = json.loads(gpuctl.path("/workspace/.gpuctl/tl1.json").read_text())
    assert record["id"] == "tl1" and record["container"] == gpuctl.ctid and record["exit_code"] == 0
    assert {"pid", "pgid", "proc_start", "boot_id", "started_at", "ended_at"} <= record.keys()
    assert gpuctl.path("/workspace/.gpuctl/tl1.metrics.jsonl").read_text().count("\n") == 1

    cache.mkdir(parents=True)
    gpuctl("launch", "--python", "fake-trainer", "--set", "fake.steps=1", "--keep-compile-cache", "--follow")
    assert cache.exists()


def test_remembered_target_needs_no_flags(gpuctl, standin):
    gpuctl.launch_fake("steps=1")
    bare = {"GPUCTL_HOST": "", "GPUCTL_CT": "", "GPUCTL_SSH_CONFIG": ""}
    result = gpuctl("status", "--json", env=bare)
    assert result.code == 0, result.stderr
    assert result.json()["run_id"] == "tl1"
    # Another host asked for: the remembered container does not carry over.
    other = gpuctl("status", "--host", "elsewhere.invalid", env=bare)
    assert other.code == 2 and "no container" in other.stderr


def test_config_file_gives_the_target(gpuctl, standin):
    config = gpuctl.home / "config" / "gpuctl"
    config.mkdir(parents=True)
    (config / "config.toml").write_text(f'host = "gpuctl-standin"\nct = {gpuctl.ctid}\n'
                                        f'ssh_config = "{standin.ssh_config}"\n')
    result = gpuctl("status", "--json", env={"GPUCTL_HOST": "", "GPUCTL_CT": "", "GPUCTL_SSH_CONFIG": ""})
    assert result.code == 0, result.stderr
    assert result.json()["container"]["ctid"] == gpuctl.ctid
    wrong = gpuctl("status", env={"GPUCTL_CT": "99999"})  # the environment wins over the config file
    assert wrong.code == 4 and "99999" in wrong.stderr


def test_local_config_file_is_staged(gpuctl, tmp_path):
    config = tmp_path / "my run.toml"
    text = "max_steps = 3\nrandom_target = \"qwen3-8b-narrow\"\n"  # a whole config: the trainer's rules pass it
    config.write_text(text)
    result = gpuctl("launch", "--python", "fake-trainer", "--config", str(config), "--set", "fake.steps=1",
                    "--follow")
    assert result.code == 0, result.stderr
    assert gpuctl.path("/root/gpuctl/configs/my run.toml").read_text() == text
    argv = json.loads(result.stdout.splitlines()[0].removeprefix("argv: "))
    assert argv[argv.index("--config") + 1] == "/root/gpuctl/configs/my run.toml"


def test_status_reads_progress_and_eta_while_running(gpuctl):
    gpuctl.launch_fake("steps=100000", "step_s=0.02")

    @retry(stop=stop_after_delay(20), wait=wait_fixed(0.1), reraise=True)
    def progressed() -> dict:
        doc = gpuctl.status()
        assert doc["progress"] and doc["progress"]["step"] >= 3
        return doc

    progress = progressed()["progress"]
    assert progress["total_steps"] == 100000 and progress["tokens_per_s"] == 1000.0
    assert progress["eta_s"] > 0
    started = time.time()
    assert gpuctl("kill", "--grace", "5").code == 0
    assert time.time() - started < 10


def test_a_trainer_that_ends_takes_the_children_it_left_in_the_run_with_it(gpuctl, standin, ctid):
    # A failed trainer (as a multi-node one that lost a node ends: at once) leaves a child and a grandchild.
    # It holds until the test says, so it ends after launch has seen it start (a 2-step run could end during it).
    launched = gpuctl.launch_fake("steps=2", "child=1", "exit=1", "hold=/workspace/release")
    assert launched.code == 0, launched.stderr
    gpuctl.path("/workspace/release").touch()

    @retry(stop=stop_after_delay(30), wait=wait_fixed(0.2), reraise=True)
    def nothing_left() -> None:
        assert gpuctl.status()["state"] == "failed"
        assert standin.container_processes(ctid) == []  # wrapper, trainer, child, grandchild: all gone

    nothing_left()
