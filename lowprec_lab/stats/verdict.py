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
against 0 (no difference), so that a significant difference is never hidden behind a plain word. The difference
against 0 is tested like the margin, as two more one-sided paired t-test families, ``H0: mu >= 0`` (rejected =
better than the control, ``p_superior``) and ``H0: mu <= 0`` (rejected = worse, ``p_worse``), each Holm-corrected
across the recipes like the non-inferiority families: with three recipes equal to the control, ``superior`` is
printed for any of them at most ``alpha`` of the time, not ``1 - (1 - alpha)^3``. A refinement is printed only
when the interval lies wholly on that side of 0 and Holm confirms it (``Verdict.better`` / ``Verdict.worse``):

- ``superior``: non-inferior and better than the control; ``superior (negligible: under a tenth of the margin)``
  when the mean difference is smaller than a tenth of the margin (a real but unimportant gain, e.g. -0.0003%);
- ``non-inferior``: non-inferior, no difference shown against 0;
- ``non-inferior (worse than control)``: non-inferior, but worse than the control by less than the margin;
- ``inconclusive (worse than control)`` / ``inconclusive (better than control)``: inconclusive against the
  margin, with a difference shown against 0 on that side (the two sides treated alike, also when Holm demoted a
  non-inferior interval to inconclusive);
- ``inconclusive``, ``inferior``, ``no-interval``: as the decision;
- ``diverged``: a run of the recipe diverged (``mark_diverged``): the decision on its finished seeds is kept in
  ``Verdict.verdict_finished`` but never printed alone, whatever it was.

The decision (``Verdict.verdict``, the MLflow tag ``verdict.<recipe>``) is one of ``VERDICTS``.

This is exactly the pair of one-sided paired t-tests at ``alpha = (1 - level) / 2``: ``H0: mu >= margin`` (rejected
= non-inferior, p-value ``p_noninferior``) and ``H0: mu <= margin`` (rejected = inferior, ``p_inferior``).

Multiplicity: several recipes against one control form one-sided families of hypotheses (non-inferiority,
inferiority, and against 0 better and worse), each corrected with Holm's step-down procedure (Holm 1979, Scand. J.
Statist. 6:65-70; ``holm``, equal to ``statsmodels.stats.multitest.multipletests(method="holm")``) at ``alpha``. A
recipe gets a conclusive verdict only when both the CI rule and the Holm-adjusted test say so, so the Holm verdict
is never less conservative than the CI rule; with ``correction="none"`` it is the CI rule exactly. The interval
reported stays the unadjusted one.

Robust cross-check: the paired t-test assumes normal differences; with one seed much worse than the others (right
skew) its rate of wrong non-inferior verdicts rises. Each verdict also carries the exact sign-flip permutation test
of the same differences against the margin (``lowprec_lab.stats.paired.sign_flip_pvalues``) at the same alpha
(``Verdict.verdict_perm``, None when the seeds are too few for it to reach alpha: 2^-n > alpha), and
``Verdict.perm_disagrees`` when its decision differs from the t-test's interval rule; the report prints it.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import asdict, dataclass, replace

import numpy as np
from scipy import stats
from statsmodels.stats.power import TTestPower

from lowprec.errors import ConfigError
from lowprec_lab.stats.order import TestingOrder, ordered_families
from lowprec_lab.stats.paired import (
    PairedEffect,
    check_level,
    paired_effect,
    relative_differences,
    sign_flip_pvalues,
    smallest_sign_flip_p,
)

