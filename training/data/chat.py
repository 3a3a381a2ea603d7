"""Chat data -> fixed-shape training batches.

Conversations are tokenised with the target's own tokenizer and chat template (training/data/tokenized.py caches the
result on disk, so a run tokenises its data once). Every batch has exactly `batch_size` rows, a sequence length
from a few fixed buckets and exactly `num_anchors` blocks per row (unused ones marked invalid): a compiled
flex_attention must only ever see a small, fixed set of shapes.

Which tokens carry loss: the tokens the target itself produced. A conversation is rendered once, whole, with the
chat template (and its options, e.g. Qwen3's `enable_thinking`, which must be the ones the data was generated
with); in it, every assistant turn carries loss from the end of the template's generation prompt (rendered for
the conversation up to that turn, with the same options) through the turn's end-of-turn token (`<|im_end|>`),
inclusive. So the role header, everything the generation prompt itself adds (Qwen3 with thinking off: the empty
`<think>\n\n</think>\n\n` scaffold), the template's newline after `<|im_end|>`, and every system, user and tool
token carry none. Reasoning the template keeps (Qwen3: the last turns' `<think>...</think>`) carries loss like
the reply; reasoning it drops from earlier turns is not in the sequence. The end-of-turn token is the first
token the template puts after a reply (found once by rendering a probe conversation). Sequences are truncated to
`max_length`; those left with under 2 x block_size loss tokens, or none with a whole block after it, are dropped.

The stream is a pure function of (seed, epoch, position): the epoch's order and each sequence's anchors come
from RNGs seeded by those numbers, so its state_dict is three integers and a resumed run draws exactly the
batches an uninterrupted one would have.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MESSAGES_SHAPE = '{"messages": [{"role", "content"}]}'
PROBE = [{"role": "user", "content": "gpuctl-probe-question"}, {"role": "assistant", "content": "gpuctl-probe-reply"}]


class DataError(ValueError):
    """Unusable data: the message is one line meant for the user."""


@dataclass
class Sequence:
    input_ids: list[int] | np.ndarray
    loss_mask: list[int] | np.ndarray  # 1 on the tokens that carry loss (see the module docstring)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] long, right-padded to a length bucket
    loss_mask: torch.Tensor  # [B, L] bool
    anchors: torch.Tensor  # [B, N] long, ascending; invalid blocks hold 0
    block_valid: torch.Tensor  # [B, N] bool
    num_tokens: int  # real (unpadded) tokens in the batch

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.anchors.to(device),
                     self.block_valid.to(device), self.num_tokens)


def parse_conversation(line: str | bytes, where: str) -> list[dict]:
    """One JSONL line's messages; a DataError naming `where` (file:line) otherwise."""
    try:
        messages = json.loads(line)["messages"]
        if not isinstance(messages, list) or not all(
                isinstance(m["role"], str) and isinstance(m["content"], str) for m in messages):
            raise TypeError("messages must be a list of messages whose role and content are strings")
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(f"{where}: not a {MESSAGES_SHAPE} line ({err})") from None
    return messages


def load_conversations(path: str, skipped: list[str] | None = None) -> list[list[dict]]:
    """Read JSONL lines of {"messages": [{"role": .., "content": ..}, ..]}. A bad line (not JSON, not UTF-8, no
    messages) is a one-line DataError with file:line; when `skipped` is given, it is left out instead and its
    error appended to `skipped`."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"data file not found: {file}")
    conversations = []
    # Lines as bytes, split at newlines only (as the tokenized cache reads them): a line that is not UTF-8 is
    # one bad line, and U+2028 inside a string splits nothing.
    for number, line in enumerate(file.read_bytes().split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            conversations.append(parse_conversation(line, f"{file}:{number}"))
        except DataError as err:
            if skipped is None:
                raise
            skipped.append(str(err))
    return conversations


def render_chat(tokenizer, messages: list[dict], generation_prompt: bool = False,
                template_options: dict | None = None) -> str:
    """A conversation as text, through the tokenizer's chat template and its options (e.g. enable_thinking)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                         **(template_options or {}))


