"""The drafters people serve now (issue 31), held to the reference package `dflash` 0.1.0 on the tiny target, on
the CPU: τ when sampling (the reference's rejection sampling, seeded)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import dflash.model as reference
import pytest
import torch

from training.acceptance import main as acceptance_main
from training.data import eval_prompts, load_conversations
from training.target import Target
from training.train import main as train_main

NEW_TOKENS = 32


@pytest.fixture(autouse=True)
def _reference_timer_on_the_cpu(monkeypatch):
    """The reference loop times itself with torch.cuda.synchronize, which the CPU build of torch refuses."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)


@pytest.fixture(scope="module")
def target(tiny_world) -> Target:
    return Target.load(str(tiny_world.target), "cpu", torch.float32)


def sets_for(world, output_dir: Path, *overrides: str) -> list[str]:
    sets = [*world.overrides(output_dir), "num_threads=1", "eval_every=0", *overrides]
    return ["--config", "tiny"] + [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def trained_run(tiny_world, tmp_path_factory) -> Path:
    """The tiny preset trained as a user runs it; a finished run exports itself (bf16) to <run>/export."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert train_main(sets_for(tiny_world, out)) == 0
    return out


def served(path: Path) -> reference.DFlashDraftModel:
    model, info = reference.DFlashDraftModel.from_pretrained(str(path), output_loading_info=True,
                                                             dtype=torch.float32)
    assert info and all(len(entries) == 0 for entries in info.values()), info
    return model.eval()


def prompt_file(world, where: Path, count: int) -> Path:
    path = where / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": c[0]["content"]}) + "\n"
                            for c in load_conversations(str(world.eval))[:count]))
    return path


def prompts(world, target: Target, count: int) -> list[list[int]]:
    return eval_prompts(target.tokenizer, load_conversations(str(world.eval)))[:count]


# ---- τ when sampling -------------------------------------------------------------------------------------------


def sampled_acceptance(world, export: Path, where: Path, *options: str) -> dict:
    report = where / f"sampled-{len(list(where.iterdir()))}.json"
    argv = ["--export", str(export), "--target", str(world.target), "--prompts", str(prompt_file(world, where, 4)),
            "--new-tokens", str(NEW_TOKENS), "--temperature", "1.0", "--json", str(report), *options]
    assert acceptance_main(argv) == 0
    return json.loads(report.read_text())


def test_sampled_tau_goes_through_the_reference_rejection_sampling_and_a_seed_reproduces_it(
        trained_run, tiny_world, tmp_path, monkeypatch, capsys):
    """At temperature 1.0 every verification step with drafts goes through the reference's `_rejection_sample`;
    three seeds give three different τ (the spread reported: std > 0, min < max), and seed 1 alone, asked
    again, gives exactly seed 1's figures of the three-seed run, prompt by prompt."""
    calls = []
    real = reference._rejection_sample

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "_rejection_sample", counted)
    three = sampled_acceptance(tiny_world, trained_run / "export", tmp_path, "--seed", "0", "--repeats", "3")
    table = capsys.readouterr().out
    assert three["seeds"] == [0, 1, 2] and three["temperature"] == 1.0
    summary = three["sets"]["prompts"]
    taus = list(summary["per_seed"].values())
    print(table)
    assert len(set(taus)) == 3 and summary["std"] > 0 and summary["min"] < summary["max"], summary
    assert summary["mean"] == pytest.approx(sum(taus) / 3) and summary["mean"] > 1.2  # the drafter is accepted
    steps = [n for p in three["prompts"] for n in p["served_steps"]]
    assert len(calls) >= len(steps) - len(three["prompts"])  # every step but a last one-token verify
    assert "served tau" in table and "0: " in table and "std" in table

    again = sampled_acceptance(tiny_world, trained_run / "export", tmp_path, "--seed", "1", "--repeats", "1")
    assert again["seeds"] == [1]
    assert again["sets"]["prompts"]["per_seed"]["1"] == summary["per_seed"]["1"]
    assert again["prompts"] == [p for p in three["prompts"] if p["seed"] == 1]
    assert again["sets"]["prompts"]["std"] == 0.0


@pytest.mark.parametrize("option, message", [(("--temperature", "-1"), "--temperature must be >= 0"),
                                             (("--temperature", "1", "--repeats", "0"), "--repeats >= 1")])
def test_bad_sampling_options_are_one_line_exit_2(option, message, tiny_world, tmp_path, capsys):
    argv = ["--export", str(tmp_path), "--target", str(tiny_world.target), "--prompts", "humaneval", *option]
    assert acceptance_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err

