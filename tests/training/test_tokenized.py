"""The tokenized-data cache: built once, read back without the tokenizer, rebuilt when its inputs change, safe
with two builders at once and with a read-only data directory."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from training.data import tokenized
from training.data.chat import ChatTokenizer, DataError, load_conversations, prepare_sequences, truncate
from training.data.tokenized import CACHE_DIR_NAME, load_tokenized, load_training_data
from training.target.tiny import synthetic_words, tiny_tokenizer

WORDS = synthetic_words(300)


@pytest.fixture
def tokenizer():
    return tiny_tokenizer()


def conversation(rng: random.Random) -> list[dict]:
    messages = []
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": "".join(" " + rng.choice(WORDS) for _ in range(rng.randint(2, 8)))})
        messages.append({"role": "assistant",
                         "content": "".join(" " + rng.choice(WORDS) for _ in range(rng.randint(3, 30)))})
    return messages


def write_data(path: Path, count: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    conversations = [conversation(rng) for _ in range(count)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return conversations


def expected_sequences(tokenizer, conversations, max_length):
    chat = ChatTokenizer(tokenizer)
    return [truncate(chat(m), max_length) for m in conversations]


def assert_matches(data, sequences):
    assert len(data) == len(sequences)
    for i, want in enumerate(sequences):
        got = data.sequence(i)
        assert got.input_ids.tolist() == want.input_ids and got.loss_mask.tolist() == want.loss_mask


def cache_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith(".tmp-")) if root.is_dir() else []


class Refusing:
    """Every way into the tokenizer's encoding and template rendering raises while active."""

    NAMES = ("__call__", "encode", "encode_plus", "batch_encode_plus", "apply_chat_template", "_encode_plus",
             "_batch_encode_plus")

    def __init__(self, monkeypatch, tokenizer):
        def refuse(*args, **kwargs):
            raise AssertionError("the tokenizer was called")

        for cls in type(tokenizer).__mro__:
            for name in self.NAMES:
                if name in vars(cls):
                    monkeypatch.setattr(cls, name, refuse)


def test_the_second_start_reads_the_cache_and_never_calls_the_tokenizer(tokenizer, tmp_path, monkeypatch):
    data_path = tmp_path / "data" / "train.jsonl"
    conversations = write_data(data_path, 40)
    want = expected_sequences(tokenizer, conversations, 64)
    first = load_tokenized(tokenizer, data_path, 64, log=lambda _: None)
    assert first.built and first.cache_dir.parent == data_path.parent / CACHE_DIR_NAME
    assert_matches(first, want)

    Refusing(monkeypatch, tokenizer)
    with pytest.raises(AssertionError, match="tokenizer was called"):  # the refusal works: a build needs it
        load_tokenized(tokenizer, data_path, 65, log=lambda _: None)
    lines = []
    second = load_tokenized(tokenizer, data_path, 64, log=lines.append)
    assert not second.built and second.cache_dir == first.cache_dir
    assert_matches(second, want)
    assert any("from the cache" in line for line in lines)


def test_a_changed_file_tokenizer_template_or_length_rebuilds(tokenizer, tmp_path):
    data_path = tmp_path / "train.jsonl"
    write_data(data_path, 30, seed=0)
    root = tmp_path / CACHE_DIR_NAME
    quiet = {"log": lambda _: None}
    assert load_tokenized(tokenizer, data_path, 64, **quiet).built
    assert not load_tokenized(tokenizer, data_path, 64, **quiet).built

    changed = write_data(data_path, 30, seed=1)  # same length, other words
    data = load_tokenized(tokenizer, data_path, 64, **quiet)
    assert data.built
    assert_matches(data, expected_sequences(tokenizer, changed, 64))
    assert cache_dirs(root) == [data.cache_dir]  # the cache of the old contents is gone

    assert load_tokenized(tokenizer, data_path, 48, **quiet).built  # another max_length: a second cache
    assert len(cache_dirs(root)) == 2
    assert load_tokenized(tokenizer, data_path, 64, {"enable_thinking": True}, **quiet).built
    assert load_tokenized(tokenizer, data_path, 64, skip_bad_data=True, **quiet).built

    tokenizer.add_tokens(["<|MASK|>"], special_tokens=True)  # a token the data never uses still changes the key
    masked = load_tokenized(tokenizer, data_path, 64, **quiet)
    assert masked.built
    other_template = tiny_tokenizer()
    other_template.chat_template = other_template.chat_template.replace("'\\n'", "' \\n'")
    assert load_tokenized(other_template, data_path, 64, **quiet).built
    assert not load_tokenized(tokenizer, data_path, 64, **quiet).built


