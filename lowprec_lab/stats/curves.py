"""Loss curves over seeds: the relative loss error of a recipe against the control, and the seed mean with a band.

Relative loss error (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv:2412.19437, which judges FP8
training by it against BF16 at the same seed and data: "consistently below 0.25%"): for seed i and step t,

    e_i(t) = (L_recipe,i(t) - L_control,i(t)) / L_control,i(t)

paired by seed (seed i of every recipe shares the initial weights and batch order of seed i of the control), so
e_i(t) > 0 means the recipe's loss is higher (worse). The training loss is noisy from step to step, so each run's
series is first smoothed by a trailing moving average over ``TRAIN_SMOOTH_WINDOW`` logged steps (fewer at the
start); validation losses are used as logged. The curve is the mean over the n paired seeds with the two-sided
paired t-interval at each step, ``mean +- t_{(1+level)/2, n-1} * sd / sqrt(n)`` (sd with ddof=1; Student 1908,
``scipy.stats.t``); with one seed there is no interval (``lo`` and ``hi`` are None).

Steps are aligned by value, not by position: a pair contributes the steps that both runs logged with a finite
value, and the curve keeps the steps that every pair has (so the mean at every step is over the same seeds).

Pure numpy/scipy; the report feeds it ``(step, value)`` lists read back from MLflow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

#: Trailing moving-average window, in logged training steps, applied to each run's training loss before the
#: relative error is taken (and to the training-loss figure).
TRAIN_SMOOTH_WINDOW = 10

#: One run's curve: ``(step, value)`` pairs, steps as logged (any order; unique).
Curve = Sequence[tuple[int, float]]


def trailing_mean(values, window: int) -> np.ndarray:
    """Trailing moving average: ``out[t] = mean(values[max(0, t - window + 1) : t + 1])``.

    Args:
        values: 1-D float series of T values (e.g. the training loss in nats, one per logged step).
        window: number of points averaged, >= 1 (window 1 returns the values unchanged).

    Returns:
        float64 array of shape (T,); a non-finite value makes the ``window`` outputs that include it non-finite.

    Raises:
        ValueError: ``window < 1`` or ``values`` not 1-D.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1 (got {window})")
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"values must be a 1-D series (got shape {x.shape})")
    csum = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(x.size)
    start = np.maximum(0, idx - window + 1)
    return (csum[idx + 1] - csum[start]) / (idx + 1 - start)


def _as_series(curve: Curve, window: int | None) -> dict[int, float]:
    """``{step: value}`` of one run in step order, smoothed by ``trailing_mean`` when ``window`` is given."""
    pts = sorted((int(s), float(v)) for s, v in curve)
    vals = [v for _, v in pts]
    if window is not None and pts:
        vals = trailing_mean(vals, window).tolist()
    return {s: v for (s, _), v in zip(pts, vals)}


