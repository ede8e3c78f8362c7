"""The training loop: one ``train_step`` for every recipe.

Precision reaches the loop only as objects made by ``lowprec.train.build`` (the model's modules,
``built.precision()``, the optimizer); nothing here reads the recipe.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lowprec.accounting import PeakMemory, measure_state_bytes
from lowprec.saved_tensors import measure_fp8_scaling_bytes, measure_saved_bytes
from lowprec.data import TokenBatches
from lowprec.train.build import Built
from lowprec.train.checkpoint import CheckpointError, check_resume_recipe, load_checkpoint, save_checkpoint
from lowprec.train.effective import EffectiveRecipeError, check_effective, expected_effective, inspect_effective, record_linear_output_dtypes
from lowprec.train.guards import preserve_buffers
from lowprec.train.spec import TrainSpec


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the message gives the step and the value."""


class MetricSink(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...


@dataclass
class StepResult:
    loss: float
    grad_norm: float


@dataclass
class RunResult:
    """What a finished run measured. ``summary`` holds the scalar metrics logged at the end;
    ``effective_checked`` is True once the effective recipe was inspected and matched the requested one."""

    effective: dict
    summary: dict[str, float]
    peak_kind: str
    history: list[dict[str, float]] = field(default_factory=list)
    effective_checked: bool = False


def _loss(built: Built, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with built.precision():
        logits = built.model(x)
    # Cross-entropy in FP32 whatever the compute dtype (torchtitan does the same).
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def train_step(built: Built, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], grad_clip: float, step: int) -> StepResult:
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
            loss = _loss(built, x.to(built.device, non_blocking=True), y.to(built.device, non_blocking=True))
            scaler.scale(loss / len(micro_batches)).backward()
            total += loss.detach()
        loss_value = built.dist.mean(total) / len(micro_batches)
        if not math.isfinite(loss_value):
            raise NonFiniteError(f"loss is {loss_value} at step {step}")
        scaler.unscale_(built.optimizer)
        grad_norm = built.dist.clip_grad_norm_(built.model.parameters(), grad_clip)
    if not math.isfinite(grad_norm) and not scaler.skips_nonfinite:
        raise NonFiniteError(f"grad_norm is {grad_norm} at step {step} (loss {loss_value:.4f})")
    scaler.step(built.optimizer)  # with dynamic loss scaling, skipped on inf/NaN gradients
    scaler.update()
    built.scheduler.step()
    return StepResult(loss=loss_value, grad_norm=grad_norm)


@torch.no_grad()
def evaluate(built: Built, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean validation loss over fixed ``batches`` in the run's compute precision (each data-parallel rank
    evaluates its slice of every batch; the mean is over all of them). Buffers (delayed-scaling amax
    histories) are restored afterwards: validation never changes the training trajectory."""
    built.model.eval()
    try:
        losses = []
        for x, y in batches:
            x, y = built.dist.shard_batch(x, y)
            with preserve_buffers(built.model):
                losses.append(built.dist.mean(_loss(built, x.to(built.device), y.to(built.device))))
    finally:
        built.model.train()
    return sum(losses) / len(losses)


StepHook = Callable[[int, Built], None]


def run_training(
    built: Built,
    data: TokenBatches,
    spec: TrainSpec,
    sink: MetricSink,
    before_step: list[StepHook] = (),
    on_effective: Callable[[dict], None] = lambda eff: None,
    checkpoint_dir: str | Path | None = None,
    resume_from: str | Path | None = None,
) -> RunResult:
    """Train for ``spec.steps`` optimizer steps, logging to ``sink``.

    Before step 0, one extra forward on step 0's first micro-batch measures the bytes autograd saves for
    backward (``lowprec.saved_tensors``); it and validation run under ``preserve_buffers``, so no buffer
    (delayed-scaling histories) sees them. The first step records each linear's output dtype; after it
    the effective recipe is inspected (no extra forward), handed to ``on_effective`` (to be recorded even
    if it is wrong), then checked (``EffectiveRecipeError`` on a mismatch); ``RunResult.effective_checked``
    says the check ran and passed. Metrics per step: ``loss``,
    ``grad_norm``, ``lr``, ``step_time_s``, ``tokens_per_s``; ``val_loss`` every ``spec.val_every`` steps
    and at the end. Summary: means over the steps after ``timing_warmup_steps``, state bytes, peak memory.
    Exceptions propagate after everything measured so far has been handed to ``sink``.

    Checkpoints: with ``checkpoint_dir`` and ``spec.checkpoint_every`` > 0, ``<checkpoint_dir>/step_<N>``
    is written after every N-th step (``lowprec.train.checkpoint``). ``resume_from`` loads one and
    continues from its step; the first resumed step is then the one inspected and measured.
    """
    start, resumed, checked = 0, {}, False
    if resume_from is not None:
        resumed = check_resume_recipe(resume_from, built.recipe, spec.resume_recipe_change)
        start = load_checkpoint(resume_from, built.model, built.optimizer, built.scheduler, built.loss_scaler)
        if start >= spec.steps:
            raise CheckpointError(f"checkpoint {str(resume_from)!r} is at step {start}; train.steps={spec.steps} leaves nothing to run")
    peak = PeakMemory(built.device)
    peak.reset()
    val_batches = data.val_batches(spec.val_batches)
    history: list[dict[str, float]] = []
    effective: dict = {}
    state = None
    timed_s, timed_steps = 0.0, 0
    first = built.dist.shard_batch(*data.train_batch(start, 0))
    with preserve_buffers(built.model):
        saved = measure_saved_bytes(lambda: _loss(built, first[0].to(built.device), first[1].to(built.device)), built.model)
    bar = tqdm(range(start, spec.steps), desc=built.recipe.name, disable=None if spec.progress else True, leave=False, dynamic_ncols=True)
    val_loss = float("nan")
    for step in bar:
        for hook in (*built.before_step, *before_step):
            hook(step, built)
        micro = [data.train_batch(step, m) for m in range(spec.grad_accum)]
        lr = built.scheduler.get_last_lr()[0]
        with record_linear_output_dtypes(built.model) if not checked else contextlib.nullcontext({}) as out_dtypes:
            t0 = time.perf_counter()
            res = train_step(built, micro, spec.grad_clip, step)
            dt = time.perf_counter() - t0
        # Inspect after the first step whose update ran: a step the loss scaler skipped (FP16 overflow at the
        # initial scale is common) has created no optimizer state yet.
        if not checked and not built.loss_scaler.last_step_skipped:
            state = measure_state_bytes(built.model, built.optimizer, built.master_params)
            effective = {**inspect_effective(built, out_dtypes), **resumed}
            on_effective(effective)
            check_effective(effective, expected_effective(built))
            checked = True
        if step - start >= spec.timing_warmup_steps:
            timed_s += dt
            timed_steps += 1
        metrics = {"loss": res.loss, "grad_norm": res.grad_norm, "lr": lr, "step_time_s": dt,
                   "tokens_per_s": spec.tokens_per_step / dt, "tokens": (step + 1) * spec.tokens_per_step}
        for hook in built.after_step:
            metrics.update(hook(step, built))
        last = step == spec.steps - 1
        if last or (spec.val_every > 0 and (step + 1) % spec.val_every == 0):
            val_loss = evaluate(built, val_batches)
            metrics["val_loss"] = val_loss
        sink.log_metrics(metrics, step)
        history.append(metrics)
        if checkpoint_dir is not None and spec.checkpoint_every > 0 and (step + 1) % spec.checkpoint_every == 0:
            save_checkpoint(Path(checkpoint_dir) / f"step_{step + 1}", built.model, built.optimizer, step + 1,
                            built.scheduler, built.loss_scaler, built.recipe)
        bar.set_postfix(loss=f"{res.loss:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
    bar.close()
    if not checked:
        raise EffectiveRecipeError(f"no optimizer step ran in steps {start}..{spec.steps - 1} (the loss scaler skipped "
                                   "every one), so the effective recipe could not be inspected")
    summary = {
        "final_loss": history[-1]["loss"],
        "final_val_loss": val_loss,
        "mean_step_time_s": timed_s / timed_steps if timed_steps else float("nan"),
        "mean_tokens_per_s": spec.tokens_per_step * timed_steps / timed_s if timed_steps else float("nan"),
        "mem_peak_bytes": (peak_bytes := peak.read()),
        "mem_peak_growth_bytes": peak_bytes - peak.baseline,
        "mem_saved_activations_bytes": saved.activations,
        "mem_saved_weight_copies_bytes": saved.weight_copies,
        "mem_fp8_scaling_state_bytes": measure_fp8_scaling_bytes(built.model),
        **state.as_metrics(),
    }
    return RunResult(effective=effective, summary=summary, peak_kind=peak.kind, history=history, effective_checked=checked)
