"""The DFlash drafter (ARCHITECTURE §5): a few Qwen3-style layers that denoise a block of masked tokens at once,
conditioned on the target's hidden states through KV injection.

Per batch row: the context is the target's features for positions 0..S-1 (fused once: Linear(n*D -> D) +
RMSNorm); the queries are N blocks of `block_size` tokens, block n starting at its anchor. In every layer the
keys and values are [proj(context); proj(block tokens)] and the mask (training/model/mask.py) lets a block token see
the context before its anchor and its own block, non-causally. RoPE positions: context 0..S-1, block token k
at anchor + k. The embedding and LM head are the target's, frozen (buffers, outside the optimizer and the
checkpoint).

This is the served format's forward (ARCHITECTURE §7, the reference `DFlashDraftModel`): block position 0 is the anchor
token and positions 1.. the `<|MASK|>` token (`mask_token_id`), both embedded by the target's table; q/k norms
before RoPE; the final norm; row k predicts anchor + k. tests/training/test_export.py holds it to the reference.
DFlash2 (the reference's DFlash2DraftModel) builds on these classes: training/model/dflash2.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from training.model.attention import AttentionMask, attend
from training.target.frozen import MASK_TOKEN, rope_parameters
from training.target.rope import rope_frequencies


@dataclass
class DrafterConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_parameters: dict  # the target's: {"rope_type": kind, "rope_theta": theta, ...} (training/target/rope.py)
    vocab_size: int
    num_layers: int
    num_features: int  # how many target layers are concatenated
    block_size: int
    target_layers: list[int]
    mask_token_id: int  # the token at block positions 1..: `<|MASK|>` in the target's tokenizer
    num_target_layers: int
    max_position_embeddings: int  # the target's
    mask_token: str = MASK_TOKEN  # the token string of mask_token_id (checkpoints before it had <|MASK|>)
    # "dflash", or "dflash2" (training/model/dflash2.py: the served DFlash2DraftModel); the fields below are DFlash2's
    # and are left out of a DFlash drafter's dict, so its checkpoints read as before.
    architecture: str = "dflash"
    conv_kernel_size: int = 0  # taps of the grouped dynamic causal convolutions around attention and MLP
    conv_group_size: int = 0  # channels sharing one dynamic tap
    selector_rank: int = 0  # the candidate selector's codebook rank
    selector_top_k: int = 0  # candidates per position the selector ranks
    output_multiplier: float = 1.0  # the served logits' scale ...
    final_logit_softcapping: float = 0.0  # ... and tanh cap (0 = none): the identity is what the trainer trains

    # Per drafter layer "full_attention" or "sliding_attention" (None: all full), and the sliding layers' window:
    # a block token sees the keys fewer than `sliding_window` positions away, either way (non-causal).
    layer_types: list[str] | None = None
    sliding_window: int | None = None

    @classmethod
    def from_target(cls, target_config, num_layers: int, block_size: int, target_layers: list[int],
                    mask_token_id: int, mask_token: str = MASK_TOKEN, layer_types: list[str] | None = None,
                    sliding_window: int | None = None, **dflash2) -> DrafterConfig:
        """`dflash2`: architecture="dflash2" and its fields (conv_kernel_size, ...); none for DFlash."""
        hidden = target_config.hidden_size
        heads = target_config.num_attention_heads
        return cls(
            hidden_size=hidden, num_heads=heads,
            num_kv_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_config, "head_dim", None) or hidden // heads,
            intermediate_size=target_config.intermediate_size, rms_norm_eps=target_config.rms_norm_eps,
            rope_parameters=rope_parameters(target_config), vocab_size=target_config.vocab_size,
            num_layers=num_layers, num_features=len(target_layers), block_size=block_size,
            target_layers=list(target_layers), mask_token_id=mask_token_id,
            num_target_layers=target_config.num_hidden_layers,
            max_position_embeddings=target_config.max_position_embeddings, mask_token=mask_token,
            layer_types=list(layer_types) if layer_types else None, sliding_window=sliding_window or None,
            **dflash2,
        )

    @property
    def attention_window(self) -> int | None:
        """The sliding layers' window, None when every layer attends fully."""
        return self.sliding_window if self.layer_types and "sliding_attention" in self.layer_types else None

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    def to_dict(self) -> dict:
        fields = asdict(self)
        if self.architecture == "dflash":
            for name in DFLASH2_FIELDS:
                del fields[name]
        return fields


DFLASH2_FIELDS = ("architecture", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                  "output_multiplier", "final_logit_softcapping")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32, returned in the input's dtype so that autocast keeps q/k/v in one dtype. One fused kernel
        # forward and backward on CUDA (it needs input and weight in one dtype), not seven float32 passes.
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