def encode_chat(tokenizer, messages: list[dict], generation_prompt: bool = False,
                template_options: dict | None = None) -> list[int]:
    """Token ids of a conversation rendered with the tokenizer's chat template."""
    text = render_chat(tokenizer, messages, generation_prompt, template_options)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix, by C-speed comparisons (the usual case: b is a prefix of a)."""
    if a.startswith(b):
        return len(b)
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low] holds; a[:high] == b[:high] may not
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class ChatTokenizer:
    """Conversations -> Sequences with the loss mask of the module docstring, for one tokenizer and template
    options. Needs a fast tokenizer (the mask maps character spans of the rendering to tokens by offsets)."""

    def __init__(self, tokenizer, template_options: dict | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise DataError(f"{type(tokenizer).__name__} is not a fast tokenizer (needed for token offsets)")
        self.tokenizer = tokenizer
        self.options = dict(template_options or {})
        self.end_of_turn = self._end_of_turn_text()

    def _end_of_turn_text(self) -> str | None:
        """The text of the first token the template puts after a reply ("<|im_end|>"), or None."""
        text = render_chat(self.tokenizer, PROBE, template_options=self.options)
        reply = PROBE[-1]["content"]
        if reply not in text:
            return None
        suffix = text[text.rindex(reply) + len(reply):]
        offsets = self.tokenizer(suffix, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        return suffix[offsets[0][0]:offsets[0][1]] if offsets else None

    def loss_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        """Character spans of `text` (the whole rendering) that carry loss: one per assistant turn."""
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = render_chat(self.tokenizer, messages[:i], generation_prompt=True, template_options=self.options)
            start = _common_prefix(text, prompt)
            found = text.find(self.end_of_turn, start) if self.end_of_turn else -1
            if found >= 0:
                end = found + len(self.end_of_turn)
            else:  # no end-of-turn token: up to where the rendering that ends with this turn stops matching
                end = _common_prefix(text, render_chat(self.tokenizer, messages[: i + 1],
                                                       template_options=self.options))
            if end > start:
                spans.append((start, end))
        return spans

    def __call__(self, messages: list[dict]) -> Sequence:
        text = render_chat(self.tokenizer, messages, template_options=self.options)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = np.array([start for start, _ in encoded["offset_mapping"]], dtype=np.int64)
        mask = np.zeros(len(starts), dtype=np.uint8)
        for start, end in self.loss_spans(messages, text):
            mask[(starts >= start) & (starts < end)] = 1
        return Sequence(list(encoded["input_ids"]), mask.tolist())


def anchor_candidates(sequence: Sequence, block_size: int) -> list[int]:
    """Positions an anchor may take: loss tokens with a whole block inside the sequence."""
    last = len(sequence.input_ids) - block_size
    return np.flatnonzero(np.asarray(sequence.loss_mask[: max(last + 1, 0)])).tolist()


def usable(length: int, loss_tokens: int, first_loss: int, block_size: int) -> bool:
    """The recipe's rule: at least 2 x block_size loss tokens, and a loss token with a whole block after it."""
    return loss_tokens >= 2 * block_size and 0 <= first_loss <= length - block_size


def truncate(sequence: Sequence, max_length: int) -> Sequence:
    return Sequence(sequence.input_ids[:max_length], sequence.loss_mask[:max_length])


def prepare_sequences(tokenizer, conversations: list[list[dict]], max_length: int, block_size: int,
                      template_options: dict | None = None) -> list[Sequence]:
    """Tokenise, truncate to max_length, drop sequences the recipe drops (see `usable`). Uncached: a run reads
    its data through training/data/tokenized.py."""
    chat = ChatTokenizer(tokenizer, template_options)
    sequences = []
    for messages in conversations:
        sequence = truncate(chat(messages), max_length)
        mask = np.asarray(sequence.loss_mask)
        first = int(np.argmax(mask)) if mask.any() else -1
        if usable(len(sequence.input_ids), int(mask.sum()), first, block_size):
            sequences.append(sequence)
    return sequences


