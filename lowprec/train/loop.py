"""The training loop: ``run_training`` drives ``train_step`` and hands each concern to a component that
decides its own timing (``RunMeter``, ``EffectiveInspector``, ``Validator``, ``Checkpointer``, ``HealthMonitor``).

Precision reaches the loop only as objects made by ``lowprec.train.build``; nothing here reads the recipe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from lowprec.data import TokenBatches
from lowprec.measure.spikes import SpikeRule
from lowprec.train.build import Built
from lowprec.train.checkpointer import Checkpointer, ResumePoint
from lowprec.train.ema import WeightEma
from lowprec.train.health import AnomalyEvent, HealthMonitor
from lowprec.train.inspector import Effective, EffectiveInspector
from lowprec.train.meter import RunMeter, step_bar
from lowprec.train.spec import TrainSpec
from lowprec.train.step import AnomalyError, NonFiniteError, StepResult, evaluate, forward_loss, train_step
from lowprec.train.stop import StopSignal, stop_requested
from lowprec.train.validator import Validator

# The step functions and their types are imported from here by the lab, tests and benchmarks;
# ``_loss`` is the name tests/distributed use for ``forward_loss``.
_loss = forward_loss
__all__ = [
    "AnomalyError",
    "AnomalyEvent",
    "MetricSink",
    "NonFiniteError",
    "RunResult",
    "StepHook",
    "StepResult",
    "evaluate",
    "run_training",
    "train_step",
]

StepHook = Callable[[int, Built], None]
"""Called with (step, built) before each optimizer step."""


class MetricSink(Protocol):
    """Where the loop's metrics go. A sink that buffers may also have ``flush()``, which the loop calls after each
    checkpoint it writes."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` (name -> value, units in the name: ``_s``, ``_bytes``, ``tokens_per_s``) of the
        0-based optimizer step ``step``."""


def flush_sink(sink: MetricSink) -> None:
    """``sink.flush()`` when the sink buffers (has one); nothing otherwise."""
    flush = getattr(sink, "flush", None)
    if flush is not None:
        flush()


@dataclass
class RunResult:
    """What a finished run measured. ``summary`` holds the scalar metrics logged at the end;
    ``effective_checked`` is True once the effective recipe was inspected and matched the requested one."""

    effective: Effective
    summary: dict[str, float]
    peak_kind: str
    history: list[dict[str, float]] = field(default_factory=list)
    effective_checked: bool = False


def run_training(
    built: Built,
    data: TokenBatches,
    spec: TrainSpec,
    sink: MetricSink,
    before_step: Sequence[StepHook] = (),
    on_effective: Callable[[Effective], None] = lambda eff: None,
    checkpoint_dir: str | Path | None = None,
    resume_from: str | Path | None = None,
    on_resume: Callable[[ResumePoint], None] = lambda r: None,
    spike_rule: SpikeRule = SpikeRule(),
    on_anomaly: Callable[[AnomalyEvent], None] = lambda e: None,
) -> RunResult:
    """Train for ``spec.steps`` optimizer steps (from the checkpoint ``resume_from``'s step if given),
    logging to ``sink``.

    Before the first step, ``RunMeter`` measures the bytes autograd saves for backward with one extra forward
    that no buffer sees. After the first step whose update ran, ``EffectiveInspector`` hands the effective
    recipe to ``on_effective``, then checks it (``EffectiveRecipeError``, also when no step ran an update).
    Metrics per step: ``loss`` (the cross-entropy), ``z_loss`` (under ``spec.z_loss`` > 0: the term added to the
    objective), ``grad_norm``, ``lr``, ``step_time_s``, ``tokens_per_s``, ``tokens``, the
    ``built.after_step`` hooks' metrics, ``val_loss`` (and ``val_loss_ema`` under ``spec.eval_ema``:
    ``lowprec.train.ema``, updated after every kept step) when ``Validator`` ran, ``anomaly/*`` counters at an
    anomaly's step. ``Checkpointer`` writes ``<checkpoint_dir>/step_<N>`` after every ``spec.checkpoint_every``-th step;
    ``on_resume`` receives the ``ResumePoint`` of a resumed run before its first step. After a step during which a
    stop signal arrived (``lowprec.train.stop``) it writes the checkpoint the spec asks for and raises
    ``StopSignal``. Summary: ``final_loss``, ``final_val_loss`` (and ``final_val_loss_ema``) and ``RunMeter.summary``.

    Health (``lowprec.train.health``, ``spec.on_anomaly``, ``spike_rule``): every anomaly goes to ``on_anomaly``. A
    skipped step is logged (its loss and grad norm as measured) with no update behind it; a rolled-back step is not
    logged as a step (its anomaly is), and the steps replayed from the checkpoint up to it are not logged again
    (their first pass was, with the same values: the replay is deterministic). An FP8 layer switched to high
    precision amends the effective recipe (``on_effective`` is called again). Exceptions propagate
    (``NonFiniteError``/``AnomalyError`` when the policy fails the run); every step before was logged.
    """
    health = HealthMonitor(built, spec, spike_rule, on_anomaly)
    ema = WeightEma(built.model, built.optimizer, spec.eval_ema) if spec.eval_ema is not None else None
    checkpointer = Checkpointer(built, spec, checkpoint_dir, health, ema)
    resumed = checkpointer.resume(resume_from)
    if resumed.loaded is not None:
        on_resume(resumed)  # which checkpoint was loaded, and why if it is not the one asked for
    start = resumed.step
    inspector = EffectiveInspector(built, on_effective, {**resumed.recipe_change, **health.effective()})
    meter = RunMeter(built, spec, start)
    meter.start()
    validator = Validator(built, data, spec, ema)  # after meter.start(): its val batches are part of the run's memory
    meter.probe_saved_bytes(data.train_batch(health.data.batch(start), 0))
    history: list[dict[str, float]] = []
    bar = step_bar(spec.steps, start, built.recipe.name, spec.progress)  # tqdm, or an ablation's display
    logged_through = start - 1  # steps up to here are in the sink; a rollback's replay does not log them again
    step = start
    while step < spec.steps:
        for hook in (*built.before_step, *before_step):
            hook(step, built)
        batch = health.batch(step)
        micro = [data.train_batch(batch, m) for m in range(spec.grad_accum)]
        lr = built.scheduler.get_last_lr()[0]  # the LR this step uses; train_step advances the schedule
        try:
            with inspector.recording(), meter.timed():
                res = train_step(built, micro, spec.grad_clip, step, health.judge)
        except AnomalyError:
            sink.log_metrics(health.pop_metrics(), step)  # the policy failed the run: its counters are logged
            raise
        if res.decision.rollback:
            for hook in built.after_step:
                hook(step, built)  # telemetry disarms; the dropped step's measurements are not logged
            sink.log_metrics(health.pop_metrics(), step)
            step = checkpointer.rollback().step
            bar.n = step
            bar.refresh()
            continue
        if not res.decision.apply:
            health.restore_buffers()  # a skipped step leaves no amax in the delayed-scaling histories
        inspector.after_step(res.applied)  # before the after_step hooks, while the step's gradients are untouched
        if ema is not None:  # every kept step, applied or skipped: the average's clock is the optimizer step
            ema.update()
        metrics = {"loss": res.loss, "grad_norm": res.grad_norm, "lr": lr, **meter.after_step(step, res.applied)}
        if res.z_loss is not None:  # the run has a z-loss (train.z_loss > 0): the term it added to the objective
            metrics["z_loss"] = res.z_loss
        for hook in built.after_step:
            metrics.update(hook(step, built))
        if health.observe_fp8(step, metrics) and health.effective():
            inspector.amend(health.effective())
        if step > logged_through:
            metrics.update(validator.maybe_validate(step))
            metrics.update(health.pop_metrics())
            sink.log_metrics(metrics, step)
            history.append(metrics)
            logged_through = step
        elif pending := health.pop_metrics():
            sink.log_metrics(pending, step)
        if checkpointer.due(step):
            # Every step up to the checkpoint is stored before the save starts: a kill -9 or a full disk at any
            # point of the save loses no metric a resume does not train again (flushed after the save, a kill
            # between the commit and the flush lost the steps since the last flush for good).
            flush_sink(sink)
            checkpointer.maybe_save(step)
        signum = stop_requested()
        if signum:  # a stop signal arrived during this step: it is complete, checkpoint and stop here
            bar.close()
            raise StopSignal(signum, step, checkpointer.save_on_stop(step))
        bar.update(1)
        bar.set_postfix(loss=f"{res.loss:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
        step += 1
    bar.close()
    inspector.finish(range(start, spec.steps))
    summary = {"final_loss": history[-1]["loss"], "final_val_loss": validator.last_loss, **meter.summary()}
    if ema is not None:
        summary["final_val_loss_ema"] = validator.last_loss_ema
    return RunResult(
        effective=inspector.effective,
        summary=summary,
        peak_kind=meter.peak_kind,
        history=history,
        effective_checked=inspector.checked,
    )
