"""A run's frozen target, loaded: the world its preset names (the tiny one, one made from a GGUF file, a random
8B-shaped one) built first where it must be."""

from __future__ import annotations

from pathlib import Path

import torch

from training.config import ConfigError, TrainConfig
from training.target.from_gguf import ensure_target_from_gguf
from training.target.frozen import Target
from training.target.random_world import random_target


def load_targets(config: TrainConfig, devices: list[torch.device], dtype: torch.dtype) -> list[Target]:
    """The frozen target, one replica per device given, loaded (or, with random_target, built) one at a time
    in this thread."""
    if config.random_target:
        return [random_target(config.random_target, device, dtype, config.target_layers or None, config.seed,
                              teacher=config.distill) for device in devices]
    if config.build_tiny:
        from training.target.tiny import ensure_tiny

        ensure_tiny(config.target_path, config.data_path, config.eval_data_path, config.seed)
    if config.target_gguf:
        ensure_target_from_gguf(config.target_path, config.target_gguf)
    if not (Path(config.target_path).expanduser() / "config.json").is_file():
        raise ConfigError(f"target_path {config.target_path} is not a model directory (no config.json)")
    return [Target.load(config.target_path, device, dtype, config.target_layers or None, config.mask_token,
                        teacher=config.distill)
            for device in devices]
