"""Loss-stability metrics of one run (spikes, largest excursion, non-finite events, divergence) and a per-recipe
stability verdict against the control.

Spike rule and divergence step: ``lowprec.measure.spikes`` (one definition, shared with the training loop's
online health monitor; its module docstring states the rule and how its defaults were measured).

Largest excursion: ``max_t r_t / ema_{t-1}`` over finite steps (relative rise above the EMA, 0 if never above).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import binomtest

from lowprec.measure.spikes import (
    MAD_TO_SD,
    SpikeRule,
    SpikeScan,
    as_series,
    divergence_step,
    ema_previous,
    scan_spikes,
)

# The rule itself lives in lowprec (the training loop detects spikes online with it); it is re-exported here, where
# the lab's statistics have always imported it from.
__all__ = [
    "AS_STABLE",
    "LESS_STABLE",
    "MAD_TO_SD",
    "SpikeRule",
    "SpikeScan",
    "StabilityMetrics",
    "StabilityVerdict",
    "divergence_step",
    "ema_previous",
    "scan_spikes",
    "stability_metrics",
    "stability_verdict",
]

LESS_STABLE, AS_STABLE = "less stable", "as stable"


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
    loss = as_series(loss, "loss")
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
        g = as_series(grad_norm, "grad_norm")
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
