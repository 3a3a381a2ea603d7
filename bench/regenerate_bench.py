"""Regeneration throughput through `python -m training.regenerate` itself, each decode side by side in one call.

    python bench/regenerate_bench.py [--shape qwen3-8b | --target DIR] [--prompts FILE] [--devices 0]
                                     [--records 64] [--batch-size 32] [--new-tokens 256]
                                     [--decodes dynamic,static,continuous] [--context 2048] [--work DIR]
                                     [--json FILE]

Without --target, saves the qwen3-8b-random world's random-weight target (training/target/random_world.py: Qwen3-8B's
shape, the tiny word-level tokenizer and its chat template) as a model directory; random weights rarely stop
early, so every reply is about `--new-tokens` long and the figure is the decode rate itself. --target takes a
model directory (e.g. SmolLM2 made by training/target/from_gguf.py) and --prompts a prompts file (e.g. the ShareGPT one
of training/data/prompts.py); the first `--records` are used. Each decode of `--decodes` regenerates the same records
into its own output, one after the other, on `--devices` (a thread per GPU); the table has, per decode, the
generated tokens per second from the run's own metrics lines, the wall time (load + capture + generate), the
static decode's capture time and how many replies are equal to the first decode's. `--shape qwen3-8b-narrow
--devices cpu` is a toy form for the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.regenerate.run import main as regenerate_main
from training.regenerate.run import metrics_file
from training.target.random_world import random_target, synthetic_conversations


class Tee(io.TextIOBase):
    """What the run says, shown as it comes and kept (the static decode's counters are in its last lines)."""

    def __init__(self, out):
        self.out, self.kept = out, []

    def write(self, text: str) -> int:
        self.kept.append(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def prepare(args, work: Path, first: str) -> tuple[Path, Path, float]:
    """The target directory, the prompts file and the seconds it took to save a random target."""
    began = time.perf_counter()
    if args.target:
        target = args.target
    else:
        built = random_target(args.shape, first, torch.float32 if first == "cpu" else torch.bfloat16, None, seed=0)
        target = work / "target"
        built.model.save_pretrained(target)
        built.tokenizer.save_pretrained(target)
        del built
        if first != "cpu":
            torch.cuda.empty_cache()
    prompts = work / "prompts.jsonl"
    if args.prompts:
        lines = [line for line in args.prompts.read_text().splitlines() if line.strip()][: args.records]
        prompts.write_text("".join(line + "\n" for line in lines))
    else:
        with prompts.open("w") as f:
            for n, conversation in enumerate(synthetic_conversations(args.records, 8, seed=0)):
                f.write(json.dumps({"id": f"p{n}", "messages": conversation}) + "\n")
    return target, prompts, time.perf_counter() - began


def run_decode(args, decode: str, target: Path, prompts: Path, work: Path, devices) -> dict:
    output = work / f"regenerated-{decode}.jsonl"
    sets = [f"target_path={target}", f"prompts_path={prompts}", f"output_path={output}", "build_tiny=false",
            f"target_devices={json.dumps(devices)}", f"batch_size={args.batch_size}",
            f"max_new_tokens={args.new_tokens}", "dtype=auto", f"decode={decode}",
            f"max_context_tokens={args.context}"]
    tee = Tee(sys.stdout)
    began = time.perf_counter()
    with contextlib.redirect_stdout(tee):
        code = regenerate_main(["--config", "tiny-regenerate"] + [a for s in sets for a in ("--set", s)])
    wall_s = time.perf_counter() - began
    if code != 0:
        raise SystemExit(f"error: regeneration with decode={decode} exited {code}")
    last = json.loads(metrics_file(output).read_text().splitlines()[-1])
    capture = re.search(r"captured in ([0-9.]+) s", "".join(tee.kept))
    records = {r["id"]: r for r in map(json.loads, output.read_text().splitlines())}
    # Generated tokens per second as the run counts them (token ids: a random target's are mostly ones the
    # word-level tokenizer has no text for).
    return {"decode": decode, "records": len(records), "wall_s": round(wall_s, 1),
            "tokens_per_s": last.get("tokens_per_s"), "capture_s": float(capture[1]) if capture else None,
            "replies": records}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--target", type=Path, help="a model directory instead of a random --shape")
    parser.add_argument("--prompts", type=Path, help="a prompts file instead of synthetic prompts")
    parser.add_argument("--devices", default="0", help="comma-separated GPU indices, or cpu")
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--decodes", default="dynamic,static", help="any of dynamic, static, continuous")
    parser.add_argument("--context", type=int, default=2048,
                        help="max_context_tokens for every decode (continuous: each row's cache slots)")
    parser.add_argument("--work", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="regen-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    devices = "cpu" if args.devices == "cpu" else [int(d) for d in args.devices.split(",")]
    first = "cpu" if devices == "cpu" else f"cuda:{devices[0]}"
    target, prompts, saved_s = prepare(args, work, first)
    runs = [run_decode(args, decode, target, prompts, work, devices) for decode in args.decodes.split(",")]
    reference = runs[0]["replies"]
    for run in runs:
        run["equal_to_first"] = sum(r == reference.get(key) for key, r in run.pop("replies").items())
    report = {"target": str(args.target or args.shape), "devices": devices, "batch_size": args.batch_size,
              "new_tokens": args.new_tokens, "target_saved_s": round(saved_s, 1), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if first != "cpu" else "cpu", "runs": runs}
    print(f"\n{report['target']} on {report['device']} x {1 if devices == 'cpu' else len(devices)}, batches of "
          f"{args.batch_size}, up to {args.new_tokens} new tokens, torch {torch.__version__}")
    print(f"{'decode':<8} {'records':>8} {'tokens/s':>10} {'wall s':>8} {'capture s':>10} {'equal':>6}")
    for run in runs:
        capture = "-" if run["capture_s"] is None else f"{run['capture_s']:.1f}"
        print(f"{run['decode']:<8} {run['records']:>8} {run['tokens_per_s'] or 0:>10.0f} {run['wall_s']:>8.1f} "
              f"{capture:>10} {run['equal_to_first']:>6}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
