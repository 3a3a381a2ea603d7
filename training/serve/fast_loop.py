"""A speculative decoding loop at the GPU's speed: the reference `dflash_generate`'s output and acceptance
lengths, step for step, without its launches and host work (ARCHITECTURE §7, "The fast loop").

At 135 M parameters a weight read takes about 0.1 ms and the eager reference loop about 30 ms a step: the step is
bound by kernel launches and Python, so no τ can win there. Here everything a step does has one shape:

- the target has a static KV cache (static_decode.StaticKVCache, sized prompt + new tokens + one block) and
  verifies exactly `block_size` tokens a step at positions start..start+block-1, attending causally to the
  cache; what it wrote past the accepted tokens is overwritten by the next step, never cropped;
- the drafter (the trainer's Drafter, DFlash or DFlash2, with the export's weights) keeps a cache of its context
  keys and values per layer: a step projects the `block_size` feature rows of the last verify into it (the rows
  past the accepted ones land beyond `start`, where the mask hides them until the next step overwrites them),
  then drafts the block [anchor, mask...] against the cache before `start` and the block itself, non-causally;
- acceptance (the drafts' agreement with the target's argmax, cut at the first miss), the bonus token and the
  next step's state (start, anchor, features) are computed on the device; the host reads one small tensor a step
  (accepted count, block, bonus) to append the tokens and look for a stop token.

The last block, where fewer than `block_size` tokens remain, keeps the shape: the drafter's block keys past the
remaining length are masked (as the reference's shorter block has none) and only that many drafts can be
accepted. On CUDA the step (draft + verify + accept) is captured once as a CUDA graph and replayed, under the
static decode's capture lock; on the CPU the same code runs eagerly. The prefill is eager. A block of 1 is the
target alone: the same loop decoding one token a step, the fair baseline.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from training.config import ConfigError
from training.model.drafter import Drafter, DrafterConfig, rotary_tables
from training.regenerate.static_decode import ATTENTION, StaticKVCache, capture_step, check_static_decodable


@dataclass
class LoopResult:
    tokens: list[int]  # after the prompt: the prefill's token, then every step's
    steps: list[int]  # tokens produced by each verification step (the reference's acceptance_lengths)


@dataclass
class LoopCounters:
    graphs: int = 0
    replays: int = 0
    eager_steps: int = 0
    capture_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def check_matches(config: DrafterConfig, target_config) -> None:
    """The export was trained for a target of this shape (else every number it gives would be meaningless)."""
    for what, ours, theirs in (("hidden size", config.hidden_size, target_config.hidden_size),
                               ("layer count", config.num_target_layers, target_config.num_hidden_layers),
                               ("vocabulary", config.vocab_size, target_config.vocab_size)):
        if ours != theirs:
            raise ConfigError(f"the export is for a target with {what} {ours}; this target's is {theirs}")
    if max(config.target_layers) >= target_config.num_hidden_layers:
        raise ConfigError(f"the export reads the target's layers {config.target_layers}; this target has "
                          f"{target_config.num_hidden_layers}")


def check_pair(drafter: Drafter | None, target_config) -> None:
    """What this loop runs: a drafter trained for this target, without what it cannot run yet (one line each)."""
    check_static_decodable(target_config)
    if drafter is None:
        return
    check_matches(drafter.config, target_config)
    if any(layer.sliding for layer in drafter.layers):
        raise ConfigError("the fast loop does not run sliding-window drafter layers yet: use --loop reference")


def cache_length(target_config, prompts: list[list[int]], new_tokens: int, block: int) -> int:
    """The cache these prompts need (the longest, new_tokens and one block); one line if the target's window is
    shorter."""
    length = max(len(p) for p in prompts) + new_tokens + block
    window = getattr(target_config, "max_position_embeddings", None)
    if window and length > window:
        raise ConfigError(f"the longest prompt ({max(map(len, prompts))} tokens), --new-tokens {new_tokens} and a "
                          f"block need {length} positions; the target's window is {window}")
    return length


@contextlib.contextmanager
def attention_of(model, implementation: str):
    """The target attends through `implementation` inside the block (the loop's 4-D boolean masks)."""
    before = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


class FastLoop:
    """Greedy speculative decoding of one prompt at a time (batch 1) with `drafter` (None: the target alone, a
    block of 1) in a cache of `cache_length` positions."""

    def __init__(self, target_model, drafter: Drafter | None, stop_ids: list[int], cache_length: int,
                 graphs: bool | None = None):
        check_pair(drafter, target_model.config)
        self.model, self.drafter, self.length = target_model, drafter, cache_length
        self.block = drafter.config.block_size if drafter is not None else 1
        self.device = target_model.get_input_embeddings().weight.device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.counters = LoopCounters()
        self.graph: torch.cuda.CUDAGraph | None = None
        device, long, block = self.device, torch.long, self.block
        self.layers = list(drafter.config.target_layers) if drafter is not None else []
        self.cache = StaticKVCache(target_model.config.num_hidden_layers, cache_length)
        self.cache_argument = ("cache" if "cache" in inspect.signature(target_model.forward).parameters
                               else "past_key_values")
        self.offsets = torch.arange(block, device=device)
        self.slots = torch.arange(cache_length, device=device)
        self.stops = torch.tensor(stop_ids or [-1], dtype=long, device=device)
        # the step's state, in place: the anchor (the last token produced), its position, the last verify's
        # features and where they start, how many tokens the block may verify (block, less at the end)
        self.anchor = torch.zeros(1, dtype=long, device=device)
        self.start = torch.zeros(1, dtype=long, device=device)
        self.feature_start = torch.zeros(1, dtype=long, device=device)
        self.verify = torch.full((1,), block, dtype=long, device=device)
        self.readout = torch.zeros(block + 2, dtype=long, device=device)  # accepted, block..., bonus
        if drafter is not None:
            c = drafter.config
            dtype = drafter.fc.weight.dtype
            self.features = torch.zeros(1, block, c.num_features * c.hidden_size, dtype=dtype, device=device)
            shape = (1, c.num_kv_heads, cache_length, c.head_dim)
            self.context_keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in drafter.layers]
            self.context_values = [torch.zeros(shape, dtype=dtype, device=device) for _ in drafter.layers]
            self.rope = (drafter.rope_inv_freq.to(device), drafter.rope_scaling)

    # -- the target ---------------------------------------------------------------------------------------------

    def _target(self, ids: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [1, T] at positions first.. (written to the cache there): logits [T, V] and the features [1, T,
        n*D] (None without a drafter)."""
        positions = first + torch.arange(ids.shape[1], device=self.device)
        self.cache.slots = positions
        attend = self.slots[None, :] <= positions[:, None]  # causal over the cache
        out = self.model(input_ids=ids, position_ids=positions[None], attention_mask=attend[None, None],
                         use_cache=True, output_hidden_states=self.drafter is not None,
                         **{self.cache_argument: self.cache})
        features = None
        if self.drafter is not None:  # the reference reads hidden_states[layer + 1]: after that decoder layer
            features = torch.cat([out.hidden_states[layer + 1] for layer in self.layers], dim=-1)
        return out.logits[0], features

    # -- the drafter --------------------------------------------------------------------------------------------

    def _draft(self, context_features: torch.Tensor) -> torch.Tensor:
        """The drafts [block - 1] for the block at `start`, after writing the context rows `context_features`
        [1, R, n*D] (positions feature_start..) into the drafter's cache."""
        drafter, c, block = self.drafter, self.drafter.config, self.block
        rows = context_features.shape[1]
        context = drafter.hidden_norm(drafter.fc(context_features.to(drafter.fc.weight.dtype)))
        context_positions = self.feature_start + torch.arange(rows, device=self.device)
        block_positions = self.start + self.offsets
        tokens = torch.full((1, block), c.mask_token_id, dtype=torch.long, device=self.device)
        tokens[:, 0] = self.anchor
        hidden = F.embedding(tokens, drafter.embed_weight).to(drafter.fc.weight.dtype)
        rope_q = rotary_tables(block_positions[None], c.head_dim, c.rope_theta, *self.rope)
        rope_kv = rotary_tables(torch.cat([context_positions, block_positions])[None], c.head_dim, c.rope_theta,
                                *self.rope)
        # the cache before the anchor, and the block up to what may be verified (all of it but at the end)
        visible = torch.cat([self.slots < self.start, self.offsets < self.verify])[None, None, None]
        for n, layer in enumerate(drafter.layers):
            q, k, v, carry = layer.before_attention(hidden, context, rope_q, rope_kv)
            self.context_keys[n].index_copy_(2, context_positions, k[:, :, :rows])
            self.context_values[n].index_copy_(2, context_positions, v[:, :, :rows])
            keys = torch.cat([self.context_keys[n], k[:, :, rows:]], dim=2)
            values = torch.cat([self.context_values[n], v[:, :, rows:]], dim=2)
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=True)
            hidden = layer.after_attention(hidden, attended.transpose(1, 2), carry)
        hidden = drafter.norm(hidden)
        return drafter.propose(hidden[:, 1:], self.anchor)[0]

    # -- one step -----------------------------------------------------------------------------------------------

    def _step(self, context_features: torch.Tensor | None) -> None:
        """Draft, verify and accept one block; the state moves to the next step and `readout` holds what the
        host needs. `context_features`: the rows the drafter has not seen yet (the last verify's)."""
        block = self.anchor.clone()
        if self.drafter is not None:
            block = torch.cat([block, self._draft(context_features)])
        logits, features = self._target(block[None], self.start)
        posterior = logits.argmax(dim=-1)
        agree = (block[1:] == posterior[:-1]) & (self.offsets[1:] < self.verify)
        accepted = agree.long().cumprod(dim=0).sum(dim=0, keepdim=True)
        bonus = posterior.gather(0, accepted)
        torch.cat([accepted, block, bonus], out=self.readout)
        self.feature_start.copy_(self.start)
        self.start += accepted + 1
        self.anchor.copy_(bonus)
        if features is not None:
            self.features.copy_(features)

    def _capture(self) -> None:
        """The steady step (the last verify's rows as context) as one CUDA graph; eager steps when that fails."""
        state = [self.anchor, self.start, self.feature_start, self.readout, self.verify]
        state += [self.features] if self.drafter is not None else []
        self.graph, _, failure, seconds = capture_step(
            self.device, lambda: self._step(self.features if self.drafter is not None else None), state)
        self.counters.capture_s += seconds
        if failure is None:
            self.counters.graphs += 1
        else:
            self.graphs = False
            self.counters.notes.append(f"capturing the step failed ({failure}); eager steps")

    def _steady_step(self) -> None:
        if self.graphs and self.graph is None:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            self.counters.replays += 1
        else:
            self._step(self.features if self.drafter is not None else None)
            self.counters.eager_steps += 1

    # -- the loop -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt: list[int], new_tokens: int) -> LoopResult:
        """The prompt's greedy continuation, up to `new_tokens` tokens or a stop token (included), and the
        tokens each verification step produced."""
        if not prompt or new_tokens <= 0:
            raise ConfigError("the fast loop needs a prompt and new tokens > 0")
        if len(prompt) + new_tokens + self.block > self.length:
            raise ConfigError(f"a prompt of {len(prompt)} tokens and {new_tokens} new ones do not fit the loop's "
                              f"cache of {self.length} positions (it needs prompt + new tokens + {self.block})")
        context = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with context, attention_of(self.model, ATTENTION):
            return self._generate(prompt, new_tokens)

    def _generate(self, prompt: list[int], new_tokens: int) -> LoopResult:
        max_length = len(prompt) + new_tokens
        self.cache.visible = self.length
        logits, features = self._target(torch.tensor([prompt], device=self.device),
                                         torch.zeros(1, dtype=torch.long, device=self.device))
        first = int(logits[-1].argmax())
        tokens, steps, stops = [first], [], set(self.stops.tolist())
        self.anchor.fill_(first)
        self.start.fill_(len(prompt))
        self.feature_start.zero_()
        self.verify.fill_(self.block)
        start, stopped = len(prompt), first in stops
        prompt_features = features
        while start + 1 < max_length and not stopped:
            remaining = max_length - start
            if remaining < self.block:
                self.verify.fill_(remaining)
            if prompt_features is not None:  # the first step's context is the whole prompt: its own shape, eager
                self._step(prompt_features)
                prompt_features = None
                self.counters.eager_steps += 1
            else:
                self._steady_step()
            readout = self.readout.tolist()  # the step's one synchronisation
            accepted, block, bonus = readout[0], readout[1:-1], readout[-1]
            new = (block[1: accepted + 1] + [bonus])[: min(accepted + 1, remaining - 1)]
            for n, token in enumerate(new):
                if token in stops:
                    new, stopped = new[: n + 1], True
                    break
            tokens += new
            steps.append(len(new))
            start += len(new)
        return LoopResult(tokens, steps)


