"""Learning-rate schedule: linear warmup then cosine decay to ``min_lr_ratio * lr``."""

from __future__ import annotations

import math

import torch


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier for optimizer step ``step`` (0-based): ramps (step+1)/warmup, then cosine."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, warmup_steps, total_steps, min_lr_ratio)
    )
