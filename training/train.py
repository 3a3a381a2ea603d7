"""Train a DFlash drafter against a frozen target, through the threaded pipeline (training/pipeline.py).

    python -m training.train --config PRESET|PATH [--set KEY=VALUE]... [--resume]

One process: a target thread per `target_devices` entry, a drafter thread (one drafter replica) per
`drafter_devices` entry; a one-device run is one of each on the same device. A bad configuration prints one
line and exits 2. SIGTERM (and Ctrl-C) stop at a step boundary, save a checkpoint and exit (0 for SIGTERM, 130
for Ctrl-C); a second one aborts at once (130, no checkpoint). A failing thread stops them all: its traceback,
then exit 1. A step whose loss or summed gradient is not finite is skipped (no optimizer or LR-schedule step;
the data moves on) and counted; `max_bad_steps` of them in a row stop the run: one line naming the step and
what was not finite, exit 3. A checkpoint that cannot be written (disk full, read-only, over quota) leaves the
earlier ones intact and stops the run: one line naming its path and the cause, exit 4; with
on_checkpoint_error=warn a periodic one is a warning instead, and the run goes on. Out of memory in a stage
stops every thread: one line naming the stage, device, shapes and the keys that lower memory, exit 5. `main`
alone turns how the run ended into the exit code, one of TrainExit:

    0 done, or stopped by SIGTERM     3 max_bad_steps non-finite steps in a row   130 Ctrl-C, or a 2nd signal
    1 a thread failed (traceback)     4 a checkpoint could not be written
    2 bad configuration or data       5 out of memory in a stage
                                      6 another node of a multi-node run was lost (one line naming it)
With RANK, WORLD_SIZE > 1, MASTER_ADDR and MASTER_PORT set, this process is one node of a multi-node run
(training/distributed.py): node 0 checkpoints, writes the run's metrics and exports; a stop signal on any node
stops every node at the same step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import itertools
import math
import os
import platform
import re
import resource
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import torch

from training.attention import FlexAttention, resolve_backend
from training.checkpoint import (
    CheckpointWriteError,
    check_checkpoint,
    checkpoint_train_config,
    checkpoints_dir,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from training.compile import AttentionShape, SharedFlexAttention, projected_qkv
from training.config import (
    ConfigError,
    OneLineArgumentParser,
    StopSignals,
    TrainConfig,
    end_process,
    load_config,
    parse_devices,
    run_entry_point,
)
from training.data import Batch, BatchStream, DataError, eval_prompts, prepare_sequences
from training.distributed import (
    NodeLost,
    Nodes,
    micro_batch_share,
    node_env,
    run_fingerprint,
    tensor_sums,
    timeouts_of,
)
from training.evaluate import acceptance_length, build_eval_set
from training.export import export_run
from training.flops import drafter_flops, target_flops
from training.layout import (
    Choice,
    Layout,
    StageProfile,
    choose_layout,
    explicit_layout,
    layout_from_topology,
    measure_stages,
)
from training.loss import block_targets
from training.mask import build_block_mask
from training.metrics import MetricsLog, announce_output, metrics_path, say, warn
from training.model import Drafter, DrafterConfig
from training.pipeline import Pipeline, PipelineConfig, PipelineError, RunResult, StepReport, Utilisation
from training.random_world import NUM_CONVERSATIONS as NUM_RANDOM_CONVERSATIONS
from training.random_world import random_target, synthetic_conversations
from training.step import compute_dtype, drafter_stage
from training.target import Target
from training.tokenized import load_training_data


class StopRequest(StopSignals):
    """The process's one signal path: while active, the first SIGTERM/SIGINT asks the run to stop at the next
    safe point (before training, or a step boundary: the pipeline polls `reason`); a second one raises
    KeyboardInterrupt at once, which aborts without a checkpoint. The handler only records or raises: it may
    run between any two bytecodes of the main thread, so it takes no lock and writes nothing."""

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt(f"a second stop signal ({signal.Signals(signum).name}): aborting without a "
                                    "checkpoint")
        self.signal = signum

    def reason(self) -> str | None:
        """The first signal's name, or None while none came."""
        return None if self.signal is None else signal.Signals(self.signal).name


class CosineSchedule:
    """The learning-rate factor of step k (0-based): linear warm-up over ceil(warmup_ratio * max_steps) steps,
    then cosine decay to 0 at max_steps.

    A run resumed with another max_steps continues from its checkpoint (`continue_to`): from the rate of the
    checkpoint's last step, a cosine down to 0 at the new end, so the rate never jumps and never reaches 0
    before the last step. Its fields are plain numbers, which LambdaLR's state_dict saves: a checkpoint holds
    the schedule it ran, and resuming it with the same max_steps continues exactly."""

    def __init__(self, max_steps: int, warmup_ratio: float):
        self.plan(max_steps, warmup_ratio)

    def plan(self, max_steps: int, warmup_ratio: float) -> None:
        self.base_max_steps = self.max_steps = max_steps
        self.warmup = math.ceil(warmup_ratio * max_steps)
        self.continued_from: int | None = None  # the first step of a continuation
        self.continued_factor = 1.0  # the factor of the step before it

    def __call__(self, step: int) -> float:
        if self.continued_from is not None and step >= self.continued_from:
            progress = (step - self.continued_from + 1) / (self.max_steps - self.continued_from + 1)
            return self.continued_factor * 0.5 * (1.0 + math.cos(math.pi * progress))
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.base_max_steps - self.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def continue_to(self, step: int, max_steps: int) -> None:
        """From `step` on, decay from the factor of step - 1 to 0 at `max_steps`."""
        self.continued_factor = self(step - 1)
        self.continued_from = step
        self.max_steps = max_steps


