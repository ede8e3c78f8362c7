"""One optimizer step and one validation pass, the same for every recipe.

Precision reaches these functions only as objects made by ``lowprec.train.build`` (the model's modules,
``built.precision()``, the loss scaler, the optimizer); nothing here reads the recipe.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lowprec.train.build import Built
from lowprec.train.guards import preserve_buffers

Batch = tuple[torch.Tensor, torch.Tensor]
"""(inputs, targets): token ids, each (batch, seq_len) int64."""


class AnomalyError(RuntimeError):
    """The health policy failed the run (``lowprec.train.health``): the message gives the step, the anomaly and
    the policy's limit when one was exhausted; the attributes ``step``, ``loss`` and ``grad_norm`` (NaN when not
    computed) the numbers of the step that failed."""

    def __init__(self, message: str, step: int, loss: float, grad_norm: float = math.nan):
        super().__init__(message)
        self.step, self.loss, self.grad_norm = step, loss, grad_norm


class NonFiniteError(AnomalyError):
    """The loss or gradient norm became NaN/inf and the policy does not go on past it (``train.on_anomaly=fail``,
    or ``skip``/``rollback`` with their limit reached)."""


@dataclass(frozen=True)
class StepDecision:
    """What happens to a step whose gradients are ready: ``apply`` its update, or drop it; ``rollback``: the loop
    reloads the last checkpoint (``lowprec.train.health``)."""

    apply: bool = True
    rollback: bool = False


Judge = Callable[[int, float, float, bool], StepDecision]
"""``(step, loss, grad_norm, scaler_skips_nonfinite) -> StepDecision``, called after backward and clipping and
before the optimizer step; raises ``AnomalyError`` to fail the run."""


def fail_on_nonfinite(step: int, loss: float, grad_norm: float, scaler_skips: bool) -> StepDecision:
    """The default judge (``train.on_anomaly=fail`` without a health monitor): ``NonFiniteError`` for a non-finite
    loss, or a non-finite gradient norm that no loss scaler is there to skip; else apply."""
    if not math.isfinite(loss):
        raise NonFiniteError(f"loss is {loss} at step {step}", step, loss, grad_norm)
    if not math.isfinite(grad_norm) and not scaler_skips:
        raise NonFiniteError(f"grad_norm is {grad_norm} at step {step} (loss {loss:.4f})", step, loss, grad_norm)
    return StepDecision()


@dataclass
class StepResult:
    """``loss``: mean cross-entropy (nats/token) over the step's micro-batches and ranks; ``grad_norm``: total
    L2 norm of the gradients before clipping (inf/NaN on a step the loss scaler skipped). ``applied``: the
    optimizer update ran (False when the loss scaler or the health policy skipped it); ``decision``: the judge's.
    ``z_loss``: the weighted z-loss term added to the objective, averaged like ``loss`` (``None`` when
    ``train.z_loss`` is off)."""

    loss: float
    grad_norm: float
    applied: bool = True
    decision: StepDecision = field(default_factory=StepDecision)
    z_loss: float | None = None


def forward_loss(built: Built, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats/token, 0-dim FP32 tensor) of the model on inputs ``x`` and targets ``y``,
    the forward in the run's compute precision, the loss by ``built.loss_fn`` (compiled under
    ``train.compile``)."""
    with built.precision():
        logits = built.model(x)
    return built.loss_fn(logits, y)


def forward_objective(built: Built, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``forward_loss``'s cross-entropy and, from the same logits, the weighted z-loss term ``built.z_loss_fn``
    (0-dim FP32; ``None`` when the run has none)."""
    with built.precision():
        logits = built.model(x)
    z = built.z_loss_fn(logits) if built.z_loss_fn is not None else None
    return built.loss_fn(logits, y), z


def train_step(
    built: Built, micro_batches: list[Batch], grad_clip: float, step: int, judge: Judge = fail_on_nonfinite
) -> StepResult:
    """One optimizer step over ``micro_batches`` (gradient accumulation), clipping and LR update.

    Gradients are zeroed at the start so they stay inspectable after the step. The loss scaler built from the recipe
    scales the loss, unscales the gradients and decides whether the step runs (a no-op scaler for recipes without
    loss scaling). The objective is the loss plus ``built.aux_loss()`` when the model has one (the MoE sequence-wise
    balance loss) plus the z-loss term when the run has one (``built.z_loss_fn``); the reported ``loss`` is the
    cross-entropy alone. After clipping and before the optimizer step,
    ``judge`` sees the loss and the gradient norm: the default raises ``NonFiniteError`` if the loss is not finite,
    or the gradient norm is not finite and no loss scaler is there to skip the step; a health monitor may drop the
    update instead (``StepDecision.apply`` False: no optimizer step, no loss-scaler update, no LR-schedule step).
    """
    built.optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=built.device)
    z_total = torch.zeros((), device=built.device) if built.z_loss_fn is not None else None
    scaler = built.loss_scaler
    # The step context (the communication meter on sampled steps of sharded runs) covers forward, backward
    # and clipping, where every collective happens, and not the optimizer step, which torch.compile may trace.
    with built.step_context(step):
        for x, y in micro_batches:
            x, y = built.dist.shard_batch(x, y)
            x, y = x.to(built.device, non_blocking=True), y.to(built.device, non_blocking=True)
            loss, z = forward_objective(built, x, y)
            aux = built.aux_loss()  # the MoE balance loss joins the objective, not the reported loss
            objective = loss if aux is None else loss + aux
            if z is not None:  # so does the z-loss: the reported loss stays comparable with runs without it
                objective = objective + z
                z_total += z.detach()
            scaler.scale(objective / len(micro_batches)).backward()
            total += loss.detach()
        loss_value = built.dist.mean(total) / len(micro_batches)
        z_value = built.dist.mean(z_total) / len(micro_batches) if z_total is not None else None
        scaler.unscale_(built.optimizer)
        grad_norm = built.dist.clip_grad_norm_(built.model.parameters(), grad_clip)
    decision = judge(step, loss_value, grad_norm, scaler.skips_nonfinite)
    if not decision.apply:
        scaler.discard_step()
        return StepResult(loss_value, grad_norm, applied=False, decision=decision, z_loss=z_value)
    stepped = scaler.step(built.optimizer)  # with dynamic loss scaling, skipped on inf/NaN gradients
    scaler.update()
    built.scheduler.step()
    return StepResult(loss=loss_value, grad_norm=grad_norm, applied=stepped, decision=decision, z_loss=z_value)


@torch.no_grad()
def evaluate(built: Built, batches: list[Batch]) -> float:
    """Mean validation loss (nats/token) over fixed ``batches`` in the run's compute precision (each
    data-parallel rank evaluates its slice of every batch; the mean is over all of them). Buffers
    (delayed-scaling amax histories) are restored afterwards: validation never changes the training
    trajectory."""
    built.model.eval()
    try:
        losses = []
        for x, y in batches:
            x, y = built.dist.shard_batch(x, y)
            with preserve_buffers(built.model):
                losses.append(built.dist.mean(forward_loss(built, x.to(built.device), y.to(built.device))))
    finally:
        built.model.train()
    return sum(losses) / len(losses)
