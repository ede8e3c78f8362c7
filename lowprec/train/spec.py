"""Training hyper-parameters that are not precision decisions."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lowprec.errors import ConfigError

#: Activation checkpointing modes (torchtitan's ``activation_checkpoint.mode``).
AC_MODES = ("none", "selective", "full")
#: ``train.on_anomaly``: what a non-finite loss or grad norm, or a loss spike, does (``lowprec.train.health``).
ANOMALY_POLICIES = ("fail", "skip", "rollback")
#: ``train.fp8_fallback``: ``layer`` switches an FP8 linear that keeps saturating or flushing to BF16.
FP8_FALLBACKS = ("off", "layer")


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

    Health (``lowprec.train.health``): ``on_anomaly`` is what a non-finite loss or grad norm, or a loss spike,
    does: ``fail`` (a non-finite value fails the run, a spike is recorded), ``skip`` (that step's update is not
    applied; the run fails after ``max_consecutive_skips`` skipped steps in a row) or ``rollback`` (reload the
    last complete checkpoint and skip the step's batch, at most ``max_rollbacks`` times, then fail; needs
    ``checkpoint_every`` > 0). ``fp8_fallback=layer``: an FP8 linear whose overflow or underflow share (FP8
    telemetry, so ``telemetry_every`` > 0) is above ``fp8_fallback_threshold`` on ``fp8_fallback_samples``
    consecutive sampled steps runs in high precision for the rest of the run. ``skip_batches``: batch indices
    never trained on (``lowprec.train.data_position``; what a rollback does, by hand). ``fused_casts``: ``auto`` |
    ``on`` | ``off``, lowprec's FP8 casts as one compiled kernel each in an eager run
    (``lowprec.kernels.fused_casts.resolve_fused_casts``: ``auto`` is on for CUDA).

    ``eval_ema``: ``None`` (off) or a decay in (0, 1): the run keeps an FP32 EMA of the trained weights and every
    validation also evaluates it (``val_loss_ema``; ``lowprec.train.ema``), never changing the training trajectory.

    ``z_loss``: weight of the z-loss, ``z_loss * mean(logsumexp(logits, -1) ** 2)`` added to the training objective
    in FP32 (PaLM, Chowdhery et al. 2022, section 5; Wortsman et al. 2023, arXiv 2309.14322, section 3.2; 1e-4 is
    typical); it pulls the softmax normaliser towards 1 and keeps output logits from drifting. 0 (the default) is off
    and trains exactly as without it. The logged ``loss`` and ``val_loss`` stay the plain cross-entropy, so runs
    with and without it compare on one quantity; the added term is logged as ``z_loss``.
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
    on_anomaly: str = "fail"
    max_rollbacks: int = 3
    max_consecutive_skips: int = 10
    fp8_fallback: str = "off"
    fp8_fallback_threshold: float = 0.05
    fp8_fallback_samples: int = 3
    skip_batches: tuple[int, ...] = ()
    fused_casts: str = "auto"
    eval_ema: float | None = None
    z_loss: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "skip_batches", tuple(self.skip_batches))
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "val_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be >= 1")
        for name in ("warmup_steps", "checkpoint_every", "keep_checkpoints", "timing_warmup_steps", "telemetry_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be >= 0")
        self._check_health()
        if self.eval_ema is not None:
            check_decay(self.eval_ema)
        if not (0.0 <= self.z_loss < math.inf):  # also refuses NaN
            raise ConfigError(
                f"train.z_loss={self.z_loss} must be finite and >= 0 (the weight of mean(logsumexp(logits)**2) in "
                "the objective, e.g. 1e-4; 0 turns it off)"
            )
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

    def _check_health(self) -> None:
        if self.on_anomaly not in ANOMALY_POLICIES:
            raise ConfigError(f"train.on_anomaly={self.on_anomaly!r} is not one of {', '.join(ANOMALY_POLICIES)}")
        if self.max_rollbacks < 0:
            raise ConfigError(f"train.max_rollbacks={self.max_rollbacks} must be >= 0")
        if self.max_consecutive_skips < 1:
            raise ConfigError(f"train.max_consecutive_skips={self.max_consecutive_skips} must be >= 1")
        if self.on_anomaly == "rollback" and self.checkpoint_every == 0:
            raise ConfigError(
                "train.on_anomaly=rollback reloads the last checkpoint: set train.checkpoint_every > 0 "
                "(or use train.on_anomaly=skip)"
            )
        if self.fused_casts not in ("auto", "on", "off"):
            raise ConfigError(f"train.fused_casts={self.fused_casts!r} is not one of auto, on, off")
        if self.fp8_fallback not in FP8_FALLBACKS:
            raise ConfigError(f"train.fp8_fallback={self.fp8_fallback!r} is not one of {', '.join(FP8_FALLBACKS)}")
        if not (0.0 < self.fp8_fallback_threshold <= 1.0):
            raise ConfigError(
                f"train.fp8_fallback_threshold={self.fp8_fallback_threshold} must be in (0, 1] "
                "(a share of a tensor's elements)"
            )
        if self.fp8_fallback_samples < 1:
            raise ConfigError(f"train.fp8_fallback_samples={self.fp8_fallback_samples} must be >= 1")
        if self.fp8_fallback == "layer" and self.telemetry_every == 0:
            raise ConfigError(
                "train.fp8_fallback=layer decides from the FP8 telemetry samples: set train.telemetry_every > 0"
            )
        bad = [b for b in self.skip_batches if b < 0]
        if bad:
            raise ConfigError(f"train.skip_batches holds {bad[0]}: batch indices are >= 0")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len


def check_decay(decay: float) -> None:
    """``train.eval_ema``'s range. Raises ``ConfigError`` unless ``0 < decay < 1`` (0 would be the weights themselves,
    1 the first step's)."""
    if not (0.0 < float(decay) < 1.0):  # also refuses NaN
        raise ConfigError(f"train.eval_ema={decay} must be a decay in (0, 1), e.g. 0.99 (or null: off)")
