"""Matrix-product FLOPs of the work the trainer does: the target's forward up to its last feature layer and the
drafter's step. The trainer reports counted FLOP/s per logging window (`tflops_per_s`); MFU is that over the
devices' matrix rate. bench/drafter_bench.py counts with the same functions.

Only matrix products are counted (backward = 2 x forward: input and weight gradients, no recomputation);
attention counts the query-key pairs it computes: causal pairs in the target, the pairs the block mask allows
in the drafter.
"""

from __future__ import annotations

import torch


def target_flops(config, rows: int, length: int, layers_run: int | None = None) -> float:
    """Forward FLOPs of `layers_run` decoder layers (default: all; no LM head) over [rows, length] tokens:
    projections, MLP, causal attention."""
    d, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    q_size, kv_size = heads * head_dim, config.num_key_value_heads * head_dim
    per_token = 2 * (d * (q_size + 2 * kv_size) + q_size * d + 3 * d * config.intermediate_size)
    causal_pairs = length * (length + 1) // 2
    layers = config.num_hidden_layers if layers_run is None else layers_run
    return layers * rows * (per_token * length + 4 * heads * head_dim * causal_pairs)


def drafter_flops(c, rows: int, context_len: int, anchors: torch.Tensor, block_valid: torch.Tensor,
                  loss_positions: int) -> dict[str, float]:
    """Matrix-product FLOPs of one drafter step (forward + backward), per component. `c` is a DrafterConfig;
    anchors/block_valid [rows, N]; loss_positions: block positions with a loss weight (what the chunked loss
    sends through the vocabulary)."""
    d, q_size, kv_size = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    block_tokens = rows * anchors.shape[1] * c.block_size
    per_block_token = 2 * (d * (q_size + 2 * kv_size) + q_size * d + 3 * d * c.intermediate_size)
    # A block token sees the context before its anchor (`anchor` keys) and its own block; padding sees nothing.
    pairs = int(((anchors + c.block_size) * c.block_size * block_valid).sum())
    flops = {
        "drafter layers, block tokens": 3 * c.num_layers * per_block_token * block_tokens,
        "context k/v projections": 3 * c.num_layers * 2 * d * 2 * kv_size * rows * context_len,
        "fusion layer (fwd + weight grad)": 2 * 2 * c.num_features * d * d * rows * context_len,
        "LM head (fwd + input grad)": 2 * 2 * d * c.vocab_size * loss_positions,
        "attention, allowed pairs": 3 * c.num_layers * 4 * c.num_heads * c.head_dim * pairs,
    }
    if c.architecture == "dflash2":
        flops.update(dflash2_flops(c, block_tokens, loss_positions))
    return flops


def dflash2_flops(c, block_tokens: int, loss_positions: int) -> dict[str, float]:
    """What DFlash2 adds (training/model/dflash2.py): two kernel projections per layer over the block tokens; per
    position with loss the selector's hidden projection, its K candidates' logits (fwd + input grad: the head is
    frozen) and their transition scores."""
    d, k, rank = c.hidden_size, c.selector_top_k, c.selector_rank
    dynamic = 2 * c.conv_kernel_size * (d // c.conv_group_size)
    return {
        "DFlash2 convolution kernel projections": 3 * c.num_layers * 2 * 2 * d * dynamic * block_tokens,
        "DFlash2 selector": (2 * 2 * k * d + 3 * 2 * d * rank + 3 * 2 * k * rank) * loss_positions,
    }
