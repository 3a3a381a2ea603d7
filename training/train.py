"""Train a DFlash drafter against a frozen target, through the threaded pipeline (training/pipeline.py).

    python -m training.train --config PRESET|PATH [--set KEY=VALUE]... [--resume]

One process: a target thread per `target_devices` entry, a drafter thread (one drafter replica) per
`drafter_devices` entry; a one-device run is one of each on the same device. A bad configuration prints one
line and exits 2. SIGTERM (and Ctrl-C) stop at a step boundary, save a checkpoint and exit (0 for SIGTERM, 130
for Ctrl-C); a second one aborts at once. A failing thread stops them all: its traceback, then exit 1.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import os
import platform
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from training.attention import build_mask, resolve_backend, use_shared_flex_attention
from training.checkpoint import checkpoints_dir, latest_checkpoint, load_checkpoint, save_checkpoint
from training.compile import AttentionShape, SharedFlexAttention, projected_qkv
from training.config import ConfigError, TrainConfig, load_config, parse_devices
from training.data import Batch, BatchStream, DataError, eval_prompts, load_conversations, prepare_sequences
from training.evaluate import acceptance_length, build_eval_set
from training.metrics import MetricsLog, metrics_path, say
from training.model import Drafter, DrafterConfig
from training.pipeline import Pipeline, PipelineConfig, PipelineError, StepReport
from training.step import compute_dtype, drafter_stage
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


def pick_devices(config: TrainConfig) -> tuple[list[torch.device], list[torch.device], str]:
    """Target and drafter devices (a thread each) and the attention backend, checked against this machine."""
    target_devices = [torch.device(d) for d in parse_devices(config.target_devices, "target_devices")]
    drafter_devices = [torch.device(d) for d in parse_devices(config.drafter_devices, "drafter_devices")]
    for device in target_devices + drafter_devices:
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"{device} requested but CUDA is not available")
        if device.type == "cuda" and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{device} requested but only {torch.cuda.device_count()} GPU(s) are visible")
    backend = resolve_backend(config.attention, drafter_devices[0])
    if backend == "flex" and any(device.type != "cuda" for device in drafter_devices):
        raise ConfigError("attention=flex needs a CUDA device for every drafter (torch refuses "
                          "flex_attention's backward on the CPU); use sdpa or auto")
    return target_devices, drafter_devices, backend


class TargetReplica:
    """The pipeline's target stage on one device: the frozen target's features for a micro-batch."""

    def __init__(self, target: Target):
        self.target = target

    def features(self, batch: Batch) -> torch.Tensor:
        return self.target.features(batch.input_ids)


class DrafterReplica:
    """The pipeline's drafter stage on one device: a drafter replica with its optimizer and LR schedule."""

    def __init__(self, drafter: Drafter, config: TrainConfig, backend: str, dtype: torch.dtype,
                 shared_flex: SharedFlexAttention | None = None):
        self.drafter, self.config, self.backend, self.dtype = drafter, config, backend, dtype
        self.shared_flex = shared_flex
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.device = self.params[0].device
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=(0.9, 0.95),
                                           weight_decay=config.weight_decay, fused=self.device.type == "cuda")
        self.scheduler = cosine_schedule(self.optimizer, config.max_steps, config.warmup_ratio)
        self.last_lr = self.scheduler.get_last_lr()[0]  # the rate of the latest step

    def trainable_parameters(self) -> list[torch.Tensor]:
        return self.params

    def loss(self, features: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        output = drafter_stage(self.drafter, features, batch, self.backend, self.config.gamma,
                               self.config.loss_chunk_size, self.dtype)
        return output.loss, {"accuracy": output.accuracy}

    def optimizer_step(self) -> None:
        self.last_lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()

    def warm_up(self) -> None:
        """Compile the shared flex_attention for every length bucket on this device (then meet the others)."""
        if self.shared_flex is not None:
            self.shared_flex.warm_up(self.device, self._warm_up_mask, projected_qkv)

    def _warm_up_mask(self, shape: AttentionShape, device: torch.device):
        """A training-like block mask for a warm-up shape: anchors spread over the context, all valid."""
        block = self.config.block_size
        context = shape.kv_len - shape.q_len
        anchors = torch.linspace(1, context - block, shape.q_len // block, device=device).long()
        anchors = anchors.expand(shape.batch, -1).contiguous()
        valid = torch.ones_like(anchors, dtype=torch.bool)
        return build_mask("flex", anchors, valid, context, block).block_mask


def shared_flex_attention(config: TrainConfig, drafter_config: DrafterConfig, devices: list[torch.device],
                          dtype: torch.dtype) -> SharedFlexAttention:
    """The run's one compiled flex_attention: drafter devices x length buckets, training mode (DESIGN §6)."""
    q_len = config.num_anchors * config.block_size
    c = drafter_config
    rows = config.micro_batch_rows()
    shapes = [AttentionShape(rows, c.num_heads, c.num_kv_heads, q_len, bucket + q_len, c.head_dim)
              for bucket in config.buckets()]
    return SharedFlexAttention(shapes=shapes, devices=devices, threads=len(devices), dtype=dtype,
                               grad_modes=(True,))


class StepBatches:
    """The pipeline's micro-batches, `per_step` to a step, read from the stream in order. Remembers each
    step's token count and the stream's state before it: targets read ahead, so a checkpoint after step s
    needs the state from before step s + 1's first micro-batch, not the stream's current one."""

    def __init__(self, stream: BatchStream, per_step: int, start_step: int):
        self.stream, self.per_step, self.start_step = stream, per_step, start_step
        self._lock = threading.Lock()  # the target threads read, the checkpointing thread asks for states
        self._state_before: dict[int, dict] = {}
        self._tokens: dict[int, int] = {}

    def __iter__(self):
        for step in itertools.count(self.start_step):
            for index in range(self.per_step):
                with self._lock:
                    if index == 0:
                        self._state_before[step] = self.stream.state_dict()
                    batch = next(self.stream)
                    self._tokens[step] = self._tokens.get(step, 0) + batch.num_tokens
                yield batch

    def state_before(self, step: int) -> dict:
        """The stream's state with exactly the micro-batches of steps before `step` read."""
        with self._lock:
            for old in [s for s in self._state_before if s < step]:
                del self._state_before[old]
            # No micro-batch of `step` read yet: the stream stands right there.
            return self._state_before.get(step) or self.stream.state_dict()

    def pop_tokens(self, step: int) -> int:
        with self._lock:
            return self._tokens.pop(step, 0)


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
    target_devices, drafter_devices, backend = pick_devices(config)
    dtype = compute_dtype(config.dtype, drafter_devices[0])
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    prepare_output_dir(config, resume)
    stop = stop or StopRequest()  # never entered: no signal handling when called as a library

    # The frozen target, one replica per target thread (loaded one at a time), and the data it is read with.
    if config.build_tiny:
        from training.tiny import ensure_tiny

        ensure_tiny(config.target_path, config.data_path, config.eval_data_path, config.seed)
    if not (Path(config.target_path).expanduser() / "config.json").is_file():
        raise ConfigError(f"target_path {config.target_path} is not a model directory (no config.json)")
    targets = [Target.load(config.target_path, device, dtype, config.target_layers or None)
               for device in target_devices]
    target = targets[0]
    tokenizer = target.tokenizer
    conversations = load_conversations(config.data_path)
    if config.eval_data_path:
        held_out = load_conversations(config.eval_data_path)[: config.eval_prompts]
    else:  # hold out the tail of the training data
        cut = max(len(conversations) - config.eval_prompts, 0)
        conversations, held_out = conversations[:cut], conversations[cut:]
    sequences = prepare_sequences(tokenizer, conversations, config.max_length, config.block_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    stream = BatchStream(sequences, config.micro_batch_rows(), config.buckets(), config.block_size,
                         config.num_anchors, pad_id, config.seed)
    say(f"target {config.target_path} on {', '.join(map(str, target_devices))} (layers {target.layers}); "
        f"{len(sequences)} training sequences; attention {backend}, {dtype}")

    # The drafter replicas (identical), each with its optimizer and schedule.
    drafter_config = DrafterConfig.from_target(target.config, config.num_draft_layers, config.block_size,
                                               target.layers)
    embedding = target.model.get_input_embeddings().weight.to(drafter_devices[0])
    lm_head = target.model.get_output_embeddings().weight.to(drafter_devices[0])
    torch.manual_seed(config.seed)  # here, so that building the tiny world first changes nothing
    # Initialised in place: a 1 B-parameter drafter is slow to init on a CPU.
    with torch.device(drafter_devices[0]):
        drafter = Drafter(drafter_config, embedding, lm_head)
    drafters = [drafter] + [copy.deepcopy(drafter).to(device) for device in drafter_devices[1:]]
    shared_flex = None
    if backend == "flex":
        shared_flex = shared_flex_attention(config, drafter_config, drafter_devices, dtype)
    replicas = [DrafterReplica(d, config, backend, dtype, shared_flex) for d in drafters]
    say(f"drafter: {config.num_draft_layers} layers, {drafter.num_trainable() / 1e6:.2f} M trainable "
        f"parameters, replicas on {', '.join(map(str, drafter_devices))}; a step is "
        f"{config.micro_batches_per_step()} micro-batches of {config.micro_batch_rows()} sequences")

    step = 0
    checkpoint = latest_checkpoint(config.output_dir) if resume else None
    if checkpoint is not None:
        for replica in replicas:
            restored = load_checkpoint(checkpoint, replica.drafter, replica.optimizer, replica.scheduler)
        step = restored["step"]
        stream.load_state_dict(restored["data"])
        say(f"resumed from {checkpoint} at step {step}")
    elif resume:
        say(f"no checkpoint in {checkpoints_dir(config.output_dir)}: starting at step 0")

    metrics = MetricsLog(metrics_path(config.output_dir), config.max_steps)
    evalset = None
    if config.eval_every and held_out:
        prompts = eval_prompts(tokenizer, held_out)
        evalset = build_eval_set(target, prompts, config.eval_new_tokens, drafter_devices[0])
        if step == 0:  # the untrained drafter's tau: the baseline every later one is compared with
            metrics.write(0, acceptance_length=acceptance_length(drafter, evalset, dtype))

    batches = StepBatches(stream, config.micro_batches_per_step(), step)
    saved_step = step

    def save(at_step: int) -> None:
        nonlocal saved_step
        save_checkpoint(config.output_dir, at_step, drafter, replicas[0].optimizer, replicas[0].scheduler,
                        batches.state_before(at_step), config.to_dict(), config.keep_checkpoints)
        saved_step = at_step

    # Every step, in the leader drafter thread once its replica has stepped: metrics, evaluation, checkpoints.
    window = {"loss": 0.0, "accuracy": 0.0, "steps": 0, "tokens": 0, "start": time.time()}

    def on_step(report: StepReport) -> None:
        done = report.step
        window["loss"] += report.loss
        window["accuracy"] += report.metrics["accuracy"]
        window["steps"] += 1
        window["tokens"] += batches.pop_tokens(done - 1)
        last = done == config.max_steps
        record = {}
        if done % config.log_every == 0 or last:
            elapsed = time.time() - window["start"]
            steps = window["steps"]
            record = {"loss": window["loss"] / steps, "accuracy": window["accuracy"] / steps,
                      "lr": replicas[0].last_lr, "grad_norm": report.grad_norm,
                      "tokens_per_s": window["tokens"] / max(elapsed, 1e-9),
                      **pipeline.utilisation().as_metrics()}
            window.update(loss=0.0, accuracy=0.0, steps=0, tokens=0, start=time.time())
        if evalset is not None and (done % config.eval_every == 0 or last):
            record["acceptance_length"] = acceptance_length(drafter, evalset, dtype)
        if record:
            metrics.write(done, **record)
        if done % config.save_every == 0 or last:
            save(done)

    if stop.requested:  # a signal while loading: nothing trained, nothing to save
        say(f"stopped at step {step} before training")
        return stop.exit_code()
    pipeline = Pipeline(
        PipelineConfig(target_devices, drafter_devices, config.micro_batches_per_step(), config.queue_depth,
                       config.grad_clip),
        [TargetReplica(t) for t in targets], replicas, batches, start_step=step, max_steps=config.max_steps,
        on_step=on_step,
    )
    if shared_flex is not None:
        use_shared_flex_attention(shared_flex)
    try:
        result = pipeline.run()
    finally:
        if shared_flex is not None:
            use_shared_flex_attention(None)
            shared_flex.close()
    step = result.steps_done
    if shared_flex is not None:
        stats = shared_flex.stats()
        say(f"compiled flex_attention: {stats.compiled_calls} calls, {stats.compiles_after_warmup} compiles "
            f"after warm-up, {stats.eager_runs} eager runs, {stats.fx_traces_after_warmup} FX traces after "
            f"warm-up, FX tracing flag {stats.fx_tracing_flag}")
    if result.stopped:
        if step != saved_step:
            save(step)
        say(f"stopped at step {step}; checkpoint saved in {checkpoints_dir(config.output_dir)}")
        return 130 if result.stop_signal == signal.SIGINT else 0
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
        # Which interpreter and torch build run this: the log's first line answers "did it use the right one?"
        say(f"python {sys.executable} ({platform.python_version()}), torch {torch.__version__} "
            f"({f'CUDA {torch.version.cuda}' if torch.version.cuda else 'a CPU-only build'})")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # progress bars would fill the run's log file with carriage returns
        with StopRequest() as stop:
            return train(config, resume=args.resume, stop=stop)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except PipelineError as err:  # a thread failed: its own traceback, then one line
        print(err.traceback_text, end="", file=sys.stderr)
        print(f"error: {err}", file=sys.stderr, flush=True)
        if err.still_running:  # a thread stuck inside a device call would hold up the interpreter's exit
            sys.stdout.flush()
            os._exit(1)
        return 130 if isinstance(err.error, KeyboardInterrupt) else 1


if __name__ == "__main__":
    sys.exit(main())
