"""Train a DFlash drafter against a frozen target, on one target device and one drafter device.

    python -m training.train --config PRESET|PATH [--set KEY=VALUE]... [--resume]

A bad configuration prints one line and exits 2. SIGTERM (and Ctrl-C) finish the current step, save a
checkpoint and exit (0 for SIGTERM, 130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import math
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

from training.attention import resolve_backend
from training.checkpoint import checkpoints_dir, latest_checkpoint, load_checkpoint, save_checkpoint
from training.config import ConfigError, TrainConfig, load_config, parse_devices
from training.data import BatchStream, DataError, eval_prompts, load_conversations, prepare_sequences
from training.evaluate import acceptance_length, build_eval_set
from training.metrics import MetricsLog, metrics_path, say
from training.model import Drafter, DrafterConfig
from training.step import compute_dtype, drafter_stage, target_stage
from training.target import Target


class StopRequest:
    """While active, SIGTERM/SIGINT become a flag the loop checks between steps; a second signal acts at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict = {}

    def __enter__(self):
        self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame) -> None:
        self.signal = signum
        signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)
        say(f"received {signal.Signals(signum).name}: stopping after this step")

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def exit_code(self) -> int:
        return 130 if self.signal == signal.SIGINT else 0


def cosine_schedule(optimizer: torch.optim.Optimizer, max_steps: int, warmup_ratio: float):
    """Linear warmup over ceil(warmup_ratio * max_steps) steps, then cosine decay to 0."""
    warmup = math.ceil(warmup_ratio * max_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, max_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def pick_devices(config: TrainConfig) -> tuple[torch.device, torch.device, str]:
    """The target and drafter devices and the attention backend, checked against this machine."""
    target_devices = parse_devices(config.target_devices, "target_devices")
    drafter_devices = parse_devices(config.drafter_devices, "drafter_devices")
    if len(target_devices) > 1 or len(drafter_devices) > 1:
        raise ConfigError("this trainer runs one target and one drafter device; give one entry each")
    target_device, drafter_device = torch.device(target_devices[0]), torch.device(drafter_devices[0])
    for device in (target_device, drafter_device):
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"{device} requested but CUDA is not available")
        if device.type == "cuda" and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{device} requested but only {torch.cuda.device_count()} GPU(s) are visible")
    backend = resolve_backend(config.attention, drafter_device)
    if backend == "flex" and drafter_device.type != "cuda":
        raise ConfigError("attention=flex needs a CUDA drafter device (torch refuses flex_attention's backward "
                          "on the CPU); use sdpa or auto")
    return target_device, drafter_device, backend


def prepare_output_dir(config: TrainConfig, resume: bool) -> None:
    """A fresh run may not silently mix with an earlier run's checkpoints."""
    if resume or latest_checkpoint(config.output_dir) is None:
        return
    if not config.overwrite_output:
        raise ConfigError(f"{config.output_dir} already holds checkpoints: pass --resume, or set "
                          "overwrite_output=true, or choose another output_dir")
    shutil.rmtree(checkpoints_dir(config.output_dir))
    metrics_path(config.output_dir).unlink(missing_ok=True)


