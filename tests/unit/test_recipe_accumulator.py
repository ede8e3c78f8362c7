"""The emulated FP8 accumulator's model as recipe fields: ``recipe.fp8.gemm.accum_rounding`` and
``recipe.fp8.gemm.accum_group`` are validated in the recipe, reach the FP8 linear's GEMM from a Hydra override, and
leave every recipe that does not set them as it was (hash, short string, numerics)."""

import pytest
import torch

from lowprec.backends import check_recipe, short_str
from lowprec.build_optim import OptimHParams
from lowprec.float8 import Float8Linear
from lowprec.float8.accumulator import HOPPER_ACCUMULATOR, ROUNDINGS
from lowprec.model import model_args
from lowprec.recipe import ACCUM_ROUNDINGS, Recipe, RecipeError
from lowprec.recipes import CATALOG
from lowprec.train.build import build
from lowprec.train.spec import TrainSpec
from lowprec_lab.cli import compose
from lowprec_lab.plan.config import recipe_from_cfg

#: (hash, short string) of catalog recipes before the fields existed (HEAD f0b4136): the new fields at their
#: defaults change neither (the hash omits them, the short string names them only when set).
BEFORE = {
    "deepseek_v3_no_promotion": (
        "b45d63b1e866",
        "w=fp32 autocast=bf16 fp8=lowprec:blockwise/e4m3/acc14-nopromo/floor0.0001+fp8cache+e5m6+swiglu:fp8 "
        "opt=bf16:lowprec",
    ),
    "deepseek_v3": (
        "ee66b5736b07",
        "w=fp32 autocast=bf16 fp8=lowprec:blockwise/e4m3/floor0.0001+fp8cache+e5m6+swiglu:fp8 opt=bf16:lowprec",
    ),
    "fp8_blockwise": ("12cf636cbb38", "w=fp32 autocast=bf16 fp8=lowprec:blockwise/e4m3+fp8cache opt=param"),
    "fp8_current": ("f90ea79b55c9", "w=fp32 autocast=bf16 fp8=lowprec:tensorwise/hybrid opt=param"),
    "fp32": ("ba17d624b610", "w=fp32 autocast=none fp8=off opt=param"),
}

HOPPER = "deepseek_v3_no_promotion_hopper"


def test_recipe_roundings_are_the_accumulators():
    # the recipe is a pure value and cannot import lowprec.float8.accumulator; the two lists must agree
    assert ACCUM_ROUNDINGS == ROUNDINGS


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_recipes_without_the_fields_keep_their_hash_and_short_string(name):
    r = CATALOG[name]
    assert (r.fp8.gemm.accum_rounding, r.fp8.gemm.accum_group) == ("nearest", None)
    assert (r.hash(), short_str(r)) == BEFORE[name]


def test_the_hopper_recipe_is_hopper_accumulator_without_promotion():
    r = CATALOG[HOPPER]
    acc = HOPPER_ACCUMULATOR
    assert (r.fp8.gemm.accum_mantissa_bits, r.fp8.gemm.accum_rounding, r.fp8.gemm.accum_group) == (
        acc.bits,
        acc.rounding,
        acc.group,
    )
    assert not r.fp8.gemm.promotion and acc.describe() in r.description
    assert f"/acc{acc.bits}-{acc.rounding}-g{acc.group}-nopromo/" in short_str(r)
    assert Recipe.from_dict(r.to_dict()) == r and r.hash() != CATALOG["deepseek_v3_no_promotion"].hash()
    # only the accumulator differs from deepseek_v3_no_promotion
    base = CATALOG["deepseek_v3_no_promotion"].fp8.flat()
    diff = {k for k, v in r.fp8.flat().items() if base[k] != v}
    assert diff == {"accum_mantissa_bits", "accum_rounding", "accum_group"}


