"""The drafters people serve now (issue 31), held to the reference package `dflash` 0.1.0 on the tiny target, on
the CPU: τ when sampling (the reference's rejection sampling, seeded), warm starts from an export, the target's scaled RoPE."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import dflash.model as reference
import pytest
import torch
from reference_helpers import prompts, served

from training.config import load_config
from training.data.chat import load_conversations
from training.model.drafter import Drafter, DrafterConfig
from training.output.checkpoint import save_checkpoint
from training.serve.acceptance import main as acceptance_main
from training.serve.evaluate import acceptance_length, build_eval_set
from training.serve.export import main as export_main
from training.serve.export import read_export
from training.serve.warm_start import read_warm_start
from training.target.frozen import Target
from training.train import main as train_main
from training.trainer import cosine_schedule
from training.trainer.world import build_drafters

NEW_TOKENS = 32

pytestmark = pytest.mark.usefixtures("reference_timer_on_the_cpu")


def sets_for(world, output_dir: Path, *overrides: str) -> list[str]:
    sets = [*world.overrides(output_dir), "num_threads=1", "eval_every=0", *overrides]
    return ["--config", "tiny"] + [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def trained_run(tiny_world, tmp_path_factory) -> Path:
    """The tiny preset trained as a user runs it; a finished run exports itself (bf16) to <run>/export."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert train_main(sets_for(tiny_world, out)) == 0
    return out


def prompt_file(world, where: Path, count: int) -> Path:
    path = where / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": c[0]["content"]}) + "\n"
                            for c in load_conversations(str(world.eval))[:count]))
    return path


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


def test_speedup_times_the_loop_with_the_drafter_against_the_targets_own_greedy_decode(
        trained_run, tiny_world, tmp_path, monkeypatch, capsys):
    """--speedup --loop reference decodes every prompt twice, through the reference loop with the drafter and
    with a block of 1 (no drafter call at all), after one warm-up each, and reports tokens/s both ways and their
    ratio (the fast loop's --speedup, the default: tests/training/test_fast_loop.py)."""
    blocks = []
    real = reference.dflash_generate

    def counted(*args, **kwargs):
        blocks.append(kwargs.get("block_size"))
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "dflash_generate", counted)
    report = tmp_path / "speedup.json"
    argv = ["--export", str(trained_run / "export"), "--target", str(tiny_world.target), "--prompts",
            str(prompt_file(tiny_world, tmp_path, 3)), "--new-tokens", str(NEW_TOKENS), "--speedup", "--loop",
            "reference", "--json", str(report)]
    assert acceptance_main(argv) == 0
    assert blocks == [None, 1] + [None, 1] * 3  # warm-up, then each prompt both ways
    found = json.loads(report.read_text())
    assert found["prompts"] == 3 and found["tokens"] > 3 and found["tau"] > 1.2  # the trained drafter is accepted
    assert found["speedup"] == pytest.approx(found["target_s"] / found["drafter_s"])
    assert "speed-up" in capsys.readouterr().out


@pytest.mark.parametrize("option, message", [(("--temperature", "-1"), "--temperature must be >= 0"),
                                             (("--temperature", "1", "--repeats", "0"), "--repeats >= 1")])
def test_bad_sampling_options_are_one_line_exit_2(option, message, tiny_world, tmp_path, capsys):
    argv = ["--export", str(tmp_path), "--target", str(tiny_world.target), "--prompts", "humaneval", *option]
    assert acceptance_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


# ---- warm start ------------------------------------------------------------------------------------------------


def reference_proposals(model, target: Target, prompt: list[int], monkeypatch) -> list[dict]:
    """The reference greedy loop on one prompt, recording at every step the block it drafts from, the context
    features it passes and the tokens it proposes."""
    steps: list[dict] = []
    real_embeddings, real_forward, real_logits = reference._raw_input_embeddings, model.forward, model.compute_logits

    def record_block(target_model, block_ids, scale=1.0):
        steps.append({"block": block_ids.clone()})
        return real_embeddings(target_model, block_ids, scale)

    def record_forward(**kwargs):
        steps[-1].update(context=kwargs["target_hidden"].clone(), positions=kwargs["position_ids"].clone())
        return real_forward(**kwargs)

    def record_logits(hidden, head):
        logits = real_logits(hidden, head)
        steps[-1]["proposed"] = logits.argmax(dim=-1)
        return logits

    with monkeypatch.context() as patch:
        patch.setattr(reference, "_raw_input_embeddings", record_block)
        patch.setattr(model, "forward", record_forward)
        patch.setattr(model, "compute_logits", record_logits)
        reference.dflash_generate(model, target.model, torch.tensor([prompt]), NEW_TOKENS,
                                  [target.tokenizer.eos_token_id])
    return steps


