"""The lab's one spike rule, for the loss and the grad-norm series: offline over a whole run (``scan_spikes``,
``divergence_step``; ``lowprec_lab.stats.stability`` turns them into a run's stability metrics) and online, one step
at a time, with the same numbers (``OnlineSpikes``; the training loop's health monitor, ``lowprec.train.health``).

Spike rule (one definition for the loss and the grad-norm series, parameters in ``SpikeRule``):

- EMA with span ``ema_window`` = w: ``alpha = 2 / (w + 1)`` (the pandas ``ewm(span=w, adjust=False)``
  convention), ``ema_0 = x_0``, ``ema_t = alpha * x_t + (1 - alpha) * ema_{t-1}``; a non-finite ``x_t`` leaves the
  EMA unchanged (it is counted as a non-finite event, not as a spike).
- residual ``r_t = x_t - ema_{t-1}``: the value against the EMA of the previous steps only, so a spike does not
  pull its own reference up.
- robust sd at step t: the scale of the residuals themselves, measured over the trailing ``sd_window`` steps
  before t, so that it is the scale of the very statistic tested. The residuals carry the EMA's lag, which drifts
  while the loss descends (about 0.4 nats at step 50 of the test suite's synthetic curve against 0.02 of noise), so
  a polynomial of degree 4 in the step is first fitted to the window's finite residuals by least squares and
  removed (``_detrended``; degree 2 left the lag of the first 100 steps in and missed a 25-sd spike at step 100;
  lower degrees while the window holds few values). The robust sd is then the larger of two estimates from the
  absolute deviations of what is left from its median: ``1.4826 * median`` (the MAD; 1.4826 makes it the sd for
  normal data) and ``98th percentile / 2.326`` (the same sd for normal data, larger for heavy tails), corrected
  for the fitted parameters (``robust_scale``). Steps with fewer than ``min_history`` finite residuals in the
  window, or a robust sd of 0, are not tested (burn-in). Trailing, because the noise changes as training proceeds;
  causal, so a spike never inflates its own yardstick.
- why the residuals and the tail: real loss curves are autocorrelated and heavy-tailed. The former rule took the
  MAD of the step-to-step differences, which measures only the non-persistent part of autocorrelated noise (for
  AR(1) noise with rho 0.8, 0.45 of its sd) and only the body of heavy-tailed noise.
- a spike step stays out of what later steps are measured against: it does not move the EMA and its residual does
  not enter the robust sd's window (``excluded_steps``). Otherwise one large spike that decays over a few steps
  pulls the EMA up and fills the window's tail with its own residuals, and hides the next spikes: after a 100-sd
  spike decaying by 0.8 per step, a 15-sd spike 10 to 90 steps later was found in 0% of curves; it is now found as
  a first one is (100%; a 7.5-sd one in 42-94% of curves depending on the first spike's tail, against 79-92% for a
  first spike). After ``ema_window`` consecutive spike steps the rise is taken as a new level and followed again.
- spike at step t: ``r_t > k * robust_sd_t`` (one-sided: only rises count). The count is in steps
  (``lowprec_lab.stats.stability`` counts events, runs of consecutive spike steps). While the loss descends fast
  the EMA lags above it, so a rise must first make up that lag: the rule is conservative early in training, by
  design of "exceeds its EMA".
- defaults (``SpikeRule``): w = 20, k = 5, sd_window = 100, min_history = 20. Measured on 40 synthetic 2,000-step
  curves per noise (the test suite's decaying curve, noise scale 0.02), spike events per 2,000 steps, former rule
  (MAD of step differences) -> this one: Gaussian 0.0 -> 0.0, Student-t(5) 3.0 -> 1.2, t(3) 9.2 -> 3.5, AR(1)
  rho 0.8 8.5 -> 0.03 (tests/unit/test_stability.py checks t(3), t(5) and AR(1) on fixed seeds); with spike steps
  kept out of the window: t(5) 1.2, t(3) 3.9 (a t(3) outlier no longer widens the yardstick for the next ones),
  AR(1) 0.025, Gaussian 0.0 (20 curves). Detection on
  Gaussian noise (100 400-step curves): a 7.5-sd spike at step 150 in 79% of runs (former rule 72%), at step 200
  in 91% (96%), at step 300 in 92% (99%), a 6.5-sd spike at step 200 in 75% (80%), a 25-sd spike at step 100 in
  90% (100%). t(3) noise has values beyond 10 of its robust sds about once per 1,000 steps: no rule that also
  catches a 6.5-sd spike on Gaussian noise can call all of them noise. Cost: about 0.6 ms per step and series
  online (``OnlineSpikes``; the former rule 0.2 ms), 0.1 s per 2,000 steps offline.

Divergence step: the first step from which the value stays non-finite or above ``divergence_factor`` times the
first finite value until the end of the series (a run that blows up and never recovers); an isolated NaN or a spike
that comes back is counted as a non-finite event or a spike, not as divergence.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

#: 1 / Phi^{-1}(3/4): MAD -> standard deviation for normal data.
MAD_TO_SD = 1.4826
#: The tail estimate of the robust sd: this quantile of the absolute deviations over Phi^{-1}((1 + q) / 2).
TAIL_QUANTILE = 0.98
TAIL_TO_SD = 1 / 2.3263478740408408  # 1 / Phi^{-1}(0.99)
#: Degree of the polynomial removed from the window's residuals (the EMA's lag) before their scale is measured.
TREND_DEGREE = 4


@dataclass(frozen=True)
class SpikeRule:
    """Parameters of the spike and divergence rules (module docstring).

    Args:
        ema_window: EMA span w in steps (alpha = 2 / (w + 1)); >= 1.
        k: spike threshold in robust standard deviations; > 0.
        sd_window: trailing window of residuals for the robust sd, in steps; >= 3.
        min_history: finite residuals needed in that window before a step is tested; 3 <= min_history <= sd_window.
        divergence_factor: divergence when the value stays above this times the first finite value; > 1.

    Raises:
        ValueError: a parameter out of range.
    """

    ema_window: int = 20
    k: float = 5.0
    sd_window: int = 100
    min_history: int = 20
    divergence_factor: float = 1.5

    def __post_init__(self) -> None:
        if self.ema_window < 1:
            raise ValueError(f"ema_window must be >= 1 (got {self.ema_window})")
        if not (self.k > 0 and math.isfinite(self.k)):
            raise ValueError(f"k must be a finite number > 0 (got {self.k})")
        if not (3 <= self.min_history <= self.sd_window):
            raise ValueError(f"need 3 <= min_history <= sd_window (got {self.min_history} and {self.sd_window})")
        if not self.divergence_factor > 1:
            raise ValueError(f"divergence_factor must be > 1 (got {self.divergence_factor})")


@dataclass(frozen=True)
class SpikeScan:
    """Per-step arrays of one series (shape (T,)): ``ema_prev`` (EMA of steps < t; nan at t=0), ``residual``
    (nan where undefined), ``robust_sd`` (nan where not tested), ``spike`` (bool)."""

    ema_prev: np.ndarray
    residual: np.ndarray
    robust_sd: np.ndarray
    spike: np.ndarray

    @property
    def spike_steps(self) -> tuple[int, ...]:
        """Indices of the spike steps."""
        return tuple(int(i) for i in np.flatnonzero(self.spike))


def as_series(x, name: str) -> np.ndarray:
    """``x`` as a float64 array of shape (T,), T >= 1; ``ValueError`` naming ``name`` otherwise."""
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D series, one value per step (got shape {a.shape})")
    return a


def ema_previous(x: np.ndarray, window: int, skip: np.ndarray | None = None) -> np.ndarray:
    """``ema_prev[t]`` = EMA (span ``window``) of the finite values among ``x[:t]`` whose ``skip`` (bool, shape
    (T,)) is False; nan until one exists."""
    alpha = 2.0 / (window + 1)
    out = np.full(x.shape, np.nan)
    skipped = [False] * x.size if skip is None else skip.tolist()
    ema = math.nan
    for t, (v, s) in enumerate(zip(x.tolist(), skipped)):
        out[t] = ema
        if math.isfinite(v) and not s:
            ema = v if math.isnan(ema) else alpha * v + (1 - alpha) * ema
    return out


def excluded_steps(spike: np.ndarray, cap: int) -> np.ndarray:
    """The spike steps kept out of the EMA and of the robust sd's window (bool, shape (T,)): each spike step that
    follows fewer than ``cap`` consecutive spike steps. Past ``cap`` the rise is taken as the new level (a shift,
    not a spike), so the EMA follows it."""
    out = np.zeros(spike.shape, dtype=bool)
    run = 0
    for t, s in enumerate(spike.tolist()):
        out[t] = s and run < cap
        run = run + 1 if s else 0
    return out


def _solve(g: list[list[np.ndarray]], b: list[np.ndarray]) -> list[np.ndarray]:
    """Solve the symmetric positive definite systems ``g c = b`` (each entry an array over rows) by Gaussian
    elimination without pivoting, elementwise over the rows: a row gives the same bits alone or in a batch."""
    n = len(b)
    g, b = [list(row) for row in g], list(b)
    for k in range(n):
        for i in range(k + 1, n):
            f = g[i][k] / g[k][k]
            for j in range(k, n):
                g[i][j] = g[i][j] - f * g[k][j]
            b[i] = b[i] - f * b[k]
    c: list[np.ndarray] = [b[0]] * n
    for i in reversed(range(n)):
        acc = b[i]
        for j in range(i + 1, n):
            acc = acc - g[i][j] * c[j]
        c[i] = acc / g[i][i]
    return c


def _detrended(win: np.ndarray, degree: int) -> np.ndarray:
    """Rows of ``win`` (shape (m, w), nan = missing) minus each row's least-squares polynomial of ``degree`` (0-4)
    in the position, fitted to its finite values (Legendre basis on [-1, 1], normal equations solved elementwise by
    ``_solve``, so that ``OnlineSpikes`` matches ``scan_spikes`` bit for bit). Rows need > ``degree`` finite
    values."""
    w = win.shape[1]
    p = np.linspace(-1.0, 1.0, w)
    basis = [np.ones(w), p, (3 * p**2 - 1) / 2, (5 * p**3 - 3 * p) / 2, (35 * p**4 - 30 * p**2 + 3) / 8]
    basis = basis[: degree + 1]
    m = np.isfinite(win)
    y = np.where(m, win, 0.0)
    mb = [np.where(m, v, 0.0) for v in basis]
    g = [[np.sum(mb[i] * basis[j], axis=1) for j in range(len(basis))] for i in range(len(basis))]
    b = [np.sum(y * v, axis=1) for v in basis]
    with np.errstate(all="ignore"):  # a row without enough points gives nan, and is not tested
        c = _solve(g, b)
        fit = sum(ci[:, None] * v for ci, v in zip(c, basis))
        return np.where(m, win - fit, np.nan)


def robust_scale(win: np.ndarray) -> np.ndarray:
    """Robust sd of each row of trailing residuals ``win`` (shape (m, w), nan = missing, >= 3 finite per row):
    the larger of ``MAD_TO_SD * MAD`` and ``TAIL_TO_SD * TAIL_QUANTILE``-quantile of the absolute deviations from
    the median, after removing each row's polynomial trend (module docstring), times ``sqrt(n / (n - degree - 1))``
    for the n finite values the fit used (the fit absorbs part of the spread). The degree is ``TREND_DEGREE``, lower
    while the window holds few values (``(n - 1) // 4``: n >= 17 for degree 4), so that a short history is never
    fitted exactly. Returns shape (m,)."""
    n = np.isfinite(win).sum(axis=1)
    degree = np.minimum((n - 1) // 4, TREND_DEGREE)
    u = np.full(win.shape, np.nan)
    for d in np.unique(degree).tolist():
        rows = degree == d
        u[rows] = _detrended(win[rows], d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-nan rows (no fit): nan, not tested
        dev = np.abs(u - np.nanmedian(u, axis=1, keepdims=True))
        mad = np.nanmedian(dev, axis=1)
        tail = np.nanquantile(dev, TAIL_QUANTILE, axis=1)
    with np.errstate(all="ignore"):
        return np.maximum(MAD_TO_SD * mad, TAIL_TO_SD * tail) * np.sqrt(n / (n - degree - 1))


def _scan_given(x: np.ndarray, rule: SpikeRule, spike: np.ndarray) -> SpikeScan:
    """One vectorized pass of the rule when the spike steps before each step are ``spike``: the EMA and the
    windows leave out ``excluded_steps(spike)``; returns the decisions this pass makes."""
    skip = excluded_steps(spike, rule.ema_window)
    ema_prev = ema_previous(x, rule.ema_window, skip)
    with np.errstate(invalid="ignore"):
        residual = np.where(np.isfinite(x) & np.isfinite(ema_prev), x - ema_prev, np.nan)
    residual[~np.isfinite(residual)] = np.nan
    w = rule.sd_window
    # windows[t] = residual[t-w : t] (nan-padded before the start, nan at excluded spike steps): the trailing
    # residuals before step t.
    kept = np.where(skip, np.nan, residual)
    windows = sliding_window_view(np.concatenate([np.full(w, np.nan), kept]), w)[: x.size]
    tested = np.isfinite(windows).sum(axis=1) >= rule.min_history
    robust_sd = np.full(x.size, np.nan)
    if tested.any():
        robust_sd[tested] = robust_scale(windows[tested])
    with np.errstate(invalid="ignore"):
        found = np.isfinite(residual) & (robust_sd > 0) & (residual > rule.k * robust_sd)
    return SpikeScan(ema_prev=ema_prev, residual=residual, robust_sd=robust_sd, spike=found)


def scan_spikes(x, rule: SpikeRule = SpikeRule()) -> SpikeScan:
    """Apply the spike rule (module docstring) to a 1-D series of T steps (loss in nats, or grad norm).

    A step's decision depends on the decisions before it (excluded spike steps), so the rule is sequential; it is
    computed here by vectorized passes repeated until the decisions stop changing. Each pass fixes at least the
    earliest step that differed (its inputs are the earlier steps' decisions), so the fixed point is reached in at
    most one pass per spike step plus one, and it is the sequential rule's answer, step for step
    (``OnlineSpikes``).

    Raises:
        ValueError: not a non-empty 1-D series.
    """
    x = as_series(x, "series")
    spike = np.zeros(x.size, dtype=bool)
    while True:
        scan = _scan_given(x, rule, spike)
        if np.array_equal(scan.spike, spike):
            return scan
        spike = scan.spike


def divergence_step(x, factor: float = 1.5) -> int | None:
    """First step from which ``x`` stays non-finite or above ``factor`` x its first finite value to the end; None
    if the series ends healthy. A series with no finite value diverges at step 0."""
    x = as_series(x, "series")
    finite = np.isfinite(x)
    if not finite.any():
        return 0
    with np.errstate(invalid="ignore"):
        bad = ~finite | (x > factor * x[np.argmax(finite)])
    if not bad[-1]:
        return None
    healthy = np.flatnonzero(~bad)
    return int(healthy[-1] + 1) if healthy.size else 0


@dataclass(frozen=True)
class SpikeTest:
    """One step's test by ``OnlineSpikes.update``: ``spike``; ``threshold``: the value above which the step would
    have been a spike (``ema_{t-1} + k * robust_sd_t``; nan while the rule is not testing: burn-in, a robust sd of 0,
    or no finite value yet); ``residual`` (nan where undefined)."""

    spike: bool
    threshold: float
    residual: float


class OnlineSpikes:
    """``scan_spikes`` one step at a time: ``update(x_t)`` tests step t against the steps before it and returns the
    same decision ``scan_spikes`` makes for index t of the whole series (same float64 operations, tested bit for bit
    in tests/unit/test_health.py). Memory: the EMA and the last ``sd_window`` residuals.

    ``state_dict``/``load_state_dict`` carry that state through a checkpoint (plain floats), so a resumed run tests
    its next steps exactly as an uninterrupted one.
    """

    def __init__(self, rule: SpikeRule = SpikeRule()):
        self.rule = rule
        self.alpha = 2.0 / (rule.ema_window + 1)
        self.ema = math.nan
        self.residuals: deque[float] = deque(maxlen=rule.sd_window)
        self.steps = 0
        self.run = 0  # consecutive spike steps just before the next one

    def robust_sd(self) -> float:
        """The robust sd over the trailing residuals (nan with fewer than ``min_history`` finite ones), computed as
        ``scan_spikes`` computes its row for this step (a nan-padded window of ``sd_window`` residuals)."""
        w = self.rule.sd_window
        win = np.full((1, w), np.nan)
        if self.residuals:
            win[0, w - len(self.residuals) :] = self.residuals
        if np.isfinite(win).sum() < self.rule.min_history:
            return math.nan
        return float(robust_scale(win)[0])

    def update(self, x: float) -> SpikeTest:
        """Test ``x`` (the next value of the series), then add it to the history."""
        x = float(x)
        ema_prev = self.ema
        residual = x - ema_prev if math.isfinite(x) and math.isfinite(ema_prev) else math.nan
        if not math.isfinite(residual):
            residual = math.nan
        sd = self.robust_sd()
        tested = math.isfinite(ema_prev) and sd > 0  # nan compares False
        threshold = ema_prev + self.rule.k * sd if tested else math.nan
        spike = bool(tested and math.isfinite(residual) and residual > self.rule.k * sd)
        excluded = spike and self.run < self.rule.ema_window  # as ``excluded_steps``
        self.run = self.run + 1 if spike else 0
        self.residuals.append(math.nan if excluded else residual)
        if math.isfinite(x) and not excluded:
            self.ema = x if math.isnan(self.ema) else self.alpha * x + (1 - self.alpha) * self.ema
        self.steps += 1
        return SpikeTest(spike, threshold, residual)

    def state_dict(self) -> dict:
        return {"ema": self.ema, "residuals": list(self.residuals), "steps": self.steps, "run": self.run}

    def load_state_dict(self, state: dict) -> None:
        """Load ``state_dict``'s output. A checkpoint of the former rule (step differences, no residuals) starts
        the residual window empty: the next ``min_history`` steps are burn-in again."""
        self.ema, self.steps = float(state["ema"]), int(state["steps"])
        self.run = int(state.get("run", 0))
        self.residuals = deque((float(r) for r in state.get("residuals", ())), maxlen=self.rule.sd_window)
