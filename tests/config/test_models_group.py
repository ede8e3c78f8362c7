"""``ablate models=[...]``: one ablation per model with every other setting shared, including the ``model``
settings the experiment or the command changed from the size's defaults (``model.qk_norm: true`` of the default
and study experiments); the sizes themselves come from each model's own config."""

from __future__ import annotations

import dataclasses

from lowprec.model import MODEL_CONFIGS
from lowprec_lab.cli import compose
from lowprec_lab.plan.preflight import preflight

QUICK = ["train.steps=4", "train.batch_size=2", "train.seq_len=64", "device=cpu", "workers=1", "dry_run=true"]


def _group(run_dirs, *overrides: str):
    plan = preflight(compose("ablate", [*QUICK, *run_dirs, "recipes=[bf16]", "controls=false", *overrides]))
    return {p.model_name: p.model for p in plan.group}


def test_a_changed_model_setting_reaches_every_model_of_the_group(run_dirs):
    models = _group(run_dirs, "models=[debug,moe_debug]", "model.qk_norm=true")
    assert models["debug"].qk_norm and models["moe_debug"].qk_norm
    # each model keeps its own size
    assert models["debug"] == dataclasses.replace(MODEL_CONFIGS["debug"], qk_norm=True)
    assert models["moe_debug"] == dataclasses.replace(MODEL_CONFIGS["moe_debug"], qk_norm=True)


def test_without_a_change_each_model_is_its_size(run_dirs):
    models = _group(run_dirs, "models=[debug,moe_debug]", "model.qk_norm=false")  # the default experiment turns it on
    assert models == {"debug": MODEL_CONFIGS["debug"], "moe_debug": MODEL_CONFIGS["moe_debug"]}
