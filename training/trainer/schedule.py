"""The learning-rate schedules: linear warm-up, then a cosine decay or WSD (warm-up, stable, decay), and their
continuation when a resumed run ends elsewhere."""

from __future__ import annotations

import math

import torch


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


class WSDSchedule:
    """Warm-up, stable, decay: linear warm-up over ceil(warmup_ratio * max_steps) steps, the full rate until the
    last ceil(decay_ratio * max_steps) steps, then linearly down to 0 at max_steps.

    A checkpoint taken in the stable phase is the same run whatever its planned end: resumed with another
    max_steps (`continue_to`), the stable phase goes on and the decay moves to the new end's last fraction. A
    run resumed inside its decay decays from the rate it had to 0 at the new end. Plain-number fields, as
    CosineSchedule's, so LambdaLR's state_dict saves them."""

    def __init__(self, max_steps: int, warmup_ratio: float, decay_ratio: float):
        self.decay_ratio = decay_ratio
        self.plan(max_steps, warmup_ratio)

    def plan(self, max_steps: int, warmup_ratio: float) -> None:
        self.max_steps = max_steps
        self.warmup = math.ceil(warmup_ratio * max_steps)
        self.decay_from = max(self.warmup, max_steps - math.ceil(self.decay_ratio * max_steps))
        self.decay_factor = 1.0  # the factor the decay starts from

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if step < self.decay_from:
            return 1.0
        progress = (step - self.decay_from + 1) / (self.max_steps - self.decay_from + 1)
        return self.decay_factor * (1.0 - progress)

    def continue_to(self, step: int, max_steps: int) -> None:
        """From `step` on, end at `max_steps`: stable until its decay, or (already decaying) down from here."""
        if step <= self.decay_from:
            self.max_steps = max_steps
            self.decay_from = max(step, max_steps - math.ceil(self.decay_ratio * max_steps))
            return
        self.decay_factor = self(step - 1)
        self.decay_from, self.max_steps = step, max_steps


def make_schedule(name: str, max_steps: int, warmup_ratio: float, decay_ratio: float) -> CosineSchedule | WSDSchedule:
    """The config's `schedule`: "cosine" or "wsd"."""
    if name == "wsd":
        return WSDSchedule(max_steps, warmup_ratio, decay_ratio)
    return CosineSchedule(max_steps, warmup_ratio)


def cosine_schedule(optimizer: torch.optim.Optimizer, max_steps: int, warmup_ratio: float):
    """LambdaLR over a CosineSchedule (which the scheduler's state_dict saves and restores)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, CosineSchedule(max_steps, warmup_ratio))
