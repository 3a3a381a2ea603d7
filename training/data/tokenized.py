"""Tokenise once: a data file's token ids and loss masks, cached on disk and memory-mapped.

- Key: sha256 of the data file's bytes, the tokenizer (its serialized state: vocabulary, merges, normalizer,
  added tokens such as `<|MASK|>`; its chat template and special tokens), `max_length`, the template options
  (`enable_thinking`), `skip_bad_data`, this module's FORMAT and the transformers/tokenizers versions. Any change
  builds a new cache; nothing is ever updated in place.
- Location: `<data dir>/.gpuctl-tokenized/<data file name>.<key>/`; when the data directory is not writable,
  `$XDG_CACHE_HOME/gpuctl/tokenized/` (default `~/.cache/gpuctl/tokenized/`), said in a log line. Both are looked
  up before building.
- Format: raw little-endian arrays, memory-mapped on read: `input_ids.int32` and `loss_mask.uint8` (every
  record's tokens, one after the other), `records.int64` (one row per conversation: RECORD_FIELDS), and
  `index.json` (the key, what it was made of, the counts, the lines skipped as bad data).
- Build: the records are tokenised in a process pool (chunks in file order; serial for small files) into a
  temporary directory beside the final one, fsynced, then renamed into place. Of two runs building at once the
  first rename wins and the other uses the winner's cache; a reader only ever sees a complete directory.
  A new build for a changed data file removes the caches of that file's earlier contents.
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import jinja2
import numpy as np

from training.data.chat import (
    ChatTokenizer,
    DataError,
    Sequence,
    load_conversations,
    parse_conversation,
    truncate,
    usable,
)
from training.durable import abandoned, fsync_path, writer_tag

FORMAT = 1  # bump when what is cached, or the loss-mask rule, changes
CACHE_DIR_NAME = ".gpuctl-tokenized"
RECORD_FIELDS = ("start", "length", "loss_tokens", "first_loss", "byte_offset", "line")
START, LENGTH, LOSS_TOKENS, FIRST_LOSS, BYTE_OFFSET, LINE = range(len(RECORD_FIELDS))
CHUNK_RECORDS = 256  # conversations per task of the process pool
PARALLEL_MIN_BYTES = 1 << 20  # smaller files are tokenised in this process: a pool costs more than it saves
TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)
Log = Callable[[str], None]


def user_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "gpuctl" / "tokenized"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of everything in the tokenizer that decides the ids: its serialized state and chat template.
    Reads state only: never encodes or renders anything."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = {
        "class": type(tokenizer).__name__,
        "backend": backend.to_str() if backend is not None else None,
        "vocab": None if backend is not None else sorted(tokenizer.get_vocab().items()),
        "added": sorted((i, str(t), t.special, t.lstrip, t.rstrip, t.normalized, t.single_word)
                        for i, t in tokenizer.added_tokens_decoder.items()),
        "chat_template": tokenizer.chat_template,
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
    }
    return hashlib.sha256(json.dumps(state, sort_keys=True, default=str).encode()).hexdigest()


def cache_key(tokenizer, data_sha256: str, max_length: int, template_options: dict,
              skip_bad_data: bool) -> tuple[str, dict]:
    """The cache's key (24 hex digits) and the fields it hashes."""
    import tokenizers
    import transformers

    fields = {"format": FORMAT, "data_sha256": data_sha256, "tokenizer": tokenizer_fingerprint(tokenizer),
              "max_length": max_length, "template_options": dict(sorted(template_options.items())),
              "skip_bad_data": skip_bad_data, "transformers": transformers.__version__,
              "tokenizers": tokenizers.__version__}
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]
    return key, fields


