"""DFlash2 (architecture="dflash2"): the drafter trains, exports as DFlash2DraftModel, and is held to the reference
implementation (the `dflash` package's DFlash2DraftModel, its context features and its greedy speculative loop
with the selector's `propose`) on the tiny target, on the CPU, as tests/training/test_export.py holds DFlash."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import dflash.model as reference
import pytest
import torch
from reference_helpers import prompts
from reference_helpers import served as served_as
from safetensors.torch import load_file, save_file

from training.data.chat import load_conversations
from training.model.attention import build_mask
from training.model.dflash2 import DFlash2Drafter, build_drafter
from training.output.checkpoint import check_checkpoint, latest_checkpoint
from training.serve.acceptance import main as acceptance_main
from training.serve.evaluate import acceptance_length, build_eval_set
from training.serve.export import main as export_main
from training.serve.export import served_name
from training.target.frozen import Target
from training.train import main as train_main

NEW_TOKENS = 48
# Small enough for the tiny target (hidden 64: four groups of 16 channels; a vocabulary of a few hundred).
DFLASH2 = ["architecture=dflash2", "conv_kernel_size=2", "conv_group_size=16", "selector_rank=16",
           "selector_top_k=8"]

pytestmark = pytest.mark.usefixtures("reference_timer_on_the_cpu")


@pytest.fixture(scope="module")
def trained_run(tiny_world, tmp_path_factory) -> Path:
    """The tiny preset trained as DFlash2 (its 60 steps, τ evaluated before and after); it exports itself."""
    out = tmp_path_factory.mktemp("dflash2") / "run"
    sets = [*tiny_world.overrides(out), "num_threads=1", "eval_every=60", *DFLASH2]
    assert train_main(["--config", "tiny"] + [a for s in sets for a in ("--set", s)]) == 0
    return out


@pytest.fixture(scope="module")
def scrambled_run(trained_run, tmp_path_factory) -> Path:
    """The trained checkpoint with its convolutions and selector drawn at random, far from the identity and from
    the unary argmax, so that both are exercised at full strength."""
    out = tmp_path_factory.mktemp("scrambled") / "run"
    checkpoint = Path(shutil.copytree(latest_checkpoint(trained_run), out / "checkpoints" / "step_00000060"))
    weights = load_file(checkpoint / "drafter.safetensors")
    generator = torch.Generator().manual_seed(1)
    for name, tensor in weights.items():
        if "conv" in name or "selector" in name:
            weights[name] = torch.randn(tensor.shape, generator=generator) * (0.5 if "base" in name else 0.3)
    save_file(weights, checkpoint / "drafter.safetensors")
    return out


def export(source: Path, out: Path, *options: str) -> Path:
    assert export_main([str(source), str(out), *options]) == 0
    return out


def trainer_drafter(run: Path, target: Target) -> DFlash2Drafter:
    checkpoint = latest_checkpoint(run)
    drafter = build_drafter(check_checkpoint(checkpoint), target.model.get_input_embeddings().weight,
                            target.model.get_output_embeddings().weight)
    drafter.load_state_dict(load_file(checkpoint / "drafter.safetensors"))
    assert isinstance(drafter, DFlash2Drafter)
    return drafter.eval()


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ---- training and the format -----------------------------------------------------------------------------------


def test_the_dflash2_run_learns_and_exports_a_model_the_reference_loads_strictly(trained_run, target, tmp_path):
    """Loss falls, the trainer's τ (through the selector) rises; the run's bf16 export and a float32 one are
    DFlash2DraftModel directories that the reference loads with nothing missing, unexpected or mismatched."""
    records = read_metrics(trained_run)
    losses = [r["loss"] for r in records if "loss" in r]
    taus = [r["acceptance_length"] for r in records if "acceptance_length" in r]
    print(f"dflash2 tiny run: loss {losses[0]:.3f} -> {losses[-1]:.3f}, trainer tau {taus[0]:.3f} -> {taus[-1]:.3f}")
    assert losses[-1] < 0.6 * losses[0], losses
    assert len(taus) == 2 and taus[1] > taus[0] + 1.0, taus
    weights = load_file(latest_checkpoint(trained_run) / "drafter.safetensors")
    for path, dtype in ((trained_run / "export", torch.bfloat16),
                        (export(trained_run, tmp_path / "fp32", "--dtype", "float32"), torch.float32)):
        config = json.loads((path / "config.json").read_text())
        assert config["architectures"] == ["DFlash2DraftModel"] and config["block_size"] == 8
        assert config["dflash_config"] == {
            "target_layer_ids": target.layers, "mask_token_id": target.mask_token_id, "mask_token": "<|MASK|>",
            "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8,
            "output_multiplier": 1.0, "final_logit_softcapping": 0.0}
        saved = load_file(path / "model.safetensors")
        assert {t.dtype for t in saved.values()} == {dtype}
        assert "candidate_selector.predecessor_codebook" in saved and "layers.1.mlp_conv.base_kernel" in saved
        model = served(path)
        assert model.mask_token_id == target.mask_token_id and model.block_size == 8
        assert model.candidate_selector.top_k == 8
        # The reference maps the codebooks onto its nn.Embedding weights; every other name is as written.
        loaded = dict(model.named_parameters())
        assert {reference_name(n) for n in saved} == loaded.keys()
        assert sorted(map(served_name, weights)) == sorted(saved)
        for name, tensor in weights.items():
            torch.testing.assert_close(saved[served_name(name)], tensor.to(dtype), rtol=0, atol=0)
            torch.testing.assert_close(loaded[reference_name(served_name(name))].detach().to(dtype),
                                       tensor.to(dtype), rtol=0, atol=0)


def reference_name(name: str) -> str:
    return name + ".weight" if name.endswith("_codebook") else name


def test_an_untrained_dflash2_drafter_is_the_dflash_drafter(target):
    """The convolutions start as the identity: with the same DFlash weights the two drafters' hidden states are
    equal, and the selector's transition term starts small."""
    from training.model.drafter import Drafter, DrafterConfig

    config = DrafterConfig.from_target(target.config, 2, 8, target.layers, target.mask_token_id)
    config2 = DrafterConfig.from_target(target.config, 2, 8, target.layers, target.mask_token_id,
                                        architecture="dflash2", conv_kernel_size=2, conv_group_size=16,
                                        selector_rank=16, selector_top_k=8)
    table, head = target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight
    dflash, dflash2 = Drafter(config, table, head), build_drafter(config2, table, head)
    assert dflash2.load_state_dict(dflash.state_dict(), strict=False).unexpected_keys == []
    features = torch.randn(1, 30, target.num_features * target.hidden_size)
    anchors, valid = torch.tensor([[2, 10, 19]]), torch.ones(1, 3, dtype=torch.bool)
    with torch.no_grad():
        mask = build_mask("sdpa", anchors, valid, 30, 8)
        tokens = torch.tensor([[5, 6, 7]])
        torch.testing.assert_close(dflash2(features, tokens, anchors, mask), dflash(features, tokens, anchors, mask),
                                   rtol=0, atol=1e-6)
    assert "architecture" not in config.to_dict() and config2.to_dict()["architecture"] == "dflash2"