def t_band(x, level: float = 0.95) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Mean over seeds and the two-sided paired t-interval at every step.

    Args:
        x: float array of shape (n, T): n seeds by T steps (finite).
        level: two-sided confidence level in (0, 1).

    Returns:
        ``(mean, lo, hi)``, each float64 of shape (T,); ``lo`` and ``hi`` are None when n < 2 (no sd, no interval).
        Equal to ``scipy.stats.t.interval(level, n - 1, loc=mean, scale=sem)`` with ``sem = sd(ddof=1) / sqrt(n)``.

    Raises:
        ValueError: ``x`` not 2-D, n == 0, or ``level`` outside (0, 1).
    """
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] == 0:
        raise ValueError(f"x must be (seeds, steps) with at least one seed (got shape {a.shape})")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1) (got {level})")
    mean = a.mean(axis=0)
    n = a.shape[0]
    if n < 2:
        return mean, None, None
    half = stats.t.ppf((1 + level) / 2, n - 1) * a.std(axis=0, ddof=1) / np.sqrt(n)
    return mean, mean - half, mean + half


@dataclass(frozen=True)
class SeedCurves:
    """Per-seed curves on common steps and their summary over seeds.

    ``steps``: int64 (T,). ``seeds``: the n seeds, the rows of ``per_seed`` (float64 (n, T)). ``mean``: (T,).
    ``lo``/``hi``: (T,) band (``band`` says which: ``"t"`` paired t-interval at ``level``, ``"minmax"`` over seeds)
    or None with one seed under ``"t"``. ``window``: the trailing-mean window applied first (None: raw values).
    """

    steps: np.ndarray
    seeds: tuple[int, ...]
    per_seed: np.ndarray
    mean: np.ndarray
    lo: np.ndarray | None
    hi: np.ndarray | None
    band: str
    level: float
    window: int | None

    @property
    def n(self) -> int:
        """Number of seeds."""
        return len(self.seeds)


def _common_steps(series: Sequence[dict[int, float]]) -> np.ndarray:
    """Steps present with a finite value in every series, ascending (int64; empty when there is none)."""
    if not series:
        return np.zeros(0, dtype=np.int64)
    common = set.intersection(*({s for s, v in d.items() if np.isfinite(v)} for d in series))
    return np.array(sorted(common), dtype=np.int64)


def _summary(steps, seeds, rows, band: str, level: float, window: int | None) -> SeedCurves:
    per_seed = np.array(rows, dtype=np.float64).reshape(len(seeds), steps.size)
    if band == "t":
        mean, lo, hi = t_band(per_seed, level)
    else:
        mean, lo, hi = per_seed.mean(axis=0), per_seed.min(axis=0), per_seed.max(axis=0)
    return SeedCurves(steps, tuple(seeds), per_seed, mean, lo, hi, band, level, window)


def relative_loss_error(
    recipe: Mapping[int, Curve], control: Mapping[int, Curve], *, window: int | None = None, level: float = 0.95
) -> SeedCurves | None:
    """Relative loss error of a recipe against the control per seed, its mean and paired t-band (module docstring).

    Args:
        recipe, control: ``{seed: [(step, loss), ...]}``, loss in nats; only seeds present in both are paired.
        window: trailing-mean window (logged steps) applied to each run before the ratio (the training loss);
            None for none (the validation loss).
        level: two-sided level of the band.

    Returns:
        ``SeedCurves`` with ``per_seed[i, t] = (L_recipe,i(t) - L_control,i(t)) / L_control,i(t)``, dimensionless
        (0.01 = 1% higher loss), ``band="t"``; None when no seed is paired or the pairs share no step.

    Raises:
        ValueError: a control loss <= 0 on a common step (the ratio would be meaningless), or a bad ``level``.
    """
    seeds = sorted(set(recipe) & set(control))
    if not seeds:
        return None
    rec = [_as_series(recipe[s], window) for s in seeds]
    ctl = [_as_series(control[s], window) for s in seeds]
    steps = _common_steps(rec + ctl)
    if steps.size == 0:
        return None
    r = np.array([[d[int(t)] for t in steps] for d in rec])
    c = np.array([[d[int(t)] for t in steps] for d in ctl])
    if (c <= 0).any():
        raise ValueError("a control loss <= 0: the relative loss error needs positive control losses")
    return _summary(steps, seeds, (r - c) / c, "t", level, window)


def seed_band(curves: Mapping[int, Curve], *, window: int | None = None) -> SeedCurves | None:
    """Mean over seeds of one recipe's curve with its min-max band over seeds (for the loss figure).

    Args:
        curves: ``{seed: [(step, value), ...]}`` of one recipe (e.g. loss in nats).
        window: trailing-mean window applied to each seed's series first (None: raw values).

    Returns:
        ``SeedCurves`` with ``band="minmax"`` (lo/hi = min/max over seeds at each common step; equal to the mean
        with one seed), or None without a common finite step.
    """
    seeds = sorted(curves)
    series = [_as_series(curves[s], window) for s in seeds]
    steps = _common_steps(series)
    if steps.size == 0:
        return None
    return _summary(steps, seeds, [[d[int(t)] for t in steps] for d in series], "minmax", 0.0, window)
