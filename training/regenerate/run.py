"""Regenerate chat data with the target itself: the drafter learns the target's own outputs (the DFlash recipe).

    python -m training.regenerate --config PRESET|PATH [--set KEY=VALUE]...

Input: JSONL of {"messages": [...], "id": ...}; a record without an id gets a stable one from its messages
("sha256:" and 16 hex digits). The target answers in place of every assistant message, in order, with its own
earlier replies as context, and after the last message when that is not an assistant one; the other messages
stay. Prompts go through the target's chat template with `enable_thinking`; decoding is greedy (temperature 0)
or sampled (temperature, top_p; each batch seeded from `seed` and its first id).

Output: JSONL of {"id", "messages"} (and "truncated": true when a reply stopped at max_new_tokens), the training
data's format. One writer appends each record as one whole line, flushed and fsynced: a record is done when its
line is. A restart truncates a torn last line, skips every id the output already holds and never writes one
twice, so a killed run loses at most the batches in flight.

One thread per `target_devices` entry (the CPU counts once), each with its own replica of the target, takes
batches of `batch_size` records and generates them turn by turn (left-padded, transformers' generate).
Progress: a JSON line per batch in $GPUCTL_METRICS, else beside the output (<output>.metrics.jsonl), with
training/output/metrics.py's keys: `step` (records done), `total_steps` (records), `tokens_per_s` (generated), `eta_s`.
SIGTERM (and Ctrl-C) finish the batches in flight, write their records and exit 0 (130 for Ctrl-C); a second
one ends at once. A bad configuration or input line prints one line and exits 2; a failing thread exits 1.
"""

from __future__ import annotations

import copy
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from training.config import ConfigError, RegenerateConfig, load_config, parse_devices
from training.console import say
from training.data.chat import DataError
from training.entry import OneLineArgumentParser, StopSignals
from training.layout.devices import check_devices, compute_dtype
from training.output.metrics import MetricsLog, announce_output
from training.regenerate.generation import EngineGenerator, ReplicaGenerator
from training.regenerate.records import (  # noqa: F401 - content_id and recover_output are part of this entry point's API
    PromptRecord,
    RecordWriter,
    content_id,
    id_key,
    load_prompts,
    recover_output,
    reply_positions,
)
from training.target.from_gguf import ensure_target_from_gguf


class Progress:
    """Records done, generated tokens per second and the ETA, as metrics lines (thread-safe)."""

    def __init__(self, metrics: MetricsLog, total: int, done: int):
        self.metrics, self.total, self.done = metrics, total, done
        self.done_at_start, self.tokens, self.start = done, 0, time.time()
        self._lock = threading.Lock()
        metrics.write(done, records_left=total - done)

    def add(self, records: int, tokens: int) -> None:
        with self._lock:
            self.done += records
            self.tokens += tokens
            elapsed = max(time.time() - self.start, 1e-9)
            rate = (self.done - self.done_at_start) / elapsed
            eta = (self.total - self.done) / rate if rate > 0 else None
            self.metrics.write(self.done, tokens_per_s=round(self.tokens / elapsed, 1),
                               records_per_s=round(rate, 3), eta_s=None if eta is None else round(eta, 1))


class StopFlag(StopSignals):
    """While active, SIGTERM/SIGINT ask the threads to stop after their batch; a second signal acts at once.
    The handler writes nothing (it may run inside one of the main thread's own prints: a reentrant call);
    the main thread says it took the signal (`announce`)."""

    _announced = False

    def _handle(self, signum, frame) -> None:
        self.signal = signum
        signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)

    def announce(self) -> None:
        if self.requested and not self._announced:
            self._announced = True
            say(f"received {signal.Signals(self.signal).name}: stopping once the batches in flight are written")

    def exit_code(self) -> int:
        return 130 if self.signal == signal.SIGINT else 0


class ThreadFailure(RuntimeError):
    def __init__(self, device: str, traceback_text: str):
        super().__init__(f"the generation thread on {device} failed")
        self.traceback_text = traceback_text


def pick_devices(config: RegenerateConfig) -> list[torch.device]:
    devices = [torch.device(d) for d in dict.fromkeys(parse_devices(config.target_devices, "target_devices"))]
    check_devices(devices)
    return devices


def metrics_file(output: Path) -> Path:
    return Path(os.environ.get("GPUCTL_METRICS") or output.with_suffix(".metrics.jsonl"))


def target_directory(config: RegenerateConfig) -> Path:
    """The target's model directory (with build_tiny, the tiny one built there first), checked."""
    if config.build_tiny:
        from training.target.tiny import ensure_tiny

        ensure_tiny(config.target_path, config.prompts_path, "", config.seed)
    if config.target_gguf:
        ensure_target_from_gguf(config.target_path, config.target_gguf)
    target_dir = Path(config.target_path).expanduser()
    if not (target_dir / "config.json").is_file():
        raise ConfigError(f"target_path {config.target_path} is not a model directory (no config.json)")
    return target_dir


