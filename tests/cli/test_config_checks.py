"""Mistakes in a launch's config are caught on the workstation before anything is sent (issue 23): exit 2, one
line, no pct call for the container (nothing staged, no run number used), in --dry-run too."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cli.conftest import REPO

pytestmark = pytest.mark.sshd

KNOWN_PRESETS = ("no preset named 'tinny' (known: qwen3-8b, qwen3-8b-random, smollm2-135m, smollm2-135m-regenerate, "
                 "tiny, tiny-regenerate)")
MISTAKES = [
    (("--config", "tinny"), KNOWN_PRESETS),
    (("--config", "tinyy"), "no preset named 'tinyy' (known: "),
    (("--config", "tinyy"), "and no such file; did you mean 'tiny'?"),
    # the trainer's own rules, with its own messages (issue 39): a range, a choice, a rule across fields
    (("--set", "max_steps=-5"), "max_steps must be > 0, got -5 (the trainer's check of preset tiny --set max_steps=-5)"),
    (("--set", "lrr=3e-4"), "unknown config key 'lrr' (--set lrr=3e-4); did you mean 'lr'?"),
    (("--set", "max_step=100"), "unknown config key 'max_step' (--set max_step=100); did you mean 'max_steps'?"),
    (("--set", "warmup_ratio=1"), "warmup_ratio must be in [0, 1), got 1.0"),
    (("--set", "dtype=fp16"), "dtype must be one of auto, bfloat16, float32, got 'fp16'"),
    (("--set", "compile=off", "--set", "attention=flex"), 'compile = "off" with attention = "flex"'),
    (("--task", "regenerate", "--set", "top_p=0"), "top_p must be in (0, 1], got 0.0"),
    (("--set", "max_steps=abc"), "max_steps must be int, got 'abc' (--set max_steps=abc)"),
    (("--set", "devices=[0,1"), "--set devices=[0,1: [0,1 is not a valid TOML value"),  # a list with a typo
    (("--set", "build_tiny=1"), "build_tiny must be bool, got 1"),
    (("--set", "devices=[0,true]"), "devices must be list[int | str] | str, got [0, True]"),
    (("--task", "regenerate", "--set", "lr=1e-3"), "unknown config key 'lr' (--set lr=1e-3)"),
    (("--task", "regenerate", "--config", "tiny"), "preset 'tiny' is not a regenerate config"),
    (("--config", "./nope.toml"), "config file not found: ./nope.toml"),
]


def refused(result, message: str) -> None:
    assert result.code == 2, (result.code, result.stderr)
    assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize(("args", "message"), MISTAKES, ids=[m[:24] for _, m in MISTAKES])
def test_a_mistake_is_refused_before_anything_is_sent(gpuctl, args, message):
    for dry_run in ((), ("--dry-run",)):
        refused(gpuctl("launch", "--python", "fake-trainer", *args, *dry_run), message)
    assert gpuctl.host.pct_calls(gpuctl.ctid) == []  # not even the container's status: nothing was sent
    assert not gpuctl.path("/workspace/.gpuctl").exists()


def test_no_run_number_is_used_and_good_values_pass(gpuctl):
    for args, message in MISTAKES[:4]:
        refused(gpuctl("launch", "--python", "fake-trainer", *args), message)
    # an int is a valid float; a string that is not a TOML literal is a string, as the trainer reads it
    launched = gpuctl.launch_fake("steps=1", extra=("--set", "lr=1", "--set", "output_dir=runs/[x"))
    assert launched.code == 0, launched.stderr
    assert launched.json()["run_id"] == "tl1"


def test_a_local_toml_error_names_the_local_file(gpuctl, tmp_path):
    config = tmp_path / "mine.toml"
    config.write_text("max_steps = 3\nlr = [\n")
    result = gpuctl("launch", "--python", "fake-trainer", "--config", str(config))
    refused(result, f"{config}: not valid TOML: ")
    assert "/root/gpuctl" not in result.stderr
    config.write_text("max_steps = 3\nmax_stepz = 4\n")
    refused(gpuctl("launch", "--config", str(config), "--dry-run"), f"unknown config key 'max_stepz' ({config})")
    config.write_text("random_target = 'qwen3-8b-narrow'\nmax_length = 16\n")  # the trainer's rule across fields
    refused(gpuctl("launch", "--config", str(config), "--dry-run"),
            f"max_length (16) must exceed 2 * block_size (16) (the trainer's check of {config})")
    assert gpuctl.host.pct_calls(gpuctl.ctid) == []


def test_resume_checks_the_runs_own_config_and_the_new_sets(gpuctl):
    assert gpuctl.launch_fake("steps=1").code == 0
    assert gpuctl("logs", "--follow").code == 0
    calls = len(gpuctl.host.pct_calls(gpuctl.ctid))
    refused(gpuctl("launch", "--resume", "--set", "max_steps=many"), "max_steps must be int, got 'many'")
    refused(gpuctl("launch", "--resume", "--set", "max_steps=0"), "max_steps must be > 0, got 0")  # its preset's
    assert not any("push" in call for call in gpuctl.host.pct_calls(gpuctl.ctid)[calls:])
    assert not gpuctl.path("/workspace/train_tl2.log").exists()
    resumed = gpuctl("launch", "--resume", "--set", "max_steps=7", "--json")
    assert resumed.code == 0, resumed.stderr
    assert resumed.json()["run_id"] == "tl2"


def test_the_trainers_rules_run_on_a_workstation_without_torch():
    """gpuctl runs the trainer's config module from its file: no torch, no `training` package imported."""
    code = ("import sys; sys.modules['torch'] = None; from gpuctl.config_schema import check_config\n"
            "try: check_config('train', 'tiny', ['warmup_ratio=-0.5'])\n"
            "except Exception as e: print(e.code, e)\n"
            "print(sorted(m for m in sys.modules if m == 'training' or m.startswith(('training.', 'torch'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == [("2 warmup_ratio must be in [0, 1), got -0.5 (the trainer's check of preset "
                                         "tiny --set warmup_ratio=-0.5)"), "['torch']"]


def test_the_nodes_of_a_resume_check_their_configs_at_once():
    """A multi-node resume checks each node's config in its own thread: each sees the whole config module, none
    one still being made (AttributeError: no TrainConfig)."""
    code = ("import threading; from gpuctl.config_schema import check_config\n"
            "start, errors = threading.Barrier(8), []\n"
            "def check():\n"
            "    start.wait()\n"
            "    try: check_config('train', 'tiny', ['max_steps=3'])\n"
            "    except Exception as e: errors.append(repr(e))\n"
            "threads = [threading.Thread(target=check) for _ in range(8)]\n"
            "[t.start() for t in threads]; [t.join() for t in threads]\n"
            "print(errors)")
    for _ in range(3):  # a fresh interpreter each time: the module is made once per process
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
        assert done.stdout.strip() == "[]", done.stdout