def eval_prompts(tokenizer, conversations: list[list[dict]], template_options: dict | None = None) -> list[list[int]]:
    """Each conversation up to its last assistant message, ready for the target to answer."""
    prompts = []
    for messages in conversations:
        last_reply = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
        if last_reply > 0:
            prompts.append(encode_chat(tokenizer, messages[:last_reply], True, template_options))
    return prompts


def draw_anchors(sequence: Sequence, block_size: int, num_anchors: int, rng: random.Random) -> list[int]:
    """Up to num_anchors distinct anchor positions, without replacement, ascending (so the query tiles of
    flex_attention cover similar context lengths, which keeps the block mask sparse)."""
    candidates = anchor_candidates(sequence, block_size)
    return sorted(rng.sample(candidates, min(num_anchors, len(candidates))))


def pick_bucket(length: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= length)


def collate(sequences: list[Sequence], anchors: list[list[int]], batch_size: int, buckets: list[int],
            num_anchors: int, pad_id: int) -> Batch:
    """Pad to exactly [batch_size, bucket] tokens and [batch_size, num_anchors] blocks; missing rows are empty."""
    length = pick_bucket(max(len(s.input_ids) for s in sequences), buckets)
    input_ids = torch.full((batch_size, length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((batch_size, length), dtype=torch.bool)
    anchor_tensor = torch.zeros((batch_size, num_anchors), dtype=torch.long)
    block_valid = torch.zeros((batch_size, num_anchors), dtype=torch.bool)
    for row, (sequence, row_anchors) in enumerate(zip(sequences, anchors)):
        n = len(sequence.input_ids)
        input_ids[row, :n] = torch.as_tensor(np.asarray(sequence.input_ids, dtype=np.int64))
        loss_mask[row, :n] = torch.as_tensor(np.asarray(sequence.loss_mask, dtype=np.bool_))
        anchor_tensor[row, : len(row_anchors)] = torch.tensor(row_anchors, dtype=torch.long)
        block_valid[row, : len(row_anchors)] = True
    return Batch(input_ids, loss_mask, anchor_tensor, block_valid, sum(len(s.input_ids) for s in sequences))


class BatchStream:
    """An endless, deterministic stream of batches over epochs; resumable from state_dict()."""

    def __init__(self, sequences: list[Sequence], batch_size: int, buckets: list[int], block_size: int,
                 num_anchors: int, pad_id: int, seed: int):
        if not sequences:
            raise DataError(f"no usable sequences (each needs at least {2 * block_size} assistant tokens)")
        self.sequences = sequences
        self.batch_size, self.buckets, self.block_size = batch_size, buckets, block_size
        self.num_anchors, self.pad_id, self.seed = num_anchors, pad_id, seed
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.sequences)))
        random.Random(f"order/{self.seed}/{epoch}").shuffle(order)
        return order

    def _next_index(self) -> tuple[int, int]:
        if self.position == len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        index = self._order[self.position]
        self.position += 1
        return index, self.epoch

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Batch:
        chosen, anchors = [], []
        for _ in range(self.batch_size):
            index, epoch = self._next_index()
            rng = random.Random(f"anchors/{self.seed}/{epoch}/{index}")  # fresh anchors every epoch
            chosen.append(self.sequences[index])
            anchors.append(draw_anchors(self.sequences[index], self.block_size, self.num_anchors, rng))
        return collate(chosen, anchors, self.batch_size, self.buckets, self.num_anchors, self.pad_id)

    def skip(self) -> None:
        """Move past the next batch without making it (another node's, in a multi-node run): its anchors come
        from a generator of its own, so what follows is what follows next()."""
        for _ in range(self.batch_size):
            self._next_index()

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise DataError(f"the checkpoint's data seed {state['seed']} differs from seed {self.seed}")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order(self.epoch)
