"""The pipeline's workers: the frozen target's role and the drafter replica's (its optimizer and LR
schedule), and the run's one compiled flex_attention they share."""

from __future__ import annotations

import torch

from training.compile.flex import AttentionShape, SharedFlexAttention, projected_qkv, spread_anchors
from training.config import TrainConfig
from training.data.chat import Batch
from training.model.attention import FlexAttention
from training.model.drafter import Drafter, DrafterConfig
from training.model.mask import build_block_mask
from training.model.step import drafter_loss
from training.target.frozen import Target
from training.trainer.schedule import make_schedule


class TargetReplica:
    """The pipeline's target role on one device: the frozen target's features for a micro-batch."""

    def __init__(self, target: Target):
        self.target = target

    def features(self, batch: Batch) -> torch.Tensor:
        return self.target.training_features(batch.input_ids)


class DrafterReplica:
    """The pipeline's drafter role on one device: a drafter replica with its optimizer and LR schedule.

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
        self.schedule = make_schedule(config.schedule, config.max_steps, config.warmup_ratio, config.decay_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        self.last_lr = self.optimizer.param_groups[0]["lr"]  # the rate of the latest step

    def trainable_parameters(self) -> list[torch.Tensor]:
        return self.params

    def parameter_names(self) -> list[str]:
        return [name for name, p in self.drafter.named_parameters() if p.requires_grad]

    def loss(self, features: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        output = drafter_loss(self.drafter, features, batch, self.backend, self.config.gamma,
                               self.config.loss_chunk_size, self.dtype, self.flex_attention,
                               self.config.selector_loss_alpha, compiled=True, distill=self.config.distill)
        # The weighted sum (a mean times its weight: the gradient of sum(w * CE), to within rounding), which the
        # pipeline divides by the step's total weight (see DrafterWorker.loss).
        return output.loss * output.weight, {"accuracy": output.accuracy, "weight": output.weight}

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
        anchors = spread_anchors(shape.batch, context, block, shape.q_len // block, device)
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
