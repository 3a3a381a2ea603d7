"""The fast speculative loop (training/serve/fast_loop.py) against the reference `dflash_generate`, on the tiny target
in float32 on the CPU: the same tokens and the same acceptance lengths step for step, for DFlash and DFlash2,
for replies that stop at a stop token and ones that reach the new-token limit mid-block; `python -m
training.acceptance --loop fast` and `--speedup` through it; what it cannot run is one line."""

from __future__ import annotations

import json
from pathlib import Path

import dflash.model as reference
import pytest
import torch
from reference_helpers import prompts as eval_prompts

from training.config import ConfigError
from training.model.dflash2 import build_drafter
from training.serve.acceptance import load_models, stop_ids
from training.serve.acceptance import main as acceptance_main
from training.serve.fast_loop import FastLoop
from training.train import main as train_main

ARCHITECTURES = {"dflash": [], "dflash2": ["architecture=dflash2", "conv_kernel_size=2", "conv_group_size=16",
                                           "selector_rank=16", "selector_top_k=8"]}

pytestmark = pytest.mark.usefixtures("reference_timer_on_the_cpu")


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def export(request, tiny_world, tmp_path_factory) -> Path:
    """The tiny preset trained (60 steps) and exported, as each architecture."""
    out = tmp_path_factory.mktemp(request.param) / "run"
    sets = [*tiny_world.overrides(out), "num_threads=1", "eval_every=0", *ARCHITECTURES[request.param]]
    assert train_main(["--config", "tiny"] + [a for s in sets for a in ("--set", s)]) == 0
    return out / "export"


def reference_decode(models, ids: list[int], new_tokens: int, stops: list[int]) -> tuple[list[int], list[int]]:
    out = reference.dflash_generate(models.served, models.target.model, torch.tensor([ids]), new_tokens, stops,
                                    return_stats=True)
    return out.output_ids[0, len(ids):].tolist(), list(out.acceptance_lengths)


def test_the_fast_loop_decodes_what_the_reference_decodes_step_for_step(export, tiny_world):
    models = load_models(str(export), str(tiny_world.target), torch.float32, torch.device("cpu"))
    prompts = eval_prompts(tiny_world, models.target, 6)
    own_stops = stop_ids(models.target)
    probe = FastLoop(models.target.model, None, own_stops, 256).generate(prompts[0], 40).tokens
    common = max(set(probe), key=probe.count)  # a word the target says often: replies that stop early
    early_stops, limits, multi_token_steps = 0, set(), 0
    for stops in (own_stops, [common, *own_stops]):
        loop = FastLoop(models.target.model, models.drafter, stops, 256)
        alone = FastLoop(models.target.model, None, stops, 256)
        for new_tokens in (40, 13):  # 13: the last block is cut at the limit, mid-block
            for ids in prompts:
                tokens, steps = reference_decode(models, ids, new_tokens, stops)
                fast = loop.generate(ids, new_tokens)
                assert (fast.tokens, fast.steps) == (tokens, steps)
                assert alone.generate(ids, new_tokens).tokens == tokens  # lossless: the target's own decode
                early_stops += len(tokens) < new_tokens
                limits.add(len(tokens) == new_tokens)
                multi_token_steps += sum(step > 1 for step in steps)
    assert early_stops and limits == {True, False} and multi_token_steps > 10


def test_acceptance_through_the_fast_loop_gives_the_reference_figures(export, tiny_world, tmp_path, capsys):
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": line["messages"][0]["content"]}) + "\n" for line in
                                   map(json.loads, tiny_world.eval.read_text().splitlines()[:4])))
    figures = {}
    for loop in ("reference", "fast"):
        report = tmp_path / f"{loop}.json"
        assert acceptance_main(["--export", str(export), "--target", str(tiny_world.target), "--prompts",
                                str(prompt_file), "--new-tokens", "24", "--loop", loop, "--json", str(report)]) == 0
        assert f"in the {loop} loop" in capsys.readouterr().out
        figures[loop] = json.loads(report.read_text())
    assert figures["fast"].pop("loop") == "fast" and figures["reference"].pop("loop") == "reference"
    assert figures["fast"] == figures["reference"]
    assert figures["fast"]["sets"]["prompts"]["differing"] == 0


def test_speedup_times_the_fast_loop_against_the_faster_target_alone_decode(export, tiny_world, tmp_path, capsys):
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": line["messages"][0]["content"]}) + "\n" for line in
                                   map(json.loads, tiny_world.eval.read_text().splitlines()[:2])))
    report = tmp_path / "speedup.json"
    assert acceptance_main(["--export", str(export), "--target", str(tiny_world.target), "--prompts",
                            str(prompt_file), "--new-tokens", "16", "--speedup", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "transformers generate, static cache" in out and "fast loop, block of 1" in out
    s = json.loads(report.read_text())
    assert s["loop"] == "fast" and s["prompts"] == 2 and s["tokens"] > 2 and s["tau"] >= 1
    assert min(s["hf_static_tok_s"], s["target_tok_s"], s["drafter_tok_s"], s["decode_ms"], s["step_ms"]) > 0
    assert s["speedup"] == pytest.approx(s["drafter_tok_s"] / max(s["hf_static_tok_s"], s["target_tok_s"]))
    assert s["tau_bound"] == pytest.approx(s["tau"] * s["decode_ms"] / s["step_ms"])


@pytest.mark.parametrize(("options", "message"), [
    (["--new-tokens", "600"], "the target's window is 512"),
    (["--loop", "fast", "--temperature", "1"], "the fast loop decodes greedily"),
    (["--loop", "slow"], "invalid choice: 'slow'"),
])
def test_what_the_fast_loop_cannot_run_is_one_line_exit_2(options, message, export, tiny_world, tmp_path, capsys):
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text(json.dumps({"prompt": "a question"}) + "\n")
    argv = ["--export", str(export), "--target", str(tiny_world.target), "--prompts", str(prompt_file),
            "--loop", "fast", *options]
    try:
        code = acceptance_main(argv)
    except SystemExit as exit_:  # the argument parser's own refusals
        code = exit_.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err


def test_a_prompt_past_the_cache_and_a_drafter_for_another_target_are_refused(export, tiny_world):
    models = load_models(str(export), str(tiny_world.target), torch.float32, torch.device("cpu"))
    loop = FastLoop(models.target.model, models.drafter, stop_ids(models.target), 64)
    with pytest.raises(ConfigError, match="do not fit the loop's cache of 64 positions"):
        loop.generate(list(range(3, 53)), 8)
    config = models.drafter.config
    for field, value, what in (("vocab_size", config.vocab_size + 1, "vocabulary"),
                               ("hidden_size", config.hidden_size * 2, "hidden size"),
                               ("target_layers", [0, 99], "this target has")):
        other = type(config)(**{**config.__dict__, field: value})
        if field == "hidden_size":
            other.head_dim, other.intermediate_size = config.head_dim, config.intermediate_size
        table = torch.zeros(other.vocab_size, other.hidden_size)
        with pytest.raises(ConfigError, match=what):
            FastLoop(models.target.model, build_drafter(other, table, table), [0], 64)
    sliding = type(config)(**{**config.__dict__, "layer_types": ["sliding_attention"] * config.num_layers,
                              "sliding_window": 4})
    table = models.target.model.get_input_embeddings().weight
    with pytest.raises(ConfigError, match="sliding-window drafter layers"):
        FastLoop(models.target.model, build_drafter(sliding, table, table), [0], 64)