@dataclass
class TokenizedData:
    """A data file's conversations as tokens: record i is the file's i-th conversation (bad lines skipped
    when skip_bad_data), truncated to max_length. Arrays are memory-mapped read-only."""

    data_path: Path
    cache_dir: Path
    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] uint8
    records: np.ndarray  # [N, len(RECORD_FIELDS)] int64
    index: dict
    built: bool  # this call tokenised the data (else it read a cache)

    def __len__(self) -> int:
        return len(self.records)

    def sequence(self, i: int) -> Sequence:
        return self.sequences([i])[0]

    def sequences(self, rows: range | list[int]) -> list[Sequence]:
        """Views into the cache, no copies."""
        spans = self.records[np.asarray(rows, dtype=np.int64)][:, [START, LENGTH]].tolist()
        return [Sequence(self.input_ids[s:s + n], self.loss_mask[s:s + n]) for s, n in spans]

    def usable_rows(self, rows: range | list[int], block_size: int) -> list[int]:
        """The rows the recipe keeps (training.data.chat.usable)."""
        stats = self.records[np.asarray(rows, dtype=np.int64)][:, [LENGTH, LOSS_TOKENS, FIRST_LOSS]].tolist()
        return [row for row, (length, loss, first) in zip(rows, stats) if usable(length, loss, first, block_size)]

    def conversations(self, rows: range | list[int]) -> list[list[dict]]:
        """The messages of some records, read back from the data file at their byte offsets."""
        conversations = []
        with open(self.data_path, "rb") as file:
            for i in rows:
                file.seek(int(self.records[i, BYTE_OFFSET]))
                where = f"{self.data_path}:{int(self.records[i, LINE])}"
                conversations.append(parse_conversation(file.readline(), where))
        return conversations


def load_tokenized(tokenizer, data_path: str | Path, max_length: int, template_options: dict | None = None,
                   skip_bad_data: bool = False, workers: int | None = None, log: Log = print) -> TokenizedData:
    """The data file's TokenizedData: from a cache when one matches its key, else tokenised (in `workers`
    processes; None = one per available core) and cached. A cache hit never calls the tokenizer."""
    file = Path(data_path).expanduser().resolve()
    if not file.is_file():
        raise DataError(f"data file not found: {file}")
    options = dict(template_options or {})
    data_sha256 = file_sha256(file)
    key, fields = cache_key(tokenizer, data_sha256, max_length, options, skip_bad_data)
    name = f"{file.name}.{key}"
    roots = [file.parent / CACHE_DIR_NAME, user_cache_root()]
    for root in roots:
        cached = _open(root / name, key, file, built=False)
        if cached is not None:
            log(f"tokenized data: {len(cached)} conversations, {len(cached.input_ids)} tokens, "
                f"from the cache {cached.cache_dir}")
            return cached
    fields["data_path"] = str(file)
    for number, root in enumerate(roots):
        try:
            tmp = _make_build_dir(root, name)
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) or number == len(roots) - 1:
                raise DataError(f"cannot create the tokenized cache in {root}: {err.strerror}") from None
            log(f"tokenized data: {root.parent} is not writable ({err.strerror}); caching under {roots[-1]}")
            continue
        built = _build(tokenizer, file, options, max_length, skip_bad_data, tmp, key, fields, workers, log)
        return _publish(tmp, root / name, built, key, file, log)
    raise AssertionError("unreachable")


def _open(cache_dir: Path, key: str, data_path: Path, built: bool) -> TokenizedData | None:
    try:
        index = json.loads((cache_dir / "index.json").read_text())
    except (OSError, ValueError):
        return None
    if index.get("key") != key:
        return None
    tokens, records = index["tokens"], index["records"]
    sizes = {"input_ids.int32": 4 * tokens, "loss_mask.uint8": tokens,
             "records.int64": 8 * records * len(RECORD_FIELDS)}
    try:
        if any((cache_dir / name).stat().st_size != size for name, size in sizes.items()):
            return None  # not one this module wrote (its builds appear whole, by rename)
    except OSError:
        return None

    def array(name: str, dtype, count: int) -> np.ndarray:
        if count == 0:
            return np.zeros(0, dtype=dtype)
        # A plain ndarray view of the mapping: slicing an np.memmap costs ~10x more, once per sequence.
        return np.memmap(cache_dir / name, dtype=dtype, mode="r", shape=(count,)).view(np.ndarray)

    rows = array("records.int64", "<i8", records * len(RECORD_FIELDS)).reshape(records, len(RECORD_FIELDS))
    return TokenizedData(data_path, cache_dir, array("input_ids.int32", "<i4", tokens),
                         array("loss_mask.uint8", "u1", tokens), rows, index, built)


def _make_build_dir(root: Path, name: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for path in abandoned(root, ".tmp-"):  # builds of this host whose process is gone (killed mid-build)
        shutil.rmtree(path, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f".tmp-{writer_tag()}-{name}-", dir=root))


@dataclass
class _Built:
    records: int
    tokens: int
    seconds: float
    workers: int


