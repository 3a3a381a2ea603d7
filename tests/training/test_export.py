"""The export is what the engines serve: held to the reference implementation (the `dflash` package's
DFlashDraftModel, its context features and its greedy speculative loop) with the tiny target, on the CPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import dflash.model as reference
import pytest
import torch
from reference_helpers import prompts, served
from safetensors.torch import load_file, save_file

import training.serve.export as export_module
from training.config import ConfigError
from training.data.chat import encode_chat, load_conversations
from training.model.attention import build_mask
from training.model.drafter import Drafter, DrafterConfig
from training.output.checkpoint import check_checkpoint, latest_checkpoint, save_checkpoint
from training.serve.acceptance import first_difference
from training.serve.acceptance import main as acceptance_main
from training.serve.evaluate import acceptance_length, build_eval_set
from training.serve.export import main as export_main
from training.target.frozen import MASK_TOKEN, Target
from training.train import main as train_main
from training.trainer import cosine_schedule

REPO = Path(__file__).resolve().parents[2]
NEW_TOKENS = 48

pytestmark = pytest.mark.usefixtures("reference_timer_on_the_cpu")


@pytest.fixture(scope="module")
def trained_run(tiny_world, tmp_path_factory) -> Path:
    """The tiny preset trained as a user would run it (its 60 steps); a finished run exports itself."""
    out = tmp_path_factory.mktemp("trained") / "run"
    sets = [*tiny_world.overrides(out), "num_threads=1", "eval_every=0"]
    assert train_main(["--config", "tiny"] + [a for s in sets for a in ("--set", s)]) == 0
    return out


@pytest.fixture(scope="module")
def untrained_run(target, tmp_path_factory) -> Path:
    """A freshly initialised drafter, built and checkpointed exactly as the trainer does at step 0."""
    out = tmp_path_factory.mktemp("untrained") / "run"
    config = DrafterConfig.from_target(target.config, 2, 8, target.layers, target.mask_token_id)
    torch.manual_seed(0)
    drafter = Drafter(config, target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight)
    optimizer = torch.optim.AdamW(drafter.parameters())
    save_checkpoint(out, 0, drafter, optimizer, cosine_schedule(optimizer, 10, 0.1), {}, {}, keep=1)
    return out


def export(source: Path, out: Path, *options: str) -> Path:
    assert export_main([str(source), str(out), *options]) == 0
    return out


def trainer_drafter(checkpoint: Path, target: Target) -> Drafter:
    """The trainer's own drafter with a checkpoint's weights, in float32."""
    drafter = Drafter(check_checkpoint(checkpoint), target.model.get_input_embeddings().weight,
                      target.model.get_output_embeddings().weight)
    drafter.load_state_dict(load_file(checkpoint / "drafter.safetensors"))
    return drafter.eval()


# ---- the format ----------------------------------------------------------------------------------------------


def test_the_run_exports_itself_and_the_reference_loads_it_with_nothing_missing(trained_run, target, tmp_path):
    """The run's own bf16 export and a float32 one: DFlashDraftModel.from_pretrained reports no missing,
    unexpected or mismatched parameter and no error; the values are the checkpoint's."""
    checkpoint = latest_checkpoint(trained_run)
    weights = load_file(checkpoint / "drafter.safetensors")
    for path, dtype in ((trained_run / "export", torch.bfloat16),
                        (export(trained_run, tmp_path / "fp32", "--dtype", "float32"), torch.float32)):
        config = json.loads((path / "config.json").read_text())
        assert config["architectures"] == ["DFlashDraftModel"] and config["num_target_layers"] == 8
        assert config["dflash_config"] == {"target_layer_ids": target.layers, "mask_token_id": target.mask_token_id,
                                           "mask_token": MASK_TOKEN}
        assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 10000.0
        assert config["block_size"] == 8 and config["num_hidden_layers"] == 2
        assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
        saved = load_file(path / "model.safetensors")
        assert {t.dtype for t in saved.values()} == {dtype}
        model = served(path)
        assert model.mask_token_id == target.tokenizer.convert_tokens_to_ids(MASK_TOKEN) == target.mask_token_id
        assert model.target_layer_ids == target.layers and model.block_size == 8
        assert saved.keys() == dict(model.named_parameters()).keys()
        assert sorted(map(export_module.served_name, weights)) == sorted(saved)
        for name, tensor in weights.items():
            torch.testing.assert_close(saved[export_module.served_name(name)], tensor.to(dtype), rtol=0, atol=0)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary directory left over