@pytest.mark.parametrize(
    "recipe, fields, message",
    [
        (
            "deepseek_v3",
            {"accum_rounding": "truncate"},
            "recipe.fp8.gemm.accum_rounding='truncate' has no effect with ",
        ),
        ("deepseek_v3", {"accum_group": 32}, "recipe.fp8.gemm.accum_group=32 has no effect with "),
        ("fp32", {"accum_group": 32}, "recipe.fp8.gemm.accum_group=32 has no effect with "),
        (
            "deepseek_v3_no_promotion",
            {"accum_rounding": "up"},
            "recipe.fp8.gemm.accum_rounding='up' is not one of ['nearest', 'truncate', 'floor']",
        ),
        ("deepseek_v3_no_promotion", {"accum_group": 0}, "recipe.fp8.gemm.accum_group=0 must be >= 1"),
        ("deepseek_v3_no_promotion", {"accum_group": -32}, "recipe.fp8.gemm.accum_group=-32 must be >= 1"),
        (
            HOPPER,
            {"accum_group": 48},
            "recipe.fp8.gemm.accum_group=48 conflicts with recipe.fp8.gemm.promotion=false and "
            "recipe.fp8.scaling='blockwise'",
        ),
        (
            HOPPER,
            {"accum_mantissa_bits": None},
            "recipe.fp8.gemm.promotion=false needs recipe.fp8.gemm.accum_mantissa_bits",
        ),
        ("fp8_current", {"accum_mantissa_bits": 14, "accum_rounding": "round"}, "accum_rounding='round' is not one"),
    ],
)
def test_bad_accumulator_fields_are_one_line_recipe_errors(recipe, fields, message):
    with pytest.raises(RecipeError) as e:
        CATALOG[recipe].with_fields("fp8.gemm", **fields)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "recipe, fields",
    [
        # with promotion a group of any size fits (the 128-wide chunk's last step is shorter); rowwise has no tiles
        ("deepseek_v3", {"accum_mantissa_bits": 13, "accum_group": 48}),
        ("fp8_rowwise", {"accum_mantissa_bits": 13, "accum_group": 48, "promotion": False, "accum_rounding": "floor"}),
        (HOPPER, {"accum_group": 16}),
    ],
)
def test_good_accumulator_fields_are_accepted(recipe, fields):
    r = check_recipe(CATALOG[recipe].with_fields("fp8.gemm", **fields))
    assert all(getattr(r.fp8.gemm, k) == v for k, v in fields.items())


def _logits(recipe: Recipe) -> torch.Tensor:
    spec = TrainSpec(steps=1, batch_size=2, seq_len=64, timing_warmup_steps=0, progress=False)
    b = build(recipe, model_args("debug"), spec, OptimHParams(), 0, torch.device("cpu"))
    fp8 = [m for m in b.model.modules() if isinstance(m, Float8Linear)]
    assert fp8 and all(
        (m.fp8_config.gemm.accum_rounding, m.fp8_config.gemm.accum_group)
        == (recipe.fp8.gemm.accum_rounding, recipe.fp8.gemm.accum_group)
        for m in fp8
    )
    tokens = torch.randint(0, model_args("debug").vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), b.precision():
        return b.model(tokens).float()


def test_hydra_overrides_reach_the_fp8_linear_and_change_its_output():
    cfg = compose(
        "train",
        [
            "recipe=deepseek_v3_no_promotion",
            "recipe.fp8.gemm.accum_rounding=truncate",
            "recipe.fp8.gemm.accum_group=32",
            "model=debug",
        ],
    )
    r = recipe_from_cfg(cfg.recipe)
    assert (r.fp8.gemm.accum_mantissa_bits, r.fp8.gemm.accum_rounding, r.fp8.gemm.accum_group) == (14, "truncate", 32)
    assert "/acc14-truncate-g32-nopromo/" in short_str(r)
    hopper = recipe_from_cfg(compose("train", [f"recipe={HOPPER}"]).recipe)
    assert hopper == CATALOG[HOPPER]
    same_as_hopper = r.with_fields("fp8.gemm", accum_mantissa_bits=13)
    assert same_as_hopper.hash() == hopper.hash()  # the catalog recipe is these overrides, nothing else
    nearest, truncated = _logits(CATALOG["deepseek_v3_no_promotion"]), _logits(r)
    assert torch.isfinite(truncated).all() and not torch.equal(nearest, truncated)
