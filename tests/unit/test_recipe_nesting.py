"""The FP8 fields grouped by role (``recipe.fp8.cast`` / ``gemm`` / ``saved`` / ``layers`` / ``block``): a record
written while they were flat still reads back as the same recipe with the same hash, ``to_dict`` writes them
nested, a mapping that mixes both forms or names an unknown key is refused in one line naming the keys, and the
hash and short name are taken of the flat view (the catalog's pinned identities: test_recipe_fields.py)."""

from __future__ import annotations

import pytest

from lowprec.backends import check_recipe, short_str
from lowprec.errors import RecipeError
from lowprec.recipe import Float8Spec, Recipe
from lowprec.recipes import CATALOG

#: ``Recipe.to_dict()["fp8"]`` of deepseek_v3_no_promotion_hopper as runs recorded it (``recipe_json``) before the
#: fields were grouped: every field flat, in its declaration order then.
FLAT_HOPPER_FP8 = {
    "backend": "lowprec",
    "scaling": "blockwise",
    "strategy": "current",
    "fp8_format": "e4m3",
    "amax_history_len": 16,
    "amax_compute_algo": "max",
    "margin": 0,
    "static_scales": [1.0, 1.0, 1.0],
    "power_of_2_scales": False,
    "gemm_backend": "scaled_mm",
    "promotion_interval": 128,
    "accum_mantissa_bits": 13,
    "accum_rounding": "truncate",
    "accum_group": 32,
    "promotion": False,
    "grad_output_granularity": None,
    "amax_floor": 0.0001,
    "cache_fp8_activations": True,
    "e5m6_inputs": ["attention.wo"],
    "swiglu_cache": "fp8",
    "pad_inner_dim": False,
    "mx_scale_mode": "rceil",
    "rht_size": 0,
    "weight_scaling_2d": False,
    "grad_rounding": "nearest",
    "precision_switch_at": None,
    "keep_hp_fqns": ["tok_embeddings", "output"],
    "hp_first_blocks": 0,
    "hp_last_blocks": 0,
    "min_features": 0,
}
#: the rest of that record (description left out: it is not hashed)
FLAT_HOPPER_REST = {
    "name": "deepseek_v3_no_promotion_hopper",
    "weights": {"param_dtype": "fp32", "master_dtype": "none", "update_rounding": "nearest"},
    "compute": {
        "autocast_dtype": "bf16",
        "loss_scaling": "none",
        "init_scale": 65536.0,
        "growth_interval": 2000,
        "reduction_order": "natural",
    },
    "optim": {"state": "bf16", "impl": "lowprec"},
    "comm": {
        "weight_all_gather": "compute",
        "grad_reduce": "fp32",
        "grad_reduce_block": 128,
        "activation_all_gather": "compute",
    },
}
#: its pinned identity (tests/unit/data/catalog_recipe_identity.json)
HOPPER_HASH = "2c3aaee57e33"


def test_a_record_written_with_flat_fp8_fields_reads_back_as_the_same_recipe():
    r = Recipe.from_dict({**FLAT_HOPPER_REST, "fp8": FLAT_HOPPER_FP8})
    want = CATALOG["deepseek_v3_no_promotion_hopper"]
    assert r.fp8 == want.fp8 and r.hash() == want.hash() == HOPPER_HASH
    assert (r.fp8.gemm.accum_mantissa_bits, r.fp8.gemm.accum_group, r.fp8.saved.e5m6_inputs) == (
        13,
        32,
        ("attention.wo",),
    )
    assert r.fp8.flat() == FLAT_HOPPER_FP8  # the flat view is that record's form, key for key and in its order
    assert list(r.fp8.flat()) == list(FLAT_HOPPER_FP8)


def test_to_dict_writes_the_groups_nested_and_reads_them_back():
    r = CATALOG["nvfp4"]
    fp8 = r.to_dict()["fp8"]
    assert set(fp8) == {"backend", "scaling", "cast", "gemm", "saved", "layers", "block"}
    assert fp8["block"]["rht_size"] == 16 and fp8["layers"]["hp_last_blocks"] == 1
    assert fp8["layers"]["keep_hp_fqns"] == ["tok_embeddings", "output"]  # sequences as lists (JSON, Hydra)
    assert Recipe.from_dict(r.to_dict()) == r
    assert check_recipe(r.with_fields("fp8.block", rht_size=0)).hash() == CATALOG["nvfp4_no_rht"].hash()


def test_a_partial_flat_mapping_takes_the_defaults_of_the_rest():
    flat = Float8Spec.from_dict({"backend": "lowprec", "strategy": "delayed", "amax_history_len": 8})
    assert flat == Float8Spec.from_dict({"backend": "lowprec", "cast": {"strategy": "delayed", "amax_history_len": 8}})
    assert short_str(Recipe(name="x", fp8=flat)).endswith("fp8=lowprec:tensorwise/delayed8-max-m0/hybrid opt=param")


def test_a_mapping_mixing_flat_and_grouped_fp8_keys_is_refused_naming_the_flat_ones():
    d = CATALOG["fp8_current"].to_dict()
    d["fp8"]["strategy"] = "delayed"
    d["fp8"]["margin"] = 1
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict(d)
    msg = str(e.value)
    assert "\n" not in msg and "mixes the flat keys ['margin', 'strategy']" in msg
    assert (
        "recipe.fp8.strategy -> recipe.fp8.cast.strategy" in msg
        and "recipe.fp8.margin -> recipe.fp8.cast.margin" in msg
    )


@pytest.mark.parametrize(
    ("fp8", "needle"),
    [
        ({"backend": "lowprec", "strateg": "delayed"}, "unknown recipe field(s) ['fp8.strateg']"),
        ({"backend": "lowprec", "cast": {"strateg": "delayed"}}, "unknown recipe field(s) ['fp8.cast.strateg']"),
        ({"backend": "lowprec", "cast": {"rht_size": 16}}, "unknown recipe field(s) ['fp8.cast.rht_size']"),
        ({"backend": "lowprec", "cast": "delayed"}, "recipe.fp8.cast must be a mapping of its fields"),
    ],
)
def test_unknown_fp8_keys_are_refused_naming_them(fp8, needle):
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict({"name": "x", "fp8": fp8})
    assert needle in str(e.value) and "\n" not in str(e.value)