def _build(tokenizer, file: Path, options: dict, max_length: int, skip_bad_data: bool, tmp: Path, key: str,
           fields: dict, workers: int | None, log: Log) -> _Built:
    """Tokenise every record of `file` into `tmp`, in file order; bad lines raise, or are skipped and counted."""
    began = time.time()
    size = file.stat().st_size
    if size < PARALLEL_MIN_BYTES:
        workers = 1
    elif not workers:
        workers = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 64)
    log(f"tokenizing {file} ({size / 2**20:.1f} MiB) with {workers} process{'es' if workers > 1 else ''}")
    tokens = records = 0
    skipped: list[str] = []
    with open(tmp / "input_ids.int32", "wb") as ids_out, open(tmp / "loss_mask.uint8", "wb") as mask_out, \
            open(tmp / "records.int64", "wb") as records_out:
        for chunk in _tokenized_chunks(tokenizer, options, max_length, _chunks(file), workers):
            if chunk.errors and not skip_bad_data:
                raise DataError(chunk.errors[0])
            skipped += chunk.errors
            rows = chunk.rows
            rows[:, START] += tokens - (rows[0, START] if len(rows) else 0)
            ids_out.write(chunk.input_ids.astype("<i4").tobytes())
            mask_out.write(chunk.loss_mask.astype("u1").tobytes())
            records_out.write(rows.astype("<i8").tobytes())
            tokens += len(chunk.input_ids)
            records += len(rows)
        for out in (ids_out, mask_out, records_out):
            out.flush()
            os.fsync(out.fileno())
    if skipped:
        log(f"skip_bad_data: skipped {len(skipped)} bad line(s) of {file}; the first: {skipped[0]}")
    index = {"key": key, "fields": fields, "records": records, "tokens": tokens, "record_fields": list(RECORD_FIELDS),
             "skipped": len(skipped), "skipped_first": skipped[:10], "built_at": time.time(),
             "build_seconds": round(time.time() - began, 3), "build_processes": workers}
    with open(tmp / "index.json", "w") as out:  # written last: a directory without it is never read
        json.dump(index, out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    return _Built(records, tokens, time.time() - began, workers)


def _publish(tmp: Path, final: Path, built: _Built, key: str, file: Path, log: Log) -> TokenizedData:
    """Rename the finished build into place; if another builder got there first, use theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        winner = _open(final, key, file, built=True)
        if winner is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            log(f"tokenized data: another run cached the same data first; using {final}")
            return winner
        log(f"tokenized data: replacing the damaged cache {final}")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    fsync_path(final.parent)
    _remove_stale(final, file)
    log(f"tokenized {built.records} conversations ({built.tokens} tokens) in {built.seconds:.1f}s with "
        f"{built.workers} process{'es' if built.workers > 1 else ''}; cached in {final}")
    return _open(final, key, file, built=True)


def _remove_stale(final: Path, file: Path) -> None:
    """Caches of this data file built from other contents: they can never match again unless the file goes
    back, and each is as large as the data."""
    current = json.loads((final / "index.json").read_text())["fields"]["data_sha256"]
    for other in final.parent.glob(f"{file.name}.*"):
        if other == final:
            continue
        try:
            fields = json.loads((other / "index.json").read_text())["fields"]
        except (OSError, ValueError, KeyError):
            continue
        if fields.get("data_path") == str(file) and fields.get("data_sha256") != current:
            shutil.rmtree(other, ignore_errors=True)


# The tokenising side: chunks of lines in, arrays out (in worker processes, or here for small files).


@dataclass
class _Chunk:
    lines: list[tuple[int, int, bytes]]  # (line number, byte offset, the line)
    path: str


@dataclass
class _ChunkResult:
    input_ids: np.ndarray
    loss_mask: np.ndarray
    rows: np.ndarray  # [n, len(RECORD_FIELDS)]; START relative to this chunk
    errors: list[str]  # "file:line: why", in order


def _chunks(file: Path) -> Iterator[_Chunk]:
    lines, offset = [], 0
    with open(file, "rb") as data:
        for number, line in enumerate(data, 1):
            if line.strip():
                lines.append((number, offset, line))
                if len(lines) == CHUNK_RECORDS:
                    yield _Chunk(lines, str(file))
                    lines = []
            offset += len(line)
    if lines:
        yield _Chunk(lines, str(file))


class _ChunkTokenizer:
    def __init__(self, tokenizer, options: dict, max_length: int):
        self.chat = ChatTokenizer(tokenizer, options)
        self.max_length = max_length

    def __call__(self, chunk: _Chunk) -> _ChunkResult:
        ids, masks, rows, errors = [], [], [], []
        start = 0
        for number, offset, line in chunk.lines:
            where = f"{chunk.path}:{number}"
            try:
                messages = parse_conversation(line, where)
                try:
                    sequence = truncate(self.chat(messages), self.max_length)
                except TEMPLATE_ERRORS as err:  # e.g. a template's raise_exception on roles out of order
                    raise DataError(f"{where}: the chat template failed on it ({type(err).__name__}: "
                                    f"{str(err).splitlines()[0] if str(err) else ''})") from None
            except DataError as err:
                errors.append(str(err))
                continue
            mask = np.asarray(sequence.loss_mask, dtype=np.uint8)
            first = int(np.argmax(mask)) if mask.any() else -1
            rows.append((start, len(mask), int(mask.sum()), first, offset, number))
            ids.append(np.asarray(sequence.input_ids, dtype=np.int32))
            masks.append(mask)
            start += len(mask)
        cat = (lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype=dtype))
        return _ChunkResult(cat(ids, np.int32), cat(masks, np.uint8),
                            np.array(rows, dtype=np.int64).reshape(-1, len(RECORD_FIELDS)), errors)


_worker: _ChunkTokenizer | None = None


def _init_worker(tokenizer, options: dict, max_length: int) -> None:
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker = _ChunkTokenizer(tokenizer, options, max_length)


def _tokenize_in_worker(chunk: _Chunk) -> _ChunkResult:
    return _worker(chunk)


def _tokenized_chunks(tokenizer, options: dict, max_length: int, chunks: Iterator[_Chunk],
                      workers: int) -> Iterator[_ChunkResult]:
    """Each chunk tokenised, in order; at most 2 x workers chunks in flight."""
    if workers <= 1:
        chunk_tokenizer = _ChunkTokenizer(tokenizer, options, max_length)
        yield from map(chunk_tokenizer, chunks)
        return
    # fork shares the loaded tokenizer and transformers with the workers; spawn would import them again.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method), initializer=_init_worker,
                             initargs=(tokenizer, options, max_length)) as pool:
        in_flight: deque = deque()
        for chunk in chunks:
            in_flight.append(pool.submit(_tokenize_in_worker, chunk))
            if len(in_flight) >= 2 * workers:
                yield in_flight.popleft().result()
        while in_flight:
            yield in_flight.popleft().result()


# What a training run reads.


@dataclass
class TrainingData:
    sequences: list[Sequence]  # the training conversations the recipe keeps, in file order
    held_out: list[list[dict]]  # conversations for evaluation (their messages)
    tokenized: TokenizedData


def load_training_data(tokenizer, config, log: Log = print, workers: int | None = None) -> TrainingData:
    """A TrainConfig's training sequences (through the cache) and held-out conversations: eval_data_path's
    first eval_prompts, or, without one, the last eval_prompts conversations of data_path. One `data:` line
    counts the conversations kept, the bad lines skipped (skip_bad_data; in either file) and the conversations
    the recipe drops."""
    options = {"enable_thinking": config.enable_thinking}
    data = load_tokenized(tokenizer, config.data_path, config.max_length, options, config.skip_bad_data,
                          workers, log)
    rows = range(len(data))
    skipped = list(data.index.get("skipped_first", []))[:1]  # the cache keeps the first few, and the count
    bad = data.index.get("skipped", 0)
    if config.eval_data_path:
        eval_skipped = [] if config.skip_bad_data else None
        held_out = load_conversations(config.eval_data_path, eval_skipped)[: config.eval_prompts]
        skipped, bad = skipped + (eval_skipped or []), bad + len(eval_skipped or [])
    else:
        cut = max(len(data) - config.eval_prompts, 0)
        rows, held_out = range(cut), data.conversations(range(cut, len(data)))
    kept = data.usable_rows(rows, config.block_size)
    first = f" (first: {skipped[0]})" if skipped else ""
    log(f"data: {len(kept):,} conversations, {bad:,} bad lines skipped{first}, {len(rows) - len(kept):,} too "
        f"short dropped (under {2 * config.block_size} loss tokens, or none with a whole block after it)")
    return TrainingData(data.sequences(kept), held_out, data)
