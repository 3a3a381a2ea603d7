"""Regeneration throughput at the real Qwen3-8B shape, through `python -m training.regenerate` itself.

    python bench/regenerate_bench.py [--shape qwen3-8b] [--devices 0] [--records 64] [--batch-size 32]
                                     [--new-tokens 256] [--work DIR]

Saves the qwen3-8b-random world's random-weight target (training/random_world.py: Qwen3-8B's shape, the tiny
word-level tokenizer and its chat template) as a model directory, writes `--records` synthetic prompts, runs
the real regeneration entry point on `--devices` (a thread per GPU) and prints a table from its own metrics
lines: records, generated tokens per second, wall time. Random weights rarely stop early, so every reply is
about `--new-tokens` long: the figure is the decode rate of `transformers.generate`, batched. `--shape
qwen3-8b-narrow --devices cpu` is a toy form for the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.random_world import random_target, synthetic_conversations
from training.regenerate import main as regenerate_main
from training.regenerate import metrics_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--devices", default="0", help="comma-separated GPU indices, or cpu")
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="regen-bench-"))
    devices = "cpu" if args.devices == "cpu" else [int(d) for d in args.devices.split(",")]
    first = "cpu" if devices == "cpu" else f"cuda:{devices[0]}"
    dtype = torch.float32 if first == "cpu" else torch.bfloat16

    began = time.perf_counter()
    target = random_target(args.shape, first, dtype, None, seed=0)
    target.model.save_pretrained(work / "target")
    target.tokenizer.save_pretrained(work / "target")
    del target
    if first != "cpu":
        torch.cuda.empty_cache()
    saved_s = time.perf_counter() - began
    prompts = work / "prompts.jsonl"
    with prompts.open("w") as f:
        for n, conversation in enumerate(synthetic_conversations(args.records, 8, seed=0)):
            f.write(json.dumps({"id": f"p{n}", "messages": conversation}) + "\n")

    output = work / "regenerated.jsonl"
    sets = [f"target_path={work / 'target'}", f"prompts_path={prompts}", f"output_path={output}",
            f"target_devices={json.dumps(devices)}", f"batch_size={args.batch_size}",
            f"max_new_tokens={args.new_tokens}", "dtype=auto"]
    began = time.perf_counter()
    code = regenerate_main(["--config", "tiny-regenerate"] + [a for s in sets for a in ("--set", s)])
    wall_s = time.perf_counter() - began
    if code != 0:
        print(f"error: regeneration exited {code}", file=sys.stderr)
        return 1
    lines = [json.loads(line) for line in metrics_file(output).read_text().splitlines()]
    last = lines[-1]
    records = sum(1 for _ in output.open())
    # Generated tokens per second as the run counts them (token ids, not decoded text: a random target's ids
    # are mostly rows the word-level tokenizer has no text for).
    report = {"shape": args.shape, "devices": devices, "records": records, "batch_size": args.batch_size,
              "new_tokens": args.new_tokens, "wall_s": wall_s, "target_saved_s": saved_s,
              "tokens_per_s": last.get("tokens_per_s"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if first != "cpu" else "cpu"}
    rows = [("device", f"{report['device']} x {len(devices) if devices != 'cpu' else 1}"),
            ("records regenerated", f"{records} (batches of {args.batch_size}, up to {args.new_tokens} tokens)"),
            ("generated tokens/s (the run's own metrics)", f"{last.get('tokens_per_s') or 0:.0f}"),
            ("wall time (load + generate)", f"{wall_s:.1f} s")]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
