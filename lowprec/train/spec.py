"""Training hyper-parameters that are not precision decisions."""

from __future__ import annotations

from dataclasses import dataclass

from lowprec.errors import ConfigError

#: Activation checkpointing modes (torchtitan's ``activation_checkpoint.mode``).
AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class TrainSpec:
    """Loop settings.

    ``batch_size`` is sequences per micro-batch; an optimizer step consumes
    ``batch_size * grad_accum * seq_len`` tokens. ``timing_warmup_steps`` steps are excluded from
    tokens/s and step time. ``val_every`` <= 0 validates only at the end. ``telemetry_every``: FP8
    numerics telemetry is sampled on steps divisible by it (0 turns it off). ``checkpoint_every``: write a
    checkpoint after every N-th step (0: never). ``keep_checkpoints``: keep only the N newest (0: all).
    ``checkpoint_on_signal``: write one when a stop signal ends the run (``lowprec.train.stop``), also with
    ``checkpoint_every`` 0.
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
    keep_checkpoints: int = 0
    checkpoint_on_signal: bool = False
    progress: bool = True
    resume_recipe_change: bool = False
    ac: str = "none"
    compile: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "val_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be >= 1")
        for name in ("warmup_steps", "checkpoint_every", "keep_checkpoints", "timing_warmup_steps", "telemetry_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be >= 0")
        if not (self.grad_clip > 0):  # also refuses NaN
            raise ConfigError(
                f"train.grad_clip={self.grad_clip} must be > 0 (a negative bound reverses the update; "
                "use inf to turn clipping off)"
            )
        if not (0.0 <= self.min_lr_ratio <= 1.0):
            raise ConfigError(
                f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1] (the final LR as a fraction of the peak)"
            )
        if self.ac not in AC_MODES:
            raise ConfigError(f"train.ac={self.ac!r} is not one of {', '.join(AC_MODES)}")
        if self.timing_warmup_steps >= self.steps:
            raise ConfigError(
                f"train.timing_warmup_steps={self.timing_warmup_steps} must be below train.steps={self.steps}"
            )

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len
