"""Cleaning a prompt mix before the target answers it (training/data/prompts.py): exact and near duplicates
dropped, and every prompt that shares a 13-word span with an evaluation set dropped (decontamination), each count
kept for the data report.

Text is compared as normalized words: lower case, runs of letters and digits (`words`), so "Hello, World!" and
"hello world" are one text. A near duplicate is found by MinHash over 5-word shingles (64 hashes, 16 bands of 4:
two prompts whose shingle sets have a Jaccard similarity of 0.8 share a band with probability 1 - (1 - 0.8^4)^16,
over 0.99), and confirmed by the signatures' agreement (>= `NEAR`); the later prompt of a pair goes. Spans are
13 words, as in the decontamination of GPT-3 and its successors: long enough that common phrases ("write a
function that returns the ...") do not match, short enough that a pasted problem statement does.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

SPAN = 13  # words in a decontamination span
SHINGLE = 5  # words in a near-duplicate shingle
HASHES, BANDS = 64, 16
NEAR = 0.8  # the share of equal MinHash values that makes two prompts near duplicates
MAX_SHINGLES = 2000  # a long prompt's first shingles are enough to tell it apart
_WORD = re.compile(r"[a-z0-9]+")
_PRIME = (1 << 61) - 1
_rng = np.random.default_rng(20261208)  # fixed: the same text has the same signature in every process
_A = _rng.integers(1, _PRIME, HASHES, dtype=np.uint64)
_B = _rng.integers(0, _PRIME, HASHES, dtype=np.uint64)


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _hash(text: str) -> int:
    # crc32 of the text and of its reverse: 64 stable bits (Python's hash() is salted per process)
    data = text.encode()
    return zlib.crc32(data) << 32 | zlib.crc32(data[::-1])


def spans(tokens: list[str], length: int) -> set[int]:
    """The hashes of every `length`-word span (the whole text when shorter)."""
    if len(tokens) <= length:
        return {_hash(" ".join(tokens))} if tokens else set()
    return {_hash(" ".join(tokens[i:i + length])) for i in range(len(tokens) - length + 1)}


def signature(tokens: list[str]) -> np.ndarray:
    """The MinHash signature of a text's shingles: HASHES values, each the minimum of one hash permutation."""
    shingles = spans(tokens[: MAX_SHINGLES + SHINGLE - 1], SHINGLE) or {0}
    values = np.fromiter(shingles, dtype=np.uint64, count=len(shingles)) % np.uint64(_PRIME)
    # (a * x + b) mod p in 64 bits: x and a below 2^61 overflow, which wraps; the permutation stays a fixed
    # pseudo-random map of x, which is all MinHash needs
    with np.errstate(over="ignore"):
        permuted = (values[:, None] * _A[None, :] + _B[None, :]) % np.uint64(_PRIME)
    return permuted.min(axis=0)


@dataclass
class Contamination:
    """The spans of the evaluation sets, by set name."""

    spans: dict[str, set[int]] = field(default_factory=dict)

    def add(self, name: str, texts: Iterable[str]) -> None:
        bucket = self.spans.setdefault(name, set())
        for text in texts:
            bucket |= spans(words(text), SPAN)

    def sets_sharing(self, text: str) -> list[str]:
        """The evaluation sets with which `text` shares a span."""
        own = spans(words(text), SPAN)
        return [name for name, theirs in self.spans.items() if not own.isdisjoint(theirs)]


@dataclass
class CleanCounts:
    offered: int = 0
    exact_duplicates: int = 0
    near_duplicates: int = 0
    contaminated: dict[str, int] = field(default_factory=dict)  # by evaluation set (a prompt counts once, first)
    kept: int = 0

    def as_dict(self) -> dict:
        return {"offered": self.offered, "exact_duplicates": self.exact_duplicates,
                "near_duplicates": self.near_duplicates, "contaminated": dict(self.contaminated), "kept": self.kept}


class Deduplicator:
    """Remembers what it has seen; `verdict` says whether a new text is an exact or a near duplicate of one."""

    def __init__(self):
        self.exact: set[int] = set()
        self.bands: list[dict[bytes, int]] = [{} for _ in range(BANDS)]
        self.signatures: list[np.ndarray] = []

    def verdict(self, tokens: list[str], first_turn: list[str]) -> str | None:
        """"exact" (the same text, or the same first turn: the target would answer it the same way), "near" or
        None (new: remembered from now on)."""
        key, first_key = _hash(" ".join(tokens)), _hash("first turn: " + " ".join(first_turn))
        if key in self.exact or first_key in self.exact:
            return "exact"
        mine = signature(tokens)
        rows = HASHES // BANDS
        keys = [mine[b * rows:(b + 1) * rows].tobytes() for b in range(BANDS)]
        for band, band_key in enumerate(keys):
            other = self.bands[band].get(band_key)
            if other is not None and np.mean(self.signatures[other] == mine) >= NEAR:
                return "near"
        self.exact |= {key, first_key}
        index = len(self.signatures)
        self.signatures.append(mine)
        for band, band_key in enumerate(keys):
            self.bands[band].setdefault(band_key, index)
        return None


def prompt_text(messages: list[dict]) -> str:
    """What a prompt asks: its system and user turns (assistant turns are the target's to write)."""
    return "\n".join(m["content"] for m in messages if m["role"] != "assistant")


def clean(records: Iterable[dict], contamination: Contamination, dedup: Deduplicator,
          counts: CleanCounts) -> list[dict]:
    """The records that are neither contaminated nor duplicates of one seen before (in `dedup`, across calls)."""
    kept = []
    for record in records:
        counts.offered += 1
        text = prompt_text(record["messages"])
        shared = contamination.sets_sharing(text)
        if shared:
            counts.contaminated[shared[0]] = counts.contaminated.get(shared[0], 0) + 1
            continue
        first = next((m["content"] for m in record["messages"] if m["role"] == "user"), "")
        verdict = dedup.verdict(words(text), words(first))
        if verdict == "exact":
            counts.exact_duplicates += 1
        elif verdict == "near":
            counts.near_duplicates += 1
        else:
            counts.kept += 1
            kept.append(record)
    return kept
