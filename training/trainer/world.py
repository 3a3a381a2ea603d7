"""The world a run trains with: its layout (topology "auto" measured and chosen here), the frozen target's
replicas, the data, the drafter replicas."""

from __future__ import annotations

import contextlib
import copy
import gc
from dataclasses import dataclass

import torch

from training.compile.flex import SharedFlexAttention, projected_qkv
from training.compile.run import CompiledRun
from training.compile.stages import resolve_compile
from training.config import ConfigError, TrainConfig, parse_devices
from training.console import say
from training.data.chat import Batch, BatchStream
from training.data.load import load_data
from training.layout.devices import check_devices
from training.layout.roles import (
    Choice,
    Layout,
    RoleProfile,
    choose_layout,
    explicit_layout,
    layout_from_topology,
    measure_roles,
    measure_shared,
)
from training.model.attention import resolve_backend
from training.model.dflash2 import build_drafter
from training.model.drafter import Drafter, DrafterConfig
from training.serve.warm_start import WarmStart, apply_warm_start, copy_target_layers, read_warm_start
from training.target.frozen import Target
from training.target.load import load_targets
from training.trainer.replicas import DrafterReplica, shared_flex_attention


def pick_layout(config: TrainConfig) -> tuple[Layout | None, list[torch.device], str]:
    """The layout (None for topology "auto", which a trial decides), the devices it may use, and the
    attention backend, checked against this machine."""
    layout = explicit_layout(config.target_devices, config.drafter_devices, config.colocated_devices)
    if layout is None and config.topology != "auto":
        layout = layout_from_topology(config.topology, parse_devices(config.devices, "devices"))
    names = list(layout.devices) if layout is not None else parse_devices(config.devices, "devices")
    devices = [torch.device(name) for name in names]
    check_devices(devices)
    # Auto may put a drafter replica on any of its devices.
    replica_devices = [torch.device(d) for d in layout.replica_devices] if layout is not None else devices
    # compile = "off" compiles nothing: auto attention is then SDPA (flex with it is refused by the config)
    attention = "sdpa" if config.compile == "off" and config.attention == "auto" else config.attention
    backend = resolve_backend(attention, replica_devices[0])
    if backend == "flex" and config.sliding_window:
        raise ConfigError("sliding-window drafter layers (layer_types) train with attention=sdpa for now: the flex "
                          "block mask has no window yet")
    if backend == "flex" and any(device.type != "cuda" for device in replica_devices):
        raise ConfigError("attention=flex needs a CUDA device for every drafter (torch refuses "
                          "flex_attention's backward on the CPU); use sdpa or auto")
    return layout, devices, backend


def build_drafters(config: TrainConfig, target: Target, devices: list[torch.device],
                   warm: WarmStart | None = None) -> list[Drafter]:
    """Identical drafter replicas, one per drafter device, on the target's frozen embedding and LM head;
    with `warm` (init_from), holding its weights."""
    drafter_config = DrafterConfig.from_target(target.config, config.num_draft_layers, config.block_size,
                                               target.layers, target.mask_token_id, target.mask_token,
                                               config.layer_types, config.sliding_window, **config.dflash2_fields())
    embedding = target.model.get_input_embeddings().weight.to(devices[0])
    head = target.model.get_output_embeddings().weight
    # A tied target (SmolLM2) has one table for both: the drafter keeps one copy of it on each device.
    lm_head = embedding if head is target.model.get_input_embeddings().weight else head.to(devices[0])
    torch.manual_seed(config.seed)  # here, so that building the tiny world first changes nothing
    # Initialised in place: a 1 B-parameter drafter is slow to init on a CPU.
    with torch.device(devices[0]):
        drafter = build_drafter(drafter_config, embedding, lm_head)
    if config.init_layers == "target":
        copy_target_layers(drafter, target.model)
    apply_warm_start(drafter, warm)
    return [drafter] + [copy.deepcopy(drafter).to(device) for device in devices[1:]]


TRIAL_BATCHES = 4  # micro-batches the layout trial times each role on (the first is warm-up)


