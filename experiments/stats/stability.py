"""Loss-stability metrics of one run (spikes, largest excursion, non-finite events, divergence) and a per-recipe
stability verdict against the control.

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

Largest excursion: ``max_t r_t / ema_{t-1}`` over finite steps (relative rise above the EMA, 0 if never above).
Divergence step: the first step from which the value stays non-finite or above ``divergence_factor`` times the
first finite value until the end of the series (a run that blows up and never recovers); an isolated NaN or a spike
that comes back is counted as a non-finite event or a spike, not as divergence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from scipy.stats import binomtest

#: 1 / Phi^{-1}(3/4): MAD -> standard deviation for normal data.
MAD_TO_SD = 1.4826
LESS_STABLE, AS_STABLE = "less stable", "as stable"


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


def _series(x, name: str) -> np.ndarray:
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
    x = _series(x, "series")
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
    x = _series(x, "series")
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
class StabilityMetrics:
    """Stability of one run (counts in steps; excursion dimensionless, 0.1 = 10% above the EMA).

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
    loss = _series(loss, "loss")
    scan = scan_spikes(loss, rule)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = scan.residual / scan.ema_prev
    rel = rel[np.isfinite(rel)]
    out = dict(
        steps=int(loss.size),
        loss_spikes=int(scan.spike.sum()),
        loss_spike_steps=scan.spike_steps,
        largest_excursion=float(max(rel.max(initial=0.0), 0.0)),
        nonfinite_loss=int((~np.isfinite(loss)).sum()),
        divergence_step=divergence_step(loss, rule.divergence_factor),
        skipped_steps=int(skipped_steps),
    )
    if grad_norm is not None:
        g = _series(grad_norm, "grad_norm")
        gscan = scan_spikes(g, rule)
        out.update(
            grad_norm_spikes=int(gscan.spike.sum()),
            grad_norm_spike_steps=gscan.spike_steps,
            nonfinite_grad_norm=int((~np.isfinite(g)).sum()),
        )
    return StabilityMetrics(**out)


@dataclass(frozen=True)
class StabilityVerdict:
    """A recipe's stability against the control: ``verdict`` is ``"less stable"`` or ``"as stable"``; ``reason``
    says which rule fired (or that none did); p-values of the spike-rate tests (None when not run)."""

    verdict: str
    reason: str
    diverged: tuple[int, int]  # (recipe runs diverged, recipe runs)
    control_diverged: tuple[int, int]
    p_loss_spikes: float | None
    p_grad_norm_spikes: float | None


def _rate_test(rec: list[int], ctl: list[int]) -> float | None:
    """One-sided exact conditional test that the recipe's spike rate per run exceeds the control's (two Poisson
    rates compared through the binomial split of the total, Przyborowski & Wilenski 1940): given S spikes in all,
    the recipe's count is Binomial(S, n_r / (n_r + n_c)) under equal rates. None when there are no spikes."""
    s_r, s_c = sum(rec), sum(ctl)
    if s_r + s_c == 0:
        return None
    return float(binomtest(s_r, s_r + s_c, len(rec) / (len(rec) + len(ctl)), alternative="greater").pvalue)


def stability_verdict(
    recipe_runs: Sequence[StabilityMetrics], control_runs: Sequence[StabilityMetrics], alpha: float = 0.05
) -> StabilityVerdict:
    """``"less stable"`` when the recipe's runs diverge or spike more than the control's, else ``"as stable"``.

    Rule: (1) a larger share of the recipe's runs diverged than of the control's (no test: a divergence at this
    scale is a fact, not noise); or (2) the recipe's loss-spike rate per run exceeds the control's by the one-sided
    exact conditional Poisson test (``_rate_test``, ``scipy.stats.binomtest``) at ``alpha``; or (3) likewise for
    grad-norm spikes when every run has a grad-norm series. When both (2) and (3) are tested each uses
    ``alpha / 2`` (Bonferroni). With 3 runs each and no control spikes, p = 0.5**s for s recipe spikes: (2) needs
    s >= 5 at alpha = 0.05 and s >= 6 at 0.025.

    Raises:
        ValueError: no recipe or no control runs, or alpha not in (0, 1).
    """
    if not recipe_runs or not control_runs:
        raise ValueError("stability_verdict needs at least one recipe run and one control run")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1) (got {alpha})")
    div_r = (sum(r.diverged for r in recipe_runs), len(recipe_runs))
    div_c = (sum(r.diverged for r in control_runs), len(control_runs))
    p_loss = _rate_test([r.loss_spikes for r in recipe_runs], [r.loss_spikes for r in control_runs])
    has_grad = all(r.grad_norm_spikes is not None for r in [*recipe_runs, *control_runs])
    p_grad = (
        _rate_test([r.grad_norm_spikes for r in recipe_runs], [r.grad_norm_spikes for r in control_runs])
        if has_grad
        else None
    )
    a = alpha / 2 if has_grad else alpha
    if div_r[0] / div_r[1] > div_c[0] / div_c[1]:
        verdict, reason = LESS_STABLE, f"diverged in {div_r[0]}/{div_r[1]} runs vs {div_c[0]}/{div_c[1]} (control)"
    elif p_loss is not None and p_loss < a:
        verdict, reason = LESS_STABLE, f"more loss spikes per run than the control (p={p_loss:.3g} < {a:g})"
    elif p_grad is not None and p_grad < a:
        verdict, reason = LESS_STABLE, f"more grad-norm spikes per run than the control (p={p_grad:.3g} < {a:g})"
    else:
        verdict, reason = AS_STABLE, "no more divergence or spikes than the control"
    return StabilityVerdict(verdict, reason, div_r, div_c, p_loss, p_grad)
