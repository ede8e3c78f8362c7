"""Real Hydra composition of conf/ and the command line's error handling."""

import json

import pytest

from lowprec.recipe import RecipeError
from lowprec.recipes import CATALOG
from lowprec_lab.cli import compose, main
from lowprec_lab.plan.config import model_from_cfg, optim_from_cfg, recipe_from_cfg, train_from_cfg
from lowprec_lab.plan.preflight import ablation_control


def test_train_defaults_compose():
    cfg = compose("train", [])
    assert recipe_from_cfg(cfg.recipe) == CATALOG["bf16"]
    assert model_from_cfg(cfg.model).dim == 256
    assert cfg.tracking.uri == "sqlite:///runs/mlflow.db"
    assert train_from_cfg(cfg).steps == 200
    assert optim_from_cfg(cfg).lr == 3e-3  # OptimHParams' default: the one source of the peak LR
    assert compose("train", ["optim.lr=1e-3"]).optim.lr == 1e-3


def test_every_recipe_field_is_overridable():
    cfg = compose(
        "train",
        [
            "recipe=fp8_tensorwise",
            "recipe.fp8.scaling=rowwise",
            "recipe.fp8.cast.fp8_format=e4m3",
            "model=debug",
            "model.n_layers=3",
            "train.steps=7",
            "seed=5",
        ],
    )
    r = recipe_from_cfg(cfg.recipe)
    assert r.fp8.scaling == "rowwise" and r.fp8.backend == "torchao" and r.name == "fp8_tensorwise"
    assert model_from_cfg(cfg.model).n_layers == 3 and cfg.train.steps == 7 and cfg.seed == 5


def test_experiments_compose():
    smoke = compose("ablate", ["experiment=smoke"])
    default = compose("ablate", [])
    full = compose("ablate", ["experiment=full"])
    assert smoke.model.name == "debug" and list(smoke.recipes) == list(full.recipes)
    assert set(default.recipes) < set(full.recipes) and full.seeds.others == 3 and default.controls
    # the wider ablation trains at the default's well-trained setting, with its controls
    assert full.train == default.train and full.model == default.model and full.controls
    assert default.seeds.others == 3 and default.seeds.bf16_reordered == 7  # seeds per recipe
    assert default.model.name == "tiny" and default.control is None and default.train.steps == 80
    assert default.workers == "auto" and smoke.workers == 1
    assert ablation_control(default, list(default.recipes)) == "bf16"  # null: bf16 when listed
    assert ablation_control(default, ["fp32", "fp8_rowwise"]) == "fp32"  # else the first recipe
    assert default.report.margin == 0.0025
    assert list(compose("ablate", ["recipes=[fp32,bf16]", "seeds=3"]).recipes) == ["fp32", "bf16"]


def test_invalid_recipe_override_fails_in_validation():
    cfg = compose("train", ["recipe.optim.state=int8"])
    with pytest.raises(RecipeError, match="recipe.optim.impl"):
        recipe_from_cfg(cfg.recipe)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["train", "train.stepz=3"], "stepz"),
        (["train", "recipe=fp7"], "fp7"),
        (
            ["train", "recipe.optim.state=int8", "train.steps=2"],
            "recipe.optim.state='int8' conflicts with recipe.optim.impl='torch'",
        ),
        (["train", "recipe.fp8.backend=te"], "recipe.fp8.backend='te'"),
        (["ablate", "recipes=[fp32,nope]"], "unknown recipe 'nope'"),
        (["train", "data=text", "data.path=/no/such/dir"], "does not exist"),
        (["train", "train.steps=0"], "train.steps=0"),
        (["train", "recipe=te_delayed"], "recipe.fp8.backend='te' needs a CUDA GPU"),
        (["ablate", "recipes=[fp32,te_blockwise]"], "recipe.fp8.backend='te' needs a CUDA GPU"),
        (
            ["train", "recipe=fp8_delayed", "recipe.fp8.scaling=rowwise"],
            "recipe.fp8.cast.strategy='delayed' conflicts with recipe.fp8.scaling='rowwise'",
        ),
        (["train", "recipe=fp8_tensorwise", "recipe.fp8.cast.strategy=delayed"], "torchao removed delayed scaling"),
        # lowprec's accumulator emulation and FP8 activation cache on Transformer Engine: refused, not ignored
        (
            ["train", "recipe=te_blockwise", "recipe.fp8.gemm.accum_mantissa_bits=14"],
            "recipe.fp8.gemm.accum_mantissa_bits is a lowprec FP8 option; it conflicts with recipe.fp8.backend='te'",
        ),
        (
            ["train", "recipe=te_delayed", "recipe.fp8.saved.cache_fp8_activations=true"],
            "recipe.fp8.saved.cache_fp8_activations is a lowprec FP8 option; it conflicts with recipe.fp8.backend='te'",
        ),
        (["train", "model=debug", "model.vocab_size=4096"], "does not fit model.vocab_size=4096"),
        # the schemas registered from the dataclasses type-check while composing, before anything runs
        (["train", "seed=abc"], "seed=abc"),
        (["train", "faults.crash_at_step=3"], "unknown key faults"),  # fault injection: LOWPREC_FAULTS only
        (["ablate", "recipes=fp32"], "recipes=fp32"),
        (["train", "optim.foo=1"], "unknown key optim.foo"),
        (["train", "data=text"], "data.path"),
    ],
)
def test_bad_input_gives_one_clear_line(args, needle, capsys, run_dirs):
    assert main(args + run_dirs) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err
    assert len(err.splitlines()) == 1 and err.startswith("lowprec ")


def test_recipes_command_lists_the_catalog(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name in CATALOG:
        assert name in out
    assert main(["recipes", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fp8_tensorwise"]["fp8"]["backend"] == "torchao"