def test_the_tiny_tokenizer_gets_mask_as_an_added_special_token_with_a_row_of_its_own(target, tiny_world):
    from transformers import AutoTokenizer

    target_dir = str(tiny_world.target)
    tokenizer = target.tokenizer
    vocab_rows = target.model.get_input_embeddings().weight.shape[0]
    assert MASK_TOKEN not in AutoTokenizer.from_pretrained(target_dir).get_vocab()  # the saved one lacks it
    assert target.mask_token_id == len(tokenizer) - 1 < vocab_rows  # added after the saved tokenizer's tokens
    assert tokenizer.added_tokens_decoder[target.mask_token_id].special
    assert tokenizer.decode([target.mask_token_id]) == MASK_TOKEN
    assert tokenizer.decode([target.mask_token_id], skip_special_tokens=True) == ""


def test_the_tiny_data_never_holds_the_mask_token(target, tiny_world):
    """The mask token marks what the drafter has not seen: it must never be a real token of the data."""
    tokenizer = target.tokenizer
    for path in (tiny_world.train, tiny_world.eval):
        assert MASK_TOKEN not in path.read_text()
        for messages in load_conversations(str(path)):
            assert target.mask_token_id not in encode_chat(tokenizer, messages)


# ---- the semantics -------------------------------------------------------------------------------------------


def test_reference_hidden_states_equal_the_trainer_drafter(trained_run, target, tmp_path, tiny_world):
    """Context features from the reference's own extract_context_feature over the tiny target; several anchors
    and a padding block in one trainer forward against one reference forward per anchor (its context: the
    positions before the anchor; its block: the anchor token, then mask_token_id)."""
    model = served(export(trained_run, tmp_path / "fp32", "--dtype", "float32"))
    drafter = trainer_drafter(latest_checkpoint(trained_run), target)
    prompt = prompts(tiny_world, target, 1)[0]
    ids = torch.tensor([(prompt + target.generate_greedy([prompt], NEW_TOKENS)[0])[:40]])
    assert ids.shape[1] == 40
    with torch.no_grad():
        states = target.model(ids, output_hidden_states=True).hidden_states
        features = reference.extract_context_feature(states, model.target_layer_ids)
        # The trainer's hooks read the same layers the reference indexes as hidden_states[layer_id + 1].
        torch.testing.assert_close(target.features(ids), features, rtol=0, atol=0)

        block = model.block_size
        anchors, valid = torch.tensor([[3, 11, 20, 31, 0]]), torch.tensor([[True, True, True, True, False]])
        mask = build_mask("sdpa", anchors, valid, ids.shape[1], block)
        ours = drafter(features, ids.gather(1, anchors), anchors, mask).view(1, -1, block, model.config.hidden_size)
        embedding = target.model.get_input_embeddings().weight
        for n, anchor in enumerate(anchors[0, :4].tolist()):
            block_ids = torch.full((1, block), model.mask_token_id)
            block_ids[0, 0] = ids[0, anchor]
            theirs = model(target_hidden=features[:, :anchor], noise_embedding=embedding[block_ids],
                           position_ids=torch.arange(anchor + block)[None])
            torch.testing.assert_close(ours[0, n], theirs[0], rtol=0, atol=1e-4)
        assert (ours[0, :4] - ours[0, :4].mean()).abs().max() > 0.1  # not a degenerate (constant) output


def run_reference_loop(model, target: Target, prompt: list[int], stop: list[int]):
    return reference.dflash_generate(model, target.model, torch.tensor([prompt]), NEW_TOKENS, stop,
                                     return_stats=True)


