"""Stopping rule for ``seeds=auto``: more seeds only for inconclusive recipes, error rate kept under repeated looks.

Method: Lan-DeMets alpha spending (Lan & DeMets 1983, "Discrete sequential boundaries for clinical trials",
Biometrika 70(3):659-663) with the O'Brien-Fleming-type spending function

    alpha(t) = 2 - 2 * Phi(z_{1 - alpha/2} / sqrt(t)),   t = n / max_seeds (information fraction),

which spends almost nothing at the early looks and reaches ``alpha`` at ``t = 1``. ``alpha`` is the one-sided
error rate of each hypothesis (``(1 - level) / 2``, 0.025 for a 95% interval). The looks are at n = start,
start + 1, ..., max_seeds seeds; at look n the one-sided nominal level is the spent increment
``alpha(n / max_seeds) - alpha((n - 1) / max_seeds)`` (the whole ``alpha(start / max_seeds)`` at the first look),
and the CONSORT CI rule is applied to the two-sided interval at ``level_at(n) = 1 - 2 * nominal_alpha(n)``.

Error control: the increments sum to ``alpha``, so by the union (Bonferroni) bound the probability of ever
rejecting a true hypothesis over all looks is at most ``alpha``, whatever the correlation between looks. This is
conservative (exact group-sequential boundaries would use the correlation and be a little wider), and it is valid
for the exact t-test at every look with no normal approximation. For several recipes, apply Holm at each look over
the recipes still running (``verdicts(active, margin, level=plan.level_at(n))``): Holm controls the family-wise
rate at that look's nominal level, and the union bound over looks keeps the total at ``alpha``. A recipe stopped
early is reported with the interval of its last look (a repeated confidence interval at ``level_at(n)``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from scipy.stats import norm

from experiments.stats.paired import check_level, paired_effect
from experiments.stats.verdict import (
    INCONCLUSIVE,
    INFERIOR,
    NO_INTERVAL,
    NON_INFERIOR,
    check_margin,
    ci_verdict,
)
from lowprec.errors import ConfigError


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
    """Lan-DeMets O'Brien-Fleming-type alpha spending over looks at ``start..max_seeds`` seeds (module docstring).

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
        if n <= 0:
            return 0.0
        t = min(n, self.max_seeds) / self.max_seeds
        return float(2 * norm.sf(norm.isf(self.alpha / 2) / math.sqrt(t)))

    def nominal_alpha(self, n: int) -> float:
        """One-sided nominal alpha at the look with ``n`` seeds (the spent increment); ValueError off a look."""
        self._check_look(n)
        return self.spent(n) - (self.spent(n - 1) if n > self.start else 0.0)

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
