"""``recipe.compute.reduction_order=reversed`` (``fp32_reordered``, the noise study's negative control): a recipe
field the build turns into a dispatch mode around the training step, recorded and checked in the effective
recipe, refused under ``train.compile``; the catalog's earlier hashes are unchanged. ``debug`` at dim 64, one step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from experiments.plan.auto_train import resolve_compile_ac
from lowprec.build_optim import OptimHParams
from lowprec.model import model_args
from lowprec.recipe import ComputeSpec, RecipeError
from lowprec.train.build import build, check_compile, compile_blocker
from lowprec.train.effective import EffectiveRecipeError, check_effective, expected_effective, inspect_effective
from lowprec.train.spec import TrainSpec
from lowprec.train.step import train_step
from recipes import CATALOG


def test_hashes_of_earlier_recipes_are_unchanged_and_the_order_hashes():
    # pinned before the field existed: checkpoints and runs keyed by these hashes stay valid
    assert CATALOG["fp32"].hash() == "ba17d624b610" and CATALOG["bf16"].hash() == "5fc655287b9b"
    assert CATALOG["fp32_reordered"].hash() != CATALOG["fp32"].hash()
    with pytest.raises(RecipeError, match="reduction_order"):
        ComputeSpec(reduction_order="shuffled")


def _one_step(recipe: str):
    args = dataclasses.replace(model_args("debug"), dim=64)
    spec = TrainSpec(steps=2, batch_size=2, seq_len=32, timing_warmup_steps=0, telemetry_every=0, progress=False)
    b = build(CATALOG[recipe], args, spec, OptimHParams(lr=1e-2), 0, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab_size, (2, 33), generator=g)
    res = train_step(b, [(x[:, :-1], x[:, 1:])], 1.0, 0)
    return b, res


def test_the_reversed_order_runs_in_the_step_and_is_checked_in_the_effective_recipe():
    ref, ref_res = _one_step("fp32")
    b, res = _one_step("fp32_reordered")
    assert ref.reduction_order is None and b.reduction_order.reversed > 0  # forward and backward matmuls
    assert res.loss != ref_res.loss and abs(res.loss - ref_res.loss) < 1e-5 * ref_res.loss  # roundings only
    eff, exp = inspect_effective(b, {}), expected_effective(b)
    assert eff["reduction_order"] == exp["reduction_order"] == "reversed"
    assert "reduction_order" not in inspect_effective(ref, {}) and "reduction_order" not in expected_effective(ref)
    # a build that dropped the mode is caught: the recipe asks for the reversed order, nothing reversed
    b.reduction_order = None
    with pytest.raises(EffectiveRecipeError, match="reduction_order"):
        check_effective(inspect_effective(b, {}), {"reduction_order": exp["reduction_order"]})


def test_compile_is_refused_explicitly_and_auto_runs_it_eager():
    r = CATALOG["fp32_reordered"]
    with pytest.raises(RecipeError, match="reduction_order"):
        check_compile(r, TrainSpec(compile=True, telemetry_every=0))
    resolved = resolve_compile_ac("auto", "auto", "cuda", False, compile_blocker(r, 0, "cuda"))
    assert resolved.compile is False and "reduction_order" in resolved.fallback
    assert compile_blocker(CATALOG["fp32"], 0, "cuda") is None