def load_generators(config: RegenerateConfig, target_dir: Path, devices: list[torch.device]) -> list[ReplicaGenerator]:
    """One generator per device, each with its own copy of the target."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.target.frozen import loading_target

    with loading_target("tokenizer", str(target_dir)):
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    if config.backend == "vllm":
        return [EngineGenerator(str(target_dir), tokenizer, config)]
    generators = []
    for device in devices:  # one at a time: loading several large checkpoints at once needs their sum in memory
        with loading_target("weights", str(target_dir)):
            model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=compute_dtype(config.dtype, device),
                                                         attn_implementation="sdpa")
        generators.append(ReplicaGenerator(model.to(device).eval(), copy.deepcopy(tokenizer), config))
    return generators


def prompt_records(config: RegenerateConfig, load_once) -> tuple[list[PromptRecord], int]:
    """load_prompts of prompts_path, written first from the mix prompts_from when it does not exist yet (the
    "self" source with the first of the generators `load_once()` loads, only then)."""
    if config.prompts_from:
        from training.data.prompts import ensure_prompts
        from training.regenerate.self_prompts import SelfPrompts

        def write_user_turns(count: int, round_: int) -> list[str]:
            return SelfPrompts(load_once()[0], config)(count, round_)

        ensure_prompts(config.prompts_path, config.prompts_from, config.seed, write_user_turns)
    return load_prompts(config.prompts_path)


def queued_batches(pending: list[PromptRecord], batch_size: int, by_length: bool) -> queue.Queue:
    """The records in batches; by_length (the static decode) sorts them first: less padding, fewer widths."""
    if by_length:
        pending = sorted(pending, key=lambda r: len(json.dumps(r.messages[: reply_positions(r.messages)[0]])))
    batches: queue.Queue = queue.Queue()
    for start in range(0, len(pending), batch_size):
        batches.put(pending[start:start + batch_size])
    return batches


def regenerate(config: RegenerateConfig, stop: StopFlag | None = None) -> int:
    devices = pick_devices(config)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    target_dir = target_directory(config)
    stop = stop or StopFlag()  # never entered: no signal handling when called as a library
    loaded: list[ReplicaGenerator] = []

    def load_once() -> list[ReplicaGenerator]:
        if not loaded:
            loaded.extend(load_generators(config, target_dir, devices))
        return loaded

    records, duplicates = prompt_records(config, load_once)
    output = Path(config.output_path).expanduser()
    done = recover_output(output)
    pending = [r for r in records if id_key(r.id) not in done]
    total, already = len(records), len(records) - len(pending)
    say(f"{total} records in {config.prompts_path}" + (f" ({duplicates} exact duplicates left out)" if duplicates
                                                        else "") + f"; {already} already in {output}")
    if not pending:
        say(f"done: all {total} records are in {output}")
        return 0

    generators = load_once()
    say(f"target {config.target_path} on {', '.join(map(str, devices))}; {len(pending)} records to generate in "
        f"batches of {config.batch_size}, {'sampled' if config.temperature > 0 else 'greedy'}, "
        f"thinking {'on' if config.enable_thinking else 'off'}")

    # continuous decoding refills its batch_size rows from a batch four times as large: fewer idle tails
    continuous = any(getattr(g, "continuous", False) for g in generators)
    batches = queued_batches(pending, config.batch_size * (4 if continuous else 1),
                             by_length=any(g.static for g in generators))
    writer = RecordWriter(output, done)
    progress = Progress(MetricsLog(metrics_file(output), total), total, already)
    failures: list[ThreadFailure] = []

    def work(generator: ReplicaGenerator) -> None:
        try:
            while not stop.requested and not failures:
                try:
                    batch = batches.get_nowait()
                except queue.Empty:
                    return
                outputs, tokens = generator.regenerate(batch)
                written = sum(writer.write(record) for record in outputs)
                progress.add(written, tokens)
        except BaseException:  # noqa: BLE001 - reported by the main thread, which exits 1
            failures.append(ThreadFailure(str(generator.device), traceback.format_exc()))

    threads = [threading.Thread(target=work, args=(g,), name=f"generate-{g.device}", daemon=True)
               for g in generators]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():  # a timed join lets the main thread take signals
            thread.join(timeout=0.2)
            stop.announce()
    writer.close()
    for generator in generators:
        if generator.static:
            say(f"{generator.device}: {generator.counters.line()}")
    if failures:
        raise failures[0]
    if stop.requested:
        say(f"stopped: {progress.done} of {total} records in {output}; run again to continue")
        return stop.exit_code()
    from training.data.prompts import mix_report_path
    from training.data.report import render, report

    tokenizer = getattr(generators[0], "tokenizer", None)
    say(render(report(output, tokenizer, mix_report_path(Path(config.prompts_path).expanduser()))))
    say(f"done: all {total} records are in {output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="python -m training.regenerate", description="Regenerate chat data with the target.")
    parser.add_argument("--config", required=True, help="preset name (training/presets/) or TOML path")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.set, kind=RegenerateConfig)
        announce_output("output_path", config.output_path)  # for `gpuctl pull --what data`
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # progress bars would fill the log file with carriage returns
        with StopFlag() as stop:
            return regenerate(config, stop)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ThreadFailure as err:
        print(err.traceback_text, end="", file=sys.stderr)
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C: now, the batches in flight unwritten (a torn line is cut later)
        print("error: interrupted: the records being generated were not written; run again to continue",
              file=sys.stderr, flush=True)
        return 130