# -- the speed-up, measured as a user would pick the fastest target-alone decode ------------------------------------


@dataclass
class Speedup:
    loop: str
    prompts: int
    tokens: int  # produced by the loop with the drafter (the target's own decode produces the same)
    tau: float
    hf_static_tok_s: float  # transformers' generate with cache_implementation="static"
    target_tok_s: float  # this loop with a block of 1
    drafter_tok_s: float  # this loop with the drafter
    decode_ms: float  # one step of the target alone (one token), replayed as a graph on CUDA
    step_ms: float  # one speculative step (draft, verify, accept)
    speedup: float  # drafter_tok_s / the larger of the two target-alone figures
    tau_bound: float  # tau x decode_ms / step_ms: what tau buys at these step times
    graphs: int
    eager_steps: int


def _timed(device: torch.device, work):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    began = time.perf_counter()
    out = work()
    sync()
    return time.perf_counter() - began, out


@torch.no_grad()
def measure_speedup(target_model, drafter: Drafter, prompts: list[list[int]], new_tokens: int,
                    stop_ids: list[int], pad_id: int) -> Speedup:
    """Greedy, batch 1, every prompt through transformers' static-cache `generate`, this loop with a block of 1
    and this loop with the drafter, in this process, after one untimed pass of the first prompt through each."""
    device = target_model.get_input_embeddings().weight.device
    length = cache_length(target_model.config, prompts, new_tokens, drafter.config.block_size)
    alone = FastLoop(target_model, None, stop_ids, length)
    drafted = FastLoop(target_model, drafter, stop_ids, length)

    def hf(ids: list[int]):
        return target_model.generate(torch.tensor([ids], device=device), max_new_tokens=new_tokens, do_sample=False,
                                     cache_implementation="static", eos_token_id=stop_ids, pad_token_id=pad_id,
                                     temperature=None, top_p=None, top_k=None)

    for work in (lambda: hf(prompts[0]), lambda: alone.generate(prompts[0], new_tokens),
                 lambda: drafted.generate(prompts[0], new_tokens)):
        work()  # warm-up: graphs captured, caches allocated
    totals = {"hf": [0.0, 0], "alone": [0.0, 0], "drafted": [0.0, 0]}
    steps_alone, steps_drafted = 0, []
    for ids in prompts:
        seconds, out = _timed(device, lambda ids=ids: hf(ids))
        totals["hf"][0] += seconds
        totals["hf"][1] += out.shape[1] - len(ids)
        seconds, result = _timed(device, lambda ids=ids: alone.generate(ids, new_tokens))
        totals["alone"][0] += seconds
        totals["alone"][1] += len(result.tokens)
        steps_alone += len(result.steps)
        seconds, result = _timed(device, lambda ids=ids: drafted.generate(ids, new_tokens))
        totals["drafted"][0] += seconds
        totals["drafted"][1] += len(result.tokens)
        steps_drafted += result.steps
    rate = {name: tokens / seconds if seconds else 0.0 for name, (seconds, tokens) in totals.items()}
    decode_ms = totals["alone"][0] / max(steps_alone, 1) * 1e3
    step_ms = totals["drafted"][0] / max(len(steps_drafted), 1) * 1e3
    tau = sum(steps_drafted) / len(steps_drafted) if steps_drafted else 0.0
    best_alone = max(rate["hf"], rate["alone"])
    counters = [alone.counters, drafted.counters]
    return Speedup("fast", len(prompts), totals["drafted"][1], tau, rate["hf"], rate["alone"], rate["drafted"],
                   decode_ms, step_ms, rate["drafted"] / best_alone if best_alone else 0.0,
                   tau * decode_ms / step_ms if step_ms else 0.0, sum(c.graphs for c in counters),
                   sum(c.eager_steps for c in counters))


def report_speedup(s: Speedup, dtype: str) -> str:
    lines = [f"{'decode (greedy, batch 1, ' + dtype + ')':<44} {'tokens/s':>9}",
             f"{'transformers generate, static cache':<44} {s.hf_static_tok_s:>9.1f}",
             f"{'fast loop, block of 1 (the target alone)':<44} {s.target_tok_s:>9.1f}",
             f"{'fast loop with the drafter (tau ' + format(s.tau, '.3f') + ')':<44} {s.drafter_tok_s:>9.1f}",
             (f"speed-up {s.speedup:.2f}x over the faster target-alone decode ({s.prompts} prompts, {s.tokens} "
             f"tokens); one target step {s.decode_ms:.2f} ms, one speculative step {s.step_ms:.2f} ms: at these "
             f"times tau {s.tau:.3f} allows {s.tau_bound:.2f}x ({s.graphs} CUDA graphs, {s.eager_steps} eager steps)")]
    return "\n".join(lines)
