"""The noise floor of an ablation, measured along the run: seed spread of the control, paired spread of a negative
control, and the seeds a non-inferiority verdict at a margin needs, at every validation point.

The negative control is a recipe that computes the same mathematics as the control with another FP32 rounding
order (``fp32_reordered``: every FP32 matmul's contraction reversed) and is trained with the control's seeds (same
initial weights, same batches). Its per-seed paired relative difference ``d_i = (neg_i - ctl_i) / ctl_i`` has a true
mean of 0 (no precision effect) and a spread that is the chaotic amplification of one rounding difference: the
smallest paired spread any recipe that changes the numerics can have. The seeds needed at a point are those for
which a recipe with a true gap of 0 and that paired sd gets ``non-inferior`` at ``margin`` with ``power``: the
one-sided paired t-test at ``alpha`` solved for n (``lowprec_lab.stats.verdict.seeds_needed``, statsmodels'
``TTestPower``), per comparison before any Holm correction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from lowprec_lab.stats.verdict import POWER, minimum_detectable_difference, seeds_needed

#: seed -> [(step, value)]: one run's validation curve (``lowprec_lab.tracking.runs.RunData.curves["val_loss"]``).
Curves = Mapping[int, Sequence[tuple[int, float]]]


def seeds_for_zero_gap(sd: float, margin: float, alpha: float, power: float = POWER) -> int | None:
    """Seeds a recipe whose true paired relative difference is 0 needs for a ``non-inferior`` verdict at ``margin``
    with probability ``power``, at paired sd ``sd`` (relative, e.g. 0.001 = 0.1%): ``seeds_needed(0, sd, margin,
    alpha, power)``, the one-sided one-sample t-test's sample size (statsmodels ``TTestPower``, effect size
    ``margin / sd``), at least 2. 2 when ``sd`` is 0 (every pair identical); None when ``sd`` is not finite."""
    if not math.isfinite(sd):
        return None
    if sd == 0:
        return 2
    return seeds_needed(0.0, sd, margin, alpha, power)


@dataclass(frozen=True)
class NoisePoint:
    """The noise at one validation point.

    Fields: ``step`` (0-based step after which it validated), ``tokens`` (training tokens seen by then),
    ``n`` (seed pairs at this point), ``control_mean`` / ``control_sd`` (nats/token; sample sd, ddof=1, over the
    control's seeds), ``control_cv`` (``control_sd / control_mean``), ``paired_mean`` / ``paired_sd`` (of the per-seed
    relative differences negative vs control, ddof=1), ``seeds_needed`` (``seeds_for_zero_gap`` of ``paired_sd``),
    ``seeds_needed_unpaired`` (the same for an unpaired design, sd ``sqrt(2) * control_cv``: what pairing by seed
    saves), ``mdd`` (minimum detectable difference at these ``n`` seeds, ``minimum_detectable_difference``). Values
    that need two seeds are nan / None with one.
    """

    step: int
    tokens: int
    n: int
    control_mean: float
    control_sd: float
    control_cv: float
    paired_mean: float
    paired_sd: float
    seeds_needed: int | None
    seeds_needed_unpaired: int | None
    mdd: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def _sd(x: np.ndarray) -> float:
    return float(x.std(ddof=1)) if x.size >= 2 else math.nan


def noise_point(step: int, tokens: int, control, negative, margin: float, alpha: float) -> NoisePoint:
    """The ``NoisePoint`` of paired per-seed values ``control[i]``, ``negative[i]`` (1-D, nats/token, > 0).
    Raises ``ValueError`` for unequal lengths or no values."""
    c, g = np.asarray(control, dtype=np.float64), np.asarray(negative, dtype=np.float64)
    if c.shape != g.shape or c.ndim != 1 or c.size == 0:
        raise ValueError(f"control and negative must be 1-D and paired by seed (got shapes {c.shape}, {g.shape})")
    d = (g - c) / c
    mean, sd, psd = float(c.mean()), _sd(c), _sd(d)
    cv = sd / mean
    return NoisePoint(
        step=step,
        tokens=tokens,
        n=int(c.size),
        control_mean=mean,
        control_sd=sd,
        control_cv=cv,
        paired_mean=float(d.mean()),
        paired_sd=psd,
        seeds_needed=seeds_for_zero_gap(psd, margin, alpha),
        seeds_needed_unpaired=seeds_for_zero_gap(math.sqrt(2) * cv, margin, alpha),
        mdd=minimum_detectable_difference(int(c.size), psd, alpha),
    )


def noise_curve(
    control: Curves, negative: Curves, tokens_per_step: int, margin: float, alpha: float
) -> list[NoisePoint]:
    """One ``NoisePoint`` per validation step that the control and the negative control share for at least one seed,
    in step order, each over the seeds both have at that step. ``tokens_per_step``: training tokens per optimizer
    step (tokens seen after step s: ``(s + 1) * tokens_per_step``)."""
    ctl = {seed: dict(curve) for seed, curve in control.items()}
    neg = {seed: dict(curve) for seed, curve in negative.items()}
    steps = sorted({s for seed in ctl.keys() & neg.keys() for s in ctl[seed].keys() & neg[seed].keys()})
    out = []
    for s in steps:
        seeds = sorted(seed for seed in ctl.keys() & neg.keys() if s in ctl[seed] and s in neg[seed])
        c, g = [ctl[seed][s] for seed in seeds], [neg[seed][s] for seed in seeds]
        out.append(noise_point(s, (s + 1) * tokens_per_step, c, g, margin, alpha))
    return out


def last_k_mean(curve: Sequence[tuple[int, float]], k: int) -> float:
    """Mean of the last ``k`` validation values of a run's ``[(step, value)]`` curve (all of them if fewer): the
    "mean of the last k validation points" estimator of the final loss. Raises ``ValueError`` for k < 1 or an empty
    curve."""
    if k < 1 or not curve:
        raise ValueError(f"need k >= 1 and a non-empty curve (k={k}, {len(curve)} points)")
    vals = [v for _, v in sorted(curve)[-k:]]
    return float(np.mean(vals))


def last_k_point(
    control: Curves, negative: Curves, k: int, tokens_per_step: int, margin: float, alpha: float
) -> NoisePoint:
    """The ``NoisePoint`` of the final loss estimated by the mean of each run's last ``k`` validation points, over the
    seeds both arms have (``step``/``tokens``: the control's last validation point)."""
    seeds = sorted(seed for seed in control.keys() & negative.keys() if control[seed] and negative[seed])
    if not seeds:
        raise ValueError("no seed has a validation curve in both arms")
    c = [last_k_mean(control[s], k) for s in seeds]
    g = [last_k_mean(negative[s], k) for s in seeds]
    last = max(step for s in seeds for step, _ in control[s])
    return noise_point(last, (last + 1) * tokens_per_step, c, g, margin, alpha)