NON_INFERIOR, INFERIOR, INCONCLUSIVE, NO_INTERVAL = "non-inferior", "inferior", "inconclusive", "no-interval"
#: A run of the recipe diverged: the decision whatever its finished seeds show (``mark_diverged``).
DIVERGED = "diverged"
VERDICTS = (NON_INFERIOR, INFERIOR, INCONCLUSIVE, NO_INTERVAL, DIVERGED)
SUPERIOR = "superior"
WORSE = " (worse than control)"
BETTER = " (better than control)"
NEGLIGIBLE = " (negligible: under a tenth of the margin)"
#: A superiority whose mean difference is below this share of the margin is labelled negligible.
NEGLIGIBLE_SHARE = 0.1
#: Every label ``consort_label`` can return.
LABELS = (
    SUPERIOR,
    SUPERIOR + NEGLIGIBLE,
    NON_INFERIOR,
    NON_INFERIOR + WORSE,
    INCONCLUSIVE,
    INCONCLUSIVE + WORSE,
    INCONCLUSIVE + BETTER,
    INFERIOR,
    NO_INTERVAL,
    DIVERGED,
)
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


def consort_label(verdict: str, better: bool, worse: bool, negligible: bool = False) -> str:
    """The CONSORT label of a decision (module docstring): ``verdict`` (one of ``VERDICTS``) refined by the
    difference against 0 it comes with: ``better`` / ``worse`` (the interval lies wholly below / above 0 and, with
    Holm, the one-sided test against 0 is confirmed), ``negligible`` (``|mean| < NEGLIGIBLE_SHARE * margin``: said
    beside a superiority).

    Raises:
        ValueError: ``verdict`` is not one of ``VERDICTS``, or both ``better`` and ``worse``.
    """
    if verdict not in VERDICTS:
        raise ValueError(f"unknown verdict {verdict!r} (one of {VERDICTS})")
    if better and worse:
        raise ValueError("a difference cannot be both better and worse than the control")
    if verdict == NON_INFERIOR:
        if better:
            return SUPERIOR + (NEGLIGIBLE if negligible else "")
        return NON_INFERIOR + WORSE if worse else NON_INFERIOR
    if verdict == INCONCLUSIVE:
        return INCONCLUSIVE + (WORSE if worse else BETTER if better else "")
    return verdict


def one_sided_pvalues(d: np.ndarray, margin: float) -> tuple[float, float]:
    """One-sided paired t-test p-values ``(p_noninferior, p_inferior)`` of ``d`` against ``margin`` (n >= 2).

    ``p_noninferior`` tests ``H0: mean >= margin`` (``scipy.stats.ttest_1samp(d, margin, alternative="less")``),
    ``p_inferior`` tests ``H0: mean <= margin`` (``alternative="greater"``); computed from the t statistic and
    Student's t distribution directly (the same numbers, without ``ttest_1samp``'s per-call overhead: four tests per
    recipe). When every difference is equal the statistic is +-infinity and the p-values are its limits: 0 on the
    side the mean lies, 1 on the other (1 and 1 when the mean equals the margin).
    """
    if np.ptp(d) == 0:
        mean = float(d[0])
        return (0.0 if mean < margin else 1.0), (0.0 if mean > margin else 1.0)
    n = d.size
    t = (float(d.mean()) - margin) / (float(d.std(ddof=1)) / math.sqrt(n))
    return float(stats.t.cdf(t, n - 1)), float(stats.t.sf(t, n - 1))


@functools.lru_cache(maxsize=256)
def _mdd_effect_size(n: int, alpha: float, power: float) -> float:
    """The standardized effect a one-sided one-sample t-test detects with ``power`` (depends on n, alpha, power)."""
    return float(TTestPower().solve_power(effect_size=None, nobs=n, alpha=alpha, power=power, alternative="larger"))


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
    return _mdd_effect_size(int(n), float(alpha), float(power)) * sd


