"""The training loop: ``run_training`` drives ``train_step`` and hands each concern to a component that
decides its own timing (``RunMeter``, ``EffectiveInspector``, ``Validator``, ``Checkpointer``).

Precision reaches the loop only as objects made by ``lowprec.train.build``; nothing here reads the recipe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tqdm.auto import tqdm

from lowprec.data import TokenBatches
from lowprec.train.build import Built
from lowprec.train.checkpointer import Checkpointer, ResumePoint
from lowprec.train.inspector import Effective, EffectiveInspector
from lowprec.train.meter import RunMeter
from lowprec.train.spec import TrainSpec
from lowprec.train.step import NonFiniteError, StepResult, evaluate, forward_loss, train_step
from lowprec.train.stop import StopSignal, stop_requested
from lowprec.train.validator import Validator

# The step functions and their types are imported from here by experiments, tests and benchmarks;
# ``_loss`` is the name tests/distributed use for ``forward_loss``.
_loss = forward_loss
__all__ = [
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
) -> RunResult:
    """Train for ``spec.steps`` optimizer steps (from the checkpoint ``resume_from``'s step if given),
    logging to ``sink``.

    Before the first step, ``RunMeter`` measures the bytes autograd saves for backward with one extra forward
    that no buffer sees. After the first step whose update ran, ``EffectiveInspector`` hands the effective
    recipe to ``on_effective``, then checks it (``EffectiveRecipeError``, also when no step ran an update).
    Metrics per step: ``loss``, ``grad_norm``, ``lr``, ``step_time_s``, ``tokens_per_s``, ``tokens``, the
    ``built.after_step`` hooks' metrics, ``val_loss`` when ``Validator`` ran. ``Checkpointer`` writes
    ``<checkpoint_dir>/step_<N>`` after every ``spec.checkpoint_every``-th step; ``on_resume`` receives the
    ``ResumePoint`` of a resumed run before its first step. After a step during which a stop signal arrived
    (``lowprec.train.stop``) it writes the checkpoint the spec asks for and raises ``StopSignal``. Summary:
    ``final_loss``, ``final_val_loss`` and ``RunMeter.summary``. Exceptions propagate; every step before was
    logged.
    """
    checkpointer = Checkpointer(built, spec, checkpoint_dir)
    resumed = checkpointer.resume(resume_from)
    if resumed.loaded is not None:
        on_resume(resumed)  # which checkpoint was loaded, and why if it is not the one asked for
    start = resumed.step
    inspector = EffectiveInspector(built, on_effective, resumed.recipe_change)
    meter = RunMeter(built, spec, start)
    meter.start()
    validator = Validator(built, data, spec)  # after meter.start(): its val batches are part of the run's memory
    meter.probe_saved_bytes(data.train_batch(start, 0))
    history: list[dict[str, float]] = []
    bar = tqdm(
        range(start, spec.steps),
        desc=built.recipe.name,
        disable=None if spec.progress else True,
        leave=False,
        dynamic_ncols=True,
    )
    for step in bar:
        for hook in (*built.before_step, *before_step):
            hook(step, built)
        micro = [data.train_batch(step, m) for m in range(spec.grad_accum)]
        lr = built.scheduler.get_last_lr()[0]  # the LR this step uses; train_step advances the schedule
        with inspector.recording(), meter.timed():
            res = train_step(built, micro, spec.grad_clip, step)
        inspector.after_step()  # before the after_step hooks, while the step's gradients are untouched
        metrics = {"loss": res.loss, "grad_norm": res.grad_norm, "lr": lr, **meter.after_step(step)}
        for hook in built.after_step:
            metrics.update(hook(step, built))
        metrics.update(validator.maybe_validate(step))
        sink.log_metrics(metrics, step)
        history.append(metrics)
        if checkpointer.maybe_save(step) is not None:
            flush_sink(sink)  # every step up to a checkpoint is stored: a kill -9 loses none a resume cannot redo
        signum = stop_requested()
        if signum:  # a stop signal arrived during this step: it is complete, checkpoint and stop here
            bar.close()
            raise StopSignal(signum, step, checkpointer.save_on_stop(step))
        bar.set_postfix(loss=f"{res.loss:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
    bar.close()
    inspector.finish(range(start, spec.steps))
    summary = {"final_loss": history[-1]["loss"], "final_val_loss": validator.last_loss, **meter.summary()}
    return RunResult(
        effective=inspector.effective,
        summary=summary,
        peak_kind=meter.peak_kind,
        history=history,
        effective_checked=inspector.checked,
    )
