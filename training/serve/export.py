"""Write a checkpoint as the directory the serving engines load (ARCHITECTURE §7).

    python -m training.export RUN_OR_CHECKPOINT_DIR OUT_DIR [--dtype bfloat16|float32] [--force]

RUN_OR_CHECKPOINT_DIR is a run's output_dir (its newest complete checkpoint is taken) or one checkpoint
directory. OUT_DIR receives config.json (a Qwen3 config with `architectures: ["DFlashDraftModel"]`, or
["DFlash2DraftModel"] for a DFlash2 drafter, `num_target_layers`, `block_size`, `dflash_config:
{target_layer_ids, mask_token_id, mask_token}` (DFlash2 adds conv_kernel_size, conv_group_size, selector_rank,
selector_top_k, output_multiplier and final_logit_softcapping, the fields SGLang's parser takes together), both
`rope_theta` and `rope_parameters` (and for a scaled RoPE `rope_scaling`) so that transformers 4.x and 5.x read
the same RoPE, and `gpuctl: {run, home, checkpoint, step}`: the run that wrote the checkpoint, from its
config.json) and model.safetensors with the reference implementation's parameter names; no embedding or LM head
(the engine uses the target's).

Everything is checked before anything is written; the directory is built under a temporary name beside OUT_DIR
and renamed into place, so an export cut short never looks complete. Bad input (a missing, incomplete, corrupt
or pre-convention checkpoint, a non-empty OUT_DIR without --force, an unknown dtype): one line on stderr, exit 2.
A successful training run calls `export_run`, which writes `<output_dir>/export/`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from training.config import ConfigError
from training.console import say
from training.durable import abandoned, fsync_path, writer_tag
from training.entry import OneLineArgumentParser
from training.model.dflash2 import build_drafter
from training.model.drafter import DFLASH2_FIELDS, DrafterConfig
from training.output.checkpoint import STEP_DIR, check_checkpoint, checkpoint_run, checkpoints_dir
from training.target.frozen import MASK_TOKEN, check_feature_layers, rope_parameters

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}  # the reference's classes
SERVED_DFLASH2_FIELDS = DFLASH2_FIELDS[1:]  # dflash_config's DFlash2 fields: all but "architecture" (the class)
# The trainer's module names inside a drafter layer -> the reference's (Qwen3 decoder layer layout).
LAYER_NAMES = {
    "input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
    "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
}
TRAINER_NAMES = {served: ours for ours, served in LAYER_NAMES.items()}
# DFlash2's own parameters carry the reference's names in the trainer too (the codebooks without ".weight": the
# reference's DFlash2DraftModel.from_pretrained maps them onto its nn.Embedding weights).
DFLASH2_LAYER_MODULES = ("attention_conv", "mlp_conv")
DFLASH2_NAMES = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "candidate_selector.hidden_projection.weight")


def is_dflash2_name(name: str) -> bool:
    parts = name.split(".")
    return name in DFLASH2_NAMES or (parts[0] == "layers" and len(parts) >= 4 and parts[2] in DFLASH2_LAYER_MODULES)


def served_name(name: str) -> str:
    """A trainer parameter name -> the reference's: layers.0.q_proj.weight -> layers.0.self_attn.q_proj.weight."""
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) == 4 and parts[2] in LAYER_NAMES:
        return ".".join([parts[0], parts[1], LAYER_NAMES[parts[2]], parts[3]])
    if name in ("fc.weight", "hidden_norm.weight", "norm.weight") or is_dflash2_name(name):
        return name
    raise ValueError(f"no served name for drafter parameter {name!r}")


def trainer_name(name: str) -> str:
    """The reference's parameter name -> the trainer's (served_name's inverse)."""
    parts = name.split(".")
    inner = ".".join(parts[2:-1])
    if parts[0] == "layers" and len(parts) >= 4 and inner in TRAINER_NAMES:
        return ".".join([parts[0], parts[1], TRAINER_NAMES[inner], parts[-1]])
    if name in ("fc.weight", "hidden_norm.weight", "norm.weight") or is_dflash2_name(name):
        return name
    raise ValueError(f"no trainer name for served parameter {name!r}")