def test_a_damaged_cache_is_rebuilt_not_read(tokenizer, tmp_path):
    data_path = tmp_path / "train.jsonl"
    conversations = write_data(data_path, 10)
    first = load_tokenized(tokenizer, data_path, 64, log=lambda _: None)
    with open(first.cache_dir / "input_ids.int32", "r+b") as ids:
        ids.truncate(8)
    lines = []
    data = load_tokenized(tokenizer, data_path, 64, log=lines.append)
    assert data.built and data.cache_dir == first.cache_dir and any("replacing the damaged" in x for x in lines)
    assert_matches(data, expected_sequences(tokenizer, conversations, 64))


def test_parallel_tokenisation_equals_serial_in_order(tokenizer, tmp_path, monkeypatch):
    conversations = write_data(tmp_path / "a" / "train.jsonl", 300)
    write_data(tmp_path / "b" / "train.jsonl", 300)
    serial = load_tokenized(tokenizer, tmp_path / "a" / "train.jsonl", 64, workers=1, log=lambda _: None)
    monkeypatch.setattr(tokenized, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(tokenized, "CHUNK_RECORDS", 7)  # many chunks, finished out of order by two workers
    lines = []
    parallel = load_tokenized(tokenizer, tmp_path / "b" / "train.jsonl", 64, workers=2, log=lines.append)
    assert any("with 2 processes" in line for line in lines)
    assert np.array_equal(serial.input_ids, parallel.input_ids)
    assert np.array_equal(serial.loss_mask, parallel.loss_mask)
    assert np.array_equal(serial.records, parallel.records)
    assert_matches(parallel, expected_sequences(tokenizer, conversations, 64))


def _build_at_the_same_time(data_path: str, barrier, results) -> None:
    """A second process's build: both tokenise, then both try to publish at the same moment."""
    publish = tokenized._publish

    def publish_together(*args, **kwargs):
        barrier.wait(timeout=60)
        return publish(*args, **kwargs)

    tokenized._publish = publish_together
    lines = []
    try:
        data = load_tokenized(tiny_tokenizer(), data_path, 64, log=lines.append)
    except Exception as err:  # reported to the test, which fails on it (BLE allows a re-raise)
        results.put((None, False, None, None, [repr(err)]))
        raise
    results.put((str(data.cache_dir), data.built, data.input_ids.tolist(), data.loss_mask.tolist(), lines))


def test_two_builders_at_once_both_get_a_whole_cache(tokenizer, tmp_path):
    data_path = tmp_path / "train.jsonl"
    conversations = write_data(data_path, 60)
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(2), context.Queue()
    processes = [context.Process(target=_build_at_the_same_time, args=(str(data_path), barrier, results))
                 for _ in range(2)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    assert [p.exitcode for p in processes] == [0, 0], outcomes
    want = expected_sequences(tokenizer, conversations, 64)
    want_ids = [t for s in want for t in s.input_ids]
    want_mask = [t for s in want for t in s.loss_mask]
    assert all(built for _, built, _, _, _ in outcomes)  # both really built: the race happened
    assert len({cache_dir for cache_dir, *_ in outcomes}) == 1
    assert all(ids == want_ids and mask == want_mask for _, _, ids, mask, _ in outcomes)
    losers = [lines for *_, lines in outcomes if any("another run cached the same data first" in x for x in lines)]
    assert len(losers) == 1
    root = tmp_path / CACHE_DIR_NAME
    assert [p.name for p in root.iterdir()] == [Path(outcomes[0][0]).name]  # no temporary directory left
    assert not load_tokenized(tokenizer, data_path, 64, log=lambda _: None).built


@contextlib.contextmanager
def read_only(directory: Path):
    """A directory nobody may create files in: mode 0555, or immutable for root (who ignores modes)."""
    if os.geteuid() == 0:
        try:
            subprocess.run(["chattr", "+i", str(directory)], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError):
            pytest.skip("root ignores directory modes, and this filesystem has no immutable flag (chattr +i)")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
    else:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)


def test_a_read_only_data_directory_caches_under_the_user_cache(tokenizer, tmp_path, monkeypatch):
    data_dir = tmp_path / "dataset"
    conversations = write_data(data_dir / "train.jsonl", 20)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with read_only(data_dir):
        with pytest.raises(OSError):  # the premise: nothing can be created there
            (data_dir / "probe").mkdir()
        lines = []
        data = load_tokenized(tokenizer, data_dir / "train.jsonl", 64, log=lines.append)
        assert data.built and data.cache_dir.parent == tmp_path / "xdg" / "gpuctl" / "tokenized"
        assert any("not writable" in line and str(tmp_path / "xdg") in line for line in lines)
        assert_matches(data, expected_sequences(tokenizer, conversations, 64))
        again = load_tokenized(tokenizer, data_dir / "train.jsonl", 64, log=lambda _: None)
        assert not again.built and again.cache_dir == data.cache_dir
    assert sorted(p.name for p in data_dir.iterdir()) == ["train.jsonl"]

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with read_only(data_dir):
        data = load_tokenized(tokenizer, data_dir / "train.jsonl", 64, log=lambda _: None)
    assert data.cache_dir.parent == tmp_path / "home" / ".cache" / "gpuctl" / "tokenized"


def test_bad_lines_are_one_line_errors_or_skipped_and_counted(tokenizer, tmp_path):
    data_path = tmp_path / "train.jsonl"
    good = write_data(data_path, 5)
    lines = data_path.read_text().splitlines()
    lines[1:1] = ['{"messages": "nope"}', "", "not json"]
    data_path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"train.jsonl:2: not a") as err:
        load_tokenized(tokenizer, data_path, 64, log=lambda _: None)
    assert "\n" not in str(err.value)
    log = []
    data = load_tokenized(tokenizer, data_path, 64, skip_bad_data=True, log=log.append)
    assert_matches(data, expected_sequences(tokenizer, good, 64))
    assert data.index["skipped"] == 2 and any("skipped 2 bad line(s)" in line for line in log)
    assert data.conversations(range(len(data))) == good  # each record still knows its own line


