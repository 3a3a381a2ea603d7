"""Decoding with a static KV cache, each step replayed as one CUDA graph (ARCHITECTURE §6).

transformers' `generate` launches every kernel of every layer from Python for each token: a small target's decode
step is bound by those launches, not by the GPU. Here a batch of `rows` prompts, left-padded to `width`, decodes
into a cache this module owns, of fixed size (rows x (width + max_new_tokens) per layer), so every step has one
shape and its inputs live in fixed buffers. On CUDA the whole step (the model's forward, the greedy choice, the
advance of every position) is captured once as a CUDA graph and replayed: one launch a token.

The model is the transformers one, unchanged. It writes keys and values through the cache's `update` and attends
through `grouped_attention` (registered with transformers' AttentionInterface as ATTENTION), which reads each
key/value head once for its group of query heads: repeating them for SDPA copies more bytes than a small model
reads in weights. The masks are built here, 4-D, which transformers passes through as they are.

The discipline, as for compiled functions (training/compile/flex.py): the shapes are fixed per decoder (rows, width,
max_new_tokens); captures happen one at a time in the process, under one lock, each thread on its own device;
`DecodeCounters` (graphs captured, capture seconds, graph replays, eager steps) go in the run's last line.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from training.config import ConfigError

ATTENTION = "gpuctl_grouped"
CAPTURE_LOCK = threading.Lock()  # one capture at a time in the process, whichever thread asks
CHECK_EVERY = 16  # steps between the (synchronising) checks whether every row has stopped, on CUDA


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention contract: query [B, H, S, D], key and value [B, KVH, L, D], here a boolean
    attention_mask [B, 1, S, L] (True: attend); returns ([B, S, H, D], None). Query head h uses key/value head
    h // (H // KVH), as transformers' repeat_kv arranges them."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    scaling = dim**-0.5 if scaling is None else scaling
    if length > 1:  # the prefill, once per batch: SDPA over repeated heads
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    grouped = query.view(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * scaling  # [B, KVH, G, L]
    scores = scores.masked_fill(~attention_mask.view(batch, 1, 1, -1), float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(value.dtype), value)  # [B, KVH, G, D]
    return out.reshape(batch, 1, heads, dim), None


AttentionInterface.register(ATTENTION, grouped_attention)


def check_static_decodable(config) -> None:
    """A target whose layers all attend to the whole context (this module builds one mask for every layer)."""
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(config, "sliding_window", None) and getattr(
            config, "use_sliding_window", True):
        raise ConfigError("decode=static handles targets whose layers all attend to the whole context; this "
                          "target has sliding-window layers: use decode=dynamic")


def sample(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """One token per row at `temperature`, from the smallest set of tokens holding `top_p` of the mass."""
    probs = (logits.float() / temperature).softmax(-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0))
    return torch.multinomial(probs, 1)[:, 0]


def capture_step(device: torch.device, step: Callable[[], object], state: list[torch.Tensor]):
    """`step` as a CUDA graph: two warm-up runs on a side stream, then the capture, under CAPTURE_LOCK (one capture
    at a time in the process). The warm-ups move `state`, which is restored after. Returns (the graph, or None
    when capturing failed; what the captured step returned, its output buffers; the failure's first line, or
    None; seconds spent)."""
    began, saved = time.perf_counter(), [t.clone() for t in state]
    graph, out, failure = None, None, None
    with CAPTURE_LOCK:
        try:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = step()
        except RuntimeError as err:
            graph, failure = None, str(err).splitlines()[0]
        for tensor, value in zip(state, saved):
            tensor.copy_(value)
    return graph, out, failure, time.perf_counter() - began


class StaticKVCache:
    """Per layer, keys and values [rows, kv_heads, length, head_dim], allocated at the first write (the prefill),
    written at `slots` (a tensor of cache positions) and read up to `visible`. The part of transformers' Cache
    that a decoder layer calls; nothing else is reached, since position ids and 4-D masks are always given."""

    def __init__(self, layers: int, length: int):
        self.length, self.visible = length, length
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.slots: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.keys[layer_idx] is None:
            rows, kv_heads, _, dim = key_states.shape
            for store in (self.keys, self.values):
                store[layer_idx] = key_states.new_zeros(rows, kv_heads, self.length, dim)
        self.keys[layer_idx].index_copy_(2, self.slots, key_states)
        self.values[layer_idx].index_copy_(2, self.slots, value_states)
        return self.keys[layer_idx][:, :, : self.visible], self.values[layer_idx][:, :, : self.visible]


@dataclass
class DecodeCounters:
    graphs: int = 0
    capture_s: float = 0.0
    replays: int = 0
    eager_steps: int = 0
    capture_failures: int = 0

    def line(self) -> str:
        return (f"static decode: {self.graphs} CUDA graphs captured in {self.capture_s:.1f} s, {self.replays} "
                f"replays, {self.eager_steps} eager steps" + (f", {self.capture_failures} captures failed"
                                                              if self.capture_failures else ""))


class StaticDecoder:
    """Decodes batches of `rows` prompts left-padded to `width`, up to `max_new_tokens` each, with one cache and
    (on CUDA) one captured step, reused for every batch of this shape."""

    def __init__(self, model, rows: int, width: int, max_new_tokens: int, eos_ids: list[int],
                 counters: DecodeCounters):
        check_static_decodable(model.config)
        self.model, self.rows, self.width, self.max_new = model, rows, width, max_new_tokens
        self.device = model.get_input_embeddings().weight.device
        self.counters, self.graph, self.graph_failed = counters, None, False
        self.cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        length = width + max_new_tokens
        self.cache = StaticKVCache(model.config.num_hidden_layers, length)
        device, long = self.device, torch.long
        self.slot = torch.zeros(1, dtype=long, device=device)  # where the step's token goes in the cache
        self.index = torch.zeros(1, dtype=long, device=device)  # where its successor goes in `generated`
        self.token = torch.zeros(rows, 1, dtype=long, device=device)
        self.position = torch.zeros(rows, 1, dtype=long, device=device)
        self.valid = torch.zeros(rows, length, dtype=torch.bool, device=device)  # slots holding a real token
        self.slots = torch.arange(length, device=device)
        self.generated = torch.zeros(rows, max_new_tokens, dtype=long, device=device)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.eos = torch.tensor(eos_ids, dtype=long, device=device)
        self.logits: torch.Tensor | None = None  # the captured step's output

    def _forward(self, ids, positions, mask, logits_to_keep: int = 1) -> torch.Tensor:
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                         logits_to_keep=logits_to_keep, **{self.cache_argument: self.cache})
        return out.logits[:, -1]

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The prompts into the cache; the logits of each row's first new token."""
        real = mask.bool()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(self.width, self.width, dtype=torch.bool, device=self.device).tril()
        # A padding slot attends to itself only: its (unused) output stays finite, so no NaN reaches the cache.
        attend = (causal & real[:, None, :]) | torch.eye(self.width, dtype=torch.bool, device=self.device)
        self.cache.slots, self.cache.visible = self.slots[: self.width], self.width
        logits = self._forward(ids, positions, attend[:, None])
        self.cache.slots, self.cache.visible = self.slot, self.cache.length
        self.valid.copy_(torch.cat([real, torch.ones_like(self.valid[:, self.width:])], dim=1))
        self.position.copy_(positions[:, -1:] + 1)
        self.slot.fill_(self.width)
        self.index.fill_(0)
        self.finished.zero_()
        return logits

    def _advance(self, chosen: torch.Tensor) -> None:
        """The chosen token [rows] of every row: recorded, and the next step's input."""
        self.generated.index_copy_(1, self.index, chosen[:, None])
        self.finished |= torch.isin(chosen, self.eos)
        self.token.copy_(chosen[:, None])
        self.index += 1

    def _step(self, greedy: bool) -> torch.Tensor:
        """One token of every row through the model: its logits (greedy: the successor chosen and advanced)."""
        attend = self.valid & (self.slots <= self.slot)
        logits = self._forward(self.token, self.position, attend[:, None, None, :])
        self.slot += 1
        self.position += 1
        if greedy:
            self._advance(logits.argmax(-1))
        return logits

    def _state(self) -> list[torch.Tensor]:
        return [self.slot, self.index, self.token, self.position, self.generated, self.finished]

    def _capture(self, greedy: bool) -> None:
        """The step as a CUDA graph; decoding goes on without one when capturing fails, and says why once."""
        self.graph, self.logits, failure, seconds = capture_step(self.device, lambda: self._step(greedy),
                                                                 self._state())
        self.counters.capture_s += seconds
        if failure is None:
            self.counters.graphs += 1
            return
        from training.console import say

        self.graph_failed = True
        self.counters.capture_failures += 1
        say(f"static decode: capturing the step as a CUDA graph failed ({failure}); decoding without graphs")

    def _one_step(self, greedy: bool, choose) -> None:
        if self.graph is not None:
            self.graph.replay()
            self.counters.replays += 1
            logits = self.logits
        else:
            logits = self._step(greedy)
            self.counters.eager_steps += 1
        if not greedy:
            self._advance(choose(logits))

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, mask: torch.Tensor, choose=None) -> list[list[int]]:
        """Each row's new tokens, up to max_new_tokens (past its first EOS they mean nothing). `choose` maps
        logits [rows, vocab] to tokens [rows]; None is greedy (argmax)."""
        if self.device.type != "cuda":
            return self._generate(ids, mask, choose)
        with torch.cuda.device(self.device):  # graphs capture on, and replay into, the current device's stream
            return self._generate(ids, mask, choose)

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, choose) -> list[list[int]]:
        greedy = choose is None
        self._advance((choose or (lambda lg: lg.argmax(-1)))(self._prefill(ids.to(self.device),
                                                                               mask.to(self.device))))
        use_graph = self.device.type == "cuda" and self.max_new >= 4 and not self.graph_failed
        if use_graph and self.graph is None:
            self._capture(greedy)
        check_every = CHECK_EVERY if self.device.type == "cuda" else 1
        steps = 1
        while steps < self.max_new and not (steps % check_every == 0 and bool(self.finished.all())):
            self._one_step(greedy, choose)
            steps += 1
        return self.generated[:, :steps].tolist()
