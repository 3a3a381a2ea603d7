"""A run that starts from a drafter in the served format (`init_from`, this project's own export) and fine-tunes
it, for a fine-tuned target, on new prompts, or for longer.

The export is read before the target loads (`read_warm_start`: readable, and the layer count and block size this
run asks for), and checked against the drafter the run builds once the target is known (`apply_warm_start`):
every field that decides what the drafter computes (widths, heads, norms' epsilon, vocabulary, the target's
layers and RoPE, the mask token) must be the run's, else one line saying which differs. The weights are then
loaded as they are (a bf16 export's values, in the run's float32 weights), so step 0 proposes exactly what the
exported drafter proposes when the reference loads it (tests/training/test_served_drafters.py). A resumed run
takes its checkpoint's weights instead; the optimizer starts fresh either way at step 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from training.config import ConfigError, TrainConfig
from training.console import say
from training.model.drafter import Drafter, DrafterConfig
from training.serve.export import read_export

# What must agree between the export and the run's drafter: (field, what the run calls it).
MATCHED = (
    ("num_layers", "num_draft_layers"), ("block_size", "block_size"), ("hidden_size", "the target's hidden size"),
    ("num_heads", "the target's attention heads"), ("num_kv_heads", "the target's KV heads"),
    ("head_dim", "the target's head_dim"), ("intermediate_size", "the target's intermediate_size"),
    ("rms_norm_eps", "the target's rms_norm_eps"), ("vocab_size", "the target's vocabulary"),
    ("num_target_layers", "the target's layer count"), ("target_layers", "target_layers"),
    ("rope_parameters", "the target's RoPE"), ("mask_token_id", "the mask token's id"),
    ("layer_types", "layer_types"), ("sliding_window", "sliding_window"),
)


@dataclass
class WarmStart:
    path: Path
    config: DrafterConfig
    weights: dict[str, torch.Tensor]  # the trainer's names


def read_warm_start(config: TrainConfig) -> WarmStart | None:
    """The export `init_from` names (None when unset), checked against what the run's config fixes before the
    target loads: the drafter's layer count and block size, and target_layers when set."""
    if not config.init_from:
        return None
    path = Path(config.init_from).expanduser()
    drafter_config, weights = read_export(path)
    expected = {"num_layers": config.num_draft_layers, "block_size": config.block_size}
    if config.target_layers:
        expected["target_layers"] = list(config.target_layers)
    warm = WarmStart(path, drafter_config, weights)
    for name, value in expected.items():
        _check_field(warm, name, value)
    return warm


def apply_warm_start(drafter: Drafter, warm: WarmStart | None) -> None:
    """The export's weights into the run's freshly built drafter, once every field that decides its output
    matches (one line naming the first that does not)."""
    if warm is None:
        return
    for name, _ in MATCHED:
        _check_field(warm, name, getattr(drafter.config, name))
    dtype = drafter.fc.weight.dtype
    try:
        drafter.load_state_dict({name: t.to(dtype) for name, t in warm.weights.items()})
    except RuntimeError as err:  # a config that says one shape over weights of another
        first = next((line.strip() for line in str(err).splitlines()[1:] if line.strip()), str(err))
        raise ConfigError(f"init_from {warm.path}: its weights do not fit its config ({first})") from None
    say(f"warm start: the drafter starts from {warm.path}")


def _check_field(warm: WarmStart, name: str, run_value) -> None:
    ours = getattr(warm.config, name)
    if _normalised(ours) != _normalised(run_value):
        what = dict(MATCHED)[name]
        raise ConfigError(f"init_from {warm.path}: its {name} is {ours}, this run's ({what}) is {run_value}; a "
                          "warm start needs the same drafter shape and target")


def _normalised(value):
    if isinstance(value, dict):
        return {key: _normalised(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalised(v) for v in value]
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


# A target decoder layer's weights (Llama, Qwen3: transformers' names) and the drafter layer's that take them.
TARGET_LAYER_WEIGHTS = {
    "input_layernorm.weight": "input_norm.weight",
    "self_attn.q_proj.weight": "q_proj.weight", "self_attn.k_proj.weight": "k_proj.weight",
    "self_attn.v_proj.weight": "v_proj.weight", "self_attn.o_proj.weight": "o_proj.weight",
    "self_attn.q_norm.weight": "q_norm.weight", "self_attn.k_norm.weight": "k_norm.weight",  # Qwen3 has them
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "gate_proj.weight", "mlp.up_proj.weight": "up_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight",
}


def copy_target_layers(drafter: Drafter, target_model: torch.nn.Module) -> list[int]:
    """init_layers = "target": the drafter's layers become copies of the target's top decoder layers (its last
    num_layers, in order) and its final norm the target's; the fusion layer, hidden_norm and any weight the
    target's layer lacks (SmolLM2's q/k norms, DFlash2's convolutions) keep their fresh values. The drafter has
    the target's width, heads and MLP, so every copied weight fits (a mismatch is one line). Returns the copied
    layers' indices."""
    decoder = target_model.get_decoder()
    layers = decoder.layers
    first = len(layers) - len(drafter.layers)
    if first < 0:
        raise ConfigError(f'init_layers = "target": the drafter has {len(drafter.layers)} layers, the target only '
                          f"{len(layers)}")
    copied = list(range(first, len(layers)))
    with torch.no_grad():
        for ours, index in zip(drafter.layers, copied):
            theirs = layers[index].state_dict()
            mine = ours.state_dict()
            for source, name in TARGET_LAYER_WEIGHTS.items():
                if source in theirs and name in mine:
                    _copy_into(mine[name], theirs[source], f"layer {index} {source}")
        _copy_into(drafter.norm.weight, decoder.norm.weight, "the final norm")
    say(f"init_layers = target: the drafter's layers start as the target's layers {copied[0]}-{copied[-1]}")
    return copied


def _copy_into(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    if ours.shape != theirs.shape:
        raise ConfigError(f'init_layers = "target": the target\'s {what} is {list(theirs.shape)}, the drafter\'s '
                          f"{list(ours.shape)}")
    ours.copy_(theirs.to(ours.device, ours.dtype))
