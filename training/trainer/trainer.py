"""The trainer: one run as an object with a lifecycle, read top to bottom in `Trainer.run`."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from training.config import TrainConfig
from training.console import say
from training.data.chat import Batch
from training.distributed import (
    Nodes,
    SingleNode,
    default_micro_batch,
    join_nodes,
    node_env,
    run_fingerprint,
    tensor_sums,
)
from training.entry import StopSignals
from training.layout.devices import compute_dtype
from training.output.checkpoint import checkpoints_dir, latest_checkpoint
from training.output.metrics import announce_output
from training.output.reporters import check_installed
from training.output.run_home import RunDir, resolve_run_dir
from training.pipeline import Pipeline, PipelineConfig, RunResult, StepReport
from training.trainer.checkpointing import prepare_output_dir, restore_checkpoint
from training.trainer.components import RunComponents
from training.trainer.replicas import TargetReplica
from training.trainer.world import World, build_world, pick_layout


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


def resolve(config: TrainConfig, resume: bool) -> tuple[RunDir, TrainConfig, str]:
    """Once, first: the run's own directory (training/output/run_home.py), said in the log and to gpuctl pull,
    and on several nodes the micro-batch size a step's batch is shared in when it is unset (said with the step's
    shape). The config comes back with both resolved."""
    check_installed(config.report_to)  # before anything is made or loaded: exit 2 at once
    run_dir = resolve_run_dir(config, resume)
    say(run_dir.line)
    announce_output("output_dir", run_dir.config.output_dir)  # for `gpuctl pull`
    env = node_env()
    config, shared_batch = default_micro_batch(run_dir.config, env.world_size if env else 1)
    return run_dir, config, shared_batch


class Trainer:
    """One run: build the world, resume, loop, finish (`run`). The world is the layout, the target's replicas,
    the data and the drafter replicas, on this node of the run's nodes (`join_nodes`: one or many, one
    interface). The components are built once after the resume, called after every step by the leader
    replica's thread (`after_step`), and closed at the end: the step log (with its evaluation), the bad-step
    guard, the checkpoint policy and the end-of-run export. Node 0 writes the run's files."""

    def __init__(self, config: TrainConfig, resume: bool = False, stop: StopRequest | None = None,
                 on_node_lost: Callable[[str], None] | None = None):
        self.resume_requested = resume
        self.stop = stop or StopRequest()  # never entered: no signal handling when called as a library
        self.on_node_lost = on_node_lost
        self.run_dir, self.config, self.shared_batch = resolve(config, resume)
        self.pipeline: Pipeline | None = None  # the heartbeat thread asks whether it failed

    def run(self) -> RunResult:
        """Train to config.max_steps, or until `stop` asks; the steps done and whether it stopped early."""
        layout, devices, backend = pick_layout(self.config)  # refused before joining any node
        dtype = compute_dtype(self.config.dtype, torch.device(layout.replica_devices[0]) if layout else devices[0])
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        with join_nodes(self.config, self._node_lost) as nodes:
            # The world, the same on every node (checked), then where it resumes from.
            world, share = self.build_world(nodes, layout, devices, backend, dtype)
            step = self.resume(nodes, world)
            # Built once, called after every step, closed at the end.
            components = RunComponents(self.config, nodes, world, share, step, self.run_dir.home)
            self.pipeline = self.build_pipeline(
                nodes, world, components.batches, share, step,
                on_step=lambda report: components.after_step(report, self.pipeline.utilisation),
                on_steady=lambda: components.on_steady(world))
            try:
                if nodes.any_stops(self.stop.requested):  # a signal while loading, on any node
                    return self.stopped_before_training(nodes, step)
                # The loop: the pipeline's threads run the steps; the leader replica's calls after_step.
                result = self.pipeline.run(stop=self.stop.reason)
            finally:
                world.close()
                components.step_log.close()
            # Finish.
            world.say_compile_counters()
            components.checkpoints.close(result.steps_done)
            components.export.close(result)
            nodes.wait_for_leader("final checkpoint and export")
            self.say_how_it_ended(nodes, result)
        return result

    def build_world(self, nodes: Nodes | SingleNode, layout, devices: list[torch.device], backend: str,
                    dtype: torch.dtype) -> tuple[World, list[int]]:
        """The layout, target, data and drafter replicas; every node checks it builds what node 0 builds. With
        the world, this node's share of each step's micro-batches."""
        config = self.config
        if nodes.leader:
            prepare_output_dir(config, self.resume_requested, self.run_dir.per_run)
        world = build_world(config, layout, devices, backend, dtype)
        target, leader = world.targets[0], world.replicas[0]
        say(f"target {config.random_target or config.target_path} (layers {target.layers}, {target.layers_run} of "
            f"{target.config.num_hidden_layers} run); {len(world.stream.sequences)} training sequences; attention "
            f"{backend}, {dtype}")
        say(world.choice.summary() if world.choice is not None else f"layout {world.layout.describe()}")
        say(f"drafter: {config.num_draft_layers} layers, {leader.drafter.num_trainable() / 1e6:.2f} M trainable "
            f"parameters, {len(world.replicas)} replica(s); a step is {config.micro_batches_per_step()} "
            f"micro-batches of {config.micro_batch_rows()} sequences{self.shared_batch}")
        share = nodes.share(config.micro_batches_per_step())
        nodes.form_group(leader.device, config.node_backend)
        nodes.check_same(lambda: self.fingerprint(world))
        if len(share) < len(world.replicas):
            say(f"note: {len(world.replicas)} replicas share {len(share)} micro-batch(es) a step: "
                "some idle every step; raise batch_size to use them")
        return world, share

    def fingerprint(self, world: World) -> dict:
        """What must be alike on every node (Nodes.check_same)."""
        target, leader = world.targets[0], world.replicas[0]
        target_config = {k: v for k, v in target.config.to_dict().items() if k != "_name_or_path"}
        trainable = [(n, p) for n, p in leader.drafter.named_parameters() if p.requires_grad]
        return run_fingerprint(self.config.to_dict(), world.data_id, target_config,
                               tensor_sums(target.model.named_parameters()), tensor_sums(trainable))

    def resume(self, nodes: Nodes | SingleNode, world: World) -> int:
        """The step to go on from: node 0's latest checkpoint (with --resume), which it sends to every other
        node (they do not share its disk), loaded into every replica and the data stream; else 0."""
        config = self.config
        latest = latest_checkpoint(config.output_dir) if self.resume_requested and nodes.leader else None
        received = Path(config.output_dir).expanduser() / ".from-node0" / f"node{nodes.rank}"
        with nodes.resume_from(latest, received) as checkpoint:
            if self.resume_requested or checkpoint is not None:
                return restore_checkpoint(config, checkpoint, world.replicas, world.stream)
        return 0

    def build_pipeline(self, nodes: Nodes | SingleNode, world: World, source: Iterable[Batch], share: list[int],
                       step: int, on_step: Callable[[StepReport], None], on_steady: Callable[[], None]) -> Pipeline:
        """The pipeline over the world's layout: its target, drafter and colocated entries, in the layout's
        order, over this node's share of each step's micro-batches from `source`."""
        config, layout = self.config, world.layout
        n_targets, n_drafters = len(layout.targets), len(layout.drafters)
        pipeline_config = PipelineConfig(
            target_devices=[torch.device(d) for d in layout.targets],
            drafter_devices=[torch.device(d) for d in layout.drafters],
            colocated_devices=[torch.device(d) for d in layout.colocated],
            micro_batches_per_step=len(share), queue_depth=config.queue_depth,
            grad_clip=config.grad_clip, global_micro_batches_per_step=config.micro_batches_per_step(),
            stall_timeout_s=nodes.stall_timeout_s(PipelineConfig.stall_timeout_s),
        )
        replicas = list(world.replicas)
        colocated = list(zip([TargetReplica(t) for t in world.targets[n_targets:]], replicas[n_drafters:]))
        nodes.begin(step)  # the first step's collectives wait out every node's warm-up
        return Pipeline(pipeline_config, [TargetReplica(t) for t in world.targets[:n_targets]],
                        replicas[:n_drafters], source, start_step=step, max_steps=config.max_steps,
                        on_step=on_step, colocated=colocated, on_steady=on_steady, nodes=nodes)

    def stopped_before_training(self, nodes: Nodes | SingleNode, step: int) -> RunResult:
        """A signal while loading (on any node): nothing trained, nothing to save."""
        say(f"{self.stop.reason() or 'another node asked to stop'}: stopped at step {step} before training")
        nodes.wait_for_leader("stop before training")
        return RunResult(step, stopped=True)

    def say_how_it_ended(self, nodes: Nodes | SingleNode, result: RunResult) -> None:
        if result.stopped:
            say(f"stopped at step {result.steps_done}; checkpoint saved in {checkpoints_dir(self.config.output_dir)}"
                + ("" if nodes.leader else " of node 0"))
        else:
            say(f"done: {result.steps_done} steps")

    def _node_lost(self, line: str) -> None:
        """From the heartbeat thread: another node hung or died. A node whose own pipeline failed is ending,
        not losing others."""
        failed = self.pipeline is not None and self.pipeline.failed
        if self.on_node_lost is not None and not failed:
            self.on_node_lost(line)


def train(config: TrainConfig, resume: bool = False, stop: StopRequest | None = None,
          on_node_lost: Callable[[str], None] | None = None) -> RunResult:
    """Train to config.max_steps, or until `stop` asks; returns the steps done and whether it stopped early.

    With WORLD_SIZE > 1 in the environment this process is one node of a multi-node run (training/distributed/,
    ARCHITECTURE §8); `on_node_lost(line)` is then called, from the heartbeat thread, when another node hangs
    or dies (the default raises nothing: `main` passes one that ends the process)."""
    return Trainer(config, resume, stop, on_node_lost).run()