def layout_trial(config: TrainConfig, devices: list[torch.device], target: Target, replica: DrafterReplica,
                 stream: BatchStream, shared_flex: SharedFlexAttention | None) -> Choice:
    """topology "auto": time a target forward and a drafter step (forward + backward, no optimizer step, so
    the weights stay as built) on the run's first micro-batches, on the first device, measure their memory,
    then the two running at once in two threads (measured on any device; offered as a layout on GPUs), and
    choose the layout (training/layout/roles.py). The data stream is not advanced; the compiled attention is warmed
    and called within its discipline (SharedFlexAttention.trial: only this thread calls it; the pair's other
    thread runs the target, whose compiled layers are warmed already)."""
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

    def target_forward(batch: Batch) -> torch.Tensor:
        return target.training_features(batch.input_ids)

    with compiled:
        measured = measure_roles(device, batches, config.micro_batch_rows(), target_forward, drafter_step)
        shared = measure_shared(device, batches, config.micro_batch_rows(), target_forward, drafter_step,
                                steps=2 * TRIAL_BATCHES)

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    rows = config.micro_batch_rows()
    profile = RoleProfile(
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
        shared_s=shared,
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
    compiled: CompiledRun | None = None  # compile = "all": the target's and the drafter's compiled stages

    def close(self) -> None:
        """The compiled stages' discipline ends (their counters stay readable)."""
        if self.shared_flex is not None:
            self.shared_flex.close()
        if self.compiled is not None:
            self.compiled.close()

    def say_compile_counters(self) -> None:
        """The proof of the compile discipline, in the run's log (ARCHITECTURE §6; bench/cold_launches.py reads
        it)."""
        if self.compiled is not None:
            self.compiled.say_counters()
        if self.shared_flex is None:
            return
        stats = self.shared_flex.stats()
        say(f"compiled flex_attention: {stats.compiled_calls} calls, {stats.compiles_after_warmup} compiles "
            f"after warm-up, {stats.eager_runs} eager runs, {stats.fx_traces_after_warmup} FX traces after "
            f"warm-up, FX tracing flag {stats.fx_tracing_flag}")


def build_world(config: TrainConfig, layout: Layout | None, devices: list[torch.device], backend: str,
                dtype: torch.dtype) -> World:
    """Targets, data and drafter replicas for `layout`; for topology "auto" (layout None), one of each on the
    first device, the trial, then the rest of the chosen layout (the trial's replicas reused where it puts the
    same role on that device)."""
    place = (lambda names: [torch.device(n) for n in names])
    first = [devices[0]]
    warm = read_warm_start(config)  # a bad init_from before the target's weights load
    targets = load_targets(config, place(layout.target_replica_devices) if layout else first, dtype)
    stream, held_out, data_id = load_data(config, targets[0].tokenizer)
    replica_devices = place(layout.replica_devices) if layout else first
    drafters = build_drafters(config, targets[0], replica_devices, warm)
    shared_flex = None
    if backend == "flex":
        shared_flex = shared_flex_attention(config, drafters[0].config, replica_devices if layout else devices,
                                            dtype, threads=len(replica_devices) if layout else None)
    replicas = [DrafterReplica(d, config, backend, dtype, shared_flex) for d in drafters]
    compiled = None
    if resolve_compile(config.compile, targets[0].device, backend) == "all":
        sized_for = max(len(layout.target_replica_devices), len(layout.replica_devices)) if layout else len(devices)
        compiled = CompiledRun(config, targets[0], sized_for)
        warm_compiled(compiled, targets, replicas, dtype)
    if layout is not None:
        if compiled is not None:
            compiled.seal()
        return World(layout, place(layout.devices), targets, replicas, stream, held_out, shared_flex, None, data_id,
                     compiled)

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
    if compiled is not None:
        warm_compiled(compiled, targets, replicas, dtype)
        compiled.seal()
    return World(layout, place(layout.devices), targets, replicas, stream, held_out, shared_flex, choice, data_id,
                 compiled)


def warm_compiled(compiled: CompiledRun, targets: list[Target], replicas: list[DrafterReplica],
                  dtype: torch.dtype) -> None:
    """In the main thread, before the trial and any pipeline thread: every target's layers and every drafter
    replica's stages on its device (one already warmed is skipped)."""
    for target in targets:
        compiled.warm_target(target)
    for replica in replicas:
        compiled.warm_drafter(replica, dtype)
