"""Statistics of an ablation: pure functions over arrays of per-seed results (numpy/scipy/statsmodels, no MLflow).

- ``paired``: per-seed paired relative differences, paired t-interval, bootstrap cross-check (``PairedEffect``).
- ``verdict``: CONSORT non-inferiority verdict at a relative margin and its CONSORT label, Holm across recipes,
  power (``Verdict``).
- ``sequential``: ``seeds=auto`` stopping rule, Lan-DeMets O'Brien-Fleming-type alpha spending with exact
  group-sequential boundaries (``SpendingPlan``).
- ``curves``: relative loss error curves against the control (paired by seed, t-band) and seed bands.
- ``stability``: per-run loss and grad-norm spikes, excursion, divergence; stability verdict per recipe.

The runner feeds these from MLflow and the report only formats their output.
"""

from experiments.stats.curves import (
    TRAIN_SMOOTH_WINDOW,
    SeedCurves,
    relative_loss_error,
    seed_band,
    t_band,
    trailing_mean,
)
from experiments.stats.paired import PairedEffect, paired_effect, relative_differences
from experiments.stats.sequential import SeedDecision, SpendingPlan
from experiments.stats.stability import (
    SpikeRule,
    StabilityMetrics,
    StabilityVerdict,
    scan_spikes,
    stability_metrics,
    stability_verdict,
)
from experiments.stats.verdict import (
    LABELS,
    VERDICTS,
    Verdict,
    check_margin,
    ci_verdict,
    consort_label,
    minimum_detectable_difference,
    seeds_needed,
    verdicts,
)

__all__ = [
    "LABELS",
    "TRAIN_SMOOTH_WINDOW",
    "VERDICTS",
    "PairedEffect",
    "SeedCurves",
    "SeedDecision",
    "SpendingPlan",
    "SpikeRule",
    "StabilityMetrics",
    "StabilityVerdict",
    "Verdict",
    "check_margin",
    "ci_verdict",
    "consort_label",
    "minimum_detectable_difference",
    "paired_effect",
    "relative_differences",
    "relative_loss_error",
    "scan_spikes",
    "seed_band",
    "seeds_needed",
    "stability_metrics",
    "stability_verdict",
    "t_band",
    "trailing_mean",
    "verdicts",
]
