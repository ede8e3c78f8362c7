"""One optimizer step and one validation pass, the same for every recipe.

Precision reaches these functions only as objects made by ``lowprec.train.build`` (the model's modules,
``built.precision()``, the loss scaler, the optimizer); nothing here reads the recipe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowprec.train.build import Built
from lowprec.train.guards import preserve_buffers

Batch = tuple[torch.Tensor, torch.Tensor]
"""(inputs, targets): token ids, each (batch, seq_len) int64."""


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the message gives the step and the value, the attributes
    ``step``, ``loss`` and ``grad_norm`` (NaN when not computed) the numbers."""

    def __init__(self, message: str, step: int, loss: float, grad_norm: float = math.nan):
        super().__init__(message)
        self.step, self.loss, self.grad_norm = step, loss, grad_norm


@dataclass
class StepResult:
    """``loss``: mean cross-entropy (nats/token) over the step's micro-batches and ranks; ``grad_norm``: total
    L2 norm of the gradients before clipping (inf/NaN on a step the loss scaler skipped)."""

    loss: float
    grad_norm: float


def forward_loss(built: Built, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats/token, 0-dim FP32 tensor) of the model on inputs ``x`` and targets ``y``,
    the forward in the run's compute precision, the loss by ``built.loss_fn`` (compiled under
    ``train.compile``)."""
    with built.precision():
        logits = built.model(x)
    return built.loss_fn(logits, y)


def train_step(built: Built, micro_batches: list[Batch], grad_clip: float, step: int) -> StepResult:
    """One optimizer step over ``micro_batches`` (gradient accumulation), clipping and LR update.

    Gradients are zeroed at the start so they stay inspectable after the step. The loss scaler built from
    the recipe scales the loss, unscales the gradients and decides whether the step runs (a no-op scaler
    for recipes without loss scaling). Raises ``NonFiniteError`` before the optimizer step if the loss is
    not finite, or the gradient norm is not finite and no loss scaler is there to skip the step.
    """
    built.optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=built.device)
    scaler = built.loss_scaler
    # The step context (the communication meter on sampled steps of sharded runs) covers forward, backward
    # and clipping, where every collective happens, and not the optimizer step, which torch.compile may trace.
    with built.step_context(step):
        for x, y in micro_batches:
            x, y = built.dist.shard_batch(x, y)
            loss = forward_loss(built, x.to(built.device, non_blocking=True), y.to(built.device, non_blocking=True))
            scaler.scale(loss / len(micro_batches)).backward()
            total += loss.detach()
        loss_value = built.dist.mean(total) / len(micro_batches)
        if not math.isfinite(loss_value):
            raise NonFiniteError(f"loss is {loss_value} at step {step}", step, loss_value)
        scaler.unscale_(built.optimizer)
        grad_norm = built.dist.clip_grad_norm_(built.model.parameters(), grad_clip)
    if not math.isfinite(grad_norm) and not scaler.skips_nonfinite:
        raise NonFiniteError(
            f"grad_norm is {grad_norm} at step {step} (loss {loss_value:.4f})", step, loss_value, grad_norm
        )
    scaler.step(built.optimizer)  # with dynamic loss scaling, skipped on inf/NaN gradients
    scaler.update()
    built.scheduler.step()
    return StepResult(loss=loss_value, grad_norm=grad_norm)


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