def trainer_proposals(drafter: Drafter, steps: list[dict]) -> list[torch.Tensor]:
    """The trainer drafter's proposals for each step of a reference loop: the same anchor token and the context
    the loop accumulated, the last block cut to the loop's verify size (its keys past the cut hidden)."""
    from training.model.attention import build_mask

    context, proposals = None, []
    for step in steps:
        context = step["context"] if context is None else torch.cat([context, step["context"]], dim=1)
        length = step["block"].shape[1]
        anchor = int(step["positions"][0, -length])
        assert context.shape[1] == anchor
        anchors = torch.tensor([[anchor]])
        mask = build_mask("sdpa", anchors, torch.tensor([[True]]), anchor, drafter.config.block_size,
                          block_lengths=torch.tensor([[length]]), sliding_window=drafter.config.attention_window)
        with torch.no_grad():
            hidden = drafter(context, step["block"][:, :1], anchors, mask)
            proposals.append(drafter.logits(hidden[:, 1:length]).argmax(dim=-1))
    return proposals


def warm_config(world, output_dir: Path, export: Path, *overrides: str):
    overrides = [*world.overrides(output_dir), "num_threads=1", f"init_from={export}", *overrides]
    return load_config("tiny", overrides)


def test_a_warm_start_proposes_at_step_0_exactly_what_its_source_proposes_in_the_reference_loop(
        trained_run, tiny_world, target, tmp_path, monkeypatch):
    """The run's own bf16 export as init_from: the drafter the trainer builds (before any step) proposes, at
    every step of the reference's greedy loop on 6 prompts, the tokens the exported drafter proposes there; a
    fresh drafter (the same run without init_from) does not."""
    export = trained_run / "export"
    config = warm_config(tiny_world, tmp_path / "warm", export)
    (warm,) = build_drafters(config, target, [torch.device("cpu")], read_warm_start(config))
    config.init_from = ""
    (fresh,) = build_drafters(config, target, [torch.device("cpu")], read_warm_start(config))
    model, compared, fresh_differs = served(export), 0, False
    for prompt in prompts(tiny_world, target, 6):
        steps = reference_proposals(model, target, prompt, monkeypatch)
        for step, ours, theirs in zip(steps, trainer_proposals(warm.eval(), steps),
                                      trainer_proposals(fresh.eval(), steps)):
            assert torch.equal(ours, step["proposed"]), (ours, step["proposed"])
            fresh_differs |= not torch.equal(theirs, step["proposed"])
            compared += 1
    assert compared >= 20 and fresh_differs


def test_a_warm_started_run_starts_at_its_sources_tau_and_fine_tunes_from_there(trained_run, tiny_world, target,
                                                                               tmp_path):
    """A run with init_from: its step-0 evaluation (the trainer's τ, training/serve/evaluate.py) is the exported
    drafter's own τ on the same prompts, far above a fresh drafter's 1.0; it trains and exports as any run."""
    out = tmp_path / "warm"
    assert train_main(sets_for(tiny_world, out, f"init_from={trained_run / 'export'}", "max_steps=4",
                               "eval_every=4")) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step0 = next(r for r in records if r["step"] == 0)["acceptance_length"]
    config, weights = read_export(trained_run / "export")
    source = Drafter(config, target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight)
    source.load_state_dict({name: t.float() for name, t in weights.items()})
    evalset = build_eval_set(target, prompts(tiny_world, target, 16), 48, "cpu")
    assert step0 == pytest.approx(acceptance_length(source, evalset, torch.float32), rel=1e-9) and step0 > 2.0
    assert (out / "export" / "model.safetensors").is_file()
    assert next(r for r in records if r["step"] == 4)["acceptance_length"] > 1.5