def seeds_needed(mean: float, sd: float, margin: float, alpha: float, power: float = POWER) -> int | None:
    """Seeds that make the verdict conclusive with probability ``power`` if the true mean and paired sd are the
    observed ones: ``TTestPower().solve_power`` (statsmodels) for the one-sided one-sample t-test at ``alpha``
    with effect size ``|mean - margin| / sd``, rounded up, at least 2. Per comparison (Holm can need more).
    None when undefined: sd is nan or 0, or the mean equals the margin (no n suffices).
    """
    if not math.isfinite(sd) or sd == 0 or mean == margin:
        return None
    es = abs(mean - margin) / sd
    # the smallest integer n whose noncentral-t power reaches ``power``: the normal approximation
    # ((z_a + z_b) / es)^2 is a lower bound and the t-test needs at most a few more (checked in one vector call)
    approx = ((stats.norm.isf(alpha) + stats.norm.ppf(power)) / es) ** 2
    if math.isfinite(approx) and approx < 1e7:
        n = np.arange(max(2, math.floor(approx) - 1), math.ceil(approx) + 12)
        ok = stats.nct.sf(stats.t.isf(alpha, n - 1), n - 1, es * np.sqrt(n)) >= power
        if ok.any():
            return int(n[np.argmax(ok)])
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
        verdict: the decision, one of ``VERDICTS``, after the multiplicity correction (``diverged`` after
            ``mark_diverged``).
        verdict_unadjusted: the CI rule alone (equals ``verdict`` with ``correction="none"``).
        correction: ``"holm"`` or ``"none"``; n_tests: recipes in its Holm family (those with >= 2 seeds; with a
            testing order, those of its stage: 1 for a control).
        p_noninferior, p_inferior: one-sided paired t-test p-values against the margin (None with one seed).
        p_noninferior_adj, p_inferior_adj: Holm-adjusted p-values (equal to the raw ones with ``"none"``).
        mdd: minimum detectable difference at this n (see ``minimum_detectable_difference``), or None.
        seeds_needed: seeds for a conclusive verdict at the observed mean and sd (see ``seeds_needed``), or None.
        rule: the exact rule in one line.
        p_superior, p_worse: one-sided paired t-test p-values against 0 (``H0: mu >= 0``, ``H0: mu <= 0``);
        p_superior_adj, p_worse_adj: their Holm-adjusted values. better, worse: the interval lies wholly below /
            above 0 and (with Holm) the adjusted test confirms it: what the label's refinement says.
        p_noninferior_perm, p_inferior_perm: the sign-flip permutation p-values against the margin (module
            docstring); verdict_perm: their decision at alpha (None when 2^-n > alpha: no decision possible).
        diverged_runs, judged_runs: set by ``mark_diverged`` (0 and 0 otherwise); verdict_finished: the decision
            on the finished seeds that ``diverged`` replaced (None unless diverged).
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
    p_superior: float | None = None
    p_worse: float | None = None
    p_superior_adj: float | None = None
    p_worse_adj: float | None = None
    better: bool = False
    worse: bool = False
    p_noninferior_perm: float | None = None
    p_inferior_perm: float | None = None
    verdict_perm: str | None = None
    diverged_runs: int = 0
    judged_runs: int = 0
    verdict_finished: str | None = None
    #: where the comparison stood in the testing order: ``control``, ``primary``, ``other``; empty for one flat family
    stage: str = ""
    #: why the decision the interval gives was not tested (an earlier stage of the order was not rejected), else None
    untested: str | None = None

    @property
    def negligible(self) -> bool:
        """The mean difference is smaller than ``NEGLIGIBLE_SHARE`` of the margin (said beside a superiority)."""
        return abs(self.effect.mean) < NEGLIGIBLE_SHARE * self.margin

    @property
    def label(self) -> str:
        """The CONSORT label of ``verdict`` (``consort_label``), e.g. ``non-inferior (worse than control)``."""
        return consort_label(self.verdict, self.better, self.worse, self.negligible)

    @property
    def label_unadjusted(self) -> str:
        """The CONSORT label of ``verdict_unadjusted``, refined against 0 by the interval alone (no Holm)."""
        e = self.effect
        better = e.has_interval and e.hi < 0
        worse = e.has_interval and e.lo > 0
        return consort_label(self.verdict_unadjusted, better, worse, self.negligible)

    @property
    def label_finished(self) -> str | None:
        """The label the finished seeds alone would get (None unless ``mark_diverged`` replaced the decision)."""
        if self.verdict_finished is None:
            return None
        return consort_label(self.verdict_finished, self.better, self.worse, self.negligible)

    @property
    def perm_disagrees(self) -> bool:
        """The sign-flip permutation test decides otherwise than the t-interval rule (``verdict_unadjusted``)."""
        return self.verdict_perm is not None and self.verdict_perm != self.verdict_unadjusted

    def as_dict(self) -> dict:
        """Flat JSON-ready dict (the effect's fields prefixed ``effect_``, and ``label``)."""
        out = {k: v for k, v in asdict(self).items() if k != "effect"}
        out["label"] = self.label
        out.update({f"effect_{k}": v for k, v in asdict(self.effect).items()})
        return out


