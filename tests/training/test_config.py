"""Presets, --set overrides, and bad configuration as one line + exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from training.config import ConfigError, load_config, parse_devices, parse_override
from training.train import main

REPO = Path(__file__).resolve().parents[2]


def test_the_qwen3_8b_preset_is_the_paper_recipe():
    c = load_config("qwen3-8b")
    assert (c.lr, c.warmup_ratio, c.grad_clip, c.max_length) == (6e-4, 0.04, 1.0, 3072)
    assert (c.num_anchors, c.block_size, c.gamma, c.num_draft_layers) == (512, 16, 7.0, 5)
    assert c.target_layers == [1, 9, 17, 25, 33] and c.dtype == "bfloat16" and c.attention == "flex"


def test_tiny_preset_and_overrides():
    c = load_config("tiny", ["max_steps=7", "lr=1e-3", "target_devices=[0]", "output_dir=/tmp/x y",
                             "attention=sdpa", "length_buckets=[48, 96]", "gamma=5"])
    assert c.build_tiny and c.max_steps == 7 and c.lr == 1e-3 and c.gamma == 5.0
    assert c.target_devices == [0] and c.output_dir == "/tmp/x y" and c.attention == "sdpa"
    assert c.buckets() == [48, 96]


def test_a_toml_path_works_like_a_preset(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('target_path = "/t"\ndata_path = "/d"\nmax_steps = 3\n')
    assert load_config(str(path)).max_steps == 3


def test_override_values_are_toml_literals_else_strings():
    assert parse_override("a=3") == ("a", 3)
    assert parse_override("a=[0, 1]") == ("a", [0, 1])
    assert parse_override("a=true") == ("a", True)
    assert parse_override("a=/some/path") == ("a", "/some/path")
    assert parse_override('a="quoted"') == ("a", "quoted")
    for meant_as_toml in ("devices=[0,1", "a={x = 1"):  # not text: a list or table with a typo
        with pytest.raises(ConfigError, match="is not a valid TOML value"):
            parse_override(meant_as_toml)


def test_devices():
    assert parse_devices("cpu") == ["cpu"]
    assert parse_devices([0, 3, "cpu"]) == ["cuda:0", "cuda:3", "cpu"]
    with pytest.raises(ConfigError):
        parse_devices([-1])


@pytest.mark.parametrize("overrides,message", [
    (["nope=1"], "unknown config key 'nope'"),
    (["max_steps=abc"], "max_steps must be int"),
    (["max_steps=2.5"], "max_steps must be int"),
    (["build_tiny=1"], "build_tiny must be bool"),
    (["lr=0"], "lr must be > 0"),
    (["attention=fast"], "attention must be one of"),
    (["dtype=float16"], "dtype must be one of"),
    (["warmup_ratio=1.5"], "warmup_ratio must be in"),
    (["target_devices=[-1]"], "target_devices"),
    (["drafter_devices=gpu"], "drafter_devices"),
    (["length_buckets=[96, 64]"], "length_buckets"),
    (["length_buckets=[32]"], "below max_length"),
    (["max_steps"], "--set expects KEY=VALUE"),
])
def test_bad_config_is_a_one_line_error(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")) as raised:
        load_config("tiny", overrides)
    assert "\n" not in str(raised.value)


def test_unknown_preset_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="no preset named 'nope'") as unknown:
        load_config("nope")
    assert "did you mean" not in str(unknown.value)  # nothing near it
    with pytest.raises(ConfigError, match="and no such file; did you mean 'tiny'[?]$"):
        load_config("tinyy")
    bad = tmp_path / "bad.toml"
    bad.write_text("max_steps = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(bad))


@pytest.mark.parametrize("args,message", [
    (["--config", "tiny", "--set", "nope=1"], "unknown config key"),
    (["--config", "tiny", "--set", "attention=flex"], "attention=flex needs a CUDA"),
    (["--config", "tiny", "--set", 'drafter_devices=["cpu", "gpu1"]'], "'gpu1' is neither a GPU index"),
    (["--config", "tiny", "--set", "micro_batch_size=3"], "must be a multiple of micro_batch_size"),
    (["--config", "tiny", "--set", "build_tiny=false", "--set", "target_path=/nonexistent"], "not a model directory"),
    (["--set", "max_steps=3"], "--config"),
])
def test_entry_point_exits_2_with_one_line(args, message, capsys, tmp_path):
    try:
        code = main([*args, "--set", f"output_dir={tmp_path}"])
    except SystemExit as exited:  # argument errors
        code = exited.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err


def test_the_real_command_prints_no_traceback():
    result = subprocess.run([sys.executable, "-m", "training.train", "--config", "tiny", "--set", "max_steps=-1"],
                            cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: max_steps must be > 0, got -1"


def test_an_output_dir_that_cannot_be_made_is_refused_before_any_work(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    code = main(["--config", "tiny", "--set", f"output_dir={tmp_path / 'file' / 'run'}"])
    assert code == 2
    err = capsys.readouterr().err
    assert err == f"error: cannot create output_dir {tmp_path / 'file' / 'run'}: Not a directory\n"