# ---- the semantics -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["trained", "scrambled"])
def test_reference_hidden_states_equal_the_trainer_dflash2_drafter(which, request, target, tmp_path, tiny_world):
    """Context features from the reference's own extract_context_feature over the tiny target; several anchors
    and a padding block in one trainer forward against one reference forward per anchor; float32, 1e-4."""
    run = request.getfixturevalue(f"{which}_run")
    model = served(export(run, tmp_path / "fp32", "--dtype", "float32"))
    drafter = trainer_drafter(run, target)
    base = drafter.layers[0].attention_conv.base_kernel.detach()
    assert (base[:, 0] - 1).abs().max() > 0.02 and base[:, 1].abs().max() > 0.02  # not the identity any more
    assert drafter.layers[0].mlp_conv.kernel_projection.weight.abs().max() > 0.02
    prompt = prompts(tiny_world, target, 1)[0]
    ids = torch.tensor([(prompt + target.generate_greedy([prompt], NEW_TOKENS)[0])[:40]])
    with torch.no_grad():
        states = target.model(ids, output_hidden_states=True).hidden_states
        features = reference.extract_context_feature(states, model.target_layer_ids)
        block = model.block_size
        anchors, valid = torch.tensor([[3, 11, 20, 31, 0]]), torch.tensor([[True, True, True, True, False]])
        mask = build_mask("sdpa", anchors, valid, ids.shape[1], block)
        ours = drafter(features, ids.gather(1, anchors), anchors, mask).view(1, -1, block, model.config.hidden_size)
        embedding = target.model.get_input_embeddings().weight
        worst = 0.0
        for n, anchor in enumerate(anchors[0, :4].tolist()):
            block_ids = torch.full((1, block), model.mask_token_id)
            block_ids[0, 0] = ids[0, anchor]
            theirs = model(target_hidden=features[:, :anchor], noise_embedding=embedding[block_ids],
                           position_ids=torch.arange(anchor + block)[None])
            torch.testing.assert_close(ours[0, n], theirs[0], rtol=0, atol=1e-4)
            worst = max(worst, float((ours[0, n] - theirs[0]).abs().max()))
        assert (ours[0, :4] - ours[0, :4].mean()).abs().max() > 0.1
    print(f"{which}: largest hidden-state difference {worst:.2e}")


