"""The lab's one spike rule, for the loss and the grad-norm series: offline over a whole run (``scan_spikes``,
``divergence_step``; ``experiments.stats.stability`` turns them into a run's stability metrics) and online, one step
at a time, with the same numbers (``OnlineSpikes``; the training loop's health monitor, ``lowprec.train.health``).

Spike rule (one definition for the loss and the grad-norm series, parameters in ``SpikeRule``):

- EMA with span ``ema_window`` = w: ``alpha = 2 / (w + 1)`` (the pandas ``ewm(span=w, adjust=False)``
  convention), ``ema_0 = x_0``, ``ema_t = alpha * x_t + (1 - alpha) * ema_{t-1}``; a non-finite ``x_t`` leaves the
  EMA unchanged (it is counted as a non-finite event, not as a spike).
- residual ``r_t = x_t - ema_{t-1}``: the value against the EMA of the previous steps only, so a spike does not
  pull its own reference up.
- robust sd at step t: the per-step noise sd, ``1.4826 * MAD / sqrt(2)`` of the finite step-to-step differences
  ``x_s - x_{s-1}`` over the trailing ``sd_window`` steps before t (MAD = median absolute deviation from the
  median; 1.4826 makes it the sd for normal data; differences of white noise have sqrt(2) times its sd: the
  finite-difference form of Donoho & Johnstone's 1994 MAD noise estimate). Differences, not the residuals, because
  differencing removes the smooth descent of the loss: during fast descent the residuals drift with the EMA's lag
  and their MAD overstates the noise (about 8x at step 100 of the test suite's synthetic curve, 50-step window).
  Trailing, not whole-series, because the noise changes as training proceeds; causal, so a spike never inflates
  its own yardstick. Steps with fewer than ``min_history`` finite differences in the window, or a robust sd of 0,
  are not tested (burn-in).
- spike at step t: ``r_t > k * robust_sd_t`` (one-sided: only rises count). The count is in steps. While the loss
  descends fast the EMA lags above it, so a rise must first make up that lag: the rule is conservative early in
  training, by design of "exceeds its EMA".
- defaults (``SpikeRule``): w = 20, k = 5, sd_window = 100, min_history = 20. Measured on 300 synthetic 400-step
  curves (the test suite's decaying curve, Gaussian noise): k = 5 gave no false spike (k = 4: 0.03 per run,
  k = 4.5: 0.01); a 7.5-sd spike at step 200 or 300 is caught in 94-98% of runs, at step 150 (where the EMA
  still lags by about 0.75 sd) in 77%.

Divergence step: the first step from which the value stays non-finite or above ``divergence_factor`` times the
first finite value until the end of the series (a run that blows up and never recovers); an isolated NaN or a spike
that comes back is counted as a non-finite event or a spike, not as divergence.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

#: 1 / Phi^{-1}(3/4): MAD -> standard deviation for normal data.
MAD_TO_SD = 1.4826


@dataclass(frozen=True)
class SpikeRule:
    """Parameters of the spike and divergence rules (module docstring).

    Args:
        ema_window: EMA span w in steps (alpha = 2 / (w + 1)); >= 1.
        k: spike threshold in robust standard deviations; > 0.
        sd_window: trailing window of step-to-step differences for the robust sd, in steps; >= 3.
        min_history: finite differences needed in that window before a step is tested; 3 <= min_history <= sd_window.
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


def ema_previous(x: np.ndarray, window: int) -> np.ndarray:
    """``ema_prev[t]`` = EMA (span ``window``) of the finite values among ``x[:t]``; nan until one exists."""
    alpha = 2.0 / (window + 1)
    out = np.full(x.shape, np.nan)
    ema = math.nan
    for t, v in enumerate(x.tolist()):
        out[t] = ema
        if math.isfinite(v):
            ema = v if math.isnan(ema) else alpha * v + (1 - alpha) * ema
    return out