def matmul_dtype(device_type: str, default: torch.dtype) -> torch.dtype:
    """The dtype autocast runs matrix products in on this device type, or `default` outside autocast."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return default


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float, inv_freq: torch.Tensor | None = None,
                  scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, head_dim] for integer positions [B, T] (the half-rotation layout of Qwen3); `inv_freq`
    and `scaling` as training/target/rope.py gives them for a scaled RoPE (None: plain RoPE of `theta`)."""
    if inv_freq is None:
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
                                   / head_dim)
    freqs = positions[..., None].float() * inv_freq.to(positions.device)
    angles = torch.cat([freqs, freqs], dim=-1)[:, None]
    if scaling == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scaling, angles.sin() * scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # chunk, not two slices: its backward is one cat of the halves' gradients, where each slice's backward
    # would write a zero-filled full-size gradient and add them up.
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def attend_heads_last(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """Attention's output as [B, T, H, d], contiguous whichever backend made it: one layout for the half after
    attention (one compiled key), and the copy the output projection's reshape made anyway."""
    out = attend(q, k, v, mask).transpose(1, 2)
    return restrided(out, contiguous_strides(out.shape))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def projected_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """[B, H, T, d] as the transposed view of a [B, T, H, d] projection (what eager gives and flex is warmed with)."""
    batch, heads, length, dim = shape
    outer, time, head, last = contiguous_strides((batch, length, heads, dim))
    return outer, head, time, last


def restrided(x: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """x with exactly `stride`. A compiled function (a stage, flex_attention) may give a dimension of size 1 any
    stride, and dynamo's guards, so the stages' and the shared flex_attention's keys, tell strides apart (seen on
    an H200 at one row a micro-batch). No copy where only such strides differ."""
    if x.stride() == stride:
        return x
    if all(have == want for have, want, size in zip(x.stride(), stride, x.shape) if size > 1):
        return x.as_strided(x.shape, stride)
    return torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device).copy_(x)


def fuse_features(drafter: Drafter, features: torch.Tensor) -> torch.Tensor:
    """The fusion layer: the target's concatenated features [B, S, n*D] -> the context [B, S, D]."""
    return drafter.hidden_norm(drafter.fc(features))


def layer_before_attention(layer: DraftLayer, hidden, context, rope_q, rope_kv):
    return layer.before_attention(hidden, context, rope_q, rope_kv)


def layer_after_attention(layer: DraftLayer, hidden, attended, carry):
    return layer.after_attention(hidden, attended, carry)


@dataclass(frozen=True)
class DrafterStages:
    """What a training forward runs around attention: the fusion layer, and each layer's half before and after
    attention. compile = "all" sets compiled ones (training/compile/stages.py); these functions are what they compile."""

    fusion: Callable = fuse_features
    before_attention: Callable = layer_before_attention
    after_attention: Callable = layer_after_attention

    def __deepcopy__(self, memo) -> DrafterStages:
        return self  # one set per process: a replica copied to another device shares them


class DraftLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.sliding = False  # a sliding-window layer (set by Drafter from config.layer_types)
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.post_attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, rope_q: tuple, rope_kv: tuple,
                mask: AttentionMask) -> torch.Tensor:
        q, k, v, carry = self.before_attention(hidden, context, rope_q, rope_kv)
        return self.after_attention(hidden, attend_heads_last(q, k, v, mask), carry)

    # The layer in two halves around attention: compile = "all" compiles each half (training/compile/stages.py) and
    # leaves attention to the run's one shared flex_attention, whose discipline stays whole (ARCHITECTURE §6).
    def before_attention(self, hidden: torch.Tensor, context: torch.Tensor, rope_q: tuple,
                         rope_kv: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
        """q [B, H, T, d], k and v [B, Hkv, S + T, d] for the block tokens `hidden` [B, T, D], and what the
        half after attention needs beside them (nothing here; DFlash2's convolution kernel)."""
        return (*self.project(self.input_norm(hidden), context, rope_q, rope_kv), ())

    def after_attention(self, hidden: torch.Tensor, attended: torch.Tensor, carry: tuple) -> torch.Tensor:
        """The residual stream after this layer, from attention's output `attended` [B, T, H, d]."""
        hidden = hidden + self.o_proj(attended.flatten(2))
        return hidden + self.mlp(self.post_attention_norm(hidden))

    def project(self, x: torch.Tensor, context: torch.Tensor, rope_q: tuple,
                rope_kv: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v for the normed block tokens x [B, T, D] and the fused context [B, S, D], RoPE applied."""
        batch, q_len, _ = x.shape
        kv_len = context.shape[1] + q_len
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # One matmul for q, k, v of the block tokens and one for k, v of the context: the normed input is read
        # and cast once, and its gradient comes out of one matmul instead of three summed ones.
        dtype = matmul_dtype(x.device.type, self.q_proj.weight.dtype)
        w_q, w_k, w_v = (proj.weight.to(dtype) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k_block, v_block = F.linear(x, torch.cat([w_q, w_k, w_v])).split([q_size, kv_size, kv_size], dim=-1)
        # KV injection: the target's context and the block tokens share this layer's k/v projections.
        k_context, v_context = F.linear(context, torch.cat([w_k, w_v])).split([kv_size, kv_size], dim=-1)
        q = self.q_norm(q.view(batch, q_len, self.num_heads, self.head_dim))
        k = torch.cat([k_context, k_block], dim=1).view(batch, kv_len, self.num_kv_heads, -1)
        v = torch.cat([v_context, v_block], dim=1).view(batch, kv_len, self.num_kv_heads, -1)
        q = apply_rotary(q.transpose(1, 2), *rope_q)
        k = apply_rotary(self.k_norm(k).transpose(1, 2), *rope_kv)
        return q, k, v.transpose(1, 2)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Drafter(nn.Module):
    layer_class = DraftLayer

    def __init__(self, config: DrafterConfig, embedding: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(c.num_features * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(c) for _ in range(c.num_layers))
        for layer, kind in zip(self.layers, c.layer_types or []):
            layer.sliding = kind == "sliding_attention"  # attends through the mask's `.sliding`
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # The target's own embedding and LM head, frozen: buffers stay out of the optimizer and the checkpoint.
        # A tied target's one table is one buffer, so a copy to another device stays one copy.
        self.register_buffer("embed_weight", embedding.detach(), persistent=False)
        self.tied = lm_head is embedding
        self.register_buffer("untied_lm_head", None if self.tied else lm_head.detach(), persistent=False)
        # The served model's RoPE frequencies and scaling, from the same transformers class (training/target/rope.py);
        # float32 whatever dtype the module is cast to, one copy per device it runs on.
        self.rope_inv_freq, self.rope_scaling = rope_frequencies(c.rope_parameters, c.head_dim,
                                                                 c.max_position_embeddings, device="cpu")
        self._rope_on: dict[torch.device, torch.Tensor] = {}
        self.stages: DrafterStages | None = None  # compile = "all": the compiled ones (training/compile/stages.py)
        self.reset_parameters()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_weight if self.tied else self.untied_lm_head

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, features: torch.Tensor, anchor_tokens: torch.Tensor, anchors: torch.Tensor,
                mask: AttentionMask, compiled: bool = False) -> torch.Tensor:
        """features [B, S, n*D], anchor_tokens/anchors [B, N] -> final-normed hidden states [B, N*block, D];
        row n*block + k predicts the token at anchors[:, n] + k. `compiled`: through `self.stages` (the training
        batches' fixed shapes; evaluation's vary and stay eager)."""
        batch, context_len, _ = features.shape
        num_blocks, block = anchors.shape[1], self.config.block_size
        stages = self.stages if compiled else None
        context = stages.fusion(self, features) if stages else fuse_features(self, features)
        # The served block: the anchor token, then the mask token, all embedded by the target's frozen table.
        block_tokens = torch.full((batch, num_blocks, block), self.config.mask_token_id, dtype=anchor_tokens.dtype,
                                  device=anchor_tokens.device)
        block_tokens[:, :, 0] = anchor_tokens
        hidden = F.embedding(block_tokens.view(batch, -1), self.embed_weight).to(self.fc.weight.dtype)

        offsets = torch.arange(block, device=anchors.device)
        block_positions = (anchors[:, :, None] + offsets).reshape(batch, -1)
        context_positions = torch.arange(context_len, device=anchors.device).expand(batch, -1)
        c = self.config
        if anchors.device not in self._rope_on:
            self._rope_on[anchors.device] = self.rope_inv_freq.to(anchors.device)
        rope = (self._rope_on[anchors.device], self.rope_scaling)
        rope_q = rotary_tables(block_positions, c.head_dim, c.rope_theta, *rope)
        rope_kv = rotary_tables(torch.cat([context_positions, block_positions], dim=1), c.head_dim, c.rope_theta, *rope)
        for layer in self.layers:
            layer_mask = mask.sliding if layer.sliding else mask
            if stages is None:
                hidden = layer(hidden, context, rope_q, rope_kv, layer_mask)
                continue
            q, k, v, carry = stages.before_attention(layer, hidden, context, rope_q, rope_kv)
            q, k, v = (restrided(t, projected_strides(t.shape)) for t in (q, k, v))
            hidden = stages.after_attention(layer, hidden, attend_heads_last(q, k, v, layer_mask), carry)
        return self.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits: only for small inputs (evaluation); training uses the chunked loss."""
        return hidden.to(self.lm_head_weight.dtype) @ self.lm_head_weight.T

    def propose(self, hidden: torch.Tensor, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """Greedy drafts [B, L] for block rows 1.. (hidden [B, L, D]) after the anchor tokens [B], as the served
        drafter proposes them: DFlash takes each row's argmax."""
        return self.logits(hidden).argmax(dim=-1)

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
