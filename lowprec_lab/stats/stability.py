"""Loss-stability metrics of one run (spikes, largest excursion, non-finite events, divergence) and a per-recipe
stability verdict against the control.

Spike rule and divergence step: ``lowprec.measure.spikes`` (one definition, shared with the training loop's
online health monitor; its module docstring states the rule and how its defaults were measured).

Spike counts are events, not steps: one decaying spike flags several consecutive steps (3-8 in simulations), so a
run's count is its number of runs of consecutive flagged steps (``count_events``); the flagged steps themselves are
kept in ``loss_spike_steps``.

Largest excursion: ``max_t r_t / ema_{t-1}`` over finite steps (relative rise above the EMA, 0 if never above).

Stability verdict (``stability_verdict``): one exact permutation test over runs (Fisher 1935; Good 2005,
"Permutation, Parametric and Bootstrap Tests of Hypotheses", ch. 3) of "the recipe's runs are no less stable than the
control's". Each run contributes a vector (diverged 0/1, loss-spike events, grad-norm spike events when every run
has a grad-norm series); each component is standardised by its sd over all runs, the statistic is the largest
standardised difference of means (recipe minus control) over the components, and its null distribution is that of
every split of the runs into groups of the recipe's and the control's sizes (``MAX_SPLITS`` random splits from a
fixed seed beyond that many). The max statistic makes one test of the three (no Bonferroni), and a test over runs,
not over events, keeps its level when runs differ in how spiky they are (a seed with a bad batch order): under
identical processes for recipe and control the verdict says "less stable" with probability at most ``alpha``
(tests/unit/test_stability.py simulates it). The price: with n_r and n_c runs the smallest p-value is
``1 / C(n_r + n_c, n_r)``, 0.05 at 3 runs each, so at 3 seeds only a recipe worse in every run than every control
run can be called less stable at alpha 0.05.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lowprec.measure.spikes import (
    MAD_TO_SD,
    SpikeRule,
    SpikeScan,
    as_series,
    divergence_step,
    ema_previous,
    scan_spikes,
)

# The rule itself lives in lowprec (the training loop detects spikes online with it); it is re-exported here, where
# the lab's statistics have always imported it from.
__all__ = [
    "AS_STABLE",
    "DIVERGED",
    "LESS_STABLE",
    "NO_TEST",
    "STABILITY_VERDICTS",
    "MAD_TO_SD",
    "SpikeRule",
    "SpikeScan",
    "StabilityMetrics",
    "StabilityVerdict",
    "count_events",
    "divergence_step",
    "ema_previous",
    "scan_spikes",
    "stability_metrics",
    "stability_verdict",
]

LESS_STABLE, AS_STABLE = "less stable", "as stable"
#: A run of the recipe diverged and the permutation test does not call it less stable (too few runs to): said, never
#: read as "as stable".
DIVERGED = "diverged"
#: No split of so few runs can reach alpha (e.g. one seed a side: the smallest p is 1/2): no test is possible.
NO_TEST = "no test possible"
STABILITY_VERDICTS = (LESS_STABLE, AS_STABLE, DIVERGED, NO_TEST)
#: Beyond this many splits of the runs the permutation test draws this many random ones (fixed seed) instead.
MAX_SPLITS = 20_000
PERMUTATION_SEED = 0


def count_events(flags) -> int:
    """Spike events in a per-step boolean series (shape (T,)): runs of consecutive True steps, each counted once."""
    f = np.asarray(flags, dtype=bool)
    return int(f[0] + np.count_nonzero(f[1:] & ~f[:-1])) if f.size else 0


@dataclass(frozen=True)
class StabilityMetrics:
    """Stability of one run (spike counts in events, runs of consecutive flagged steps; ``*_steps``: the flagged
    steps; non-finite counts in steps; excursion dimensionless, 0.1 = 10% above the EMA).

    ``grad_norm_spikes`` / ``nonfinite_grad_norm`` are None when no grad-norm series was given; ``divergence_step``
    is None for a run that did not diverge.
    """

    steps: int
    loss_spikes: int
    loss_spike_steps: tuple[int, ...]
    largest_excursion: float
    nonfinite_loss: int
    divergence_step: int | None
    grad_norm_spikes: int | None = None
    grad_norm_spike_steps: tuple[int, ...] = ()
    nonfinite_grad_norm: int | None = None
    skipped_steps: int = 0

    @property
    def diverged(self) -> bool:
        """True when the run diverged (see ``divergence_step``)."""
        return self.divergence_step is not None

    def as_metrics(self) -> dict[str, float]:
        """MLflow-ready ``{name: float}``; ``stability/divergence_step`` only for a diverged run, grad-norm keys only
        when a grad-norm series was given."""
        m = {
            "stability/loss_spikes": float(self.loss_spikes),
            "stability/loss_max_excursion": float(self.largest_excursion),
            "stability/loss_nonfinite": float(self.nonfinite_loss),
            "stability/diverged": float(self.diverged),
            "stability/skipped_steps": float(self.skipped_steps),
        }
        if self.divergence_step is not None:
            m["stability/divergence_step"] = float(self.divergence_step)
        if self.grad_norm_spikes is not None:
            m["stability/grad_norm_spikes"] = float(self.grad_norm_spikes)
            m["stability/grad_norm_nonfinite"] = float(self.nonfinite_grad_norm)
        return m


def stability_metrics(
    loss, grad_norm=None, *, skipped_steps: int = 0, rule: SpikeRule = SpikeRule()
) -> StabilityMetrics:
    """Stability metrics of one run from its per-step training loss (and grad-norm) series.

    Args:
        loss: 1-D series of T training losses (nats), one per optimizer step; NaN/inf allowed.
        grad_norm: optional 1-D series of gradient norms (any length >= 1); spikes by the same rule.
        skipped_steps: steps the loss scaler skipped (passed through to the metrics).
        rule: spike and divergence parameters.

    Raises:
        ValueError: an empty or non-1-D series.
    """
    loss = as_series(loss, "loss")
    scan = scan_spikes(loss, rule)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = scan.residual / scan.ema_prev
    rel = rel[np.isfinite(rel)]
    out = dict(
        steps=int(loss.size),
        loss_spikes=count_events(scan.spike),
        loss_spike_steps=scan.spike_steps,
        largest_excursion=float(max(rel.max(initial=0.0), 0.0)),
        nonfinite_loss=int((~np.isfinite(loss)).sum()),
        divergence_step=divergence_step(loss, rule.divergence_factor),
        skipped_steps=int(skipped_steps),
    )
    if grad_norm is not None:
        g = as_series(grad_norm, "grad_norm")
        gscan = scan_spikes(g, rule)
        out.update(
            grad_norm_spikes=count_events(gscan.spike),
            grad_norm_spike_steps=gscan.spike_steps,
            nonfinite_grad_norm=int((~np.isfinite(g)).sum()),
        )
    return StabilityMetrics(**out)


@dataclass(frozen=True)
class StabilityVerdict:
    """A recipe's stability against the control: ``verdict`` is one of ``STABILITY_VERDICTS`` (``"less stable"``,
    ``"as stable"``, ``"diverged"``, ``"no test possible"``); ``reason`` says why. ``p``: the joint permutation
    test's p-value (module docstring; None when no component varies across the runs); ``p_diverged``, ``p_loss_spikes``,
    ``p_grad_norm_spikes``: each component's own permutation p-value, for reading (None when that component is
    constant or absent). The verdict is ``p <= alpha``."""

    verdict: str
    reason: str
    diverged: tuple[int, int]  # (recipe runs diverged, recipe runs)
    control_diverged: tuple[int, int]
    p_loss_spikes: float | None
    p_grad_norm_spikes: float | None
    p_diverged: float | None = None
    p: float | None = None


@functools.lru_cache(maxsize=64)
def _splits(n_r: int, n_c: int) -> np.ndarray:
    """Recipe-group indices of the splits of ``n_r + n_c`` runs, shape (splits, n_r), the observed split
    (0..n_r-1) first: all of them, or ``MAX_SPLITS`` random ones (generator seed ``PERMUTATION_SEED``)."""
    n = n_r + n_c
    if math.comb(n, n_r) <= MAX_SPLITS:
        return np.array(list(itertools.combinations(range(n), n_r)), dtype=np.intp).reshape(-1, n_r)
    rng = np.random.default_rng(PERMUTATION_SEED)
    random = np.argsort(rng.random((MAX_SPLITS, n)), axis=1)[:, :n_r]
    return np.vstack([np.arange(n_r)[None, :], random])


def smallest_pvalue(n_r: int, n_c: int) -> float:
    """The smallest p-value the permutation test can give with ``n_r`` and ``n_c`` runs: one split in all of them
    (``1 / C(n_r + n_c, n_r)``), or the observed one among ``MAX_SPLITS + 1`` beyond that many."""
    splits = math.comb(n_r + n_c, n_r)
    return 1 / splits if splits <= MAX_SPLITS else 1 / (MAX_SPLITS + 1)


def permutation_pvalues(recipe: np.ndarray, control: np.ndarray) -> tuple[float | None, list[float | None]]:
    """One-sided exact permutation test over runs that the recipe's components are larger (module docstring).

    Args:
        recipe, control: per-run components, float arrays of shapes (n_r, K) and (n_c, K).

    Returns:
        ``(p_joint, [p_k per component])``: the p-value of the max standardised difference of means, and of each
        component alone; None where no component (or that component) varies across the runs.
    """
    runs = np.vstack([recipe, control]).astype(np.float64)
    n_r, n_c = len(recipe), len(control)
    sd = runs.std(axis=0)
    varies = sd > 0
    if not varies.any():
        return None, [None] * runs.shape[1]
    z = runs[:, varies] / sd[varies]
    splits = _splits(n_r, n_c)
    # mean(recipe group) - mean(control group) of every split, from the recipe group's sum alone
    diff = z[splits].sum(axis=1) * (1 / n_r + 1 / n_c) - z.sum(axis=0) / n_c
    tol = 1e-9  # equal statistics computed through different sums count as ties
    each = (diff >= diff[0] - tol).mean(axis=0)
    best = diff.max(axis=1)
    joint = float((best >= best[0] - tol).mean())
    out: list[float | None] = [None] * runs.shape[1]
    for k, i in enumerate(np.flatnonzero(varies)):
        out[i] = float(each[k])
    return joint, out


def stability_verdict(
    recipe_runs: Sequence[StabilityMetrics], control_runs: Sequence[StabilityMetrics], alpha: float = 0.05
) -> StabilityVerdict:
    """The recipe's stability against the control's runs, in this order:

    - ``"less stable"`` when the recipe's runs diverge or spike more than the control's by the exact permutation
      test over runs (module docstring) at ``alpha``;
    - ``"diverged"`` when any run of the recipe diverged but the test does not say less stable (one diverged run
      of 8 against none gives p = 1/2): a divergence is always said, never read as "as stable";
    - ``"no test possible"`` when no split of so few runs can reach ``alpha`` (``smallest_pvalue``: 1/2 with one
      run a side, 1/6 with two);
    - else ``"as stable"`` (no evidence of worse, not proof of equal).

    Components of each run: diverged (0/1), loss-spike events, and grad-norm spike events when every run has a
    grad-norm series. With 3 runs each the smallest p-value is 1/20 = 0.05: a recipe that diverged in all 3 runs
    (or spiked more in each than every control run) against a control that never did is less stable at 0.05; one
    diverged run of 3 is ``diverged``, and [5, 0, 0] spike events against [0, 0, 0] ``as stable``.

    Raises:
        ValueError: no recipe or no control runs, or alpha not in (0, 1).
    """
    if not recipe_runs or not control_runs:
        raise ValueError("stability_verdict needs at least one recipe run and one control run")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1) (got {alpha})")
    div_r = (sum(r.diverged for r in recipe_runs), len(recipe_runs))
    div_c = (sum(r.diverged for r in control_runs), len(control_runs))
    has_grad = all(r.grad_norm_spikes is not None for r in [*recipe_runs, *control_runs])

    def components(r: StabilityMetrics) -> list[float]:
        return [float(r.diverged), float(r.loss_spikes)] + ([float(r.grad_norm_spikes)] if has_grad else [])

    p, each = permutation_pvalues(
        np.array([components(r) for r in recipe_runs]), np.array([components(r) for r in control_runs])
    )
    p_div, p_loss = each[0], each[1]
    p_grad = each[2] if has_grad else None
    diverged = f"diverged in {div_r[0]}/{div_r[1]} runs vs {div_c[0]}/{div_c[1]} (control)"
    smallest = smallest_pvalue(div_r[1], div_c[1])
    if p is None or p > alpha:
        if div_r[0]:
            test = "no permutation test over so few runs can reach" if smallest > alpha else f"p={p:.3g} >"
            reason = f"{diverged}; not shown less stable ({test} {alpha:g})"
            return StabilityVerdict(DIVERGED, reason, div_r, div_c, p_loss, p_grad, p_div, p)
        if smallest > alpha:
            reason = (
                f"{div_r[1]} recipe and {div_c[1]} control run(s): the smallest permutation p-value, "
                f"{smallest:.3g}, exceeds {alpha:g}"
            )
            return StabilityVerdict(NO_TEST, reason, div_r, div_c, p_loss, p_grad, p_div, p)
        return StabilityVerdict(
            AS_STABLE, "no more divergence or spikes than the control", div_r, div_c, p_loss, p_grad, p_div, p
        )
    what = {
        "diverged": diverged,
        "loss": "more loss-spike events per run than the control",
        "grad": "more grad-norm spike events per run than the control",
    }
    named = [(q, what[k]) for k, q in (("diverged", p_div), ("loss", p_loss), ("grad", p_grad)) if q is not None]
    least = min(q for q, _ in named)
    parts = [w for q, w in named if q == least]
    if div_r[0] and diverged not in parts:  # a divergence is always named
        parts.append(diverged)
    reason = "; ".join(parts) + f" (exact permutation test over runs, p={p:.3g} <= {alpha:g})"
    return StabilityVerdict(LESS_STABLE, reason, div_r, div_c, p_loss, p_grad, p_div, p)
