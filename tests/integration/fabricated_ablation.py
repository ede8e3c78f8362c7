"""A fabricated ablation in a real MLflow store: a parent run and child runs logged directly with known per-seed
losses (no training), as ``lowprec ablate`` logs them, so every verdict of its report is known in advance. Shared by
the verdict-report, HTML-report and tracking-server tests."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from mlflow.entities import Metric

from lowprec.model import model_args
from lowprec_lab.tracking.tracker import ABLATION_TAG

STEPS = 100
SEEDS = [0, 1, 2, 3]
CONTROL = "bf16"
CONTROL_LOSS = [4.00, 4.05, 3.98, 4.02]
#: Per-seed relative differences to the control's final validation loss. fp8_blockwise finishes seed 0 only.
D = {
    "fp8_rowwise": [0.0001, -0.0002, 0.0003, 0.0],  # upper bound far below +0.25%: non-inferior
    "fp8_tensorwise": [0.0, 0.006, -0.001, 0.004],  # interval straddles +0.25%: inconclusive
    "bf16_pure": [0.020, 0.022, 0.019, 0.021],  # about 2% worse, tight: inferior
    "fp8_blockwise": [0.001],  # one seed: no interval
    # non-inferior by its interval alone (one-sided p = 0.016 < 0.025) but not after Holm over 4 recipes (second
    # smallest p must be < 0.025 / 3): inconclusive
    "fp8_delayed": [0.0009, 0.0019, 0.0009, 0.0019],
}
RECIPES = [CONTROL, *D]
TOKENS_PER_S = {
    "bf16": 1000.0,
    "fp32": 600.0,
    "fp8_rowwise": 800.0,
    "fp8_tensorwise": 900.0,
    "bf16_pure": 1200.0,
    "fp8_blockwise": 700.0,
    "fp8_delayed": 850.0,
}
STATE_B = {"bf16_pure": 8.0}  # 16 for the others
PEAK_B = {"bf16": 1.0e9, "bf16_pure": 0.9e9}  # 1.1e9 for the others
#: The ablation's model as its parent run logs it (``model.<field>`` params): ``debug`` with 3 layers, not 2, so a
#: prediction that ignored the params would differ. Batch and sequence of every fabricated run.
MODEL = dataclasses.replace(model_args("debug"), n_layers=3)
BATCH, SEQ = 2, 8


def val_curve(final: float, seed: int, val_every: int) -> list[tuple[int, float]]:
    """A decaying validation curve ending at ``final``; a per-seed wiggle off the last point makes the last-quarter
    mean differ from the final value."""
    steps = [s for s in range(STEPS) if (s + 1) % val_every == 0 or s == STEPS - 1]
    return [(s, final * (1 + 0.3 * (1 - (s + 1) / STEPS)) + (0.02 * seed if s < STEPS - 1 else 0)) for s in steps]


def late_mean(final: float, seed: int) -> float:
    """The last-quarter mean the report must use: validation points after step 75 of 100."""
    return float(np.mean([v for s, v in val_curve(final, seed, 10) if s + 1 > 75]))


def child_run(tracker, parent, abl, recipe, seed, final=None, reason="", val_every=10):
    rid = tracker.start_run(
        f"{recipe}/seed{seed}",
        {"recipe": recipe, "seed": str(seed), "recipe_short": recipe, ABLATION_TAG: abl},
        parent,
    )
    tracker.log_params(rid, {"train.batch_size": 2, "train.grad_accum": 1, "train.seq_len": 8, "train.steps": STEPS})
    if final is None:
        tracker.end_run(rid, "FAILED", reason)
        return
    ms = [Metric("loss", final * (2 - s / STEPS), 0, s) for s in range(STEPS)]
    ms += [Metric("grad_norm", 1.0, 0, s) for s in range(STEPS)]
    ms += [Metric("val_loss", v, 0, s) for s, v in val_curve(final, seed, val_every)]
    summary = {
        "final_val_loss": final,
        "mean_tokens_per_s": TOKENS_PER_S[recipe],
        "state_bytes_per_param": STATE_B.get(recipe, 16.0),
        "mem_peak_bytes": PEAK_B.get(recipe, 1.1e9),
        "mem_peak_growth_bytes": 1e8,
    }
    ms += [Metric(k, v, 0, STEPS) for k, v in summary.items()]
    tracker.client.log_batch(rid, metrics=ms)
    tracker.set_tags(rid, {"effective_matches": "true"})
    tracker.end_run(rid, "FINISHED")


def parent_run(tracker, abl, recipes: list[str], margin=None, steps=STEPS) -> str:
    """A parent run as ``lowprec ablate`` makes it (tags, and the params the report reads)."""
    parent = tracker.start_run(
        abl,
        {
            ABLATION_TAG: abl,
            "lowprec.kind": "ablation",
            "recipes": json.dumps(recipes),
            "seeds": json.dumps(SEEDS),
            "control": CONTROL,
            "model": "debug",
            "device": "CPU: test",
            "device_type": "cpu",
        },
    )
    model = {f"model.{k}": str(v) for k, v in dataclasses.asdict(MODEL).items()}
    train = {"train.steps": steps, "train.batch_size": BATCH, "train.seq_len": SEQ, "train.ac": "none"}
    tracker.log_params(
        parent, {**train, **model, "model.name": "debug", **({"report.margin": margin} if margin else {})}
    )
    return parent


CRASH = "InjectedCrash: injected crash before step 2"


def fabricate_ablation(tracker, abl, runs: dict[str, dict[int, float | None]], val_every=10, margin=None) -> str:
    """A parent run and one child per (recipe, seed): a loss, or None for FAILED."""
    parent = parent_run(tracker, abl, list(runs), margin)
    for recipe, by_seed in runs.items():
        for seed, loss in by_seed.items():
            child_run(
                tracker, parent, abl, recipe, seed, loss, "InjectedCrash: injected crash before step 2", val_every
            )
    tracker.end_run(parent, "FINISHED")
    return parent


def main_runs() -> dict[str, dict[int, float | None]]:
    runs = {CONTROL: dict(zip(SEEDS, CONTROL_LOSS))}
    for name, d in D.items():
        runs[name] = {s: (CONTROL_LOSS[s] * (1 + d[s]) if s < len(d) else None) for s in SEEDS}
    return runs
