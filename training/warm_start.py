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
from training.export import read_export
from training.model import Drafter, DrafterConfig

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
