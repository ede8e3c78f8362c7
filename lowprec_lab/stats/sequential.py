"""Stopping rule for ``seeds=auto``: more seeds only for inconclusive recipes, error rate kept under repeated looks.

Method: Lan-DeMets alpha spending (Lan & DeMets 1983, "Discrete sequential boundaries for clinical trials",
Biometrika 70(3):659-663) with the O'Brien-Fleming-type spending function

    alpha(t) = 2 - 2 * Phi(z_{1 - alpha/2} / sqrt(t)),   t = n / max_seeds (information fraction),

which spends almost nothing at the early looks and reaches ``alpha`` at ``t = 1``. ``alpha`` is the one-sided
error rate of each hypothesis (``(1 - level) / 2``, 0.025 for a 95% interval). The looks are at n = start,
start + 1, ..., max_seeds seeds.

Exact boundaries: at look n a recipe is declared non-inferior when its paired t statistic at the margin,
``T_n = (mean_n - margin) / (sd_n / sqrt(n))``, is below ``-c_n``, inferior when above ``+c_n``, and it stops at
its first conclusive look. The critical values ``c_n`` are chosen so that, for a recipe whose true difference is
exactly the margin, the probability of first crossing ``-c_n`` at look n (not having stopped before, either way)
is the spent increment ``alpha(n / max_seeds) - alpha((n - 1) / max_seeds)`` (all of ``alpha(start /
max_seeds)`` at the first look): the cumulative type-I rate over the looks is ``alpha`` itself, as the spending
function promises. At the margin ``T_n`` is a function of standard normal paired differences alone (it does not
depend on the paired sd), so the ``c_n`` depend only on (max_seeds, alpha, start): ``critical_values``
computes them once per plan by Monte Carlo over ``CALIBRATION_PATHS`` null paths from a fixed generator seed
(``CALIBRATION_SEED``; the sign symmetry of the null uses both tails), and caches them. Where a look's increment
is so small that fewer than ``MIN_TAIL_PATHS`` paths would cross it (the first looks of a large ``max_seeds``),
``c_n`` is the t quantile of the increment itself (the union bound; at such tiny levels the looks' correlation
does not matter). With max_seeds = 8 the critical values are 44.3, 9.34, 5.07, 3.70, 3.04, 2.64 at 3..8 seeds,
against 44.5, 9.41, 5.29, 4.02, 3.44, 3.12 for the union (Bonferroni) bound that sums the increments: exact
boundaries are narrower, the union bound's real type-I rate is only about 1.5% and it loses power (tests/unit/
test_stats.py simulates both). The CONSORT CI rule is applied to the two-sided interval at ``level_at(n) =
1 - 2 * nominal_alpha(n)``, ``nominal_alpha(n) = P(T_{n-1 df} > c_n)``: an interval at that level excludes the
margin exactly when ``|T_n| > c_n``.

For several recipes, apply Holm at each look over the recipes still running (``verdicts(active, margin,
level=plan.level_at(n))``): Holm controls the family-wise rate at that look's nominal level. A recipe stopped early
is reported with the interval of its last look (a repeated confidence interval at ``level_at(n)``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from scipy.stats import norm
from scipy.stats import t as student_t

from lowprec.errors import ConfigError
from lowprec_lab.stats.paired import check_level, paired_effect
from lowprec_lab.stats.verdict import (
    INCONCLUSIVE,
    INFERIOR,
    NO_INTERVAL,
    NON_INFERIOR,
    check_margin,
    ci_verdict,
)

#: Null paths simulated per plan to calibrate the exact boundaries, and the generator seed (fixed: the same plan
#: always gets the same boundaries). Standard error of the calibrated type-I rate: about 0.0001.
CALIBRATION_PATHS = 1 << 20
CALIBRATION_SEED = 20240529
#: Below this many expected crossing paths a look's boundary falls back to the union bound (module docstring).
MIN_TAIL_PATHS = 100


def _spent(n: int, max_seeds: int, alpha: float) -> float:
    if n <= 0:
        return 0.0
    t = min(n, max_seeds) / max_seeds
    return float(2 * norm.sf(norm.isf(alpha / 2) / math.sqrt(t)))


@functools.lru_cache(maxsize=32)
def critical_values(max_seeds: int, alpha: float, start: int) -> tuple[float, ...]:
    """Exact critical values ``c_n`` of the paired t statistic at looks ``start..max_seeds`` (module docstring).

    Monte Carlo over ``CALIBRATION_PATHS`` paths of standard normal differences (generator seed
    ``CALIBRATION_SEED``), one look after the other: ``c_n`` is the ``2 * increment * paths``-th largest
    ``|T_n|`` among the paths that have not stopped, so that each tail takes the spent increment. About 0.5 s
    for max_seeds = 8, memory O(paths); cached per (max_seeds, alpha, start).

    Returns:
        ``c_n`` per look, a tuple of ``max_seeds - start + 1`` floats (t units, > 0).
    """
    paths = CALIBRATION_PATHS
    rng = np.random.default_rng(CALIBRATION_SEED)
    total, squares = np.zeros(paths), np.zeros(paths)
    alive = np.ones(paths, dtype=bool)
    out = []
    for n in range(1, max_seeds + 1):
        z = rng.standard_normal(paths)  # one seed's paired difference per path, drawn seed by seed: O(paths) memory
        total += z
        squares += z * z
        if n < start:
            continue
        inc = _spent(n, max_seeds, alpha) - (_spent(n - 1, max_seeds, alpha) if n > start else 0.0)
        crossing = 2 * inc * paths  # both tails: the null is symmetric
        if crossing < MIN_TAIL_PATHS:
            c = float(student_t.isf(inc, n - 1))
        else:
            mean = total / n
            stat = np.abs(mean / np.sqrt((squares - n * mean * mean) / (n - 1) / n))
            live = stat[alive]
            k = int(round(crossing))
            c = float(np.partition(live, live.size - k)[live.size - k])
        out.append(c)
        if crossing >= MIN_TAIL_PATHS:
            alive &= stat < c
    return tuple(out)


@dataclass(frozen=True)
class SeedDecision:
    """Whether a recipe gets another seed, and why: reason ``"conclusive"`` or ``"max_seeds"`` (stopped), or
    its current verdict ``"inconclusive"`` / ``"no-interval"`` (continues)."""

    recipe: str
    seeds: int
    verdict: str
    more: bool
    reason: str


@dataclass(frozen=True)
class SpendingPlan:
    """Lan-DeMets O'Brien-Fleming-type alpha spending over looks at ``start..max_seeds`` seeds with exact
    group-sequential boundaries (module docstring).

    Args:
        max_seeds: largest number of seeds per recipe (>= 3 and >= start).
        alpha: one-sided error rate of each hypothesis over all looks, in (0, 0.5) (0.025 for a 95% interval).
        start: seeds before the first look (>= 2).

    Raises:
        ConfigError (a ValueError): ``seeds=auto needs max_seeds >= 3 (got N)``, or a bad alpha or start.
    """

    max_seeds: int = 8
    alpha: float = 0.025
    start: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.max_seeds, bool) or not isinstance(self.max_seeds, int) or self.max_seeds < 3:
            raise ConfigError(f"seeds=auto needs max_seeds >= 3 (got {self.max_seeds!r})")
        if isinstance(self.start, bool) or not isinstance(self.start, int) or not 2 <= self.start <= self.max_seeds:
            raise ConfigError(f"seeds=auto needs 2 <= start <= max_seeds={self.max_seeds} (got start={self.start!r})")
        if not (0.0 < float(self.alpha) < 0.5):
            raise ConfigError(f"one-sided alpha must be in (0, 0.5) (got {self.alpha!r})")

    @classmethod
    def for_level(cls, level: float = 0.95, max_seeds: int = 8, start: int = 3) -> SpendingPlan:
        """The plan whose overall one-sided alpha is ``(1 - level) / 2`` (the fixed-n CI rule's)."""
        return cls(max_seeds=max_seeds, alpha=(1 - check_level(level)) / 2, start=start)

    @property
    def looks(self) -> tuple[int, ...]:
        """Seed counts at which a verdict is taken: ``start, start + 1, ..., max_seeds``."""
        return tuple(range(self.start, self.max_seeds + 1))

    def _check_look(self, n: int) -> None:
        if n not in self.looks:
            raise ValueError(f"{n} seeds is not a look of this plan (looks at {self.start}..{self.max_seeds} seeds)")

    def spent(self, n: int) -> float:
        """Cumulative one-sided alpha spent by ``n`` seeds: ``2 - 2 Phi(z_{1-alpha/2} / sqrt(n / max_seeds))``."""
        return _spent(n, self.max_seeds, float(self.alpha))

    def critical_t(self, n: int) -> float:
        """Exact critical value ``c_n`` of the paired t statistic at the look with ``n`` seeds
        (``critical_values``); ValueError off a look."""
        self._check_look(n)
        return critical_values(self.max_seeds, float(self.alpha), self.start)[n - self.start]

    def nominal_alpha(self, n: int) -> float:
        """One-sided nominal alpha at the look with ``n`` seeds, ``P(T_{n-1} > c_n)``: the per-look level the
        exact boundary amounts to (larger than the spent increment: the looks are correlated); ValueError off a
        look."""
        return float(student_t.sf(self.critical_t(n), n - 1))

    @property
    def final_alpha(self) -> float:
        """The nominal one-sided alpha of the final analysis (the look at ``max_seeds``): the level at which a
        recipe still open at the end is judged, and at which ``seeds=auto`` states MDD and seeds needed."""
        return self.nominal_alpha(self.max_seeds)

    def level_at(self, n: int) -> float:
        """Two-sided confidence level for the CI rule at the look with ``n`` seeds: ``1 - 2 * nominal_alpha(n)``."""
        return 1 - 2 * self.nominal_alpha(n)

    def schedule(self) -> list[tuple[int, float, float, float]]:
        """``(n, cumulative alpha spent, nominal one-sided alpha, CI level)`` per look, for the report."""
        return [(n, self.spent(n), self.nominal_alpha(n), self.level_at(n)) for n in self.looks]

    def decide(self, recipe, control, margin: float) -> str:
        """Verdict of one recipe at the look given by its seed count n = len(recipe): the CI rule on the paired
        t-interval at ``level_at(n)``. For several recipes use ``verdicts(..., level=plan.level_at(n))`` (Holm).

        Raises:
            ValueError: n is not a look of the plan, or bad arrays; ConfigError: bad margin.
        """
        margin = check_margin(margin)
        n = len(recipe)
        self._check_look(n)
        eff = paired_effect(recipe, control, self.level_at(n), bootstrap=False)
        return ci_verdict(eff.lo, eff.hi, margin)

    def next_seeds(self, verdicts: Mapping[str, str], seeds: Mapping[str, int]) -> dict[str, SeedDecision]:
        """Which recipes get another seed: those still inconclusive (or without an interval) below ``max_seeds``.

        Args:
            verdicts: ``{recipe: verdict string}`` at the current look. seeds: ``{recipe: seeds run so far}``.

        Returns:
            ``{recipe: SeedDecision}``; stopped recipes say why (``"conclusive"`` or ``"max_seeds"``).

        Raises:
            ValueError: the two mappings name different recipes, or an unknown verdict string.
        """
        if set(verdicts) != set(seeds):
            raise ValueError(f"verdicts and seeds name different recipes: {sorted(verdicts)} and {sorted(seeds)}")
        out = {}
        for name, v in verdicts.items():
            if v not in (NON_INFERIOR, INFERIOR, INCONCLUSIVE, NO_INTERVAL):
                raise ValueError(f"unknown verdict {v!r} for recipe {name!r}")
            n = int(seeds[name])
            if v in (NON_INFERIOR, INFERIOR):
                more, reason = False, "conclusive"
            elif n >= self.max_seeds:
                more, reason = False, "max_seeds"
            else:
                more, reason = True, v
            out[name] = SeedDecision(recipe=name, seeds=n, verdict=v, more=more, reason=reason)
        return out
