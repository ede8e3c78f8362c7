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

import importlib

#: public name -> the submodule defining it. Loaded on first use (PEP 562): the run path (a worker, a torchrun rank,
#: ``lowprec train``) needs only ``stability``, and importing scipy.stats and statsmodels costs it ~0.9 s per process.
_WHERE = {
    "TRAIN_SMOOTH_WINDOW": "curves",
    "SeedCurves": "curves",
    "relative_loss_error": "curves",
    "seed_band": "curves",
    "t_band": "curves",
    "trailing_mean": "curves",
    "PairedEffect": "paired",
    "paired_effect": "paired",
    "relative_differences": "paired",
    "SeedDecision": "sequential",
    "SpendingPlan": "sequential",
    "SpikeRule": "stability",
    "StabilityMetrics": "stability",
    "StabilityVerdict": "stability",
    "scan_spikes": "stability",
    "stability_metrics": "stability",
    "stability_verdict": "stability",
    "LABELS": "verdict",
    "VERDICTS": "verdict",
    "Verdict": "verdict",
    "check_margin": "verdict",
    "ci_verdict": "verdict",
    "consort_label": "verdict",
    "minimum_detectable_difference": "verdict",
    "seeds_needed": "verdict",
    "verdicts": "verdict",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'lowprec_lab.stats' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lowprec_lab.stats.{_WHERE[name]}"), name)


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
