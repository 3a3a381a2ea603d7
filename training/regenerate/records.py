"""The records of a regeneration: prompt records in (ids, the places the target answers), whole output lines
out, each written once, and the recovery of an output a killed run left (training/regenerate/run.py)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from training.console import say
from training.data.chat import DataError, parse_conversation


@dataclass
class PromptRecord:
    id: str | int
    messages: list[dict]
    line: int


def content_id(messages: list[dict]) -> str:
    """A stable id for a record that has none: the hash of its messages."""
    canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()[:16]


def id_key(record_id: str | int) -> str:
    return json.dumps(record_id)


def reply_positions(messages: list[dict]) -> list[int]:
    """Where the target answers: every assistant message, and the end when the last message is not one."""
    positions = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not messages or messages[-1]["role"] != "assistant":
        positions.append(len(messages))
    return positions


def load_prompts(path: str) -> tuple[list[PromptRecord], int]:
    """The prompt records, and how many exact duplicates (same id, same messages) were left out."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"prompts file not found: {file}")
    records: list[PromptRecord] = []
    seen: dict[str, PromptRecord] = {}
    duplicates = 0
    with open(file, "rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{file}:{number}"
            messages = parse_conversation(line, where)
            record_id = json.loads(line).get("id")
            if record_id is None:
                record_id = content_id(messages)
            elif isinstance(record_id, bool) or not isinstance(record_id, (str, int)):
                raise DataError(f"{where}: id must be a string or an integer, got {record_id!r}")
            if reply_positions(messages)[0] == 0:
                raise DataError(f"{where}: nothing before the first reply to answer")
            earlier = seen.get(id_key(record_id))
            if earlier is not None:
                if earlier.messages != messages:
                    raise DataError(f"{where}: id {record_id!r} is also line {earlier.line}'s, with other messages")
                duplicates += 1
                continue
            record = PromptRecord(record_id, messages, number)
            seen[id_key(record_id)] = record
            records.append(record)
    return records, duplicates


def recover_output(path: Path) -> set[str]:
    """The ids (id_key) of the complete records in the output; a torn last line is cut off first."""
    if not path.exists():
        return set()
    with open(path, "r+b") as file:
        data = file.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            file.truncate(end)
            file.flush()
            os.fsync(file.fileno())
            say(f"{path}: cut a torn last line ({len(data) - end} bytes) left by an interrupted run")
    done = set()
    for number, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            done.add(id_key(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{path}:{number}: not a complete record; fix or move the file") from None
    return done


class RecordWriter:
    """The one writer of the output: whole lines, each flushed and fsynced, every id at most once."""

    def __init__(self, path: Path, done: set[str]):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "ab")  # noqa: SIM115 - open for the writer's whole life, closed in close()
        self._lock = threading.Lock()
        self.done = done

    def write(self, record: dict) -> bool:
        key = id_key(record["id"])
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        with self._lock:
            if key in self.done:
                return False
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())
            self.done.add(key)
        return True

    def close(self) -> None:
        self._file.close()
