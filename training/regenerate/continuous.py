"""Continuous batching for regeneration (`decode = "continuous"`, training/regenerate/generation.py).

The static decode (static_decode.py) runs a batch until its longest reply ends: with replies from 5 to 1,024
tokens most rows idle most of the time. Here a fixed set of `rows` decodes one token each per step (one shape,
so on CUDA the step is one CUDA graph, as in the static decode), and a row whose reply ended takes the next
prompt at once: the waiting prompts are prefilled together into the free rows (eager, one forward per refill),
and the step goes on. A conversation's next turn is queued the moment its reply is known, so multi-turn
records never wait for a batch's slowest reply.

Each row owns `length` cache slots. A prefill group is left-padded to its longest prompt, so every row's last
prompt token sits at the same slot and the group's first tokens come from one logits row each; a row then
remembers where its prompt starts (`start`) and where its next token goes (`slot`), its position being the
difference. The decode step writes each row's key and value at its own slot and attends to the slots from its
start to its slot, so what an earlier occupant left beyond is never read. The host synchronises every
CHECK_EVERY steps on CUDA (each step on the CPU) to collect the replies that ended and refill their rows.

Greedy only, like the static decode's captured step; the replies are the static decode's, record for record
(tests/training/test_regenerate.py, float32 on the CPU).
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable

import torch

from training.regenerate.static_decode import (
    CHECK_EVERY,
    DecodeCounters,
    capture_step,
    check_static_decodable,
)


class RowCache:
    """Keys and values [rows, kv_heads, length, head_dim] per layer; a prefill writes whole rows (`fill_rows`,
    slots 0..width-1) and attends to what it writes, a decode step writes every row at its own `slots`."""

    def __init__(self, layers: int, rows: int, length: int):
        self.rows, self.length = rows, length
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.fill_rows: torch.Tensor | None = None  # set during a prefill
        self.slots: torch.Tensor | None = None  # [rows]: each row's write slot during a decode step
        self.every_row: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.keys[layer_idx] is None:
            _, kv_heads, _, dim = key_states.shape
            for store in (self.keys, self.values):
                store[layer_idx] = key_states.new_zeros(self.rows, kv_heads, self.length, dim)
            self.every_row = torch.arange(self.rows, device=key_states.device)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.fill_rows is not None:
            width = key_states.shape[2]
            keys[self.fill_rows, :, :width] = key_states
            values[self.fill_rows, :, :width] = value_states
            return key_states, value_states
        keys[self.every_row, :, self.slots] = key_states[:, :, 0]
        values[self.every_row, :, self.slots] = value_states[:, :, 0]
        return keys, values


class ContinuousDecoder:
    """`rows` rows of `length` cache slots each; `decode` runs jobs (a key and a prompt's token ids) through them
    until none is left, each reply up to `max_new_tokens` and its first EOS."""

    def __init__(self, model, rows: int, length: int, max_new_tokens: int, eos_ids: list[int], pad_id: int,
                 counters: DecodeCounters):
        check_static_decodable(model.config)
        self.model, self.rows, self.length, self.max_new = model, rows, length, max_new_tokens
        self.device = model.get_input_embeddings().weight.device
        self.pad_id, self.counters, self.graph, self.graph_failed = pad_id, counters, None, False
        self.cache = RowCache(model.config.num_hidden_layers, rows, length)
        self.cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        device, long = self.device, torch.long
        self.token = torch.zeros(rows, 1, dtype=long, device=device)
        self.slot = torch.zeros(rows, dtype=long, device=device)  # where each row's next token goes
        self.start = torch.zeros(rows, dtype=long, device=device)  # where each row's prompt starts
        self.count = torch.zeros(rows, dtype=long, device=device)  # tokens generated in each row
        self.done = torch.ones(rows, dtype=torch.bool, device=device)  # free, or its reply ended
        self.generated = torch.zeros(rows, max_new_tokens, dtype=long, device=device)
        self.slots = torch.arange(length, device=device)
        self.eos = torch.tensor(eos_ids, dtype=long, device=device)

    def _forward(self, ids, positions, mask) -> torch.Tensor:
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                         logits_to_keep=1, **{self.cache_argument: self.cache})
        return out.logits[:, -1]

    def _record(self, rows: torch.Tensor, chosen: torch.Tensor) -> None:
        """Each of `rows`' chosen token: kept (until its reply ended), and its next input."""
        live = ~self.done[rows]
        index = self.count[rows].clamp(max=self.max_new - 1)
        self.generated[rows, index] = torch.where(live, chosen, self.generated[rows, index])
        self.count[rows] += live.long()
        ended = torch.isin(chosen, self.eos) | (self.count[rows] >= self.max_new)
        self.done[rows] |= live & ended
        self.token[rows, 0] = chosen

    def _prefill(self, rows: list[int], prompts: list[list[int]]) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        real = torch.zeros((len(rows), width), dtype=torch.bool)
        for n, prompt in enumerate(prompts):
            ids[n, width - len(prompt):] = torch.tensor(prompt)
            real[n, width - len(prompt):] = True
        ids, real = ids.to(self.device), real.to(self.device)
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        # a padding slot attends to itself only: its (unread) output stays finite
        attend = (causal & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=self.device)
        index = torch.tensor(rows, device=self.device)
        self.cache.fill_rows = index
        try:
            logits = self._forward(ids, positions, attend[:, None])
        finally:
            self.cache.fill_rows = None
        self.start[index] = width - real.sum(-1)
        self.slot[index] = width
        self.count[index] = 0
        self.done[index] = False
        self._record(index, logits.argmax(-1))

    def _step(self) -> None:
        """One token of every row (free rows too: the shape stays fixed; what they compute is never kept)."""
        self.cache.slots = self.slot.clamp(max=self.length - 1)
        attend = (self.slots >= self.start[:, None]) & (self.slots <= self.cache.slots[:, None])
        logits = self._forward(self.token, (self.slot - self.start)[:, None], attend[:, None, None, :])
        self.slot += 1
        self._record(self.every_row(), logits.argmax(-1))

    def every_row(self) -> torch.Tensor:
        if self.cache.every_row is None:
            self.cache.every_row = torch.arange(self.rows, device=self.device)
        return self.cache.every_row

    def _capture(self) -> None:
        """The step as a CUDA graph; decoding goes on without one when capturing fails, and says why once."""
        state = [self.token, self.slot, self.start, self.count, self.done, self.generated]
        self.graph, _, failure, seconds = capture_step(self.device, self._step, state)
        self.counters.capture_s += seconds
        if failure is None:
            self.counters.graphs += 1
            return
        from training.console import say

        self.graph_failed = True
        self.counters.capture_failures += 1
        say(f"continuous decode: capturing the step as a CUDA graph failed ({failure}); decoding without graphs")

    def _one_step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            self.counters.replays += 1
        else:
            self._step()
            self.counters.eager_steps += 1

    @torch.no_grad()
    def decode(self, jobs: list[tuple[object, list[int]]],
               finished: Callable[[object, list[int]], tuple[object, list[int]] | None]) -> None:
        """Runs every job; `finished(key, tokens)` gets each reply's tokens (with its EOS, if it reached one) and
        may return a follow-up job (the conversation's next turn), which goes first in the queue. A prompt longer
        than `length - max_new_tokens` is refused (the caller keeps such contexts out)."""
        if self.device.type != "cuda":
            return self._decode(jobs, finished)
        with torch.cuda.device(self.device):  # graphs capture on, and replay into, the current device's stream
            return self._decode(jobs, finished)

    def _decode(self, jobs, finished) -> None:
        waiting = collections.deque(jobs)
        keys: list[object | None] = [None] * self.rows
        check_every = CHECK_EVERY if self.device.type == "cuda" else 1
        self.done.fill_(True)
        while waiting or any(key is not None for key in keys):
            done = self.done.tolist()
            counts = self.count.tolist() if any(d and k is not None for d, k in zip(done, keys)) else []
            for row, key in enumerate(keys):
                if key is not None and done[row]:
                    follow_up = finished(key, self.generated[row, : counts[row]].tolist())
                    keys[row] = None
                    if follow_up is not None:
                        waiting.appendleft(follow_up)
            free = [row for row, key in enumerate(keys) if key is None]
            if waiting and free:
                group = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
                for (key, prompt) in group:
                    if len(prompt) + self.max_new > self.length:
                        raise ValueError(f"a prompt of {len(prompt)} tokens does not fit a row of {self.length}")
                rows = free[: len(group)]
                self._prefill(rows, [prompt for _, prompt in group])
                for row, (key, _) in zip(rows, group):
                    keys[row] = key
                continue  # a reply may have ended at its first token
            if not any(key is not None for key in keys):
                break
            if self.device.type == "cuda" and self.graph is None and not self.graph_failed:
                self._capture()
            for _ in range(check_every):
                self._one_step()
