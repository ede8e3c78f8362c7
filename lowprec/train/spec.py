"""Training hyper-parameters that are not precision decisions."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainSpec:
    """Loop settings.

    ``batch_size`` is sequences per micro-batch; an optimizer step consumes
    ``batch_size * grad_accum * seq_len`` tokens. ``timing_warmup_steps`` steps are excluded from
    tokens/s and step time. ``val_every`` <= 0 validates only at the end. ``telemetry_every``: FP8
    numerics telemetry is sampled on steps divisible by it (0 turns it off). ``checkpoint_every``: write a
    checkpoint after every N-th step (0: never).
    """

    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    grad_accum: int = 1
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    val_every: int = 50
    val_batches: int = 8
    timing_warmup_steps: int = 3
    telemetry_every: int = 25
    checkpoint_every: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "val_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 1")
        if self.checkpoint_every < 0:
            raise ValueError(f"train.checkpoint_every={self.checkpoint_every} must be >= 0")
        if self.timing_warmup_steps >= self.steps:
            raise ValueError(
                f"train.timing_warmup_steps={self.timing_warmup_steps} must be below train.steps={self.steps}"
            )

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len