def test_proposals_in_the_reference_loop_equal_the_trainer_drafter(trained_run, target, tmp_path, tiny_world,
                                                                    monkeypatch):
    """At every step of the reference's greedy loop, the served drafter's proposals are the tokens the trainer's
    drafter proposes for the same anchor and context (the context features the loop has accumulated)."""
    model = served(export(trained_run, tmp_path / "fp32", "--dtype", "float32"))
    drafter = trainer_drafter(latest_checkpoint(trained_run), target)
    steps = []

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

    real_embeddings, real_forward, real_logits = reference._raw_input_embeddings, model.forward, model.compute_logits
    monkeypatch.setattr(reference, "_raw_input_embeddings", record_block)
    monkeypatch.setattr(model, "forward", record_forward)
    monkeypatch.setattr(model, "compute_logits", record_logits)

    block, compared = model.block_size, 0
    for prompt in prompts(tiny_world, target, 6):
        steps.clear()
        run_reference_loop(model, target, prompt, [target.tokenizer.eos_token_id])
        context = torch.zeros(1, 0, features_width(target))
        for step in steps:
            context = torch.cat([context, step["context"]], dim=1)
            anchor = int(step["positions"][0, -step["block"].shape[1]])
            assert context.shape[1] == anchor  # the loop's context is every position before the anchor
            assert (step["block"][0, 1:] == target.mask_token_id).all()
            if step["block"].shape[1] < block:  # the loop's last, shortened block: not what anyone trains
                continue
            anchors = torch.tensor([[anchor]])
            with torch.no_grad():
                hidden = drafter(context, step["block"][:, :1], anchors,
                                 build_mask("sdpa", anchors, torch.tensor([[True]]), anchor, block))
                ours = drafter.logits(hidden[:, 1:]).argmax(dim=-1)
            assert torch.equal(ours, step["proposed"]), (anchor, ours, step["proposed"])
            compared += 1
    assert compared >= 20


def features_width(target: Target) -> int:
    return target.num_features * target.hidden_size


def test_served_trained_drafter_beats_the_untrained_one_and_the_loop_emits_the_target_greedy_output(
        trained_run, untrained_run, target, tiny_world, tmp_path):
    """Served with the reference loop (the run's own bf16 export): mean accepted length (accepted drafts + the
    bonus token per step) at least 1.0 above an untrained drafter's; the output is the target's greedy one."""
    stop = [target.tokenizer.eos_token_id]
    taus = {}
    for name, path in (("untrained", export(untrained_run, tmp_path / "untrained")),
                       ("trained", trained_run / "export")):
        model, lengths = served(path), []
        for prompt in prompts(tiny_world, target, 16):
            result = run_reference_loop(model, target, prompt, stop)
            greedy = target.generate_greedy([prompt], NEW_TOKENS)[0]
            assert result.output_ids[0, len(prompt):].tolist() == greedy
            lengths += result.acceptance_lengths
        taus[name] = sum(lengths) / len(lengths)
    print(f"reference-loop tau: untrained {taus['untrained']:.2f}, trained {taus['trained']:.2f}")
    assert taus["trained"] >= taus["untrained"] + 1.0, taus


def test_the_trainer_tau_equals_the_served_tau_of_the_acceptance_command(trained_run, target, tiny_world,
                                                                        tmp_path):
    """The acceptance command on the run's float32 export: the reference loop's tau and the trainer's
    (training/serve/evaluate.py, counting steps as the loop counts them) agree step by step on every prompt, and the
    trainer's equals what the run itself logged on the same prompts."""
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
    drafter = trainer_drafter(latest_checkpoint(trained_run), target)
    evalset = build_eval_set(target, prompts(tiny_world, target, 16), NEW_TOKENS, "cpu")
    assert acceptance_length(drafter, evalset, torch.float32) == pytest.approx(served_tau, rel=1e-6)


