"""compile = "all": the run's compiled stages beside flex_attention, built with the world and warmed in its main
thread (ARCHITECTURE §6): the target's decoder layers and the drafter's fusion layer and layer halves.

Both are warmed before the layout trial (so topology "auto" measures the compiled stages) and before any pipeline
thread starts, so no compile overlaps a steady-state call; nothing here calls the shared flex_attention, whose
keys its own threads warm: the drafter's warm-up step attends with SDPA, and the half after attention takes one
layout whichever backend attended (training/model/drafter.py `attend_heads_last`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from training.compile.flex import spread_anchors
from training.compile.stages import (
    CompiledStage,
    compiled_drafter_stages,
    decoder_layer_forward,
    stages_of,
    warming_all,
)
from training.config import TrainConfig
from training.console import say
from training.data.chat import Batch
from training.model.step import drafter_loss
from training.target.frozen import Target

if TYPE_CHECKING:  # the replica's trainer imports this module
    from training.trainer.replicas import DrafterReplica


class CompiledRun:
    """The compiled stages of one run: built once, warmed per device, sealed before the pipeline starts."""

    def __init__(self, config: TrainConfig, target: Target, devices: int):
        self.config = config
        keys = devices * len(config.buckets())
        # dynamo may keep an entry per layer (the limits allow it); the first drafter layer's input has no
        # gradient (the frozen embedding), the others' do: two keys per device and bucket for each half.
        self.target_layers = CompiledStage("target layers", decoder_layer_forward, keys_expected=keys * target.layers_run)
        self.drafter = compiled_drafter_stages(keys_expected=2 * keys * config.num_draft_layers)
        self._drafter_devices: set[torch.device] = set()

    @property
    def stages(self) -> list[CompiledStage]:
        return [self.target_layers, *stages_of(self.drafter)]

    def warm_target(self, target: Target) -> None:
        """The target's layers through the stage, compiled for every length bucket at the micro-batch's rows on
        the target's device (the training batches' shapes)."""
        if target.layer_stage is self.target_layers:
            return  # the trial's target, warmed already
        target.compile_layers(self.target_layers)
        with self.target_layers.warming():
            for bucket in self.config.buckets():
                ids = torch.zeros(self.config.micro_batch_rows(), bucket, dtype=torch.long, device=target.device)
                target.training_features(ids)

    def warm_drafter(self, replica: DrafterReplica, dtype: torch.dtype) -> None:
        """The replica's drafter through the stages, compiled for every length bucket on its device: a training
        step (forward, loss, backward, which compiles the stages' backward) on a made-up batch of each bucket's
        shape, twice (the second runs compiled code only); the gradients it leaves are dropped."""
        replica.drafter.stages = self.drafter
        if replica.device in self._drafter_devices:
            return
        config = self.config
        with warming_all(stages_of(self.drafter)):
            for bucket in config.buckets():
                batch = warm_up_batch(config, bucket, replica.device)
                width = (replica.drafter.config.num_features + config.distill) * replica.drafter.config.hidden_size
                features = torch.randn(config.micro_batch_rows(), bucket, width, dtype=dtype, device=replica.device)
                for _ in range(2):
                    output = drafter_loss(replica.drafter, features, batch, "sdpa", config.gamma,
                                           config.loss_chunk_size, dtype, None, config.selector_loss_alpha,
                                           compiled=True, distill=config.distill)
                    output.loss.backward()
        for param in replica.params:
            param.grad = None
        self._drafter_devices.add(replica.device)

    def seal(self) -> None:
        for stage in self.stages:
            stage.seal()

    def steady(self) -> None:
        for stage in self.stages:
            stage.steady()

    def say_counters(self) -> None:
        for stage in self.stages:
            say(stage.stats().line())

    def close(self) -> None:
        for stage in self.stages:
            stage.close()


def warm_up_batch(config: TrainConfig, bucket: int, device: torch.device) -> Batch:
    """A training batch's shape for `bucket`: every token a loss token, anchors spread over the sequence."""
    rows, block = config.micro_batch_rows(), config.block_size
    anchors = spread_anchors(rows, bucket, block, config.num_anchors, device)
    ids = torch.zeros(rows, bucket, dtype=torch.long, device=device)
    return Batch(ids, torch.ones_like(ids, dtype=torch.bool), anchors, torch.ones_like(anchors, dtype=torch.bool),
                 rows * bucket)

