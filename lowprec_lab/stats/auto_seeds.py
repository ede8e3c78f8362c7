"""``seeds=auto``: which recipes get another seed, replayed from the runs' results alone.

The ablation and the report call the same function, ``replay``, on the final validation losses by
(recipe, seed): the ablation to decide what to train next, the report (from MLflow alone) to state each recipe's
verdict at the look where it stopped, how many seeds it got and why. Because the looks are a pure function of the
results, the report cannot disagree with what the ablation did.

Procedure (rule and error control: ``lowprec_lab.stats.sequential``, Lan-DeMets O'Brien-Fleming-type alpha
spending with exact group-sequential boundaries): every recipe and the control train seeds ``s_0, s_1, s_2``
(``start`` = 3); at the look with n seeds, the recipes still running get their Holm-corrected CONSORT verdicts at
the look's level ``plan.level_at(n)`` from the seeds ``s_0..s_{n-1}`` they share with the control; a conclusive
recipe, or one at ``max_seeds``, stops there with that verdict; the others, and the control, train seed ``s_n``.

A stopped recipe's verdict keeps the interval of its look (level ``plan.level_at(n)``), but its minimum detectable
difference and seeds needed are restated at the final analysis' one-sided alpha (``plan.final_alpha``, the level at
which a recipe still open at ``max_seeds`` is judged): at the first look's level (alpha 0.00025 with 3 seeds) they
would describe a test nobody runs (an MDD ten times larger).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from lowprec_lab.stats import (
    SeedDecision,
    SpendingPlan,
    Verdict,
    minimum_detectable_difference,
    seeds_needed,
    verdicts,
)
from lowprec_lab.stats.paired import paired_effect

#: seeds before the first look (the issue's "start with 3 seeds").
START = 3


@dataclass(frozen=True)
class Look:
    """One look: ``n`` seeds, the two-sided CI level used, and per recipe still running its verdict and
    decision."""

    n: int
    level: float
    verdicts: dict[str, Verdict]
    decisions: dict[str, SeedDecision]


@dataclass(frozen=True)
class AutoSeeds:
    """The replayed procedure: every look taken, each recipe's final verdict and decision (at the look where it
    stopped, or its latest look if the ablation ended before it stopped), and the recipes that still want
    seed ``next_seed`` (empty when the procedure is over)."""

    looks: list[Look]
    final: dict[str, tuple[Verdict, SeedDecision]]
    wanting: list[str]
    next_seed: int | None
    #: the one-sided alpha of the final analysis (``plan.final_alpha``), at which ``final``'s MDD and seeds needed
    #: are stated
    final_alpha: float = 0.025
    #: the seed sequence ``s_0, s_1, ...`` of the looks (a look at n seeds uses ``seeds[:n]``)
    seeds: tuple[int, ...] = ()


def plan_for(max_seeds: int, level: float = 0.95) -> SpendingPlan:
    """The alpha-spending plan of ``seeds=auto`` with ``max_seeds``; ``ConfigError`` when ``max_seeds`` < 3."""
    return SpendingPlan.for_level(level, max_seeds=max_seeds, start=START)


def _paired(values, control, name, seeds):
    rec, ctl = [], []
    for s in seeds:
        if (name, s) in values and (control, s) in values:
            rec.append(values[(name, s)])
            ctl.append(values[(control, s)])
    return rec, ctl


def _at_final_alpha(v: Verdict, alpha: float) -> Verdict:
    """``v`` with its MDD and seeds needed at the final analysis' one-sided ``alpha`` (module docstring)."""
    e = v.effect
    return replace(
        v,
        mdd=minimum_detectable_difference(e.n, e.sd, alpha),
        seeds_needed=seeds_needed(e.mean, e.sd, v.margin, alpha) if e.n >= 2 else None,
    )