def scan_spikes(x, rule: SpikeRule = SpikeRule()) -> SpikeScan:
    """Apply the spike rule (module docstring) to a 1-D series of T steps (loss in nats, or grad norm).

    Raises:
        ValueError: not a non-empty 1-D series.
    """
    x = as_series(x, "series")
    ema_prev = ema_previous(x, rule.ema_window)
    with np.errstate(invalid="ignore"):
        residual = np.where(np.isfinite(x) & np.isfinite(ema_prev), x - ema_prev, np.nan)
    with np.errstate(invalid="ignore"):
        diff = np.concatenate([[np.nan], np.diff(x)])  # diff[s] = x[s] - x[s-1]; nan next to a non-finite value
    diff[~np.isfinite(diff)] = np.nan
    w = rule.sd_window
    # windows[t] = diff[t-w : t] (nan-padded before the start): the trailing differences before step t.
    windows = sliding_window_view(np.concatenate([np.full(w, np.nan), diff]), w)[: x.size]
    tested = np.isfinite(windows).sum(axis=1) >= rule.min_history
    robust_sd = np.full(x.size, np.nan)
    if tested.any():
        win = windows[tested]
        med = np.nanmedian(win, axis=1, keepdims=True)
        robust_sd[tested] = MAD_TO_SD * np.nanmedian(np.abs(win - med), axis=1) / math.sqrt(2)
    with np.errstate(invalid="ignore"):
        spike = np.isfinite(residual) & (robust_sd > 0) & (residual > rule.k * robust_sd)
    return SpikeScan(ema_prev=ema_prev, residual=residual, robust_sd=robust_sd, spike=spike)


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
    in tests/unit/test_health.py). Memory: the EMA, the last value and the last ``sd_window`` differences.

    ``state_dict``/``load_state_dict`` carry that state through a checkpoint (plain floats), so a resumed run tests
    its next steps exactly as an uninterrupted one.
    """

    def __init__(self, rule: SpikeRule = SpikeRule()):
        self.rule = rule
        self.alpha = 2.0 / (rule.ema_window + 1)
        self.ema = math.nan
        self.last = math.nan
        self.diffs: deque[float] = deque(maxlen=rule.sd_window)
        self.steps = 0

    def robust_sd(self) -> float:
        """The robust sd over the trailing differences (nan with fewer than ``min_history`` finite ones), computed as
        ``scan_spikes`` computes its row for this step (a nan-padded window of ``sd_window`` differences)."""
        w = self.rule.sd_window
        win = np.full((1, w), np.nan)
        if self.diffs:
            win[0, w - len(self.diffs) :] = self.diffs
        if np.isfinite(win).sum() < self.rule.min_history:
            return math.nan
        med = np.nanmedian(win, axis=1, keepdims=True)
        return float(MAD_TO_SD * np.nanmedian(np.abs(win - med), axis=1)[0] / math.sqrt(2))

    def update(self, x: float) -> SpikeTest:
        """Test ``x`` (the next value of the series), then add it to the history."""
        x = float(x)
        ema_prev = self.ema
        residual = x - ema_prev if math.isfinite(x) and math.isfinite(ema_prev) else math.nan
        sd = self.robust_sd()
        tested = math.isfinite(ema_prev) and sd > 0  # nan compares False
        threshold = ema_prev + self.rule.k * sd if tested else math.nan
        spike = bool(tested and math.isfinite(residual) and residual > self.rule.k * sd)
        # scan_spikes' diff[t] = x[t] - x[t-1]: nan at t = 0 and next to a non-finite value.
        d = x - self.last if self.steps > 0 else math.nan
        self.diffs.append(d if math.isfinite(d) else math.nan)
        if math.isfinite(x):
            self.ema = x if math.isnan(self.ema) else self.alpha * x + (1 - self.alpha) * self.ema
        self.last = x
        self.steps += 1
        return SpikeTest(spike, threshold, residual)

    def state_dict(self) -> dict:
        return {"ema": self.ema, "last": self.last, "diffs": list(self.diffs), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.ema, self.last, self.steps = float(state["ema"]), float(state["last"]), int(state["steps"])
        self.diffs = deque((float(d) for d in state["diffs"]), maxlen=self.rule.sd_window)