@dataclass
class Config:
    data_path: str
    eval_data_path: str = ""
    eval_prompts: int = 4
    max_length: int = 64
    block_size: int = 4
    enable_thinking: bool = False
    skip_bad_data: bool = False


def test_training_data_is_what_the_uncached_path_gives(tokenizer, tmp_path):
    data_path = tmp_path / "train.jsonl"
    conversations = write_data(data_path, 50)
    data = load_training_data(tokenizer, Config(str(data_path)), log=lambda _: None)
    want = prepare_sequences(tokenizer, conversations[:-4], 64, 4)
    assert 0 < len(want) < 46  # some are dropped (under 2 x block loss tokens)
    assert [s.input_ids.tolist() for s in data.sequences] == [s.input_ids for s in want]
    assert [s.loss_mask.tolist() for s in data.sequences] == [s.loss_mask for s in want]
    assert data.held_out == conversations[-4:]

    eval_path = tmp_path / "eval.jsonl"
    write_data(eval_path, 6, seed=3)
    with_eval = load_training_data(tokenizer, Config(str(data_path), str(eval_path)), log=lambda _: None)
    assert len(with_eval.sequences) == len(prepare_sequences(tokenizer, conversations, 64, 4))
    assert with_eval.held_out == load_conversations(str(eval_path))[:4]