def cosine_schedule(optimizer: torch.optim.Optimizer, max_steps: int, warmup_ratio: float):
    """LambdaLR over a CosineSchedule (which the scheduler's state_dict saves and restores)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, CosineSchedule(max_steps, warmup_ratio))


def pick_layout(config: TrainConfig) -> tuple[Layout | None, list[torch.device], str]:
    """The layout (None for topology "auto", which a trial decides), the devices it may use, and the
    attention backend, checked against this machine."""
    layout = explicit_layout(config.target_devices, config.drafter_devices, config.colocated_devices)
    if layout is None and config.topology != "auto":
        layout = layout_from_topology(config.topology, parse_devices(config.devices, "devices"))
    names = list(layout.devices) if layout is not None else parse_devices(config.devices, "devices")
    devices = [torch.device(name) for name in names]
    for device in devices:
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"{device} requested but CUDA is not available")
        if device.type == "cuda" and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{device} requested but only {torch.cuda.device_count()} GPU(s) are visible")
    # Auto may put a drafter replica on any of its devices.
    replica_devices = [torch.device(d) for d in layout.replica_devices] if layout is not None else devices
    backend = resolve_backend(config.attention, replica_devices[0])
    if backend == "flex" and any(device.type != "cuda" for device in replica_devices):
        raise ConfigError("attention=flex needs a CUDA device for every drafter (torch refuses "
                          "flex_attention's backward on the CPU); use sdpa or auto")
    return layout, devices, backend


class TargetReplica:
    """The pipeline's target stage on one device: the frozen target's features for a micro-batch."""

    def __init__(self, target: Target):
        self.target = target

    def features(self, batch: Batch) -> torch.Tensor:
        return self.target.features(batch.input_ids)


class DrafterReplica:
    """The pipeline's drafter stage on one device: a drafter replica with its optimizer and LR schedule.

    `flex_attention` is what its drafter calls with the flex backend (None with SDPA): the trainer's
    SharedFlexAttention, which `warm_up` compiles on this device before steady state."""

    def __init__(self, drafter: Drafter, config: TrainConfig, backend: str, dtype: torch.dtype,
                 flex_attention: FlexAttention | None = None):
        self.drafter, self.config, self.backend, self.dtype = drafter, config, backend, dtype
        self.flex_attention = flex_attention
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.device = self.params[0].device
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=(0.9, 0.95),
                                           weight_decay=config.weight_decay, fused=self.device.type == "cuda")
        self.schedule = CosineSchedule(config.max_steps, config.warmup_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        self.last_lr = self.optimizer.param_groups[0]["lr"]  # the rate of the latest step

    def trainable_parameters(self) -> list[torch.Tensor]:
        return self.params

    def parameter_names(self) -> list[str]:
        return [name for name, p in self.drafter.named_parameters() if p.requires_grad]

    def loss(self, features: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        output = drafter_stage(self.drafter, features, batch, self.backend, self.config.gamma,
                               self.config.loss_chunk_size, self.dtype, self.flex_attention)
        loss = output.loss * float("nan") if isinstance(batch, NanLossBatch) else output.loss
        return loss, {"accuracy": output.accuracy}

    def optimizer_step(self) -> None:
        self.last_lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()

    def continue_schedule(self, step: int, max_steps: int) -> None:
        """A resumed run with another max_steps: the rest of the schedule decays from the checkpoint's last
        rate to 0 at max_steps (CosineSchedule), starting with the next step's rate."""
        self.schedule.continue_to(step, max_steps)
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self.schedule(step)

    def warm_up(self) -> None:
        """Compile the shared flex_attention for every length bucket on this device (then meet the others)."""
        if isinstance(self.flex_attention, SharedFlexAttention):
            self.flex_attention.warm_up(self.device, self._warm_up_mask, projected_qkv)

    def _warm_up_mask(self, shape: AttentionShape, device: torch.device):
        """A training-like block mask for a warm-up shape: anchors spread over the context, all valid."""
        block = self.config.block_size
        context = shape.kv_len - shape.q_len
        anchors = torch.linspace(1, context - block, shape.q_len // block, device=device).long()
        anchors = anchors.expand(shape.batch, -1).contiguous()
        valid = torch.ones_like(anchors, dtype=torch.bool)
        return build_block_mask(anchors, valid, context, block)


def shared_flex_attention(config: TrainConfig, drafter_config: DrafterConfig, devices: list[torch.device],
                          dtype: torch.dtype, threads: int | None) -> SharedFlexAttention:
    """The run's one compiled flex_attention: every device a drafter replica may use x length buckets,
    training mode (ARCHITECTURE §6). `threads`: how many replica threads warm it up (None: decided later)."""
    q_len = config.num_anchors * config.block_size
    c = drafter_config
    rows = config.micro_batch_rows()
    shapes = [AttentionShape(rows, c.num_heads, c.num_kv_heads, q_len, bucket + q_len, c.head_dim)
              for bucket in config.buckets()]
    return SharedFlexAttention(shapes=shapes, devices=devices, threads=threads, dtype=dtype, grad_modes=(True,))


@dataclasses.dataclass
class NanLossBatch(Batch):
    """Tests only (debug_nan_steps): a micro-batch whose loss the drafter replica makes NaN."""


class StepBatches:
    """The pipeline's micro-batches, `per_step` to a step, read from the stream in order. Remembers each
    step's token count, its counted FLOPs (`flops_of`, training/flops.py) and the stream's state before it:
    targets read ahead, so a checkpoint after step s needs the state from before step s + 1's first
    micro-batch, not the stream's current one. The micro-batches of `nan_steps` (numbered as logged, from 1)
    come as NanLossBatch. In a multi-node run, `share` is the indices of each step's micro-batches this node
    computes: every node moves through the whole stream (so every node's data position is the run's), makes
    only its own micro-batches (skipping the others' costs an index each) and counts only their tokens."""

    def __init__(self, stream: BatchStream, per_step: int, start_step: int,
                 flops_of: Callable[[Batch], float] | None = None, nan_steps: Iterable[int] = (),
                 share: list[int] | None = None):
        self.stream, self.per_step, self.start_step = stream, per_step, start_step
        self.share = set(range(per_step) if share is None else share)
        self.flops_of = flops_of
        self.nan_steps = set(nan_steps)
        self._lock = threading.Lock()  # the target threads read, the checkpointing thread asks for states
        self._state_before: dict[int, dict] = {}
        self._tokens: dict[int, int] = {}
        self._flops: dict[int, float] = {}

    def __iter__(self):
        last_own = max(self.share)
        for step in itertools.count(self.start_step):
            for index in range(last_own + 1):
                with self._lock:
                    if index == 0:
                        self._state_before[step] = self.stream.state_dict()
                    if index not in self.share:
                        self.stream.skip()
                        continue
                    batch = next(self.stream)
                    self._tokens[step] = self._tokens.get(step, 0) + batch.num_tokens
                    if index == last_own:  # the step's later micro-batches are other nodes': move past them now
                        for _ in range(last_own + 1, self.per_step):
                            self.stream.skip()
                flops = self.flops_of(batch) if self.flops_of is not None else 0.0
                with self._lock:
                    self._flops[step] = self._flops.get(step, 0.0) + flops
                yield NanLossBatch(**vars(batch)) if step + 1 in self.nan_steps else batch

    def state_before(self, step: int) -> dict:
        """The stream's state with exactly the micro-batches of steps before `step` read."""
        with self._lock:
            for old in [s for s in self._state_before if s < step]:
                del self._state_before[old]
            # No micro-batch of `step` read yet: the stream stands right there.
            return self._state_before.get(step) or self.stream.state_dict()

    def pop_tokens(self, step: int) -> tuple[int, float]:
        """The step's real tokens and counted FLOPs."""
        with self._lock:
            return self._tokens.pop(step, 0), self._flops.pop(step, 0.0)


def step_flops(config: TrainConfig, target: Target, drafter_config: DrafterConfig) -> Callable[[Batch], float]:
    """Counted FLOPs of one micro-batch (training/flops.py): the target forward over its padded length, up to
    the last feature layer, and the drafter's forward + backward."""

    def flops_of(batch: Batch) -> float:
        rows, length = batch.input_ids.shape
        _, weights = block_targets(batch.input_ids, batch.loss_mask, batch.anchors, batch.block_valid,
                                   config.block_size, config.gamma)
        drafter = drafter_flops(drafter_config, rows, length, batch.anchors, batch.block_valid,
                                int((weights > 0).sum()))
        return target_flops(target.config, rows, length, target.layers_run) + sum(drafter.values())

    return flops_of


def prepare_output_dir(config: TrainConfig, resume: bool) -> None:
    """The output dir, made and writable before any slow work; a fresh run may not silently mix with an earlier
    run's checkpoints."""
    output_dir = Path(config.output_dir).expanduser()
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create output_dir {output_dir}: {err.strerror or err}") from None
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write in output_dir {output_dir}: permission denied")
    if resume and latest_checkpoint(config.output_dir) is not None:
        check_checkpoint(latest_checkpoint(config.output_dir))  # e.g. a pre-<|MASK|> one: refused before any work
    if resume or latest_checkpoint(config.output_dir) is None:
        return
    if not config.overwrite_output:
        raise ConfigError(f"{config.output_dir} already holds checkpoints: pass --resume, or set "
                          "overwrite_output=true, or choose another output_dir")
    shutil.rmtree(checkpoints_dir(config.output_dir))
    metrics_path(config.output_dir).unlink(missing_ok=True)


def load_targets(config: TrainConfig, devices: list[torch.device], dtype: torch.dtype) -> list[Target]:
    """The frozen target, one replica per device given, loaded (or, with random_target, built) one at a time
    in this thread."""
    if config.random_target:
        return [random_target(config.random_target, device, dtype, config.target_layers or None, config.seed)
                for device in devices]
    if config.build_tiny:
        from training.tiny import ensure_tiny

        ensure_tiny(config.target_path, config.data_path, config.eval_data_path, config.seed)
    if not (Path(config.target_path).expanduser() / "config.json").is_file():
        raise ConfigError(f"target_path {config.target_path} is not a model directory (no config.json)")
    return [Target.load(config.target_path, device, dtype, config.target_layers or None) for device in devices]


def load_data(config: TrainConfig, tokenizer) -> tuple[BatchStream, list[list[dict]], dict]:
    """The training micro-batches, the held-out conversations evaluation drafts on (eval_data_path, else
    the tail of the training data, through the tokenized cache; with random_target, synthetic conversations
    that fill max_length, tokenized here), and what identifies the training data (the tokenized cache's key:
    the data file's sha256, the tokenizer, the template options; and the count kept). Bad lines stop the run,
    or with skip_bad_data are skipped; they and the conversations the recipe drops (under 2 x block_size loss
    tokens) are counted in one line."""
    if config.random_target:
        conversations = synthetic_conversations(NUM_RANDOM_CONVERSATIONS + config.eval_prompts, config.max_length,
                                                config.seed)
        cut = len(conversations) - config.eval_prompts
        sequences = prepare_sequences(tokenizer, conversations[:cut], config.max_length, config.block_size,
                                      {"enable_thinking": config.enable_thinking})
        held_out = conversations[cut:]
        data_id = {"synthetic conversations of seed": config.seed}
    else:
        data = load_training_data(tokenizer, config, log=say)  # tokenised once, then read from its cache
        sequences, held_out = data.sequences, data.held_out
        # What decides the ids (not the path, nor the libraries' versions when the tokenizer is the same).
        data_id = {key: data.tokenized.index["fields"][key] for key in
                   ("data_sha256", "tokenizer", "max_length", "template_options", "skip_bad_data")}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    stream = BatchStream(sequences, config.micro_batch_rows(), config.buckets(), config.block_size,
                         config.num_anchors, pad_id, config.seed)
    return stream, held_out, {**data_id, "sequences kept": len(sequences)}


def build_drafters(config: TrainConfig, target: Target, devices: list[torch.device]) -> list[Drafter]:
    """Identical drafter replicas, one per drafter device, on the target's frozen embedding and LM head."""
    drafter_config = DrafterConfig.from_target(target.config, config.num_draft_layers, config.block_size,
                                               target.layers, target.mask_token_id)
    embedding = target.model.get_input_embeddings().weight.to(devices[0])
    lm_head = target.model.get_output_embeddings().weight.to(devices[0])
    torch.manual_seed(config.seed)  # here, so that building the tiny world first changes nothing
    # Initialised in place: a 1 B-parameter drafter is slow to init on a CPU.
    with torch.device(devices[0]):
        drafter = Drafter(drafter_config, embedding, lm_head)
    return [drafter] + [copy.deepcopy(drafter).to(device) for device in devices[1:]]


def restore_checkpoint(config: TrainConfig, checkpoint: Path | None, replicas: list[DrafterReplica],
                       stream: BatchStream) -> int:
    """The step to go on from: `checkpoint`'s (the latest one), loaded into every replica and the data stream;
    0 when there is none. With another max_steps than the checkpoint's, the learning rate continues from the
    checkpoint's to 0 at the new end (CosineSchedule)."""
    if checkpoint is None:
        say(f"no checkpoint in {checkpoints_dir(config.output_dir)}: starting at step 0")
        return 0
    trained = checkpoint_train_config(checkpoint)
    for replica in replicas:
        # The checkpoint's own schedule (from its config; its scheduler state, when it has one, restores it
        # exactly, continuations included).
        replica.schedule.plan(trained.get("max_steps", config.max_steps),
                              trained.get("warmup_ratio", config.warmup_ratio))
        restored = load_checkpoint(checkpoint, replica.drafter, replica.optimizer, replica.scheduler)
        ended = replica.schedule.max_steps
        rescheduled = ended != config.max_steps and config.max_steps > restored["step"]
        if rescheduled:
            replica.continue_schedule(restored["step"], config.max_steps)
    stream.load_state_dict(restored["data"])
    say(f"resumed from {checkpoint} at step {restored['step']}")
    if rescheduled:
        leader = replicas[0]
        say(f"max_steps {ended} -> {config.max_steps}: the learning rate decays from "
            f"{leader.optimizer.param_groups[0]['lr']:.3e} at step {restored['step'] + 1} to 0 at step "
            f"{config.max_steps}")
    return restored["step"]


def peak_memory_gib(devices: list[torch.device]) -> dict[str, float]:
    """Peak memory so far per device: allocated by torch on each GPU; the process's peak RSS for the CPU."""
    peaks = {}
    for device in dict.fromkeys(devices):
        if device.type == "cuda":
            peaks[str(device)] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        else:
            peaks[str(device)] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    return peaks


class StepLog:
    """The run's numbers. Built once; `start` before the first step, `steady` when the pipeline's threads have
    warmed up, `after_step` after every step (in the leader drafter thread): loss, accuracy, tokens and
    counted FLOPs add up over a window (loss and accuracy over the steps that updated; skipped ones are
    counted), and every `log_every`-th step (and the last) writes one metrics record, the JSON line and the
    progress line, with the layout and each device's peak memory; every `eval_every`-th step (and the last)
    adds the acceptance length τ on the held-out prompts. In a multi-node run the nodes exchange their window's
    tokens, FLOPs and busy fractions at each record: node 0's record is the run's (and evaluates), each other
    node writes its own figures to its own file (metrics_path)."""

    def __init__(self, config: TrainConfig, leader: DrafterReplica, batches: StepBatches, target: Target,
                 held_out: list[list[dict]], layout: Layout, devices: list[torch.device],
                 choice: Choice | None = None, nodes: Nodes | None = None):
        self.config, self.leader, self.batches = config, leader, batches
        self.layout, self.devices, self.choice, self.nodes = layout, devices, choice, nodes
        node = 0 if nodes is None else nodes.rank
        self.metrics = MetricsLog(metrics_path(config.output_dir, node), config.max_steps)
        self.evalset = None
        if config.eval_every and held_out and node == 0:
            prompts = eval_prompts(target.tokenizer, held_out, {"enable_thinking": config.enable_thinking})
            self.evalset = build_eval_set(target, prompts, config.eval_new_tokens, leader.device)
        self.skipped_total = 0  # steps skipped for a non-finite loss or gradient, since this process started
        self._records = 0
        self._open_window()

    def start(self, step: int) -> None:
        """On a fresh run, the untrained drafter's τ: the baseline every later one is compared with."""
        if step == 0 and self.evalset is not None:
            self.metrics.write(0, acceptance_length=self.evaluate())
        self._open_window()

    def steady(self) -> None:
        """Every thread has compiled and warmed up: time from here (the first window leaves warm-up out)."""
        self._start = time.time()

    def after_step(self, report: StepReport, utilisation: Callable[[], Utilisation]) -> None:
        """Count step `report.step`; `utilisation` (the pipeline's, since its previous call) is asked once a
        window."""
        done, last = report.step, report.step == self.config.max_steps
        if report.skipped is None:
            self._loss += report.loss
            self._accuracy += report.metrics["accuracy"]
            self._steps += 1
        else:
            self._skipped += 1
            self.skipped_total += 1
        tokens, flops = self.batches.pop_tokens(done - 1)
        self._tokens += tokens
        self._flops += flops
        record = {}
        if done % self.config.log_every == 0 or last:
            record = self._close_window(report, utilisation())
        if self.evalset is not None and (done % self.config.eval_every == 0 or last):
            record["acceptance_length"] = self.evaluate()
        if record:
            self.metrics.write(done, **record)

    def evaluate(self) -> float:
        return acceptance_length(self.leader.drafter, self.evalset, self.leader.dtype)

    def _open_window(self) -> None:
        self._loss, self._accuracy, self._steps, self._skipped = 0.0, 0.0, 0, 0
        self._tokens, self._flops = 0, 0.0
        self._start = time.time()

    def _close_window(self, report: StepReport, utilisation: Utilisation) -> dict:
        elapsed = max(time.time() - self._start, 1e-9)
        tokens_per_s, tflops_per_s = self._tokens / elapsed, round(self._flops / elapsed / 1e12, 3)
        spread = {}
        if self.nodes is not None:
            mine = {"node": self.nodes.rank, "tokens_per_s": round(tokens_per_s, 1), "tflops_per_s": tflops_per_s,
                    "busy": utilisation.as_metrics()["busy"], "all_reduce_ms": self.nodes.take_all_reduce_ms()}
            spread = {"node": self.nodes.rank, "all_reduce_ms": mine["all_reduce_ms"]}
            everyone = self.nodes.gather(mine, f"step {report.step}'s metrics")
            if self.nodes.leader:
                tokens_per_s = sum(node["tokens_per_s"] for node in everyone)
                tflops_per_s = round(sum(node["tflops_per_s"] for node in everyone), 3)
                spread = {"nodes": everyone}
        record = {"lr": self.leader.last_lr, "tokens_per_s": tokens_per_s, "tflops_per_s": tflops_per_s,
                  "skipped_steps": self._skipped, "skipped_steps_total": self.skipped_total,
                  **utilisation.as_metrics(), "layout": self.layout.name,
                  "peak_memory_gib": peak_memory_gib(self.devices), **spread}
        if self._steps:  # a window of skipped steps only has no loss (JSON has no NaN)
            record.update(loss=self._loss / self._steps, accuracy=self._accuracy / self._steps)
        if report.skipped is None:
            record["grad_norm"] = report.grad_norm
        if self.choice is not None:
            record["predicted_tokens_per_s"] = round(self.choice.chosen.tokens_per_s, 1)
        if self._records == 0:  # the whole layout once, and auto's measurements and candidates
            record["layout_detail"] = self.layout.as_dict()
            if self.choice is not None:
                record["layout_auto"] = self.choice.as_dict()
        elif self._records == 1 and self.choice is not None:  # the first window without the pipeline's fill
            say(f"layout auto: {self.layout.name}: measured {tokens_per_s:.0f} tokens/s, predicted "
                f"{self.choice.chosen.tokens_per_s:.0f}")
        self._records += 1
        self._open_window()
        return record


class NonFiniteSteps(RuntimeError):
    """max_bad_steps steps in a row had a non-finite loss or gradient: the run stops (TrainExit.NON_FINITE)."""


class BadStepGuard:
    """Steps the pipeline skipped for a non-finite loss or gradient (no update; the data moves on). Built
    once; `after_step` after every step (in the leader drafter thread) says each one, and the `max_bad_steps`-th
    in a row raises NonFiniteSteps, which stops every thread. The count starts again on resume."""

    def __init__(self, max_bad_steps: int):
        self.max_bad_steps = max_bad_steps
        self.in_a_row = 0

    def after_step(self, report: StepReport) -> None:
        if report.skipped is None:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        if self.in_a_row >= self.max_bad_steps:
            raise NonFiniteSteps(
                f"step {report.step}: non-finite {report.skipped}; {self.in_a_row} steps in a row skipped "
                f"(max_bad_steps={self.max_bad_steps}); the weights are those after step "
                f"{report.step - self.in_a_row}, the latest checkpoint is intact")
        warn(f"step {report.step}: non-finite {report.skipped}: update skipped ({self.in_a_row} in a row, "
             f"max_bad_steps={self.max_bad_steps})")


class CheckpointPolicy:
    """When the run goes to disk. Built once; `after_step` after every step (in the leader drafter thread)
    saves every `save_every`-th step and the last; `close` at the end saves the final step unless it is saved
    already (a stop). A checkpoint holds the leader replica (the replicas are identical) and the data
    position of its own step. One that cannot be written raises CheckpointWriteError (exit 4), or with
    on_checkpoint_error=warn, for any but the run's last, is a warning, and the run goes on. In a multi-node
    run only node 0 writes (`writes`); the others' replicas are the same."""

    def __init__(self, config: TrainConfig, leader: DrafterReplica, batches: StepBatches, step: int,
                 writes: bool = True):
        self.config, self.leader, self.batches, self.writes = config, leader, batches, writes
        self.saved_step = step  # where the run starts is on disk already (or step 0: nothing to keep)

    def due(self, step: int) -> bool:
        return step % self.config.save_every == 0 or step == self.config.max_steps

    def after_step(self, step: int) -> None:
        if self.writes and self.due(step):
            self.save(step, last=step == self.config.max_steps)

    def close(self, step: int) -> None:
        if self.writes and step != self.saved_step:
            self.save(step, last=True)

    def save(self, step: int, last: bool = False) -> None:
        """Write step's checkpoint; `last`: the run ends with it, so it cannot be skipped with a warning."""
        leader = self.leader
        try:
            save_checkpoint(self.config.output_dir, step, leader.drafter, leader.optimizer, leader.scheduler,
                            self.batches.state_before(step), self.config.to_dict(), self.config.keep_checkpoints)
        except CheckpointWriteError as err:
            if last or self.config.on_checkpoint_error != "warn":
                raise
            warn(f"{err}; the run goes on (on_checkpoint_error=warn), the next save tries again")
            return
        self.saved_step = step


def say_compile_counters(attention: SharedFlexAttention) -> None:
    """The proof of the compile discipline, in the run's log (ARCHITECTURE §6; bench/cold_launches.py reads it)."""
    stats = attention.stats()
    say(f"compiled flex_attention: {stats.compiled_calls} calls, {stats.compiles_after_warmup} compiles "
        f"after warm-up, {stats.eager_runs} eager runs, {stats.fx_traces_after_warmup} FX traces after "
        f"warm-up, FX tracing flag {stats.fx_tracing_flag}")


TRIAL_BATCHES = 4  # micro-batches the layout trial times each stage on (the first is warm-up)


def layout_trial(config: TrainConfig, devices: list[torch.device], target: Target, replica: DrafterReplica,
                 stream: BatchStream, shared_flex: SharedFlexAttention | None) -> Choice:
    """topology "auto": time a target forward and a drafter step (forward + backward, no optimizer step, so
    the weights stay as built) on the run's first micro-batches, on the first device, measure their memory,
    and choose the layout (training/layout.py). The data stream is not advanced; the compiled attention is
    warmed and called within its discipline (SharedFlexAttention.trial)."""
    device = replica.device
    probe = BatchStream(stream.sequences, config.micro_batch_rows(), config.buckets(), config.block_size,
                        config.num_anchors, stream.pad_id, config.seed)
    probe.load_state_dict(stream.state_dict())
    batches = [next(probe).to(device) for _ in range(TRIAL_BATCHES)]

    def drafter_step(features: torch.Tensor, batch: Batch) -> None:
        loss, _ = replica.loss(features, batch)
        loss.backward()
        for param in replica.params:
            param.grad = None

    compiled = (shared_flex.trial(device, replica._warm_up_mask, projected_qkv) if shared_flex is not None
                else contextlib.nullcontext())
    with compiled:
        measured = measure_stages(device, batches, config.micro_batch_rows(),
                                  lambda batch: target.features(batch.input_ids), drafter_step)

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    rows = config.micro_batch_rows()
    profile = StageProfile(
        target_s=measured["target_s"], drafter_s=measured["drafter_s"], rows=rows,
        tokens_per_sequence=sum(b.num_tokens for b in batches) / (len(batches) * rows),
        target_static=nbytes([*target.model.parameters(), *target.model.buffers()]),
        target_peak=int(measured["target_peak"]),
        # fp32 weights and AdamW's two fp32 moments (the gradients are in the measured peak), frozen tables.
        drafter_static=nbytes(replica.drafter.buffers()) + sum(p.numel() * (p.element_size() + 8)
                                                               for p in replica.params),
        drafter_peak=int(measured["drafter_peak"]), features=int(measured["features"]),
        device_memory={str(d): torch.cuda.get_device_properties(d).total_memory for d in devices
                       if d.type == "cuda"},
    )
    for gpu in {d for d in devices if d.type == "cuda"}:
        torch.cuda.reset_peak_memory_stats(gpu)  # the run's peaks, not the trial's
    return choose_layout([str(d) for d in devices], profile, config.micro_batches_per_step(), config.queue_depth)


@dataclass
class World:
    """What a run trains with: its layout and the replicas on it."""

    layout: Layout
    devices: list[torch.device]  # every device the layout uses
    targets: list[Target]  # one per layout.target_replica_devices entry
    replicas: list[DrafterReplica]  # one per layout.replica_devices entry; replica 0 leads
    stream: BatchStream
    held_out: list[list[dict]]
    shared_flex: SharedFlexAttention | None
    choice: Choice | None  # topology "auto": what it measured and why it chose the layout
    data_id: dict  # what identifies the training data (load_data)


def build_world(config: TrainConfig, layout: Layout | None, devices: list[torch.device], backend: str,
                dtype: torch.dtype) -> World:
    """Targets, data and drafter replicas for `layout`; for topology "auto" (layout None), one of each on the
    first device, the trial, then the rest of the chosen layout (the trial's replicas reused where it puts the
    same role on that device)."""
    place = (lambda names: [torch.device(n) for n in names])
    first = [devices[0]]
    targets = load_targets(config, place(layout.target_replica_devices) if layout else first, dtype)
    stream, held_out, data_id = load_data(config, targets[0].tokenizer)
    replica_devices = place(layout.replica_devices) if layout else first
    drafters = build_drafters(config, targets[0], replica_devices)
    shared_flex = None
    if backend == "flex":
        shared_flex = shared_flex_attention(config, drafters[0].config, replica_devices if layout else devices,
                                            dtype, threads=len(replica_devices) if layout else None)
    replicas = [DrafterReplica(d, config, backend, dtype, shared_flex) for d in drafters]
    if layout is not None:
        return World(layout, place(layout.devices), targets, replicas, stream, held_out, shared_flex, None, data_id)

    choice = layout_trial(config, devices, targets[0], replicas[0], stream, shared_flex)
    layout = choice.chosen.layout
    trial_target, trial_replica, trial_device = targets[0], replicas[0], str(devices[0])
    targets, replicas = [], []
    for name in layout.target_replica_devices:
        reuse = name == trial_device and trial_target not in targets
        targets += [trial_target] if reuse else load_targets(config, [torch.device(name)], dtype)
    for name in layout.replica_devices:
        reuse = name == trial_device and trial_replica not in replicas
        drafter = trial_replica.drafter if reuse else copy.deepcopy(trial_replica.drafter).to(torch.device(name))
        replicas.append(trial_replica if reuse else DrafterReplica(drafter, config, backend, dtype, shared_flex))
    del trial_target, trial_replica
    gc.collect()
    if devices[0].type == "cuda":
        torch.cuda.empty_cache()  # a trial replica the layout does not keep
    if shared_flex is not None:
        shared_flex.expect_threads(len(replicas))
    return World(layout, place(layout.devices), targets, replicas, stream, held_out, shared_flex, choice, data_id)


def build_pipeline(config: TrainConfig, world: World, batches: StepBatches, step: int,
                   on_step: Callable[[StepReport], None], on_steady: Callable[[], None],
                   nodes: Nodes | None = None) -> Pipeline:
    """The pipeline over the world's layout: its target, drafter and colocated entries, in the layout's order;
    in a multi-node run, over this node's share of each step."""
    layout, n_targets, n_drafters = world.layout, len(world.layout.targets), len(world.layout.drafters)
    config_ = PipelineConfig(
        target_devices=[torch.device(d) for d in layout.targets],
        drafter_devices=[torch.device(d) for d in layout.drafters],
        colocated_devices=[torch.device(d) for d in layout.colocated],
        micro_batches_per_step=len(batches.share), queue_depth=config.queue_depth,
        grad_clip=config.grad_clip, global_micro_batches_per_step=config.micro_batches_per_step(),
        # Waiting for other nodes (node 0's checkpoint or evaluation) makes no progress here: not a stall.
        stall_timeout_s=max(PipelineConfig.stall_timeout_s, config.node_sync_timeout_s + 60) if nodes else
        PipelineConfig.stall_timeout_s,
    )
    colocated = list(zip([TargetReplica(t) for t in world.targets[n_targets:]], world.replicas[n_drafters:]))
    return Pipeline(config_, [TargetReplica(t) for t in world.targets[:n_targets]], world.replicas[:n_drafters],
                    batches, start_step=step, max_steps=config.max_steps, on_step=on_step, colocated=colocated,
                    on_steady=on_steady, nodes=nodes)


def train(config: TrainConfig, resume: bool = False, stop: StopRequest | None = None,
          on_node_lost: Callable[[str], None] | None = None) -> RunResult:
    """Train to config.max_steps, or until `stop` asks; returns the steps done and whether it stopped early.

    With WORLD_SIZE > 1 in the environment this process is one node of a multi-node run (training/distributed.py,
    ARCHITECTURE §10); `on_node_lost(line)` is then called, from the heartbeat thread, when another node hangs
    or dies (the default raises nothing: `main` passes one that ends the process)."""
    stop = stop or StopRequest()  # never entered: no signal handling when called as a library

    # The world: the layout (with topology "auto", measured and chosen here), the frozen target (a replica
    # per target entry), its data, the drafter replicas; in a multi-node run, first every node.
    layout, devices, backend = pick_layout(config)
    dtype = compute_dtype(config.dtype, torch.device(layout.replica_devices[0]) if layout else devices[0])
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    env = node_env()
    nodes = None
    pipelines: list[Pipeline] = []  # the one built: a node whose own pipeline failed is ending, not losing others

    def node_lost(line: str) -> None:
        if on_node_lost is not None and not any(pipeline.failed for pipeline in pipelines):
            on_node_lost(line)

    if env is not None:
        micro_batch_share(config.micro_batches_per_step(), env.rank, env.world_size)  # refused before joining
        say(f"node {env.rank} of {env.world_size}: joining node 0 at {env.master_addr}:{env.master_port}")
        nodes = Nodes(env, timeouts_of(config), node_lost)
    try:
        result = _train(config, resume, stop, layout, devices, backend, dtype, nodes, pipelines)
    except BaseException:
        if nodes is not None:
            nodes.heartbeat.stop(wait=False)  # ending anyway: a node that ends first is not "lost"
        raise
    if nodes is not None:
        nodes.close()
    return result


def _train(config: TrainConfig, resume: bool, stop: StopRequest, layout: Layout | None,
           devices: list[torch.device], backend: str, dtype: torch.dtype, nodes: Nodes | None,
           pipelines: list[Pipeline]) -> RunResult:
    leads = nodes is None or nodes.leader  # writes checkpoints, the run's metrics and the export
    if leads:
        prepare_output_dir(config, resume)
    world = build_world(config, layout, devices, backend, dtype)
    target, leader = world.targets[0], world.replicas[0]
    say(f"target {config.random_target or config.target_path} (layers {target.layers}, {target.layers_run} of "
        f"{target.config.num_hidden_layers} run); {len(world.stream.sequences)} training sequences; attention "
        f"{backend}, {dtype}")
    say(world.choice.summary() if world.choice is not None else f"layout {world.layout.describe()}")
    say(f"drafter: {config.num_draft_layers} layers, {leader.drafter.num_trainable() / 1e6:.2f} M trainable "
        f"parameters, {len(world.replicas)} replica(s); a step is {config.micro_batches_per_step()} "
        f"micro-batches of {config.micro_batch_rows()} sequences")
    share = None
    if nodes is not None:
        share = micro_batch_share(config.micro_batches_per_step(), nodes.rank, nodes.world_size)
        nodes.form_group(leader.device, config.node_backend)
        target_config = {k: v for k, v in target.config.to_dict().items() if k != "_name_or_path"}
        trainable = [(n, p) for n, p in leader.drafter.named_parameters() if p.requires_grad]
        nodes.check_same(run_fingerprint(config.to_dict(), world.data_id, target_config,
                                         tensor_sums(target.model.named_parameters()), tensor_sums(trainable)))
        say(f"node {nodes.rank} of {nodes.world_size}: every node has the same config, data, target and drafter; "
            f"this node computes {len(share)} of each step's {config.micro_batches_per_step()} micro-batches")
    replicas_here = len(share) if share is not None else config.micro_batches_per_step()
    if replicas_here < len(world.replicas):
        say(f"note: {len(world.replicas)} replicas share {replicas_here} micro-batch(es) a step: "
            "some idle every step; raise batch_size to use them")

    # Resume: node 0's latest checkpoint, which it sends to every other node (they do not share its disk).
    step = 0
    if resume or nodes is not None:
        checkpoint = latest_checkpoint(config.output_dir) if resume and leads else None
        received = Path(config.output_dir).expanduser() / ".from-node0" / f"node{nodes.rank if nodes else 0}"
        if nodes is not None:
            checkpoint = nodes.share_checkpoint(checkpoint, received)
        if resume or checkpoint is not None:
            step = restore_checkpoint(config, checkpoint, world.replicas, world.stream)
        if not leads:
            shutil.rmtree(received, ignore_errors=True)
            with contextlib.suppress(OSError):  # empty unless another node shares this output_dir
                received.parent.rmdir()

    # Built once, called after every step, closed at the end.
    batches = StepBatches(world.stream, config.micro_batches_per_step(), step,
                          step_flops(config, target, leader.drafter.config), nan_steps=config.debug_nan_steps,
                          share=share)
    step_log = StepLog(config, leader, batches, target, world.held_out, world.layout, world.devices, world.choice,
                       nodes)
    step_log.start(step)
    bad_steps = BadStepGuard(config.max_bad_steps)
    checkpoints = CheckpointPolicy(config, leader, batches, step, writes=leads)

    def leader_works_after(done: int) -> bool:
        """Node 0 checkpoints or evaluates after step `done`: the others wait for it with the long timeout."""
        return checkpoints.due(done) or bool(config.eval_every and done % config.eval_every == 0)

    # The loop: the pipeline's threads run the steps; after each one the leader replica's thread calls this.
    def after_step(report: StepReport) -> None:
        step_log.after_step(report, pipeline.utilisation)
        bad_steps.after_step(report)
        checkpoints.after_step(report.step)
        if nodes is not None and leader_works_after(report.step):
            nodes.wait_for_leader(f"step {report.step} checkpoint or evaluation")

    if nodes is not None:
        nodes.first_step = step  # its collectives wait out every node's warm-up
    pipeline = build_pipeline(config, world, batches, step, after_step, step_log.steady, nodes)
    pipelines.append(pipeline)
    shared_flex = world.shared_flex
    try:
        # A signal while loading (on any node): nothing trained, nothing to save.
        if nodes.any_stops(stop.requested) if nodes is not None else stop.requested:
            say(f"{stop.reason() or 'another node asked to stop'}: stopped at step {step} before training")
            if nodes is not None:
                nodes.wait_for_leader("stop before training")
            return RunResult(step, stopped=True)
        result = pipeline.run(stop=stop.reason)
    finally:
        if shared_flex is not None:
            shared_flex.close()

    # Finish.
    if shared_flex is not None:
        say_compile_counters(shared_flex)
    checkpoints.close(result.steps_done)
    if not result.stopped and leads:
        export_run(config.output_dir)
    if nodes is not None:
        nodes.wait_for_leader("final checkpoint and export")
    if result.stopped:
        say(f"stopped at step {result.steps_done}; checkpoint saved in {checkpoints_dir(config.output_dir)}"
            + ("" if leads else " of node 0"))
    else:
        say(f"done: {result.steps_done} steps")
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineArgumentParser(prog="python -m training.train", description="Train a DFlash drafter.")
    parser.add_argument("--config", required=True, help="preset name (training/presets/) or TOML path")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    return parser.parse_args(argv)


class TrainExit(IntEnum):
    """The trainer's exit codes, written here and nowhere else; `main` decides which, once."""

    OK = 0  # done, or stopped by SIGTERM with a checkpoint saved
    FAILED = 1  # a thread failed (its traceback is in the log)
    BAD_INPUT = 2  # a bad configuration or bad data: one line
    NON_FINITE = 3  # max_bad_steps steps in a row with a non-finite loss or gradient: one line (step, what)
    CHECKPOINT_WRITE = 4  # a checkpoint could not be written (disk full, read-only, quota): one line (path, why)
    OUT_OF_MEMORY = 5  # a stage ran out of device memory: one line (stage, device, shapes, the keys to lower)
    NODE_LOST = 6  # another node of a multi-node run died, hung or could not be reached: one line naming it
    INTERRUPTED = 130  # stopped by Ctrl-C (checkpoint saved), or aborted by a second signal (none)


def out_of_memory_line(err: PipelineError, config: TrainConfig) -> str:
    """Which stage ran out of memory, where, on what shapes, and what lowers it."""
    stage = err.thread.rstrip("0123456789")  # "target1" -> the target stage
    batch = err.batch
    if isinstance(batch, Batch):
        rows, length = batch.input_ids.shape
        shapes = f"a micro-batch of {rows} rows x {length} tokens (length bucket), {batch.anchors.shape[1]} anchors"
    else:
        shapes = "no micro-batch (warm-up, or the step's update, evaluation or checkpoint)"
    tried = re.search(r"Tried to allocate [\d.]+ \w+", str(err.error))  # CUDA's message says how much
    keys = [f"micro_batch_size ({config.micro_batch_rows()})", f"max_length ({config.max_length}, and length_buckets)"]
    if stage != "target":  # the target's memory does not depend on the drafter's blocks
        keys += [f"num_anchors ({config.num_anchors})", f"loss_chunk_size ({config.loss_chunk_size})"]
    return (f"out of memory in the {stage} stage ({err.thread} on {err.device}) on {shapes}"
            f"{f' ({tried[0]})' if tried else ''}; lower {', '.join(keys[:-1])} or {keys[-1]}")


def thread_failure(err: PipelineError, config: TrainConfig) -> tuple[TrainExit, str]:
    """The exit code for a failed pipeline thread, and the line that says why."""
    if isinstance(err.error, NonFiniteSteps):
        return TrainExit.NON_FINITE, str(err.error)
    if isinstance(err.error, CheckpointWriteError):
        return TrainExit.CHECKPOINT_WRITE, str(err.error)
    if isinstance(err.error, torch.OutOfMemoryError):
        return TrainExit.OUT_OF_MEMORY, out_of_memory_line(err, config)
    if isinstance(err.error, NodeLost):
        return TrainExit.NODE_LOST, str(err.error)
    return TrainExit.INTERRUPTED if isinstance(err.error, KeyboardInterrupt) else TrainExit.FAILED, str(err)


def end_for_lost_node(line: str) -> None:
    """Another node hung or died: say which, and end this process now, from whichever thread (one stuck in a
    collective that will never complete cannot be joined)."""
    print(f"error: {line}", file=sys.stderr, flush=True)
    end_process(TrainExit.NODE_LOST)


def main(argv: list[str] | None = None) -> int:
    """The process: train, then the exit code (TrainExit), decided here and nowhere else."""
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.set)
        announce_output("output_dir", config.output_dir)  # for `gpuctl pull`
        # Which interpreter and torch build run this: the log's first line answers "did it use the right one?"
        say(f"python {sys.executable} ({platform.python_version()}), torch {torch.__version__} "
            f"({f'CUDA {torch.version.cuda}' if torch.version.cuda else 'a CPU-only build'})")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # progress bars would fill the run's log file with carriage returns
        with StopRequest() as stop:
            result = train(config, resume=args.resume, stop=stop, on_node_lost=end_for_lost_node)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return TrainExit.BAD_INPUT
    except CheckpointWriteError as err:  # the run's last checkpoint, saved in this thread
        print(f"error: {err}", file=sys.stderr, flush=True)
        return TrainExit.CHECKPOINT_WRITE
    except NodeLost as err:  # joining, the start's checks, or the end's wait
        end_for_lost_node(str(err))
    except PipelineError as err:  # a thread failed: one line for a known cause, else its traceback and a line
        code, line = thread_failure(err, config)
        if code in (TrainExit.FAILED, TrainExit.INTERRUPTED):
            print(err.traceback_text, end="", file=sys.stderr)
        print(f"error: {line}", file=sys.stderr, flush=True)
        return code
    except KeyboardInterrupt as interrupt:  # a second signal outside the pipeline (loading, saving)
        print(f"error: {interrupt or 'interrupted'}", file=sys.stderr, flush=True)
        return TrainExit.INTERRUPTED
    return TrainExit.INTERRUPTED if result.stopped and stop.signal == signal.SIGINT else TrainExit.OK


if __name__ == "__main__":
    run_entry_point(main)
