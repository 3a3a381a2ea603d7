"""The target's RoPE in the drafter, exactly as the reference computes it (ARCHITECTURE §7).

The served drafter (the reference `DFlashDraftModel`) builds transformers' `Qwen3RotaryEmbedding` from its config's
`rope_parameters`: inverse frequencies and an attention scaling fixed at load, then cos and sin of position x
frequency, times that scaling. So the trainer asks the same class, built from the same fields, for the same two
things (`rope_frequencies`) and computes cos and sin the same way (training/model/drafter.py `rotary_tables`).

That is exact for the RoPE types whose frequencies are fixed at load: default, linear, llama3 and yarn
(tests/training/test_served_drafters.py holds each to the reference). `dynamic` is refused: its frequencies are
recomputed from the longest position of each forward and kept while later ones are shorter, so they depend on the
history of calls, and one training forward over many blocks never sees what the serving loop's block-by-block
calls see. `longrope` and the rest are refused as not held to the reference; so is a partial rotary factor.
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from training.config import ConfigError

SERVED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
REFUSED_WHY = {
    "dynamic": "its frequencies follow the longest position of each forward (and stay after it), which one "
               "training forward over many blocks and the serving loop's block-by-block calls do not share",
}


def served_rope_parameters(params: dict) -> dict:
    """A target's RoPE parameters ({"rope_type" or "type", "rope_theta", ...}) as the drafter serves them:
    {"rope_type": kind, "rope_theta": theta, ...the type's own parameters}, or a one-line ConfigError for a type
    the drafter does not compute exactly as the reference does."""
    params = dict(params)
    kind = params.pop("rope_type", params.pop("type", "default"))
    theta = params.pop("rope_theta", None)
    if params.get("partial_rotary_factor", 1.0) == 1.0:
        params.pop("partial_rotary_factor", None)
    if kind not in SERVED_ROPE_TYPES or "partial_rotary_factor" in params or (kind == "default" and params):
        extra = f" with {params}" if params else ""
        why = REFUSED_WHY.get(kind, f"the drafter computes RoPE types {', '.join(SERVED_ROPE_TYPES)} exactly as "
                                    "the served model does, with the full head rotated")
        raise ConfigError(f"the target's RoPE is {kind!r}{extra}: refused, {why}")
    if theta is None:
        raise ConfigError("the target config has no RoPE theta")
    return {"rope_type": kind, "rope_theta": float(theta), **params}


def rope_frequencies(rope_parameters: dict, head_dim: int, max_position_embeddings: int,
                     device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] float32, attention scaling): what the served drafter's rotary
    embedding holds, from the same class and fields. A type's missing parameter is one ConfigError line."""
    try:
        config = Qwen3Config(hidden_size=head_dim, num_attention_heads=1, num_key_value_heads=1, head_dim=head_dim,
                             max_position_embeddings=max_position_embeddings, rope_parameters=dict(rope_parameters))
        with torch.device("cpu"):  # a drafter built on the meta device (export's shape check) still gets values
            rotary = Qwen3RotaryEmbedding(config)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
        raise ConfigError(f"the target's RoPE {rope_parameters} is incomplete for its type "
                          f"({type(err).__name__}: {err})") from None
    return rotary.inv_freq.to(device=device, dtype=torch.float32), float(rotary.attention_scaling)
