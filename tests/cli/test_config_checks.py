"""Mistakes in a launch's config are caught on the workstation before anything is sent (issue 23): exit 2, one
line, no pct call for the container (nothing staged, no run number used), in --dry-run too."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sshd

KNOWN_PRESETS = ("no preset named 'tinny' (known: qwen3-8b, qwen3-8b-random, smollm2-135m, smollm2-135m-regenerate, "
                 "tiny, tiny-regenerate)")
MISTAKES = [
    (("--config", "tinny"), KNOWN_PRESETS),
    (("--set", "lrr=3e-4"), "unknown config key 'lrr' (--set lrr=3e-4)"),
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
    for args, message in MISTAKES[:3]:
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
    assert gpuctl.host.pct_calls(gpuctl.ctid) == []


def test_resume_checks_the_runs_own_config_and_the_new_sets(gpuctl):
    assert gpuctl.launch_fake("steps=1").code == 0
    assert gpuctl("logs", "--follow").code == 0
    calls = len(gpuctl.host.pct_calls(gpuctl.ctid))
    refused(gpuctl("launch", "--resume", "--set", "max_steps=many"), "max_steps must be int, got 'many'")
    assert not any("push" in call for call in gpuctl.host.pct_calls(gpuctl.ctid)[calls:])
    assert not gpuctl.path("/workspace/train_tl2.log").exists()
    resumed = gpuctl("launch", "--resume", "--set", "max_steps=7", "--json")
    assert resumed.code == 0, resumed.stderr
    assert resumed.json()["run_id"] == "tl2"