def mark_diverged(v: Verdict, diverged: int, runs: int) -> Verdict:
    """``v`` decided ``diverged`` when ``diverged`` of the recipe's ``runs`` judged runs diverged (> 0); the
    decision on its finished seeds moves to ``verdict_finished``. A diverged run drops out of the paired seeds (it
    has no final loss, or one that means nothing), so without this a recipe that diverged in one seed of eight reads
    like one that never did. ``v`` unchanged when ``diverged`` is 0.

    Raises:
        ValueError: ``diverged`` < 0 or > ``runs``.
    """
    if not 0 <= diverged <= runs:
        raise ValueError(f"diverged runs must be in [0, runs]: got {diverged} of {runs}")
    if diverged == 0:
        return v
    return replace(v, verdict=DIVERGED, diverged_runs=int(diverged), judged_runs=int(runs), verdict_finished=v.verdict)


def rule_text(
    margin: float, level: float | None, correction: str, n_tests: int | None, order: TestingOrder | None = None
) -> str:
    """One line stating the exact decision rule and its source; ``level=None``: each ``seeds=auto`` look's level;
    ``n_tests=None``: Holm over the recipes still running at each look (``seeds=auto``); ``order``: the testing
    order (``lowprec_lab.stats.order``), stated when it is not one flat family."""
    if level is None:
        interval, tests = "two-sided paired t-interval at the look's level", "the look's nominal alpha"
    else:
        interval, tests = f"two-sided {level:.4g} paired t-interval", f"alpha={(1 - level) / 2:.4g}"
    text = (
        f"CONSORT non-inferiority (Piaggio et al. 2012, JAMA 308:2594): {interval} of "
        f"(recipe - control)/control; non-inferior if upper < +{margin:.4g}, inferior if lower > +{margin:.4g}, "
        f"else inconclusive (= one-sided paired t-tests at {tests}); labelled against 0 by two more one-sided "
        "tests: superior if upper < 0, '(worse than control)' if lower > 0, '(better than control)' beside an "
        "inconclusive if upper < 0; any diverged run: diverged"
    )
    if correction == "holm":
        over = "the recipes still running at each look" if n_tests is None else f"{n_tests} recipe(s)"
        if order is not None and not order.flat:
            text += f"; tested in order (serial gatekeeping, lowprec_lab/stats/order.py): {order.text()}"
        else:
            text += f"; Holm-adjusted over {over} per one-sided family"
    return text


def _perm_verdict(d: np.ndarray, margin: float, alpha: float) -> tuple[float | None, float | None, str | None]:
    """The sign-flip cross-check: ``(p_noninferior_perm, p_inferior_perm, verdict_perm)`` (module docstring)."""
    if d.size < 2:
        return None, None, None
    p_ni, p_inf = sign_flip_pvalues(d, margin)
    if smallest_sign_flip_p(int(d.size)) > alpha:
        return p_ni, p_inf, None
    return p_ni, p_inf, NON_INFERIOR if p_ni <= alpha else INFERIOR if p_inf <= alpha else INCONCLUSIVE


