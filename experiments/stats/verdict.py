"""Verdict of each recipe against the control at a relative margin, corrected for multiplicity (Holm).

The rule is the CONSORT non-inferiority convention (Piaggio et al. 2012, "Reporting of noninferiority and
equivalence randomized trials", JAMA 308(24):2594-2604, figure 1): take the two-sided ``level`` confidence
interval of the paired relative difference ``d = (recipe - control) / control`` (lower loss is better, ``d > 0`` =
recipe worse) and compare it with ``+margin``:

- ``non-inferior``: upper bound < +margin;
- ``inferior``: lower bound > +margin (worse by more than the margin);
- ``inconclusive``: neither;
- ``no-interval``: one seed, no interval exists (no p-values, no verdict).

The printed label (``consort_label``, ``Verdict.label``) follows CONSORT's figure 1, which also places the interval
against 0 (no difference), so that a significant difference is never hidden behind a plain word:

- ``superior``: non-inferior and the interval wholly below 0 (the recipe's loss is lower than the control's);
- ``non-inferior``: non-inferior, the interval contains 0;
- ``non-inferior (worse than control)``: non-inferior, but the interval lies wholly above 0 (worse by less than the
  margin);
- ``inconclusive (worse than control)``: inconclusive with the interval wholly above 0;
- ``inconclusive``, ``inferior``, ``no-interval``: as the decision.

The label refines the decision with the same (unadjusted) interval; the decision (``Verdict.verdict``, the MLflow
tag ``verdict.<recipe>``) stays one of ``VERDICTS``.

This is exactly the pair of one-sided paired t-tests at ``alpha = (1 - level) / 2``: ``H0: mu >= margin`` (rejected
= non-inferior, p-value ``p_noninferior``) and ``H0: mu <= margin`` (rejected = inferior, ``p_inferior``).

Multiplicity: several recipes against one control form two families of one-sided hypotheses (non-inferiority and
inferiority), each corrected with Holm's step-down procedure (Holm 1979, Scand. J. Statist. 6:65-70;
``statsmodels.stats.multitest.multipletests(method="holm")``) at ``alpha``. A recipe gets a conclusive verdict only
when both the CI rule and the Holm-adjusted test say so, so the Holm verdict is never less conservative than the CI
rule; with ``correction="none"`` it is the CI rule exactly. The interval reported stays the unadjusted one.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.power import TTestPower

from experiments.stats.paired import PairedEffect, check_level, paired_effect, relative_differences
from lowprec.errors import ConfigError

NON_INFERIOR, INFERIOR, INCONCLUSIVE, NO_INTERVAL = "non-inferior", "inferior", "inconclusive", "no-interval"
VERDICTS = (NON_INFERIOR, INFERIOR, INCONCLUSIVE, NO_INTERVAL)
SUPERIOR = "superior"
WORSE = " (worse than control)"
#: Every label ``consort_label`` can return.
LABELS = (SUPERIOR, NON_INFERIOR, NON_INFERIOR + WORSE, INCONCLUSIVE, INCONCLUSIVE + WORSE, INFERIOR, NO_INTERVAL)
CORRECTIONS = ("holm", "none")
#: Power of the minimum detectable difference and of the seeds-needed calculation.
POWER = 0.8
#: Two-sided confidence level of every interval of the report (one-sided tests at alpha = (1 - LEVEL) / 2); here,
#: not in the report, because ``seeds=auto``'s spending plan (built at preflight) must use the same level.
LEVEL = 0.95


def check_margin(margin: float) -> float:
    """Return ``margin`` as a float; raise ``ConfigError`` (a ValueError) unless it is finite and > 0."""
    try:
        m = float(margin)
    except (TypeError, ValueError):
        m = math.nan
    if not (math.isfinite(m) and m > 0):
        raise ConfigError(f"report.margin must be a finite relative margin > 0, e.g. 0.0025 for 0.25% (got {margin!r})")
    return m


def ci_verdict(lo: float | None, hi: float | None, margin: float) -> str:
    """The CONSORT CI rule: non-inferior if ``hi < margin``, inferior if ``lo > margin``, else inconclusive."""
    if lo is None or hi is None:
        return NO_INTERVAL
    if hi < margin:
        return NON_INFERIOR
    if lo > margin:
        return INFERIOR
    return INCONCLUSIVE


def consort_label(verdict: str, lo: float | None, hi: float | None) -> str:
    """The CONSORT label of a decision (module docstring): ``verdict`` (one of ``VERDICTS``) refined by where the
    interval ``[lo, hi]`` (relative difference, > 0 = recipe worse) lies against 0.

    Raises:
        ValueError: ``verdict`` is not one of ``VERDICTS``.
    """
    if verdict not in VERDICTS:
        raise ValueError(f"unknown verdict {verdict!r} (one of {VERDICTS})")
    if lo is None or hi is None or verdict in (INFERIOR, NO_INTERVAL):
        return verdict
    if verdict == NON_INFERIOR and hi < 0:
        return SUPERIOR
    return verdict + WORSE if lo > 0 else verdict


def one_sided_pvalues(d: np.ndarray, margin: float) -> tuple[float, float]:
    """One-sided paired t-test p-values ``(p_noninferior, p_inferior)`` of ``d`` against ``margin`` (n >= 2).

    ``p_noninferior`` tests ``H0: mean >= margin`` (``scipy.stats.ttest_1samp(d, margin, alternative="less")``),
    ``p_inferior`` tests ``H0: mean <= margin`` (``alternative="greater"``). When every difference is equal the
    statistic is +-infinity and the p-values are its limits: 0 on the side the mean lies, 1 on the other (1 and 1
    when the mean equals the margin).
    """
    if np.ptp(d) == 0:
        mean = float(d[0])
        return (0.0 if mean < margin else 1.0), (0.0 if mean > margin else 1.0)
    p_ni = float(stats.ttest_1samp(d, margin, alternative="less").pvalue)
    p_inf = float(stats.ttest_1samp(d, margin, alternative="greater").pvalue)
    return p_ni, p_inf


def minimum_detectable_difference(n: int, sd: float, alpha: float, power: float = POWER) -> float | None:
    """Smallest distance below (or above) the margin that a one-sided paired t-test at ``alpha`` detects with
    ``power`` over ``n`` seeds at paired standard deviation ``sd`` (same units as ``sd``).

    A recipe whose true relative difference is ``<= margin - mdd`` is declared non-inferior with probability
    >= ``power`` (and one ``>= margin + mdd`` inferior); for a recipe equal to the control, ``mdd`` is the smallest
    margin this design resolves. Computed with ``statsmodels.stats.power.TTestPower`` (noncentral t power of the
    one-sample t-test): standardized effect at this n times ``sd``. Per comparison, before any Holm correction.
    None when n < 2 or sd is not finite; 0 when sd == 0.
    """
    if n < 2 or not math.isfinite(sd):
        return None
    if sd == 0:
        return 0.0
    es = TTestPower().solve_power(effect_size=None, nobs=n, alpha=alpha, power=power, alternative="larger")
    return float(es) * sd


def seeds_needed(mean: float, sd: float, margin: float, alpha: float, power: float = POWER) -> int | None:
    """Seeds that make the verdict conclusive with probability ``power`` if the true mean and paired sd are the
    observed ones: ``TTestPower().solve_power`` (statsmodels) for the one-sided one-sample t-test at ``alpha``
    with effect size ``|mean - margin| / sd``, rounded up, at least 2. Per comparison (Holm can need more).
    None when undefined: sd is nan or 0, or the mean equals the margin (no n suffices).
    """
    if not math.isfinite(sd) or sd == 0 or mean == margin:
        return None
    es = abs(mean - margin) / sd
    tp = TTestPower()
    if tp.power(effect_size=es, nobs=2, alpha=alpha, alternative="larger") >= power:
        return 2  # the solver cannot bracket a root below 2 observations
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConvergenceWarning for absurd n; checked below
        n = tp.solve_power(effect_size=es, nobs=None, alpha=alpha, power=power, alternative="larger")
    n = float(np.asarray(n).squeeze())
    return max(2, math.ceil(n)) if math.isfinite(n) else None


@dataclass(frozen=True)
class Verdict:
    """One recipe's verdict against the control (a value, logged on the parent run).

    Fields:
        recipe, metric: names (e.g. ``"fp8_rowwise"``, ``"val_loss_final"``).
        effect: the paired relative difference with its unadjusted ``level`` t-interval (``PairedEffect``).
        margin: the relative non-inferiority margin (0.0025 = 0.25%); level: two-sided confidence level.
        verdict: the decision, one of ``VERDICTS``, after the multiplicity correction.
        verdict_unadjusted: the CI rule alone (equals ``verdict`` with ``correction="none"``).
        correction: ``"holm"`` or ``"none"``; n_tests: recipes in each Holm family (those with >= 2 seeds).
        p_noninferior, p_inferior: one-sided paired t-test p-values (None with one seed).
        p_noninferior_adj, p_inferior_adj: Holm-adjusted p-values (equal to the raw ones with ``"none"``).
        mdd: minimum detectable difference at this n (see ``minimum_detectable_difference``), or None.
        seeds_needed: seeds for a conclusive verdict at the observed mean and sd (see ``seeds_needed``), or None.
        rule: the exact rule in one line.
    """

    recipe: str
    metric: str
    effect: PairedEffect
    margin: float
    level: float
    verdict: str
    verdict_unadjusted: str
    correction: str
    n_tests: int
    p_noninferior: float | None
    p_inferior: float | None
    p_noninferior_adj: float | None
    p_inferior_adj: float | None
    mdd: float | None
    seeds_needed: int | None
    rule: str

    @property
    def label(self) -> str:
        """The CONSORT label of ``verdict`` (``consort_label``), e.g. ``non-inferior (worse than control)``."""
        return consort_label(self.verdict, self.effect.lo, self.effect.hi)

    @property
    def label_unadjusted(self) -> str:
        """The CONSORT label of ``verdict_unadjusted`` (the CI rule alone)."""
        return consort_label(self.verdict_unadjusted, self.effect.lo, self.effect.hi)

    def as_dict(self) -> dict:
        """Flat JSON-ready dict (the effect's fields prefixed ``effect_``, and ``label``)."""
        out = {k: v for k, v in asdict(self).items() if k != "effect"}
        out["label"] = self.label
        out.update({f"effect_{k}": v for k, v in asdict(self.effect).items()})
        return out


def rule_text(margin: float, level: float | None, correction: str, n_tests: int) -> str:
    """One line stating the exact decision rule and its source; ``level=None``: each ``seeds=auto`` look's level."""
    if level is None:
        interval, tests = "two-sided paired t-interval at the look's level", "the look's nominal alpha"
    else:
        interval, tests = f"two-sided {level:.4g} paired t-interval", f"alpha={(1 - level) / 2:.4g}"
    text = (
        f"CONSORT non-inferiority (Piaggio et al. 2012, JAMA 308:2594): {interval} of "
        f"(recipe - control)/control; non-inferior if upper < +{margin:.4g}, inferior if lower > +{margin:.4g}, "
        f"else inconclusive (= one-sided paired t-tests at {tests}); labelled against 0: superior if "
        "upper < 0, '(worse than control)' if lower > 0"
    )
    if correction == "holm":
        text += f"; Holm-adjusted over {n_tests} recipe(s) per one-sided family"
    return text


def verdicts(
    results: dict,
    margin: float,
    level: float = 0.95,
    correction: str = "holm",
    *,
    metric: str = "val_loss",
    bootstrap: bool = True,
) -> dict[str, Verdict]:
    """One ``Verdict`` per recipe against the shared control (rule and sources: module docstring).

    Args:
        results: ``{recipe_name: (recipe_values, control_values)}``, each a 1-D array over seeds, seed i paired
            with seed i (lower is better, e.g. final validation loss). The control arrays may differ in length
            between recipes (each recipe pairs with the control seeds it has).
        margin: relative margin > 0 (``report.margin``, e.g. 0.0025).
        level: two-sided confidence level in (0, 1); the one-sided tests run at ``alpha = (1 - level) / 2``.
        correction: ``"holm"`` (across the recipes with >= 2 seeds, per one-sided family) or ``"none"``.
        metric: name stored in each verdict. bootstrap: compute the bootstrap cross-check.

    Returns:
        ``{recipe_name: Verdict}`` in the order of ``results`` (empty for empty ``results``).

    Raises:
        ConfigError (a ValueError): bad margin, level or correction. ValueError: bad arrays.
    """
    margin, level = check_margin(margin), check_level(level)
    if correction not in CORRECTIONS:
        raise ConfigError(f"correction must be one of {CORRECTIONS} (got {correction!r})")
    alpha = (1 - level) / 2
    effects, pvals = {}, {}
    for name, (rec, ctl) in results.items():
        effects[name] = paired_effect(rec, ctl, level, bootstrap=bootstrap)
        if effects[name].n >= 2:
            pvals[name] = one_sided_pvalues(relative_differences(rec, ctl), margin)
    tested = list(pvals)
    adjusted, reject = {}, {}
    if tested and correction == "holm":
        families = []
        for j in (0, 1):
            rej, adj, _, _ = multipletests([pvals[k][j] for k in tested], alpha=alpha, method="holm")
            families.append((rej, adj))
        for i, k in enumerate(tested):
            adjusted[k] = (float(families[0][1][i]), float(families[1][1][i]))
            reject[k] = (bool(families[0][0][i]), bool(families[1][0][i]))
    rule = rule_text(margin, level, correction, len(tested))
    out = {}
    for name, eff in effects.items():
        unadj = final = ci_verdict(eff.lo, eff.hi, margin)
        p = p_adj = pvals.get(name, (None, None))
        if correction == "holm" and name in reject:
            p_adj, (rej_ni, rej_inf) = adjusted[name], reject[name]
            if (unadj == NON_INFERIOR and not rej_ni) or (unadj == INFERIOR and not rej_inf):
                final = INCONCLUSIVE  # the CI rule alone would decide; Holm does not confirm it
        out[name] = Verdict(
            recipe=name,
            metric=metric,
            effect=eff,
            margin=margin,
            level=level,
            verdict=final,
            verdict_unadjusted=unadj,
            correction=correction,
            n_tests=len(tested),
            p_noninferior=p[0],
            p_inferior=p[1],
            p_noninferior_adj=p_adj[0],
            p_inferior_adj=p_adj[1],
            mdd=minimum_detectable_difference(eff.n, eff.sd, alpha),
            seeds_needed=seeds_needed(eff.mean, eff.sd, margin, alpha) if eff.n >= 2 else None,
            rule=rule,
        )
    return out
