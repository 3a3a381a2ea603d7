"""The DFlash2 drafter (ARCHITECTURE §7, the reference `DFlash2DraftModel` of `dflash` 0.1.0): DFlash plus a
grouped dynamic causal convolution around the attention and around the MLP of every layer, and a candidate
selector that proposes a path through each position's top-k tokens instead of each position's argmax.

The convolution mixes each block token with the `conv_kernel_size - 1` block tokens before it, inside its own
block only (taps before the block's first token read zeros): out[t, c] = sum_o (base[o, c] + dyn[t, o, g(c)]) *
x[t - o, c], where the dynamic part dyn is one linear projection of the sublayer's normed input, shared by every
`conv_group_size` channels. One projection feeds both sides: `prepare` convolves the sublayer's input and hands
on the kernel that `finish` applies to its output. It starts as the identity (base tap 0 is 1, the rest and
the projection 0), so an untrained DFlash2 drafter is a DFlash drafter.

The selector scores candidate c at a position, after the predecessor token p, as unary[c] + <A[p] * P(h), B[c]>
(A, B: the predecessor and successor codebooks of `selector_rank`; P: a projection of the position's hidden
state; unary: the position's logit), over the `selector_top_k` tokens with the highest logits, and walks the
block greedily from the anchor: each position's choice is the next one's predecessor. How it is trained:
training/model/selector_loss.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from training.config import ARCHITECTURES, ConfigError
from training.model.drafter import Drafter, DrafterConfig, DraftLayer


class GroupedCausalConv(nn.Module):
    """The reference's GroupedDynamicCausalConv, over [B, N blocks * block, D] with the taps kept in each block."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))  # [prepare|finish, tap, channel]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> (x convolved, the dynamic kernel [B, T, taps, groups] that `finish` applies)."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self.convolve(x, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self.convolve(x, dynamic, self.base_kernel[1])

    def convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        blocks = x.view(batch, length // self.block_size, self.block_size, self.groups, self.group_size)
        dynamic = dynamic.reshape(*blocks.shape[:3], self.kernel_size, self.groups, 1)
        out = torch.zeros_like(blocks)
        for tap in range(self.kernel_size):
            # The token `tap` places earlier in the same block; zeros before the block's first token.
            shifted = blocks if tap == 0 else F.pad(blocks[:, :, :-tap], (0, 0, 0, 0, tap, 0))
            out = out + base[tap].view(self.groups, self.group_size).to(x.dtype) * shifted
            out = torch.addcmul(out, dynamic[:, :, :, tap], shifted)
        return out.view_as(x)


class DFlash2Layer(DraftLayer):
    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        c = config
        self.attention_conv = GroupedCausalConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size, c.block_size)
        self.mlp_conv = GroupedCausalConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size, c.block_size)

    def before_attention(self, hidden: torch.Tensor, context: torch.Tensor, rope_q: tuple, rope_kv: tuple):
        x, kernel = self.attention_conv.prepare(self.input_norm(hidden))
        return (*self.project(x, context, rope_q, rope_kv), (kernel,))

    def after_attention(self, hidden: torch.Tensor, attended: torch.Tensor, carry: tuple) -> torch.Tensor:
        (kernel,) = carry
        hidden = hidden + self.attention_conv.finish(self.o_proj(attended.flatten(2)), kernel)
        x, kernel = self.mlp_conv.prepare(self.post_attention_norm(hidden))
        return hidden + self.mlp_conv.finish(self.mlp(x), kernel)


class CandidateSelector(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        c = config
        self.top_k = c.selector_top_k
        # Plain parameters: the served file names them without ".weight", as the reference's loader expects.
        self.predecessor_codebook = nn.Parameter(torch.empty(c.vocab_size, c.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(c.vocab_size, c.selector_rank))
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)

    def reset_parameters(self) -> None:
        # Small: the transition term starts near 0, so the first walk is each position's argmax (DFlash's).
        for codebook in (self.predecessor_codebook, self.successor_codebook):
            nn.init.normal_(codebook, std=0.02)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)

    def scores(self, hidden: torch.Tensor, predecessor: torch.Tensor, candidates: torch.Tensor,
               unary: torch.Tensor) -> torch.Tensor:
        """hidden [..., D], predecessor [...], candidates and their logits [..., K] -> scores [..., K]."""
        context = F.embedding(predecessor, self.predecessor_codebook) * self.hidden_projection(hidden)
        successor = F.embedding(candidates, self.successor_codebook)
        return unary + torch.einsum("...r,...kr->...k", context.to(successor.dtype), successor).to(unary.dtype)

    def greedy_path(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """The reference's greedy `select`: hidden [B, L, D], logits [B, L, V], anchor tokens [B] -> [B, L]."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        predecessor, path = anchor_tokens, []
        for position in range(hidden.shape[1]):
            scores = self.scores(hidden[:, position], predecessor, candidates[:, position], unary[:, position])
            predecessor = candidates[:, position].gather(-1, scores.argmax(dim=-1, keepdim=True))[:, 0]
            path.append(predecessor)
        return torch.stack(path, dim=1)


class DFlash2Drafter(Drafter):
    layer_class = DFlash2Layer

    def __init__(self, config: DrafterConfig, embedding: torch.Tensor, lm_head: torch.Tensor):
        check_dflash2(config)
        super().__init__(config, embedding, lm_head)  # its reset_parameters (below) sets the convolutions
        self.candidate_selector = CandidateSelector(config)
        self.candidate_selector.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        for module in self.modules():  # after the Linear init, which would overwrite theirs
            if isinstance(module, (GroupedCausalConv, CandidateSelector)):
                module.reset_parameters()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The reference's compute_logits: the head's logits, scaled by output_multiplier, then soft-capped."""
        logits = super().logits(hidden)
        c = self.config
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping > 0:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def propose(self, hidden: torch.Tensor, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """As the reference's `propose` (greedy): the selector's path through each row's top-k."""
        return self.candidate_selector.greedy_path(hidden, self.logits(hidden), anchor_tokens)


def check_dflash2(c: DrafterConfig) -> None:
    """A DFlash2 config the reference can build: a one-line ConfigError naming the field otherwise."""
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        if getattr(c, name) < 1:
            raise ConfigError(f"{name} must be >= 1 for dflash2, got {getattr(c, name)}")
    if c.hidden_size % c.conv_group_size:
        raise ConfigError(f"conv_group_size ({c.conv_group_size}) must divide the hidden size ({c.hidden_size})")
    if c.conv_kernel_size > c.block_size:
        raise ConfigError(f"conv_kernel_size ({c.conv_kernel_size}) must not exceed block_size ({c.block_size})")
    if c.selector_top_k > c.vocab_size:
        raise ConfigError(f"selector_top_k ({c.selector_top_k}) exceeds the vocabulary ({c.vocab_size})")


def drafter_class(config: DrafterConfig) -> type[Drafter]:
    if config.architecture not in ARCHITECTURES:
        raise ConfigError(f"architecture must be one of {', '.join(ARCHITECTURES)}, got {config.architecture!r}")
    return DFlash2Drafter if config.architecture == "dflash2" else Drafter


def build_drafter(config: DrafterConfig, embedding: torch.Tensor, lm_head: torch.Tensor) -> Drafter:
    """The drafter of the config's architecture."""
    return drafter_class(config)(config, embedding, lm_head)