def _paired_tests(
    results: dict, margin: float, level: float, alpha: float, bootstrap: bool
) -> tuple[dict[str, PairedEffect], dict[str, tuple[float, ...]], dict[str, tuple]]:
    """Per recipe of ``results`` (``verdicts``' argument): its ``paired_effect``; and, with >= 2 seeds, its four
    one-sided p-values (non-inferior and inferior against ``margin``, better and worse against 0) and its sign-flip
    cross-check (``_perm_verdict``) at ``alpha``. Returns ``(effects, pvals, perms)``, each keyed by recipe."""
    effects, pvals, perms = {}, {}, {}
    for name, (rec, ctl) in results.items():
        effects[name] = paired_effect(rec, ctl, level, bootstrap=bootstrap)
        if effects[name].n >= 2:
            d = relative_differences(rec, ctl)
            # families: non-inferior, inferior (against the margin), better, worse (against 0)
            pvals[name] = (*one_sided_pvalues(d, margin), *one_sided_pvalues(d, 0.0))
            perms[name] = _perm_verdict(d, margin, alpha)
    return effects, pvals, perms


def verdicts(
    results: dict,
    margin: float,
    level: float = 0.95,
    correction: str = "holm",
    *,
    metric: str = "val_loss",
    bootstrap: bool = True,
    order: TestingOrder | None = None,
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
        order: with ``"holm"``, the order the comparisons are tested in (``lowprec_lab.stats.order``: the controls
            first, each alone; then the primary comparisons; then the rest, each stage Holm-corrected and tested
            only where every earlier one was rejected). None or a flat order: one Holm family over every recipe.

    Returns:
        ``{recipe_name: Verdict}`` in the order of ``results`` (empty for empty ``results``).

    Raises:
        ConfigError (a ValueError): bad margin, level or correction. ValueError: bad arrays.
    """
    margin, level = check_margin(margin), check_level(level)
    if correction not in CORRECTIONS:
        raise ConfigError(f"correction must be one of {CORRECTIONS} (got {correction!r})")
    alpha = (1 - level) / 2
    order = order or TestingOrder()
    effects, pvals, perms = _paired_tests(results, margin, level, alpha, bootstrap)
    gated = ordered_families(pvals, alpha, order) if correction == "holm" else {}
    rule = rule_text(margin, level, correction, len(pvals), order)
    out = {}
    for name, eff in effects.items():
        unadj = final = ci_verdict(eff.lo, eff.hi, margin)
        p = p_adj = pvals.get(name, (None, None, None, None))
        better = worse = False
        untested = None
        if name in pvals:
            better, worse = eff.hi < 0, eff.lo > 0  # the interval against 0 (the CI rule of the 0 families)
        if name in gated:
            g = gated[name]
            p_adj = g.adjusted
            rej_ni, rej_inf, rej_better, rej_worse = g.reject
            if (unadj == NON_INFERIOR and not rej_ni) or (unadj == INFERIOR and not rej_inf):
                final = INCONCLUSIVE  # the CI rule alone would decide; the ordered Holm families do not confirm it
                untested = g.why[0] if unadj == NON_INFERIOR else g.why[1]
            # the refinement against 0 is confirmed in its own family, on either side alike
            better, worse = better and rej_better, worse and rej_worse
        p_ni_perm, p_inf_perm, v_perm = perms.get(name, (None, None, None))
        out[name] = Verdict(
            recipe=name,
            metric=metric,
            effect=eff,
            margin=margin,
            level=level,
            verdict=final,
            verdict_unadjusted=unadj,
            correction=correction,
            n_tests=gated[name].stage_size if name in gated else len(pvals),
            p_noninferior=p[0],
            p_inferior=p[1],
            p_noninferior_adj=p_adj[0],
            p_inferior_adj=p_adj[1],
            mdd=minimum_detectable_difference(eff.n, eff.sd, alpha),
            seeds_needed=seeds_needed(eff.mean, eff.sd, margin, alpha) if eff.n >= 2 else None,
            rule=rule,
            p_superior=p[2],
            p_worse=p[3],
            p_superior_adj=p_adj[2],
            p_worse_adj=p_adj[3],
            better=bool(better),
            worse=bool(worse),
            p_noninferior_perm=p_ni_perm,
            p_inferior_perm=p_inf_perm,
            verdict_perm=v_perm,
            stage="" if order.flat else order.stage_of(name),
            untested=untested,
        )
    return out