def test_the_one_forward_check_finds_exactly_where_an_output_leaves_the_greedy_decode(target, tiny_world):
    """The acceptance command's lossless check (one forward over prompt + output) agrees with token-by-token
    decoding: the greedy decode passes; one token changed anywhere is found at its position, with the target's
    own choice ahead of it."""
    for prompt in prompts(tiny_world, target, 4):
        greedy = target.generate_greedy([prompt], NEW_TOKENS)[0]
        assert first_difference(target, prompt, greedy) is None
        for at in (0, len(greedy) // 2, len(greedy) - 1):
            changed = greedy[:at] + [(greedy[at] + 1) % target.config.vocab_size] + greedy[at + 1:]
            where, margin = first_difference(target, prompt, changed)
            assert where == at and margin > 0


# ---- refusals ------------------------------------------------------------------------------------------------


def copy_checkpoint(run: Path, where: Path) -> Path:
    return Path(shutil.copytree(latest_checkpoint(run), where / "checkpoints" / "step_00000001"))


def edit_drafter_config(checkpoint: Path, **changes) -> None:
    doc = json.loads((checkpoint / "config.json").read_text())
    doc["drafter"].update(changes)
    (checkpoint / "config.json").write_text(json.dumps(doc))


def add_learned_mask_vector(checkpoint: Path) -> None:
    weights = load_file(checkpoint / "drafter.safetensors")
    weights["mask_embedding"] = torch.zeros(64)
    save_file(weights, checkpoint / "drafter.safetensors")


def as_older_trainer_wrote_it(checkpoint: Path) -> None:
    """The drafter config without the served format's fields (a checkpoint of the learned-vector trainer, minus
    the vector)."""
    doc = json.loads((checkpoint / "config.json").read_text())
    for name in ("mask_token_id", "num_target_layers", "max_position_embeddings"):
        del doc["drafter"][name]
    doc["drafter"]["rope_theta"] = doc["drafter"].pop("rope_parameters")["rope_theta"]
    (checkpoint / "config.json").write_text(json.dumps(doc))


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:100])


BAD_CHECKPOINTS = {
    "no drafter weights": (lambda c: (c / "drafter.safetensors").unlink(), "no drafter.safetensors"),
    "no state": (lambda c: (c / "state.pt").unlink(), "no state.pt"),
    "truncated weights": (lambda c: truncate(c / "drafter.safetensors"), "unreadable"),
    "corrupt config": (lambda c: (c / "config.json").write_text("{not json"), "no drafter config"),
    "learned mask vector": (add_learned_mask_vector, "learned mask vector"),
    "config of an older trainer": (as_older_trainer_wrote_it, "predates the served format"),
    "the target's last layer": (lambda c: edit_drafter_config(c, target_layers=[1, 2, 3, 4, 7]), "last layer"),
    "dynamic rope": (lambda c: edit_drafter_config(c, rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                                                       "rope_theta": 1e4}), "dynamic"),
    "weights of another shape": (lambda c: edit_drafter_config(c, intermediate_size=100), "wrong shape"),
}


def assert_one_line_and_nothing_written(code: int, err: str, out: str, where: Path, before: set) -> None:
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert {p.name for p in where.iterdir()} == before  # no OUT_DIR, no temporary directory


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_a_bad_checkpoint_is_one_line_exit_2_and_nothing_written(case, trained_run, tmp_path, capsys):
    damage, message = BAD_CHECKPOINTS[case]
    checkpoint = copy_checkpoint(trained_run, tmp_path / "run")
    damage(checkpoint)
    out_parent = tmp_path / "exports"
    out_parent.mkdir()
    code = export_main([str(checkpoint), str(out_parent / "draft")])
    captured = capsys.readouterr()
    assert_one_line_and_nothing_written(code, captured.err, captured.out, out_parent, set())
    assert message in captured.err, captured.err