def train(config: TrainConfig, resume: bool = False, stop: StopRequest | None = None) -> int:
    # Devices and numerics.
    target_device, drafter_device, backend = pick_devices(config)
    dtype = compute_dtype(config.dtype, drafter_device)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    prepare_output_dir(config, resume)
    stop = stop or StopRequest()  # never entered: no signal handling when called as a library

    # The frozen target and the data it is read with.
    if config.build_tiny:
        from training.tiny import ensure_tiny

        ensure_tiny(config.target_path, config.data_path, config.eval_data_path, config.seed)
    if not (Path(config.target_path).expanduser() / "config.json").is_file():
        raise ConfigError(f"target_path {config.target_path} is not a model directory (no config.json)")
    target = Target.load(config.target_path, target_device, dtype, config.target_layers or None)
    tokenizer = target.tokenizer
    conversations = load_conversations(config.data_path)
    if config.eval_data_path:
        held_out = load_conversations(config.eval_data_path)[: config.eval_prompts]
    else:  # hold out the tail of the training data
        cut = max(len(conversations) - config.eval_prompts, 0)
        conversations, held_out = conversations[:cut], conversations[cut:]
    sequences = prepare_sequences(tokenizer, conversations, config.max_length, config.block_size)
    stream = BatchStream(sequences, config.batch_size, config.buckets(), config.block_size, config.num_anchors,
                         tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0, config.seed)
    say(f"target {config.target_path} on {target_device} (layers {target.layers}); "
        f"{len(sequences)} training sequences; attention {backend}, {dtype}")

    # The drafter, its optimizer and schedule.
    drafter_config = DrafterConfig.from_target(target.config, config.num_draft_layers, config.block_size,
                                               target.layers)
    embedding = target.model.get_input_embeddings().weight.to(drafter_device)
    lm_head = target.model.get_output_embeddings().weight.to(drafter_device)
    torch.manual_seed(config.seed)  # here, so that building the tiny world first changes nothing
    with torch.device(drafter_device):  # initialised in place: a 1 B-parameter drafter is slow to init on a CPU
        drafter = Drafter(drafter_config, embedding, lm_head)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay,
                                  fused=drafter_device.type == "cuda")
    scheduler = cosine_schedule(optimizer, config.max_steps, config.warmup_ratio)
    say(f"drafter: {config.num_draft_layers} layers, {drafter.num_trainable() / 1e6:.2f} M trainable parameters")

    step = 0
    checkpoint = latest_checkpoint(config.output_dir) if resume else None
    if checkpoint is not None:
        restored = load_checkpoint(checkpoint, drafter, optimizer, scheduler)
        step = restored["step"]
        stream.load_state_dict(restored["data"])
        say(f"resumed from {checkpoint} at step {step}")
    elif resume:
        say(f"no checkpoint in {checkpoints_dir(config.output_dir)}: starting at step 0")

    metrics = MetricsLog(metrics_path(config.output_dir), config.max_steps)
    evalset = None
    if config.eval_every and held_out:
        evalset = build_eval_set(target, eval_prompts(tokenizer, held_out), config.eval_new_tokens, drafter_device)
        if step == 0:  # the untrained drafter's tau: the baseline every later one is compared with
            metrics.write(0, acceptance_length=acceptance_length(drafter, evalset, dtype))

    def save() -> None:
        save_checkpoint(config.output_dir, step, drafter, optimizer, scheduler, stream.state_dict(),
                        config.to_dict(), config.keep_checkpoints)

    # The loop: one batch, target stage, drafter stage, optimizer step.
    loss_sum, accuracy_sum, window_steps, window_tokens = 0.0, 0.0, 0, 0
    window_start = time.time()
    saved_step = step
    while step < config.max_steps and not stop.requested:
        batch = next(stream)
        features = target_stage(target, batch, drafter_device)
        output = drafter_stage(drafter, features, batch.to(drafter_device), backend, config.gamma,
                               config.loss_chunk_size, dtype)
        output.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        loss_sum += output.loss.detach()  # summed on the device: no host sync until a log step
        accuracy_sum += output.accuracy
        window_steps += 1
        window_tokens += batch.num_tokens
        last = step == config.max_steps
        record = {}
        if step % config.log_every == 0 or last:
            elapsed = time.time() - window_start
            record = {"loss": float(loss_sum) / window_steps, "accuracy": float(accuracy_sum) / window_steps, "lr": lr,
                      "grad_norm": float(grad_norm), "tokens_per_s": window_tokens / max(elapsed, 1e-9)}
        if evalset is not None and (step % config.eval_every == 0 or last):
            record["acceptance_length"] = acceptance_length(drafter, evalset, dtype)
        if record:
            metrics.write(step, **record)
        if "loss" in record:
            loss_sum, accuracy_sum, window_steps, window_tokens = 0.0, 0.0, 0, 0
            window_start = time.time()
        if step % config.save_every == 0 or last:
            save()
            saved_step = step

    if stop.requested:
        if step != saved_step:
            save()
        say(f"stopped at step {step}; checkpoint saved in {checkpoints_dir(config.output_dir)}")
        return stop.exit_code()
    say(f"done: {step} steps")
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other bad-input path
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="python -m training.train", description="Train a DFlash drafter.")
    parser.add_argument("--config", required=True, help="preset name (training/presets/) or TOML path")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.set)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # progress bars would fill the run's log file with carriage returns
        with StopRequest() as stop:
            return train(config, resume=args.resume, stop=stop)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
