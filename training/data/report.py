"""The data report: what a regenerated data file holds, by prompt source, and what cleaning dropped before.

    python -m training.data_report DATA [--tokenizer DIR] [--mix FILE] [--json]

By source (the part of each record's id before its first colon: sharegpt, codeio, math, self; "other" for ids
without one): conversations, assistant replies, reply tokens (with the target's tokenizer, `--tokenizer`; words
without it), the median, 90th percentile and longest reply, the share of conversations with a reply cut at
max_new_tokens ("truncated") and of those that ended early because their context filled the target's window
("shortened"). Then the mix report written beside the prompts (`--mix`, by default DATA's folder's
prompts.mix.json when it is there): what each source offered, the exact and near duplicates and the prompts
sharing a span with an evaluation set that were dropped. Regeneration prints the same report when it finishes,
and the trainer's log names the mix it trains on (`mix_line`).
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from training.config import PROMPT_SOURCES
from training.data.chat import DataError
from training.entry import OneLineArgumentParser

_SOURCE = re.compile(rb'^\{"id": "([A-Za-z0-9_-]+):')


def source_of(record_id) -> str:
    """The prompt source a record id names ("math:gsm_symbolic:0:7" -> "math"); "other" for any other id."""
    prefix = record_id.split(":", 1)[0] if isinstance(record_id, str) else ""
    return prefix if prefix in PROMPT_SOURCES else "other"


@dataclass
class SourceStats:
    conversations: int = 0
    replies: int = 0
    truncated: int = 0
    shortened: int = 0
    lengths: list[int] = field(default_factory=list)  # reply lengths (tokens or words)

    def row(self) -> dict:
        lengths = sorted(self.lengths)

        def at(share: float) -> int:
            return lengths[min(len(lengths) - 1, int(share * len(lengths)))] if lengths else 0

        return {"conversations": self.conversations, "replies": self.replies, "reply_tokens": sum(lengths),
                "median": at(0.5), "p90": at(0.9), "longest": lengths[-1] if lengths else 0,
                "truncated": self.truncated, "shortened": self.shortened}


def data_stats(path: Path, tokenizer=None) -> dict[str, SourceStats]:
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    stats: dict[str, SourceStats] = {}
    replies: list[tuple[SourceStats, str]] = []
    for number, line in enumerate(path.read_bytes().split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            messages = record["messages"]
            texts = [m["content"] for m in messages if m["role"] == "assistant"]
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{path}:{number}: not a record ({{\"id\", \"messages\"}})") from None
        entry = stats.setdefault(source_of(record.get("id")), SourceStats())
        entry.conversations += 1
        entry.replies += len(texts)
        entry.truncated += bool(record.get("truncated"))
        entry.shortened += bool(record.get("shortened"))
        replies += [(entry, text) for text in texts]
    for start in range(0, len(replies), 4096):
        chunk = replies[start:start + 4096]
        if tokenizer is not None:
            counts = [len(ids) for ids in tokenizer([t for _, t in chunk], add_special_tokens=False)["input_ids"]]
        else:
            counts = [len(text.split()) for _, text in chunk]
        for (entry, _), count in zip(chunk, counts):
            entry.lengths.append(count)
    return stats


def report(path: Path, tokenizer=None, mix_path: Path | None = None) -> dict:
    stats = data_stats(path, tokenizer)
    mix_path = mix_path or path.with_name("prompts.mix.json")
    mix = json.loads(mix_path.read_text()) if mix_path.is_file() else None
    return {"data": str(path), "unit": "tokens" if tokenizer is not None else "words",
            "sources": {name: s.row() for name, s in sorted(stats.items())}, "mix": mix}


def render(result: dict) -> str:
    unit = result["unit"]
    lines = [f"{result['data']}: reply lengths in {unit}",
             (f"{'source':<10} {'convs':>8} {'replies':>8} {unit:>12} {'median':>7} {'p90':>6} {'longest':>8} "
              f"{'cut':>6} {'short':>6}")]
    rows = list(result["sources"].items())
    total = Counter()
    for _, row in rows:
        total.update({k: v for k, v in row.items() if k in ("conversations", "replies", "reply_tokens", "truncated",
                                                              "shortened")})
    for name, row in rows + ([("all", {**total, "median": "", "p90": "", "longest": ""})] if len(rows) > 1 else []):
        cut = f"{row['truncated'] / row['conversations']:.0%}" if row["conversations"] else "-"
        lines.append(f"{name:<10} {row['conversations']:>8,} {row['replies']:>8,} {row['reply_tokens']:>12,} "
                     f"{row['median']:>7} {row['p90']:>6} {row['longest']:>8} {cut:>6} {row['shortened']:>6,}")
    mix = result.get("mix")
    if mix:
        lines.append(f"prompts (mix {' '.join(mix['mix'])}, seed {mix['seed']}): offered, dropped as exact / near "
                     "duplicates, sharing a 13-word span with an evaluation set, kept")
        for name, c in mix["sources"].items():
            contaminated = ", ".join(f"{k} {v:,}" for k, v in c["contaminated"].items()) or "0"
            lines.append(f"  {name:<10} {c['offered']:>8,} offered, {c['exact_duplicates']:,} exact, "
                         f"{c['near_duplicates']:,} near, contaminated {contaminated}; {c['kept']:,} kept")
        held = mix["held_out"]
        lines.append(f"  evaluation sets kept apart: chat {held['chat']:,} prompts, HumanEval {held['humaneval']:,}")
    return "\n".join(lines)


def mix_line(path: Path) -> str:
    """The sources a data file's records come from, with their shares (read from the ids, not parsed whole)."""
    counts: Counter = Counter()
    with open(path, "rb") as lines:
        for line in lines:
            if line.strip():
                found = _SOURCE.match(line)
                counts[source_of(found.group(1).decode() + ":") if found else "other"] += 1
    total = sum(counts.values()) or 1
    return ", ".join(f"{name} {count:,} ({count / total:.0%})" for name, count in counts.most_common())


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="python -m training.data_report",
                                   description="What a regenerated data file holds, by prompt source.")
    parser.add_argument("data", help="a JSONL data file (regenerate's output)")
    parser.add_argument("--tokenizer", help="the target's model directory: reply lengths in its tokens")
    parser.add_argument("--mix", help="the mix report (default: prompts.mix.json beside DATA)")
    parser.add_argument("--json", action="store_true", help="the report as JSON")
    args = parser.parse_args(argv)
    try:
        tokenizer = None
        if args.tokenizer:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(str(Path(args.tokenizer).expanduser()))
            except (OSError, ValueError) as err:
                raise DataError(f"no tokenizer in {args.tokenizer} ({str(err).splitlines()[0]})") from None
        result = report(Path(args.data).expanduser(), tokenizer, Path(args.mix).expanduser() if args.mix else None)
    except (DataError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else render(result))
    return 0
