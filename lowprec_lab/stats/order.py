"""The order in which an ablation's comparisons are tested: controls first, then the primary ones, then the rest.

One flat Holm family over every recipe makes the experiment's headline comparison pay for every other row it
trains: with seven rows, a headline with one-sided p = 0.015 (its 95% interval inside the margin) is not confirmed,
and the seeds it would need grow with each row added. Trials solve this by stating the order of the hypotheses
before the data (ICH E9, section 5.6; ICH E9(R1)): a fixed sequence gives the first hypothesis the full alpha and
tests the next ones only once every earlier one is rejected, and the family-wise error stays at alpha (serial
gatekeeping: Westfall & Krishen 2001, J. Stat. Plan. Inference 99:25-40; Dmitrienko, Tamhane & Wiens 2008, Biom. J.
50:667-677). The "gold-standard" three-arm non-inferiority design puts assay sensitivity first in that sequence
(Koch & Roehmel 2004, J. Biopharm. Stat. 14:315-325; Hauschke & Pigeot 2005, Biom. J. 47:782-786): only an
experiment that has shown it can see the margin may declare anything non-inferior.

``TestingOrder`` states it for one ablation:

1. **The controls**, each alone at alpha: the negative control's non-inferiority and the positive control's
   inferiority. Both rejected (an intersection-union test, Berger 1982, Technometrics 24:295-300: level alpha
   without correction) opens the next stage; their adjusted p-value is the larger of the two raw ones.
2. **The primary comparisons** (``report.primary``, stated before the run), Holm among themselves at alpha.
3. **The other recipes**, Holm among themselves at alpha.

Each one-sided family (non-inferior, inferior, better than the control, worse) runs the sequence on its own: a stage
is tested in a family only where every comparison of the stages before it was rejected in that family (and the
controls passed). The adjusted p-value of a comparison is the largest of its Holm-adjusted p-value within its stage
and the adjusted p-values of every earlier stage; it is rejected when that is <= alpha. A primary comparison with
fewer than 2 seeds (no test) keeps the stage after it closed. Without controls and primary comparisons the order is
one Holm family over every recipe (``TestingOrder.flat``), as before the order existed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: The one-sided families of ``verdicts``, in its order: non-inferior and inferior against the margin, better and
#: worse against 0.
FAMILIES = ("non-inferior", "inferior", "better", "worse")
#: The family in which each control must be rejected: the negative control non-inferior, the positive inferior.
NEGATIVE_FAMILY, POSITIVE_FAMILY = 0, 1
#: Why a comparison was not tested in a family (``Gated.why``).
CONTROLS_FAILED = "the controls did not both come out as they must"
PRIMARY_OPEN = "a primary comparison is not conclusive in that direction"


@dataclass(frozen=True)
class TestingOrder:
    """The order of an ablation's comparisons (module docstring).

    ``negative``/``positive``: the control recipes (``controls=true``), or None. ``primary``: the recipes tested
    right after the controls (``report.primary``), in any order (Holm among them). A name absent from the results
    of a ``verdicts`` call is ignored, except a primary one, which keeps the stage after it closed.
    """

    negative: str | None = None
    positive: str | None = None
    primary: tuple[str, ...] = ()

    @property
    def flat(self) -> bool:
        """No controls and no primary comparison: one Holm family over every recipe."""
        return self.negative is None and self.positive is None and not self.primary

    def stage_of(self, name: str) -> str:
        """``control``, ``primary`` or ``other``: where ``name`` is tested."""
        if name in (self.negative, self.positive):
            return "control"
        return "primary" if name in self.primary else "other"

    def text(self) -> str:
        """The order as one clause of the report's rule, e.g. ``controls first (each alone), then deepseek_v3,
        then the other recipes (Holm)``."""
        parts = []
        if self.negative or self.positive:
            parts.append("the controls first, each alone at alpha (both must pass)")
        if self.primary:
            parts.append(f"then the primary comparison(s) {', '.join(self.primary)} (Holm among them)")
        parts.append("then the other recipes (Holm among them)")
        return ", ".join(parts) + "; each stage only where every earlier one was rejected in that one-sided family"


@dataclass(frozen=True)
class Gated:
    """One comparison's result in the ordered families: per family (``FAMILIES``), the adjusted p-value, whether it
    is rejected, and ``why`` it was not tested when an earlier stage kept it closed (None when it was tested)."""

    adjusted: tuple[float, ...]
    reject: tuple[bool, ...]
    why: tuple[str | None, ...]
    #: the comparisons tested beside it in its stage's Holm family (1 for a control)
    stage_size: int


def holm(pvalues, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Holm's step-down procedure (Holm 1979, Scand. J. Statist. 6:65-70): ``(reject, adjusted)`` for 1-D
    ``pvalues`` (shape (m,)) at family-wise level ``alpha``. Adjusted ``p_(k) = max_{j <= k} min(1, (m - j) p_(j))``
    over the sorted p-values; reject where adjusted <= alpha. Equals
    ``statsmodels.stats.multitest.multipletests(method="holm")``, without its ``gc.collect()`` on every call (76 ms
    each in a loaded process; the report makes four families per column)."""
    p = np.asarray(pvalues, dtype=np.float64)
    m = p.size
    order = np.argsort(p, kind="stable")
    adj_sorted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    adjusted = np.empty(m)
    adjusted[order] = adj_sorted
    return adjusted <= alpha, adjusted


def ordered_families(pvals: dict[str, tuple[float, ...]], alpha: float, order: TestingOrder) -> dict[str, Gated]:
    """The comparisons of ``pvals`` (``{recipe: (p_noninferior, p_inferior, p_better, p_worse)}``, raw one-sided
    p-values of the recipes with >= 2 seeds) tested in ``order`` at ``alpha`` (module docstring). Returns
    ``{recipe: Gated}`` for every key of ``pvals``."""
    tested = list(pvals)
    controls = {n: f for n, f in ((order.negative, NEGATIVE_FAMILY), (order.positive, POSITIVE_FAMILY)) if n}
    out: dict[str, Gated] = {}
    for n in controls:
        if n in pvals:
            out[n] = Gated(tuple(pvals[n]), tuple(p <= alpha for p in pvals[n]), (None,) * len(FAMILIES), 1)
    # a control without a test (fewer than 2 seeds) has not passed: p = 1 keeps every later stage closed
    gate = max((pvals[n][f] if n in pvals else 1.0 for n, f in controls.items()), default=0.0)
    primary = [n for n in order.primary if n in pvals]
    stages = [(primary, any(n not in pvals for n in order.primary))]
    stages.append(([n for n in tested if n not in controls and n not in order.primary], False))
    rows: dict[str, list[list]] = {n: [[], [], []] for s, _ in stages for n in s}
    for j in range(len(FAMILIES)):
        prev, why = gate, CONTROLS_FAILED
        for names, untested_primary in stages:
            if names:
                _, adj = holm([pvals[n][j] for n in names], alpha)
                for n, a in zip(names, adj):
                    final = max(float(a), prev)
                    rows[n][0].append(final)
                    rows[n][1].append(final <= alpha)
                    rows[n][2].append(why if prev > alpha else None)
                prev = max(prev, *(rows[n][0][j] for n in names))
            if untested_primary:
                prev = 1.0
            why = PRIMARY_OPEN if prev > alpha and why == CONTROLS_FAILED and gate <= alpha else why
    for names, _ in stages:
        for n in names:
            out[n] = Gated(tuple(rows[n][0]), tuple(rows[n][1]), tuple(rows[n][2]), len(names))
    return out