def edited_export(export: Path, where: Path, **changes) -> Path:
    path = Path(shutil.copytree(export, where / "edited"))
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("case", ["layers", "block", "width", "not an export"])
def test_a_warm_start_that_does_not_fit_is_one_line_exit_2(case, trained_run, tiny_world, tmp_path, capsys):
    export = trained_run / "export"
    overrides, message = {
        "layers": (["num_draft_layers=3"], "its num_layers is 2, this run's (num_draft_layers) is 3"),
        "block": (["block_size=4"], "its block_size is 8, this run's (block_size) is 4"),
        "width": ([], "its intermediate_size is 100"),
        "not an export": ([], "is not an exported drafter"),
    }[case]
    if case == "width":
        export = edited_export(export, tmp_path, intermediate_size=100)
    elif case == "not an export":
        export = tmp_path
    code = train_main(sets_for(tiny_world, tmp_path / "run", f"init_from={export}", *overrides))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---- the target's RoPE -----------------------------------------------------------------------------------------

# Each scaled type with its pretraining length at 16 positions, so that the tests' contexts (40-90 positions) are
# well past it.
SCALED_ROPE = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}


def target_with(world, where: Path, **config_changes) -> Path:
    path = Path(shutil.copytree(world.target, where / "target"))
    config = json.loads((path / "config.json").read_text())
    config.update(config_changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


def exported_drafter(target: Target, where: Path, drafter_config: DrafterConfig) -> tuple[Drafter, Path]:
    """A freshly initialised drafter (seed 0) for `target`, checkpointed as the trainer does and exported in
    float32."""
    torch.manual_seed(0)
    drafter = Drafter(drafter_config, target.model.get_input_embeddings().weight,
                      target.model.get_output_embeddings().weight)
    optimizer = torch.optim.AdamW(drafter.parameters())
    save_checkpoint(where / "run", 0, drafter, optimizer, cosine_schedule(optimizer, 10, 0.1), {}, {}, keep=1)
    assert export_main([str(where / "run"), str(where / "export"), "--dtype", "float32"]) == 0
    return drafter.eval(), where / "export"


def reference_hidden_states(model, target: Target, ids: torch.Tensor, anchors: list[int]) -> list[torch.Tensor]:
    """The reference drafter's final hidden states for the block at each anchor (its context: every position
    before it, its block: the anchor token then mask_token_id), one reference forward per anchor."""
    with torch.no_grad():
        features = reference.extract_context_feature(target.model(ids, output_hidden_states=True).hidden_states,
                                                     model.target_layer_ids)
        embedding = target.model.get_input_embeddings().weight
        states = []
        for anchor in anchors:
            block_ids = torch.full((1, model.block_size), model.mask_token_id)
            block_ids[0, 0] = ids[0, anchor]
            states.append(model(target_hidden=features[:, :anchor], noise_embedding=embedding[block_ids],
                                position_ids=torch.arange(anchor + model.block_size)[None])[0])
    return states


def trainer_hidden_states(drafter: Drafter, target: Target, ids: torch.Tensor, anchors: list[int]) -> torch.Tensor:
    """The trainer drafter's, every anchor in one forward (and a padding block), [anchors, block, D]."""
    from training.model.attention import build_mask

    block = drafter.config.block_size
    at = torch.tensor([anchors + [0]])
    valid = torch.tensor([[True] * len(anchors) + [False]])
    with torch.no_grad():
        mask = build_mask("sdpa", at, valid, ids.shape[1], block, sliding_window=drafter.config.attention_window)
        hidden = drafter(target.features(ids), ids.gather(1, at), at, mask)
    return hidden.view(len(anchors) + 1, block, -1)[: len(anchors)]


def long_sequence(world, target: Target, length: int) -> torch.Tensor:
    tokens: list[int] = []
    for prompt in prompts(world, target, 16):
        tokens += prompt + target.generate_greedy([prompt], NEW_TOKENS)[0]
        if len(tokens) >= length:
            return torch.tensor([tokens[:length]])
    raise AssertionError("the eval prompts are too short")


@pytest.mark.parametrize("kind", sorted(SCALED_ROPE))
def test_a_scaled_rope_drafter_computes_what_the_reference_computes(kind, tiny_world, tmp_path, monkeypatch):
    """A target with a scaled RoPE: the trainer takes it (no refusal); its drafter's hidden states equal the
    reference's (loaded from the float32 export, RoPE from its rope_parameters) within 1e-4 at anchors up to 80
    positions, far past the scaling's pretraining length, where plain RoPE would be 1e-3 off or more; its
    proposals equal the reference's at every step of the reference's greedy loop on 4 prompts."""
    rope = {**SCALED_ROPE[kind], "rope_theta": 10000.0}
    target = Target.load(str(target_with(tiny_world, tmp_path, rope_parameters=rope)), "cpu", torch.float32)
    config = DrafterConfig.from_target(target.config, 2, 8, target.layers, target.mask_token_id)
    assert config.rope_parameters["rope_type"] == kind
    drafter, export = exported_drafter(target, tmp_path, config)
    model = served(export)
    assert model.rotary_emb.rope_type == kind
    ids, anchors = long_sequence(tiny_world, target, 90), [3, 17, 40, 63, 80]
    theirs = reference_hidden_states(model, target, ids, anchors)
    ours = trainer_hidden_states(drafter, target, ids, anchors)
    plain = Drafter(DrafterConfig(**{**config.to_dict(), "rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 10000.0}}),
                    drafter.embed_weight, drafter.untied_lm_head)
    plain.load_state_dict(drafter.state_dict())
    plain_states = trainer_hidden_states(plain.eval(), target, ids, anchors)
    for n in range(len(anchors)):
        torch.testing.assert_close(ours[n], theirs[n], rtol=0, atol=1e-4)
    assert max((plain_states[n] - theirs[n]).abs().max() for n in range(len(anchors))) > 1e-3
    compared = 0
    for prompt in prompts(tiny_world, target, 4):
        steps = reference_proposals(model, target, prompt, monkeypatch)
        for step, proposed in zip(steps, trainer_proposals(drafter, steps)):
            assert torch.equal(proposed, step["proposed"]), (step["positions"], proposed, step["proposed"])
            compared += 1
    assert compared >= 8


def test_a_dynamic_rope_is_refused_in_one_line_before_the_weights_load(tiny_world, tmp_path, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("the target's weights were loaded before the refusal")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    target = target_with(tiny_world, tmp_path, rope_parameters=rope)
    code = train_main(sets_for(tiny_world, tmp_path / "run", f"target_path={target}"))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "RoPE is 'dynamic'" in err and "longest position" in err, err


# ---- sliding-window layers ---------------------------------------------------------------------------------

WINDOW = 5  # under the block (8) and far under the contexts (up to 80 positions): both sides of the window bite


@pytest.mark.parametrize("layer_types", [["sliding_attention", "full_attention"],
                                         ["sliding_attention", "sliding_attention"]])
def test_a_sliding_window_drafter_computes_what_the_reference_computes(layer_types, target, tiny_world, tmp_path,
                                                                       monkeypatch):
    """Sliding-window layers (window 5) with contexts up to 80 positions: the export says is_causal false and
    its layer_types; the reference builds its sliding layers non-causal with that window; the trainer drafter's
    hidden states (its dense training mask within the window) equal the reference's (the mask it builds at
    serve time, `_attention_mask`) within 1e-4 at every anchor, where the same weights attending fully are 1e-3
    off or more; its proposals equal the reference's at every step of the greedy loop, where the loop's draft
    cache keeps only the window's last keys."""
    config = DrafterConfig.from_target(target.config, 2, 8, target.layers, target.mask_token_id,
                                       layer_types=layer_types, sliding_window=WINDOW)
    drafter, export = exported_drafter(target, tmp_path, config)
    served_config = json.loads((export / "config.json").read_text())
    assert served_config["is_causal"] is False and served_config["use_sliding_window"] is True
    assert served_config["layer_types"] == layer_types and served_config["sliding_window"] == WINDOW
    model = served(export)
    for layer, kind in zip(model.layers, layer_types):
        assert layer.self_attn.is_causal is False
        assert layer.self_attn.sliding_window == (WINDOW if kind == "sliding_attention" else None)
    assert read_export(export)[0] == config
    ids, anchors = long_sequence(tiny_world, target, 90), [3, 17, 40, 63, 80]
    theirs = reference_hidden_states(model, target, ids, anchors)
    ours = trainer_hidden_states(drafter, target, ids, anchors)
    full = Drafter(DrafterConfig(**{**config.to_dict(), "layer_types": None, "sliding_window": None}),
                   drafter.embed_weight, drafter.untied_lm_head)
    full.load_state_dict(drafter.state_dict())
    full_states = trainer_hidden_states(full.eval(), target, ids, anchors)
    for n in range(len(anchors)):
        torch.testing.assert_close(ours[n], theirs[n], rtol=0, atol=1e-4)
    assert max((full_states[n] - theirs[n]).abs().max() for n in range(len(anchors))) > 1e-3
    compared = 0
    for prompt in prompts(tiny_world, target, 4):
        steps = reference_proposals(model, target, prompt, monkeypatch)
        assert int(steps[-1]["positions"][0, -1]) > 3 * WINDOW  # the loop went far past the window
        for step, proposed in zip(steps, trainer_proposals(drafter, steps)):
            assert torch.equal(proposed, step["proposed"]), (step["positions"], proposed, step["proposed"])
            compared += 1
    assert compared >= 8


def test_a_sliding_window_run_trains_and_exports_what_the_reference_loads(trained_run, tiny_world, tmp_path):
    """A run with a sliding layer trains (its loss falls), exports with causality and layer types written, and
    the reference loads it strictly; the acceptance command's reference loop and the trainer's τ (its evaluation,
    the same window) agree step by step on every prompt, losslessly; a run without says is_causal false and
    nothing of windows."""
    out = tmp_path / "run"
    assert train_main(sets_for(tiny_world, out, 'layer_types=["sliding_attention", "full_attention"]',
                               f"sliding_window={WINDOW}", "max_steps=30", "log_every=5")) == 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert losses[-1] < losses[0]
    config = json.loads((out / "export" / "config.json").read_text())
    assert (config["is_causal"], config["layer_types"], config["sliding_window"]) == (
        False, ["sliding_attention", "full_attention"], WINDOW)
    assert served(out / "export").layers[0].self_attn.sliding_window == WINDOW
    report = tmp_path / "acceptance.json"
    assert acceptance_main(["--export", str(out / "export"), "--target", str(tiny_world.target), "--prompts",
                            str(prompt_file(tiny_world, tmp_path, 6)), "--new-tokens", "48", "--dtype", "float32",
                            "--json", str(report)]) == 0
    figures = json.loads(report.read_text())
    assert all(p["lossless"] for p in figures["prompts"])
    assert [p["served_steps"] for p in figures["prompts"]] == [p["trainer_steps"] for p in figures["prompts"]]
    assert figures["sets"]["prompts"]["served_tau"] > 1.2
    plain = json.loads((trained_run / "export" / "config.json").read_text())
    assert plain["is_causal"] is False and plain["use_sliding_window"] is False and "layer_types" not in plain


@pytest.mark.parametrize("overrides, message", [
    (['layer_types=["sliding_attention"]', "sliding_window=4"], "layer_types has 1 entries for 2 drafter layers"),
    (['layer_types=["sliding_attention", "local"]', "sliding_window=4"], "layer_types takes"),
    (['layer_types=["sliding_attention", "full_attention"]'], "sliding_window (0) must be > 0 exactly when"),
    (["sliding_window=4"], "sliding_window (4) must be > 0 exactly when"),
    (['layer_types=["sliding_attention", "full_attention"]', "sliding_window=4", "attention=flex"],
     "train with attention=sdpa"),
])
def test_bad_sliding_window_settings_are_one_line_exit_2(overrides, message, tiny_world, tmp_path, capsys):
    code = train_main(sets_for(tiny_world, tmp_path / "run", *overrides))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
