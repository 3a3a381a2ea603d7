"""Chat data -> fixed-shape training batches.

Conversations are tokenised with the target's own tokenizer and chat template; the loss covers assistant tokens
only. Every batch has exactly `batch_size` rows, a sequence length from a few fixed buckets and exactly
`num_anchors` blocks per row (unused ones marked invalid): a compiled flex_attention must only ever see a small,
fixed set of shapes.

The stream is a pure function of (seed, epoch, position): the epoch's order and each sequence's anchors come
from RNGs seeded by those numbers, so its state_dict is three integers and a resumed run draws exactly the
batches an uninterrupted one would have.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch


class DataError(ValueError):
    """Unusable data: the message is one line meant for the user."""


@dataclass
class Sequence:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens


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


def load_conversations(path: str, skipped: list[str] | None = None) -> list[list[dict]]:
    """Read JSONL lines of {"messages": [{"role": .., "content": ..}, ..]}. A bad line (not JSON, not UTF-8, no
    messages) is a one-line DataError with file:line; when `skipped` is given, it is left out instead and that
    line appended to `skipped`."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"data file not found: {file}")
    conversations = []
    # Lines split as bytes: one that is not UTF-8 is one bad line, and U+2028 inside a string splits nothing.
    for number, line in enumerate(file.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
            if not all(isinstance(m["role"], str) and isinstance(m["content"], str) for m in messages):
                raise TypeError("role and content must be strings")
        except (ValueError, KeyError, TypeError) as err:
            problem = f"{file}:{number}: not a {{\"messages\": [{{\"role\", \"content\"}}]}} line ({err})"
            if skipped is None:
                raise DataError(problem) from None
            skipped.append(problem)
            continue
        conversations.append(messages)
    return conversations


def encode_chat(tokenizer, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    """Token ids of a conversation rendered with the tokenizer's chat template."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def tokenize_conversation(tokenizer, messages: list[dict]) -> Sequence:
    """The whole conversation's ids, with loss_mask 1 on each assistant message's tokens.

    An assistant message's span is found by rendering prefixes of the conversation, which works with any
    template: it starts where the rendering up to the previous message plus the generation prompt stops
    matching the full rendering and ends where the rendering up to this message does. A template that renders a
    message differently once later messages follow (Qwen3 drops old reasoning) just loses that turn's loss.
    """
    ids = encode_chat(tokenizer, messages)
    loss_mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _common_prefix(ids, encode_chat(tokenizer, messages[:i], generation_prompt=True))
        end = _common_prefix(ids, encode_chat(tokenizer, messages[: i + 1]))
        for position in range(start, end):
            loss_mask[position] = 1
    return Sequence(ids, loss_mask)


def anchor_candidates(sequence: Sequence, block_size: int) -> list[int]:
    """Positions an anchor may take: assistant tokens with a whole block inside the sequence."""
    last = len(sequence.input_ids) - block_size
    return [p for p, on in enumerate(sequence.loss_mask) if on and p <= last]


def prepare_sequences(tokenizer, conversations: list[list[dict]], max_length: int, block_size: int) -> list[Sequence]:
    """Tokenise, truncate to max_length, drop sequences with under 2 * block_size loss tokens."""
    sequences = []
    for messages in conversations:
        sequence = tokenize_conversation(tokenizer, messages)
        sequence = Sequence(sequence.input_ids[:max_length], sequence.loss_mask[:max_length])
        if sum(sequence.loss_mask) >= 2 * block_size and anchor_candidates(sequence, block_size):
            sequences.append(sequence)
    return sequences


def eval_prompts(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    """Each conversation up to its last assistant message, ready for the target to answer."""
    prompts = []
    for messages in conversations:
        last_reply = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
        if last_reply > 0:
            prompts.append(encode_chat(tokenizer, messages[:last_reply], generation_prompt=True))
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
        input_ids[row, :n] = torch.tensor(sequence.input_ids)
        loss_mask[row, :n] = torch.tensor(sequence.loss_mask, dtype=torch.bool)
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

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise DataError(f"the checkpoint's data seed {state['seed']} differs from seed {self.seed}")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order(self.epoch)
