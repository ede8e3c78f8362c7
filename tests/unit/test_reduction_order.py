"""``recipe.compute.reduction_order=reversed`` (``fp32_reordered``, the noise study's negative control): a recipe
field the build turns into a dispatch mode around the training step, recorded and checked in the effective
recipe, refused under ``train.compile``; the catalog's earlier hashes are unchanged. ``debug`` at dim 64, one step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lowprec.build_optim import OptimHParams
from lowprec.model import model_args
from lowprec.numerics.reorder import ReversedReductionOrder
from lowprec.recipe import ComputeSpec, RecipeError
from lowprec.recipes import CATALOG
from lowprec.train.build import build, check_compile, compile_blocker
from lowprec.train.effective import EffectiveRecipeError, check_effective, expected_effective, inspect_effective
from lowprec.train.spec import TrainSpec
from lowprec.train.step import train_step
from lowprec_lab.plan.auto_train import resolve_compile_ac


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


#: every catalog recipe's hash before ``bf16_reordered`` joined the catalog and the mode learnt the autocast dtype:
#: checkpoints and runs keyed by these hashes stay valid
CATALOG_HASHES = {
    "fp32": "ba17d624b610",
    "fp32_reordered": "b380e53f6532",
    "bf16": "5fc655287b9b",
    "bf16_pure": "28d0f3c4bd62",
    "fp8_tensorwise": "1d3cfb87a303",
    "bf16_adamw8bit": "5dd8e81d5a6f",
    "fp8_current": "f90ea79b55c9",
    "fp8_delayed": "d389f0fe5395",
    "fp8_rowwise": "c3059e7bd89f",
    "fp8_blockwise": "12cf636cbb38",
    "te_delayed": "871ed2263010",
    "te_blockwise": "c4233d090b61",
    "bf16_master": "22f13cabc8f1",
    "bf16_sr": "7c7ea17d1df8",
    "bf16_moments": "bdf28ea6e343",
    "bf16_adamw8bit_ao": "e68a18d69d4b",
    "bf16_adamw4bit": "607f63854bdd",
    "fp8_msamp_o2": "d1b2325d448c",
    "fp16_amp": "4266619d96cc",
    "fp16_noscale": "6cd3bee10b5b",
    "deepseek_v3": "ee66b5736b07",
    "deepseek_v3_no_promotion": "b45d63b1e866",
    "deepseek_v3_no_promotion_hopper": "2c3aaee57e33",
    "deepseek_v3_tensorwise": "4f8851832105",
    "deepseek_v3_fp32_moments": "3c4fc2ca420b",
    "deepseek_v3_no_fp8_cache": "004f62e0b7ca",
    "deepseek_v3_grad_blocks": "8b6c0cd94c88",
    "fp8_tensorwise_fsdp8": "42e597003ef4",
    "fp8_comm8": "19dfc70939b6",
    "deepseek_v3_comm8": "045110426db3",
    "mxfp8": "2c8a0a6e2663",
    "mxfp4": "d5ad71e61e7d",
    "nvfp4": "ce3ec6907e3a",
    "nvfp4_no_rht": "a25f5cab204f",
    "nvfp4_no_2d": "294fa3243014",
    "nvfp4_no_sr": "565d1544c106",
    "nvfp4_no_hp": "5a71b7a3a8b9",
    "te_mxfp8": "edb305c603b9",
    "te_nvfp4": "5fcf6810a4ad",
}


#: recipes added to the catalog after these pins (tests/unit/data/catalog_recipe_identity.json pins every recipe)
LATER = ("bf16_reordered", "fp8_unscaled")


def test_every_earlier_catalog_hash_is_unchanged():
    assert {k: r.hash() for k, r in CATALOG.items() if k not in LATER} == CATALOG_HASHES
    assert CATALOG["bf16_reordered"].hash() not in CATALOG_HASHES.values()


def _losses(recipe: str, steps: int = 3):
    # dim 128: at 64 the reversed BF16 GEMMs (FP32-accumulated, outputs rounded to bf16) came out bit-identical over
    # six steps on one thread; the FP32 roundings they move rarely cross a bf16 rounding boundary
    args = dataclasses.replace(model_args("debug"), dim=128)
    spec = TrainSpec(steps=steps, batch_size=2, seq_len=32, timing_warmup_steps=0, telemetry_every=0, progress=False)
    b = build(CATALOG[recipe], args, spec, OptimHParams(lr=1e-2), 0, torch.device("cpu"))
    x = torch.randint(0, args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    return b, [train_step(b, [(x[:, :-1], x[:, 1:])], 1.0, s).loss for s in range(steps)]


def test_bf16_reordered_reverses_the_autocast_matmuls_and_trains_close_to_bf16():
    # under BF16 autocast the linears' GEMMs see bf16 operands: an FP32-only mode would reverse nothing here
    ref, ref_losses = _losses("bf16")
    b, losses = _losses("bf16_reordered")
    assert b.reduction_order.reversed > 0
    assert losses != ref_losses  # another rounding sequence
    assert max(abs(a - r) / r for a, r in zip(losses, ref_losses, strict=True)) < 1e-3  # roundings only
    eff, exp = inspect_effective(b, {}), expected_effective(b)
    assert eff["reduction_order"] == exp["reduction_order"] == "reversed"
    check_effective(eff, {"reduction_order": exp["reduction_order"]})


def test_the_mode_reverses_fp32_only_unless_given_the_autocast_dtype():
    a, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, 3, dtype=torch.bfloat16)
    fp32_only, with_bf16 = ReversedReductionOrder(), ReversedReductionOrder(torch.bfloat16)
    for mode in (fp32_only, with_bf16):
        with mode:
            a @ b
            a.float() @ b.float()
    assert (fp32_only.reversed, with_bf16.reversed) == (1, 2)
    with pytest.raises(ValueError, match="autocast_dtype"):
        ReversedReductionOrder(torch.float8_e4m3fn)
