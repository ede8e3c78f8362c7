import dataclasses

import pytest
import torch

from lowprec.backends import check_recipe, short_str
from lowprec.build_optim import OptimHParams
from lowprec.convert import convert_fp8
from lowprec.estimate import estimate
from lowprec.model import model_args
from lowprec.recipe import Float8Spec, Recipe, RecipeError
from lowprec.recipes import CATALOG, get_recipe
from lowprec.train.build import build, build_model_meta, check_runtime
from lowprec.train.spec import TrainSpec


def test_catalog_recipes_are_frozen_hashed_and_distinct():
    hashes = {r.hash() for r in CATALOG.values()}
    assert len(hashes) == len(CATALOG)
    r = get_recipe("bf16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.name = "x"
    assert r.hash() == Recipe.from_dict(r.to_dict()).hash()
    assert Recipe.from_dict(r.to_dict()) == r


def test_short_str_states_every_group():
    assert short_str(get_recipe("fp8_tensorwise")) == "w=fp32 autocast=bf16 fp8=torchao:tensorwise opt=param"
    assert short_str(get_recipe("bf16_adamw8bit")) == "w=fp32 autocast=bf16 fp8=off opt=int8:bitsandbytes"


def test_lowprec_recipes_spells_autocast_out(capsys):
    """``ac`` meant autocast in ``lowprec recipes`` and activation checkpointing (``train.ac``) everywhere
    else; the catalog's lines (and ``--json``'s ``short``) now say ``autocast=``."""
    import json

    from lowprec_lab.cli import main

    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]  # the table's header, then one line per recipe
    assert len(lines) == len(CATALOG) and all(" autocast=" in x and " ac=" not in x for x in lines)
    assert main(["recipes", "--json"]) == 0
    assert all(d["short"].split()[1].startswith("autocast=") for d in json.loads(capsys.readouterr().out).values())


def test_hash_ignores_name_but_not_numerics():
    a = get_recipe("bf16")
    assert dataclasses.replace(a, name="other").hash() == a.hash()
    d = a.to_dict()
    d["fp8"]["backend"] = "torchao"
    assert Recipe.from_dict(d).hash() != a.hash()


@pytest.mark.parametrize(
    "patch, words",
    [
        ({"optim": {"state": "int8", "impl": "torch"}}, ["recipe.optim.state", "recipe.optim.impl"]),
        ({"optim": {"state": "param", "impl": "bitsandbytes"}}, ["recipe.optim.impl", "recipe.optim.state"]),
        ({"weights": {"param_dtype": "fp8"}}, ["recipe.weights.param_dtype"]),
        ({"fp8": {"backend": "transformer_engine"}}, ["recipe.fp8.backend"]),
        ({"fp8": {"backend": "torchao", "scaling": "blockwise"}}, ["recipe.fp8.scaling"]),
        (
            {"fp8": {"backend": "lowprec", "cast": {"strategy": "delayed"}, "scaling": "rowwise"}},
            ["recipe.fp8.cast.strategy", "recipe.fp8.scaling"],
        ),
        ({"fp8": {"backend": "torchao", "scaling": "rowwise"}}, ["recipe.fp8.cast.fp8_format", "recipe.fp8.backend"]),
        (
            {"fp8": {"backend": "lowprec", "scaling": "blockwise", "gemm": {"promotion_interval": 256}}},
            ["recipe.fp8.gemm.promotion_interval"],
        ),
        (
            {"fp8": {"backend": "torchao", "saved": {"cache_fp8_activations": True}}},
            ["recipe.fp8.saved.cache_fp8_activations"],
        ),
        ({"fp8": {"scalling": "rowwise"}}, ["fp8.scalling"]),
        ({"colour": "red"}, ["colour"]),
    ],
)
def test_invalid_recipes_name_the_conflicting_fields(patch, words):
    def merge(base: dict, patch: dict) -> dict:
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    d = merge(get_recipe("bf16").to_dict(), patch)
    with pytest.raises(RecipeError) as e:
        check_recipe(Recipe.from_dict(d))  # its own checks at construction, the backend registry's where it is built
    for w in words:
        assert w in str(e.value)


def test_unknown_recipe_lists_the_catalog():
    with pytest.raises(RecipeError, match="fp32"):
        get_recipe("fp7")


def test_fp8_filter_matches_fqn_suffixes():
    spec = get_recipe("fp8_tensorwise").fp8
    assert spec.keeps_high_precision("output")
    assert not spec.keeps_high_precision("layers.0.feed_forward.w1")
    assert not spec.keeps_high_precision("layers.0.attention.output_gate")  # a suffix match, not a substring


def test_every_catalog_recipe_passes_the_backend_checks():
    # a Recipe is a pure value, so constructing one no longer asks the backend registry: each catalog entry must
    # pass its checks (lowprec.recipes.catalog runs them on import)
    refused = {}
    for name, r in CATALOG.items():
        try:
            check_recipe(r)
        except RecipeError as e:
            refused[name] = str(e)
    assert not refused


#: A recipe its own fields allow and its backend refuses (torchao has no blockwise scaling).
_BAD = dict(name="bad", fp8=Float8Spec(backend="torchao", scaling="blockwise"))
_BAD_MESSAGE = r"recipe.fp8.scaling='blockwise' is not one of \['tensorwise', 'rowwise', 'rowwise_with_gw_hp'\]"


def test_the_backend_checks_run_where_a_recipe_is_built_or_planned():
    bad = Recipe(**_BAD)  # constructs: the value alone cannot know torchao's scalings
    with pytest.raises(RecipeError, match=_BAD_MESSAGE):
        check_runtime(bad, torch.device("cpu"))  # preflight's and build's first check
    with pytest.raises(RecipeError, match=_BAD_MESSAGE):
        build(
            bad,
            model_args("debug"),
            TrainSpec(steps=2, warmup_steps=1, timing_warmup_steps=1, progress=False),
            OptimHParams(),
            0,
            torch.device("cpu"),
        )
    with pytest.raises(RecipeError, match=_BAD_MESSAGE):
        convert_fp8(build_model_meta(model_args("debug")), bad.fp8)
    with pytest.raises(RecipeError, match=_BAD_MESSAGE):
        estimate(model_args("debug"), bad)