def record_reference_loop(model, monkeypatch) -> list[dict]:
    """Each step of the reference loop: its block, context features, positions and the selector's proposals."""
    steps: list[dict] = []
    real_embeddings, real_forward, real_propose = reference._raw_input_embeddings, model.forward, model.propose

    def record_block(target_model, block_ids, scale=1.0):
        steps.append({"block": block_ids.clone()})
        return real_embeddings(target_model, block_ids, scale)

    def record_forward(**kwargs):
        steps[-1].update(context=kwargs["target_hidden"].clone(), positions=kwargs["position_ids"].clone())
        return real_forward(**kwargs)

    def record_propose(hidden, anchor_ids, head, temperature):
        tokens, candidates, q = real_propose(hidden, anchor_ids, head, temperature)
        steps[-1].update(proposed=tokens.clone(), unary_argmax=model.compute_logits(hidden, head).argmax(dim=-1))
        return tokens, candidates, q

    monkeypatch.setattr(reference, "_raw_input_embeddings", record_block)
    monkeypatch.setattr(model, "forward", record_forward)
    monkeypatch.setattr(model, "propose", record_propose)
    return steps


@pytest.mark.parametrize("which", ["trained", "scrambled"])
def test_proposals_in_the_reference_loop_equal_the_trainer_dflash2_drafter(which, request, target, tmp_path,
                                                                          tiny_world, monkeypatch):
    """At every step of the reference's greedy loop (DFlash2DraftModel.propose: the selector's walk), the served
    drafter's proposals are the trainer's drafter's for the same anchor and context; the scrambled selector's
    walk leaves the unary argmax, so the comparison is of the selector's path, not of argmaxes."""
    run = request.getfixturevalue(f"{which}_run")
    model = served(export(run, tmp_path / "fp32", "--dtype", "float32"))
    drafter = trainer_drafter(run, target)
    steps = record_reference_loop(model, monkeypatch)
    block, compared, off_argmax = model.block_size, 0, 0
    for prompt in prompts(tiny_world, target, 6):
        steps.clear()
        reference.dflash_generate(model, target.model, torch.tensor([prompt]), NEW_TOKENS,
                                  [target.tokenizer.eos_token_id])
        context = torch.zeros(1, 0, target.num_features * target.hidden_size)
        for step in steps:
            context = torch.cat([context, step["context"]], dim=1)
            anchor = int(step["positions"][0, -step["block"].shape[1]])
            assert context.shape[1] == anchor
            if step["block"].shape[1] < block:  # the loop's last, shortened block
                continue
            anchors = torch.tensor([[anchor]])
            with torch.no_grad():
                hidden = drafter(context, step["block"][:, :1], anchors,
                                 build_mask("sdpa", anchors, torch.tensor([[True]]), anchor, block))
                ours = drafter.propose(hidden[:, 1:], step["block"][:, 0])
            assert torch.equal(ours, step["proposed"]), (anchor, ours, step["proposed"])
            compared += 1
            off_argmax += int(not torch.equal(step["proposed"], step["unary_argmax"]))
    print(f"{which}: {compared} steps compared, {off_argmax} where the selector's path is not the argmax")
    assert compared >= 20
    if which == "scrambled":
        assert off_argmax >= compared // 2, (off_argmax, compared)


