"""The data phase of a training start, tokenising vs reading the tokenized cache (training/data/tokenized.py).

    python bench/data_bench.py [--conversations 20000] [--workers N] [--starts 3] [--json PATH]

Builds a synthetic JSONL of multi-turn conversations over the tiny tokenizer's vocabulary (saved like a model's
tokenizer, with its ChatML template), then times what a training start does with its data
(`load_training_data`: hash the file, tokenise or read the cache, drop short sequences, read the held-out
conversations), each start in a fresh process with the tokenizer already loaded: the first start with no cache
(with `--workers` processes, and with one), then `--starts` starts that find the cache. Prints a table.
Aim (issue 13): the cached start >= 10x faster than the first.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MAX_LENGTH, BLOCK_SIZE, EVAL_PROMPTS = 3072, 16, 16


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def positive(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def write_world(root: Path, count: int, seed: int = 0) -> Path:
    """The tiny tokenizer saved as a model directory's, and `count` conversations of 1-3 turns."""
    from training.target.tiny import synthetic_words, tiny_tokenizer

    tiny_tokenizer().save_pretrained(root / "tokenizer")
    words = synthetic_words(300)
    rng = random.Random(seed)

    def said(low: int, high: int) -> str:
        return "".join(" " + rng.choice(words) for _ in range(rng.randint(low, high)))

    with open(root / "train.jsonl", "w") as out:
        for _ in range(count):
            messages = [{"role": "system", "content": said(3, 12)}] if rng.random() < 0.3 else []
            for _ in range(rng.randint(1, 3)):
                messages += [{"role": "user", "content": said(5, 60)}, {"role": "assistant", "content": said(20, 250)}]
            out.write(json.dumps({"messages": messages}) + "\n")
    return root / "train.jsonl"


@dataclass
class DataConfig:  # the TrainConfig keys load_training_data reads
    data_path: str
    eval_data_path: str = ""
    eval_prompts: int = EVAL_PROMPTS
    max_length: int = MAX_LENGTH
    block_size: int = BLOCK_SIZE
    enable_thinking: bool = False
    skip_bad_data: bool = False


def one_start(root: Path, workers: int) -> dict:
    """In this (fresh) process: the tokenizer loaded, then the timed data phase."""
    from transformers import AutoTokenizer

    from training.data.tokenized import load_training_data

    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    start = time.perf_counter()
    data = load_training_data(tokenizer, DataConfig(str(root / "train.jsonl")), log=lambda _: None, workers=workers)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "built": data.tokenized.built, "sequences": len(data.sequences),
            "processes": data.tokenized.index["build_processes"] if data.tokenized.built else 0,
            "records": len(data.tokenized), "tokens": len(data.tokenized.input_ids)}


def timed_start(root: Path, workers: int) -> dict:
    result = subprocess.run([sys.executable, __file__, "--one-start", str(root), "--workers", str(workers)],
                            cwd=REPO, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"error: a timed start failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python bench/data_bench.py", description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=positive, default=20000)
    parser.add_argument("--workers", type=positive, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--starts", type=positive, default=3, help="cached starts to take the median of")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--one-start", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_start:
        print(json.dumps(one_start(args.one_start, args.workers)))
        return 0

    root = Path(tempfile.mkdtemp(prefix="data-bench-"))
    try:
        data = write_world(root, args.conversations)
        cache = root / ".gpuctl-tokenized"
        rows = []
        worker_counts = [args.workers] + ([1] if args.workers > 1 else [])
        for workers in worker_counts:
            shutil.rmtree(cache, ignore_errors=True)
            first = timed_start(root, workers)
            assert first["built"], "the first start found a cache"
            used = first["processes"]  # a small file is tokenised in the process itself
            rows.append((f"first start: tokenise ({used} process{'es' if used > 1 else ''})", first))
        cached = [timed_start(root, args.workers) for _ in range(args.starts)]
        assert not any(c["built"] for c in cached), "a later start tokenised again"
        assert len({(c["sequences"], c["tokens"]) for c in cached + [r for _, r in rows]}) == 1
        median = statistics.median(c["seconds"] for c in cached)
        rows.append((f"second start: cached (median of {args.starts})", {**cached[0], "seconds": median}))
        base = rows[0][1]["seconds"]
        size = data.stat().st_size / 2**20
        print(f"data phase of a training start: {base_info(rows[0][1], size)}, max_length {MAX_LENGTH}, "
              f"{len(os.sched_getaffinity(0))} cores")
        print(f"{'start':<44} {'seconds':>9} {'speedup':>8}")
        for name, row in rows:
            print(f"{name:<44} {row['seconds']:>9.3f} {base / row['seconds']:>7.1f}x")
        if args.json:
            args.json.write_text(json.dumps({"conversations": args.conversations, "mib": size,
                                             "rows": [{"start": n, **r} for n, r in rows]}, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def base_info(row: dict, mib: float) -> str:
    return (f"{row['records']} conversations ({mib:.1f} MiB, {row['tokens']} tokens; {row['sequences']} kept "
            "for training), tiny tokenizer")


if __name__ == "__main__":
    sys.exit(main())