def read_export(path: str | Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """An exported drafter directory as the trainer's config and weights (to evaluate what was served)."""
    path = Path(path).expanduser()
    for name in ("config.json", "model.safetensors"):
        if not (path / name).is_file():
            raise ConfigError(f"{path} is not an exported drafter (no {name})")
    try:
        c = json.loads((path / "config.json").read_text())
        dflash = c["dflash_config"]
        config = DrafterConfig(
            hidden_size=c["hidden_size"], num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
            head_dim=c["head_dim"], intermediate_size=c["intermediate_size"], rms_norm_eps=c["rms_norm_eps"],
            rope_parameters=dict(c["rope_parameters"]), vocab_size=c["vocab_size"],
            num_layers=c["num_hidden_layers"], num_features=len(dflash["target_layer_ids"]),
            block_size=c["block_size"], target_layers=list(dflash["target_layer_ids"]),
            mask_token_id=dflash["mask_token_id"], num_target_layers=c["num_target_layers"],
            max_position_embeddings=c["max_position_embeddings"], mask_token=dflash.get("mask_token", MASK_TOKEN),
            **served_dflash2_fields(c), **served_attention_layers(c))
        weights = {trainer_name(name): t for name, t in load_file(path / "model.safetensors").items()}
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as err:
        raise ConfigError(f"{path} is not a readable DFlash export ({type(err).__name__}: {err})") from None
    return config, weights


def served_dflash2_fields(c: dict) -> dict:
    """The DrafterConfig's DFlash2 fields of an exported config.json ({} for a DFlashDraftModel)."""
    if c["architectures"] == [ARCHITECTURES["dflash"]]:
        return {}
    if c["architectures"] != [ARCHITECTURES["dflash2"]]:
        raise ValueError(f"architectures {c['architectures']} is neither DFlash's nor DFlash2's")
    dflash = c["dflash_config"]
    return {"architecture": "dflash2", **{name: dflash[name] for name in SERVED_DFLASH2_FIELDS}}
def served_attention_layers(c: dict) -> dict:
    """An export's sliding-window layers as DrafterConfig fields; a causal drafter is not this trainer's."""
    if c.get("is_causal"):
        raise ValueError("its config says is_causal: this trainer's drafters attend both ways")
    if not c.get("use_sliding_window") or "sliding_attention" not in (c.get("layer_types") or []):
        return {}
    return {"layer_types": list(c["layer_types"]), "sliding_window": int(c["sliding_window"])}


def served_config(c: DrafterConfig, dtype: str) -> dict:
    """config.json of the served drafter: a Qwen3 config plus the DFlash (and DFlash2) fields the reference reads."""
    dflash2 = {name: getattr(c, name) for name in SERVED_DFLASH2_FIELDS} if c.architecture == "dflash2" else {}
    return {
        "architectures": [ARCHITECTURES[c.architecture]],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": c.attention_window is not None,
        "rope_theta": c.rope_theta,
        "rope_parameters": dict(c.rope_parameters),
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
        "num_hidden_layers": c.num_layers,
        "num_target_layers": c.num_target_layers,
        "block_size": c.block_size,
        # Both: vLLM reads mask_token_id; SGLang reads mask_token too (default <|MASK|>, which a target such as
        # SmolLM2 lacks), so neither falls back to a token this tokenizer has not got.
        "dflash_config": {"target_layer_ids": list(c.target_layers), "mask_token_id": c.mask_token_id,
                          "mask_token": c.mask_token, **dflash2},
        "dtype": dtype,
        "torch_dtype": dtype,  # the same, for engines on transformers 4.x (5.x reads `dtype`, warns on this one)
        **rope_scaling(c.rope_parameters),
        **attention_layers(c),
    }


def attention_layers(c: DrafterConfig) -> dict:
    """Causality, always said (the reference and vLLM take a sliding-window drafter layer as causal unless the
    config says otherwise; this drafter attends both ways in every layer), and the sliding-window layers."""
    if c.attention_window is None:
        return {"is_causal": False}
    return {"is_causal": False, "layer_types": list(c.layer_types), "sliding_window": c.sliding_window}


def rope_scaling(params: dict) -> dict:
    """A scaled RoPE also as `rope_scaling`, the field transformers 4.x reads it from (5.x: rope_parameters)."""
    if params.get("rope_type", "default") == "default":
        return {}
    return {"rope_scaling": {key: value for key, value in params.items() if key != "rope_theta"}}


def provenance(checkpoint: Path) -> dict:
    """The export's "gpuctl" entry: the run that wrote the checkpoint (gpuctl's run id, None by hand; its
    home), the checkpoint's name and its step."""
    run, step = checkpoint_run(checkpoint), STEP_DIR.fullmatch(checkpoint.name)
    return {"run": run["id"], "home": run["home"], "checkpoint": checkpoint.name,
            "step": int(step[1]) if step else None}


def resolve_checkpoint(source: str | Path) -> Path:
    """A checkpoint directory itself, or the newest complete checkpoint of a run's output_dir."""
    source = Path(source).expanduser()
    if not source.is_dir():
        raise ConfigError(f"{source} is not a directory")
    if STEP_DIR.fullmatch(source.name) or (source / "drafter.safetensors").exists():
        return source
    root = checkpoints_dir(source)
    if not root.is_dir():
        raise ConfigError(f"{source} is neither a checkpoint nor a run's output_dir (no checkpoints/ in it)")
    complete = [p for p in sorted(root.iterdir(), reverse=True)
                if STEP_DIR.fullmatch(p.name) and all((p / name).is_file() for name in
                                                  ("drafter.safetensors", "config.json", "state.pt"))]
    if not complete:
        raise ConfigError(f"no complete checkpoint in {root}")
    return complete[0]


def served_weights(checkpoint: Path, dtype: torch.dtype) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """The checkpoint's config and its weights under the reference's names, checked against that config."""
    config = check_checkpoint(checkpoint)
    try:
        check_feature_layers(config.target_layers, config.num_target_layers)
        rope_parameters(SimpleNamespace(rope_parameters=config.rope_parameters))
        if not 0 <= config.mask_token_id < config.vocab_size:
            raise ConfigError(f"mask_token_id {config.mask_token_id} has no row in a {config.vocab_size}-row table")
    except ConfigError as err:
        raise ConfigError(f"{checkpoint}: {err}") from None
    try:
        weights = load_file(checkpoint / "drafter.safetensors")
    except (OSError, SafetensorError) as err:
        raise ConfigError(f"{checkpoint / 'drafter.safetensors'} is unreadable: {err}") from None
    with torch.device("meta"):  # the parameters this config has, without allocating them
        rows = torch.empty(config.vocab_size, config.hidden_size)
        expected = {name: tuple(p.shape) for name, p in build_drafter(config, rows, rows).state_dict().items()}
    got = {name: tuple(t.shape) for name, t in weights.items()}
    if got != expected:
        missing, unexpected = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
        wrong = sorted(n for n in expected.keys() & got.keys() if expected[n] != got[n])
        raise ConfigError(f"{checkpoint}: weights do not match its config (missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]}, wrong shape {wrong[:3]})")
    return config, {served_name(name): t.to(dtype).contiguous() for name, t in weights.items()}


def _check_destination(out: Path, checkpoint: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory")
    resolved, source = out.resolve(), checkpoint.resolve()
    if resolved == source or resolved in source.parents:
        raise ConfigError(f"{out} holds the checkpoint being exported; choose another OUT_DIR")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"{out} is not empty (pass --force to replace it)")


def recover_export(out: Path) -> None:
    """Clear what an export to `out` killed mid-write (kill -9) by a process of this host left beside it: its
    directory being built, removed; the export it set aside (`.replaced-`), put back when `out` is missing
    (killed between the two renames), else removed. Called by every export and by a run's start."""
    if not out.parent.is_dir():
        return
    for path in abandoned(out.parent, f".{out.name}.export-"):
        shutil.rmtree(path, ignore_errors=True)
    for path in abandoned(out.parent, f".{out.name}.replaced-"):
        if not out.exists():
            os.replace(path, out)
        else:
            shutil.rmtree(path, ignore_errors=True)


def export_checkpoint(source: str | Path, out_dir: str | Path, dtype: str = "bfloat16",
                      force: bool = False) -> tuple[Path, Path]:
    """Export `source` (a run's output_dir or a checkpoint) to `out_dir`; returns (checkpoint, out_dir)."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    checkpoint = resolve_checkpoint(source)
    out = Path(os.path.abspath(Path(out_dir).expanduser()))  # "." and ".." resolved: a name to build beside
    _check_destination(out, checkpoint, force)
    config, weights = served_weights(checkpoint, DTYPES[dtype])

    # Checked: now build it beside OUT_DIR and rename it into place.
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_export(out)
    tmp = out.parent / f".{out.name}.export-{writer_tag()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        served = {**served_config(config, dtype), "gpuctl": provenance(checkpoint)}
        (tmp / "config.json").write_text(json.dumps(served, indent=2) + "\n")
        for file in tmp.iterdir():
            fsync_path(file)
        fsync_path(tmp)
        if out.exists():  # empty, or --force: set the old one aside, put the new one in, then delete the old
            old = out.parent / f".{out.name}.replaced-{writer_tag()}"
            os.replace(out, old)
            try:
                os.replace(tmp, out)
            except OSError:
                os.replace(old, out)
                raise
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
        fsync_path(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return checkpoint, out


def export_run(output_dir: str | Path) -> Path:
    """A finished run's newest checkpoint into <output_dir>/export/ (bf16), replacing an earlier export."""
    checkpoint, out = export_checkpoint(output_dir, Path(output_dir).expanduser() / "export", force=True)
    say(f"exported {checkpoint.name} to {out} for serving")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="python -m training.export",
                     description="Write a drafter checkpoint in the format SGLang and vLLM load "
                                 "(DFlashDraftModel, DFlash2DraftModel).")
    parser.add_argument("source", metavar="RUN_OR_CHECKPOINT_DIR",
                        help="a run's output_dir (its newest complete checkpoint) or a checkpoint directory")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the model directory to write")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    args = parser.parse_args(argv)
    try:
        checkpoint, out = export_checkpoint(args.source, args.out_dir, args.dtype, args.force)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # writing failed (disk full, permissions): nothing is left half-written
        print(f"error: writing {args.out_dir}: {err}", file=sys.stderr)
        return 1
    print(f"exported {checkpoint} to {out} ({args.dtype})")
    return 0