def test_the_trainer_tau_equals_the_served_tau_of_the_acceptance_command(trained_run, target, tiny_world,
                                                                        tmp_path):
    """The acceptance command on the DFlash2 export: the reference loop's τ and the trainer's agree step by step
    on every prompt, the output is the target's greedy one, and the trainer's equals what the run logged."""
    path = export(trained_run, tmp_path / "fp32", "--dtype", "float32")
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": c[0]["content"]}) + "\n"
                                   for c in load_conversations(str(tiny_world.eval))))
    report = tmp_path / "acceptance.json"
    assert acceptance_main(["--export", str(path), "--target", str(tiny_world.target), "--prompts",
                            str(prompt_file), "--new-tokens", str(NEW_TOKENS), "--json", str(report)]) == 0
    figures = json.loads(report.read_text())
    assert all(p["lossless"] for p in figures["prompts"])
    assert [p["served_steps"] for p in figures["prompts"]] == [p["trainer_steps"] for p in figures["prompts"]]
    served_tau = figures["sets"]["prompts"]["served_tau"]
    assert served_tau == figures["sets"]["prompts"]["trainer_tau"] and served_tau > 2.0
    evalset = build_eval_set(target, prompts(tiny_world, target, 16), NEW_TOKENS, "cpu")
    assert acceptance_length(trainer_drafter(trained_run, target), evalset, torch.float32) == pytest.approx(
        served_tau, rel=1e-6)
    logged = [r["acceptance_length"] for r in read_metrics(trained_run) if "acceptance_length" in r]
    assert logged[-1] == pytest.approx(served_tau, rel=1e-6)


# ---- refusals ------------------------------------------------------------------------------------------------


def train_args(world, output_dir: Path, *overrides: str) -> list[str]:
    sets = [*world.overrides(output_dir), "num_threads=1", "eval_every=0", *overrides]
    return ["--config", "tiny"] + [a for s in sets for a in ("--set", s)]


def assert_one_line_exit_2(code: int, capsys, message: str) -> None:
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err


def test_an_unknown_architecture_and_a_group_size_that_does_not_divide_the_width_are_refused(tiny_world, tmp_path,
                                                                                            capsys):
    assert_one_line_exit_2(train_main(train_args(tiny_world, tmp_path / "a", "architecture=dflash3")), capsys,
                           "architecture must be one of dflash, dflash2")
    assert_one_line_exit_2(train_main(train_args(tiny_world, tmp_path / "b", *DFLASH2, "conv_group_size=24")),
                           capsys, "conv_group_size (24) must divide the hidden size (64)")
    assert not (tmp_path / "b" / "checkpoints").exists()


def test_resuming_with_another_architecture_is_refused_before_any_work(trained_run, tiny_world, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(latest_checkpoint(trained_run), run / "checkpoints" / latest_checkpoint(trained_run).name)
    code = train_main(train_args(tiny_world, run) + ["--resume"])
    assert_one_line_exit_2(code, capsys, "is a dflash2 drafter; this run says architecture='dflash'")


def test_a_resumed_dflash2_run_gives_the_losses_of_an_uninterrupted_one(tiny_world, tmp_path):
    """The convolutions, the codebooks and their optimizer state go through the checkpoint: 2N steps straight,
    then the same run resumed from its step-N checkpoint, loss for loss."""
    out = tmp_path / "run"
    args = train_args(tiny_world, out, *DFLASH2, "max_steps=12", "save_every=6", "log_every=1",
                      "keep_checkpoints=5")
    assert train_main(args) == 0
    straight = {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}
    shutil.rmtree(out / "checkpoints" / "step_00000012")
    (out / "metrics.jsonl").unlink()
    assert train_main(args + ["--resume"]) == 0
    resumed = {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}
    assert resumed == {step: straight[step] for step in range(7, 13)}


def served(path: Path) -> reference.DFlash2DraftModel:
    return served_as(path, reference.DFlash2DraftModel)