def test_bad_arguments_are_one_line_exit_2(trained_run, tmp_path, capsys):
    (tmp_path / "empty-run").mkdir()
    (tmp_path / "empty-run" / "checkpoints").mkdir()
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        ([str(tmp_path / "missing"), str(tmp_path / "o")], "not a directory"),
        ([str(tmp_path / "empty-run"), str(tmp_path / "o")], "no complete checkpoint"),
        ([str(full), str(tmp_path / "o")], "neither a checkpoint nor a run"),
        ([str(trained_run), str(full)], "not empty (pass --force"),
        ([str(trained_run), str(a_file)], "not a directory"),
        ([str(trained_run), str(trained_run), "--force"], "holds the checkpoint"),
        ([str(trained_run), str(tmp_path / "o"), "--dtype", "float16"], "dtype must be one of"),
        ([str(trained_run)], "required"),
    ]
    before = {p.name for p in tmp_path.iterdir()}
    for argv, message in cases:
        try:
            code = export_main(argv)
        except SystemExit as exit_:  # argparse's own refusals
            code = exit_.code
        captured = capsys.readouterr()
        assert_one_line_and_nothing_written(code, captured.err, captured.out, tmp_path, before)
        assert message in captured.err, (argv, captured.err)
    assert (full / "keep.txt").read_text() == "mine" and a_file.read_text() == "x"
    assert (trained_run / "checkpoints").is_dir()