def _replay(values, control, names, seeds, plan, margin, metric, ran, bootstrap=True) -> AutoSeeds:
    looks: list[Look] = []
    final: dict[str, tuple[Verdict, SeedDecision]] = {}
    final_pairs: dict[str, tuple[list, list]] = {}
    active = list(names)
    n = plan.start
    while active:
        if not all((r, seeds[n - 1]) in ran for r in [control, *active]):
            break  # this look's seeds have not been trained yet
        results = {name: _paired(values, control, name, seeds[:n]) for name in active}
        have = {k: v for k, v in results.items() if v[0]}
        vs = verdicts(have, margin, plan.level_at(n), "holm", metric=metric, bootstrap=False) if have else {}
        strings = {name: vs[name].verdict if name in vs else "no-interval" for name in active}
        decisions = plan.next_seeds(strings, {name: n for name in active})
        looks.append(Look(n, plan.level_at(n), vs, decisions))
        for name in active:
            if name in vs:
                final[name] = (_at_final_alpha(vs[name], plan.final_alpha), decisions[name])
                final_pairs[name] = results[name]
        active = [name for name in active if decisions[name].more]
        if not active:
            break
        n += 1
    if bootstrap:  # the looks skip it (they only decide); the verdicts the report prints carry their cross-check
        for name, (v, decision) in final.items():
            final[name] = (replace(v, effect=paired_effect(*final_pairs[name], v.level)), decision)
    wanting = active if looks and active else []
    next_seed = seeds[n - 1] if wanting and n <= plan.max_seeds else None
    return AutoSeeds(looks, final, wanting, next_seed, plan.final_alpha, tuple(seeds))


def replay(
    values: Mapping[tuple[str, int], float],
    ran: set[tuple[str, int]],
    control: str,
    names: Sequence[str],
    seeds: Sequence[int],
    plan: SpendingPlan,
    margin: float,
    metric: str = "final_val_loss",
    *,
    bootstrap: bool = True,
) -> AutoSeeds:
    """Replay the looks on the results so far.

    Args:
        values: ``{(recipe, seed): value}`` of the finished, comparable runs (lower is better); a failed run is
            absent, so its seed is unpaired.
        ran: every (recipe, seed) trained, finished or failed. A look at n seeds is taken only once the control
            and every recipe still running have trained seed ``s_{n-1}``.
        control: the control recipe; names: the other recipes, in report order.
        seeds: the seed sequence ``s_0, s_1, ...`` (at least ``plan.max_seeds`` long).
        plan, margin: the spending plan and the relative margin (> 0).
        bootstrap: give each recipe's final verdict the bootstrap cross-check (``PairedEffect.disagree``) on the
            seeds of its look; False skips it (the looks never need it).

    Returns:
        ``AutoSeeds``: ``wanting``/``next_seed`` say what to train next (the control and ``wanting`` at
        ``next_seed``), empty/None when the procedure is over.

    Raises:
        ValueError: ``seeds`` shorter than ``plan.max_seeds``; ConfigError: a bad margin.
    """
    if len(seeds) < plan.max_seeds:
        raise ValueError(f"need {plan.max_seeds} seeds in the sequence (got {len(seeds)})")
    return _replay(values, control, list(names), list(seeds), plan, margin, metric, ran=set(ran), bootstrap=bootstrap)


def replay_results(
    results: Iterable[tuple[str, int, float | None]],
    control: str,
    names: Sequence[str],
    seed0: int,
    max_seeds: int,
    margin: float,
    level: float = 0.95,
) -> AutoSeeds:
    """``replay`` on the runs of an ablation, for the ablation itself and for the report alike.

    Args:
        results: ``(recipe, seed, final validation loss)`` of every run trained; the loss is None (or not finite)
            for a run that failed or is not comparable (it counts as trained, its seed unpaired).
        control, names: the control and the other recipes; seed0: the ablation's first seed (``seed``);
        max_seeds, margin, level: the plan (``plan_for``) and the relative margin.

    Raises:
        ConfigError: ``max_seeds`` < 3 or a bad margin.
    """
    plan = plan_for(max_seeds, level)
    values, ran = {}, set()
    for recipe, seed, value in results:
        ran.add((recipe, seed))
        if value is not None and math.isfinite(value):
            values[(recipe, seed)] = value
    seeds = [seed0 + i for i in range(plan.max_seeds)]
    return replay(values, ran, control, list(names), seeds, plan, margin)
