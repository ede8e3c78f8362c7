"""``lowprec ablate ... dry_run=true [gpus=8] [hardware=h100]``: the plan of an ablation, without training.

Runs (recipes x seeds), where each worker trains (``lowprec_lab.plan.placement``), steps and tokens per run, the
corpus and how many epochs a run sees of it, and the predicted wall time from the cost model
(``lowprec.estimate.cost_model.step_cost``, what ``lowprec estimate`` prints) on the named or detected part. The
prediction counts training steps only (no validation, compile time or start-up) and schedules the runs in their
order onto the workers, each run as long as its recipe's predicted step time x steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lowprec.errors import ConfigError, UserError
from lowprec.estimate.cost_model import Layout, step_cost
from lowprec.estimate.hardware import Hardware
from lowprec.estimate.runnable import hardware_blocker
from lowprec.model import ModelArgs
from lowprec.model.moe import MoEArgs
from lowprec.parallel import ParallelDims
from lowprec.recipe import Recipe
from lowprec.train.build import compile_blocker
from lowprec.train.spec import TrainSpec
from lowprec_lab.plan.auto_train import resolve_compile_ac
from lowprec_lab.plan.placement import Placement
from lowprec_lab.plan.plan import seeds_by_count
from lowprec_lab.plan.preflight import PREPARE_HINT


@dataclass(frozen=True)
class Corpus:
    """What the plan knows of the corpus: ``train_tokens`` (None: not prepared yet) and its description."""

    train_tokens: int | None
    description: str
    allow_epochs: bool = False


def epochs_error(tokens_per_run: int, corpus: Corpus) -> str | None:
    """The one-line refusal for a run that would see the corpus more than once (unless ``allow_epochs``)."""
    if corpus.train_tokens is None or corpus.allow_epochs or tokens_per_run <= corpus.train_tokens:
        return None
    return (
        f"each run trains on {tokens_per_run:,} tokens but the corpus has {corpus.train_tokens:,} "
        f"({tokens_per_run / corpus.train_tokens:.2f} epochs): use a larger corpus ({PREPARE_HINT}), fewer "
        "train.steps, or data.allow_epochs=true to repeat data"
    )


def _step_s(model: ModelArgs, recipe: Recipe, hw: Hardware, dims: ParallelDims, spec: TrainSpec, device: str, asked):
    """Predicted seconds per step of ``recipe`` and the compile/ac it resolves to (``asked``: the requested
    ``(compile, ac)``), or a reason string instead of the seconds."""
    moe = isinstance(model, MoEArgs)
    blocker = compile_blocker(recipe, spec.telemetry_every, device)
    r = resolve_compile_ac(*asked, device, moe, blocker)
    why = hardware_blocker(recipe, hw)
    if why is not None:
        return f"not runnable on {hw.name}: {why}", r
    dp = dims.dp_shard * dims.dp_replicate
    batch = max(spec.batch_size // dp, 1) * spec.grad_accum
    try:
        lo = Layout(dims.dp_shard, dims.tp, batch, spec.seq_len, r.ac, r.compile)
        return step_cost(model, recipe, hw, lo).step_time_s, r
    except (ValueError, UserError) as e:
        return f"no prediction: {e}", r


def _dur(seconds: float) -> str:
    """``"43.8 min"``, or ``"12 s"`` under a minute."""
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _makespan(durations: Sequence[float], workers: int) -> float:
    """Wall time of ``durations`` run in order, each on the first free of ``workers`` slots."""
    free = [0.0] * max(workers, 1)
    for d in durations:
        i = free.index(min(free))
        free[i] += d
    return max(free)


def plan_text(
    model_name: str,
    model: ModelArgs,
    recipes: Sequence[Recipe],
    seeds: Mapping[str, Sequence[int]],
    spec: TrainSpec,
    dims: ParallelDims,
    placement: Placement,
    corpus: Corpus,
    hardware: Hardware | None,
    hardware_source: str,
    auto_seeds: int | None = None,
    asked: tuple = ("auto", "auto"),
) -> str:
    """The dry run's text. ``seeds``: per recipe name, the seeds it trains first; ``spec``: the run's loop
    settings; ``asked``: ``(train.compile, train.ac)`` as requested
    (``auto`` resolved here for ``placement.device_type``); ``hardware``: the part predicted for (None: no
    prediction, e.g. a CPU plan); ``auto_seeds``: ``max_seeds`` when ``seeds=auto`` (the first seeds are planned,
    the most is said).

    Raises ``ConfigError`` for a corpus smaller than one run's tokens without ``data.allow_epochs``."""
    tokens = spec.steps * spec.tokens_per_step
    err = epochs_error(tokens, corpus)
    if err:
        raise ConfigError(err)
    counts = [len(seeds[r.name]) for r in recipes]
    runs = sum(counts)
    each = f"{counts[0]} seed(s)" if len(set(counts)) == 1 else f"{min(counts)}-{max(counts)} seeds"
    lines = [
        f"dry run: {len(recipes)} recipe(s) x {each} = {runs} runs on model={model_name} "
        f"({model.n_layers} layers, dim {model.dim})"
        + (f"; seeds=auto may add seeds up to {auto_seeds} per recipe" if auto_seeds else ""),
        *(
            [f"seeds per recipe: {seeds_by_count({r.name: len(seeds[r.name]) for r in recipes})}"]
            if len(set(counts)) > 1
            else []
        ),
        f"placement: {placement.describe()}",
        f"per run: {spec.steps} steps x {spec.tokens_per_step:,} tokens = {tokens:,} tokens"
        f" (layout {dims.short()}, {dims.world_size} rank(s))",
    ]
    if corpus.train_tokens is None:
        lines.append(f"corpus: {corpus.description}; a run needs {tokens:,} training tokens for one epoch")
    else:
        lines.append(
            f"corpus: {corpus.description}, {corpus.train_tokens:,} training tokens; each run sees "
            f"{tokens / corpus.train_tokens:.2f} epoch(s)"
        )
    if hardware is None:
        lines.append(f"predicted wall time: none ({hardware_source})")
        return "\n".join(lines)
    lines.append(f"predicted on {hardware.name} ({hardware_source}), training steps only (lowprec estimate's model):")
    per_recipe: dict[str, float | None] = {}
    for r in recipes:
        step, res = _step_s(model, r, hardware, dims, spec, placement.device_type, asked)
        setup = f"compile={res.compile}, ac={res.ac}" + (" (auto)" if "train_auto" in res.tags() else "")
        if isinstance(step, str):
            per_recipe[r.name] = None
            lines.append(f"  {r.name:<16} {setup}: {step}")
            continue
        per_recipe[r.name] = step * spec.steps
        note = f"; {res.fallback}" if res.fallback else ""
        lines.append(
            f"  {r.name:<16} {setup}: {step * 1e3:.1f} ms/step, {spec.tokens_per_step / step:,.0f} tokens/s per run, "
            f"{_dur(step * spec.steps)} per run{note}"
        )
    order = sorted({s for r in recipes for s in seeds[r.name]})  # seed-major, as the ablation trains them
    timed = [r for r in recipes if per_recipe[r.name] is not None]
    known = [per_recipe[r.name] for s in order for r in timed if s in seeds[r.name]]
    total = _makespan(known, placement.workers)
    missing = sum(len(seeds[r.name]) for r in recipes if per_recipe[r.name] is None)
    lines.append(
        f"predicted wall time: {_dur(total)} for {runs - missing} runs, {placement.workers} at a time"
        + (f" ({missing} run(s) without a prediction not counted)" if missing else "")
    )
    return "\n".join(lines)