def test_the_cli_takes_the_newest_complete_checkpoint_and_force_replaces(trained_run, tmp_path):
    run = tmp_path / "run"
    older = copy_checkpoint(trained_run, run)
    newer = Path(shutil.copytree(older, run / "checkpoints" / "step_00000002"))
    newest_incomplete = Path(shutil.copytree(older, run / "checkpoints" / "step_00000003"))
    (newest_incomplete / "state.pt").unlink()
    shutil.copytree(older, run / "checkpoints" / ".tmp-step_00000004-1")  # a save cut short
    out = tmp_path / "draft"
    out.mkdir()  # empty: no --force needed
    command = [sys.executable, "-m", "training.export", str(run), str(out), "--dtype", "float32"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert f"exported {newer} to {out}" in result.stdout
    (out / "stale.txt").write_text("from before")
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "--force" in again.stderr
    assert export_main([str(run), str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert load_file(out / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "run"]


@pytest.mark.parametrize("existing", [False, True])
def test_an_export_cut_short_never_looks_complete(existing, trained_run, tmp_path, monkeypatch, capsys):
    """A write that fails after the weights are on disk: no OUT_DIR (or the previous export, intact), no
    temporary directory left, one line."""
    out = tmp_path / "draft"
    if existing:
        export(trained_run, out)
    previous = {p.name: p.read_bytes() for p in out.iterdir()} if existing else None
    real_fsync = export_module.fsync_path

    def disk_full(path):
        if path.name == "config.json":
            raise OSError(28, "No space left on device")
        real_fsync(path)

    monkeypatch.setattr(export_module, "fsync_path", disk_full)
    assert export_main([str(trained_run), str(out), "--dtype", "float32", "--force"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err
    assert [p.name for p in tmp_path.iterdir()] == (["draft"] if existing else [])
    if existing:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == previous


# A process that exports and kills itself with SIGKILL at one point of the export (no handler, no finally runs).
KILLED_AT = """
import os, signal, sys
import training.serve.export as export
real_fsync, real_replace, where = export.fsync_path, os.replace, sys.argv[1]
def fsync_path(path):
    if where == "written" and path.name == "config.json":
        os.kill(os.getpid(), signal.SIGKILL)
    real_fsync(path)
def replace(src, dst):
    if where == "set-aside" and ".replaced-" not in str(dst) and ".replaced-" not in str(src):
        os.kill(os.getpid(), signal.SIGKILL)  # the old export set aside, the new one not in place yet
    real_replace(src, dst)
export.fsync_path, os.replace = fsync_path, replace
export.main(sys.argv[2:])
"""


@pytest.mark.parametrize("where", ["written", "set-aside"])
def test_an_export_killed_with_sigkill_leaves_nothing_after_the_next_export(where, trained_run, tmp_path):
    out = tmp_path / "draft"
    export(trained_run, out)
    killed = subprocess.run([sys.executable, "-c", KILLED_AT, where, str(trained_run), str(out), "--force"],
                            cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert killed.returncode == -9, killed.stderr
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".draft."))
    assert left and all(".export-" in n or ".replaced-" in n for n in left), left  # what the kill left
    assert export_main([str(trained_run), str(out), "--force"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


# ---- the trainer refuses what would export wrong, before any work ----------------------------------------------


@pytest.fixture
def no_weights_load(monkeypatch):
    """Refusals must come before the target's weights load."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("the target's weights were loaded before the refusal")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def train_args(world, output_dir: Path, *overrides: str, target: Path | None = None) -> list[str]:
    sets = [*world.overrides(output_dir), "num_threads=1", "eval_every=0", *overrides]
    if target is not None:
        sets.append(f"target_path={target}")
    return ["--config", "tiny"] + [a for s in sets for a in ("--set", s)]


def copy_target(world, where: Path, **config_changes) -> Path:
    path = Path(shutil.copytree(world.target, where / "target"))
    config = json.loads((path / "config.json").read_text())
    config.update(config_changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


def assert_refused(code: int, capsys, message: str, output_dir: Path) -> None:
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not (output_dir / "checkpoints").exists() and not (output_dir / "metrics.jsonl").exists()


def test_the_trainer_refuses_the_targets_last_layer(tiny_world, tmp_path, capsys, no_weights_load):
    code = train_main(train_args(tiny_world, tmp_path / "run", "target_layers=[1, 3, 7]"))
    assert_refused(code, capsys, "last layer (7)", tmp_path / "run")


@pytest.mark.parametrize("rope", [  # the served types (linear, llama3, yarn): tests/training/test_served_drafters.py
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "factor": 2.0,
     "original_max_position_embeddings": 128, "rope_theta": 10000.0},
])
def test_the_trainer_refuses_a_rope_scaling_the_drafter_does_not_implement(rope, tiny_world, tmp_path, capsys,
                                                                           no_weights_load):
    target = copy_target(tiny_world, tmp_path, rope_parameters=rope, rope_scaling=rope)
    code = train_main(train_args(tiny_world, tmp_path / "run", target=target))
    assert_refused(code, capsys, f"RoPE is '{rope['rope_type']}'", tmp_path / "run")


def test_the_trainer_refuses_a_target_with_no_row_for_the_mask_token(tiny_world, tmp_path, capsys):
    """A table of exactly len(tokenizer) rows (tiny-v1's target): <|MASK|> gets an id past its end."""
    from transformers import AutoModelForCausalLM

    from training.target.tiny import tiny_target_config, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_target_config(tokenizer, len(tokenizer)))
    path = tmp_path / "target"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    code = train_main(train_args(tiny_world, tmp_path / "run", target=path))
    assert_refused(code, capsys, f"has {len(tokenizer)} rows, none for {MASK_TOKEN}", tmp_path / "run")


def test_resuming_a_checkpoint_with_a_learned_mask_vector_is_refused_before_any_work(
        trained_run, tiny_world, tmp_path, capsys, monkeypatch):
    add_learned_mask_vector(copy_checkpoint(trained_run, tmp_path / "run"))

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr(Target, "load", refuse)
    code = train_main(train_args(tiny_world, tmp_path / "run") + ["--resume"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "learned mask vector" in err, err


def test_rope_parameters_of_either_transformers_generation():
    from types import SimpleNamespace

    from training.target.frozen import rope_parameters

    expected = {"rope_type": "default", "rope_theta": 1e6}
    assert rope_parameters(SimpleNamespace(rope_theta=1e6, rope_scaling=None)) == expected  # 4.x
    assert rope_parameters(SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6})) == expected
    llama3 = {"rope_type": "llama3", "factor": 8.0}
    assert rope_parameters(SimpleNamespace(rope_theta=5e5, rope_scaling=llama3)) == {**llama3, "rope_theta": 5e5}
    with pytest.raises(ConfigError, match="'dynamic'"):
        rope_parameters(SimpleNamespace(rope_theta=1e4, rope_scaling={"type": "dynamic", "factor": 2.0}))
    with pytest.raises(ConfigError, match="no RoPE theta"):
        rope_parameters(SimpleNamespace(rope_parameters={"rope_type": "default"}))
