"""lowprec: mixed- and low-precision LLM training recipes, measured (docs/architecture.md).

The library's front door. ``import lowprec`` is cheap (it imports neither torch nor the catalog); each name below
is imported from its module on first use (PEP 562), so ``lowprec.Recipe`` costs the recipe module alone and
``lowprec.build`` costs torch. The base install (``pip install lowprec``) is enough for all of them; the lab
(``lowprec_lab``: Hydra, MLflow, reports) is the ``lab`` extra.

Recipes
    ``Recipe``: one precision recipe (weights, compute, FP8, optimizer states, communication), a frozen value.
    ``get_recipe``: a named recipe of the catalog (``lowprec.recipes.catalog``); raises ``RecipeError`` for an
    unknown name.
    ``recipe_names``: the catalog's names, in order.
Model and training
    ``ModelArgs``: the Llama decoder's shape (dimensions, layers, heads, vocabulary).
    ``model_args``: a named size (``debug``, ``tiny``, ...) with optional field overrides.
    ``TrainSpec``: how to train (steps, batch, sequence length, schedule, checkpoints, health policy).
    ``OptimHParams``: AdamW hyper-parameters (lr, betas, eps, weight decay).
    ``TokenBatches``: deterministic batches of token windows from uint16/uint32 shards (numpy arrays).
    ``build``: recipe + model + spec -> ``Built`` (the model converted, sharded, materialised; its optimizer).
    ``run_training``: train a ``Built`` on ``TokenBatches``, logging to a ``MetricSink``; returns ``RunResult``.
    ``MetricSink``: the protocol a metrics destination implements (``log_metrics(metrics, step)``).
FP8
    ``Float8Linear``: an ``nn.Linear`` whose GEMMs run in FP8 as its ``LinearFP8Config`` says.
    ``LinearFP8Config``: per-role (input, weight, grad_output) formats and scalings of a ``Float8Linear``, with the
    recipe's ``cast`` and ``gemm`` groups as they are.
    ``linear_config``: the ``LinearFP8Config`` of one linear under a recipe's ``Float8Spec`` (``recipe.fp8``).
    ``convert_fp8``: swap a model's selected linears for FP8 linears of a recipe's ``Float8Spec``, in place.
Estimates
    ``estimate``: the estimator package; ``lowprec.estimate.estimate(...)`` predicts a recipe's memory and step time
    before any run (the name is the package's, which a function of the same name would shadow).
Errors
    ``UserError``: the base of every error a user can fix (bad value, file or combination); one-line message.
    ``ConfigError``, ``RecipeError``, ``CheckpointError``, ``DataError``: its subclasses for run settings, recipes,
    checkpoint folders and data.
"""

from __future__ import annotations

import importlib

from lowprec import _quiet

_quiet.install()

# typing.TYPE_CHECKING without importing typing (~5 ms, a third of `import lowprec`); type checkers read it as True.
TYPE_CHECKING = False

#: public name -> (module it lives in, attribute; None: the module itself). Kept as data so that ``import lowprec``
#: loads none of them.
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "Recipe": ("lowprec.recipe", "Recipe"),
    "get_recipe": ("lowprec.recipes.catalog", "get_recipe"),
    "recipe_names": ("lowprec.recipes.catalog", "recipe_names"),
    "ModelArgs": ("lowprec.model", "ModelArgs"),
    "model_args": ("lowprec.model", "model_args"),
    "TrainSpec": ("lowprec.train.spec", "TrainSpec"),
    "OptimHParams": ("lowprec.build_optim", "OptimHParams"),
    "TokenBatches": ("lowprec.data.loader", "TokenBatches"),
    "build": ("lowprec.train.build", "build"),
    "run_training": ("lowprec.train.loop", "run_training"),
    "MetricSink": ("lowprec.train.loop", "MetricSink"),
    "Float8Linear": ("lowprec.float8", "Float8Linear"),
    "LinearFP8Config": ("lowprec.float8", "LinearFP8Config"),
    "linear_config": ("lowprec.float8", "linear_config"),
    "convert_fp8": ("lowprec.convert", "convert_fp8"),
    "estimate": ("lowprec.estimate", None),
    "UserError": ("lowprec.errors", "UserError"),
    "ConfigError": ("lowprec.errors", "ConfigError"),
    "RecipeError": ("lowprec.errors", "RecipeError"),
    "CheckpointError": ("lowprec.errors", "CheckpointError"),
    "DataError": ("lowprec.data.errors", "DataError"),
}

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "Float8Linear",
    "LinearFP8Config",
    "MetricSink",
    "ModelArgs",
    "OptimHParams",
    "Recipe",
    "RecipeError",
    "TokenBatches",
    "TrainSpec",
    "UserError",
    "build",
    "convert_fp8",
    "estimate",
    "get_recipe",
    "linear_config",
    "model_args",
    "recipe_names",
    "run_training",
]

if TYPE_CHECKING:  # for type checkers and IDEs only: at run time every name is imported on first use
    from lowprec import estimate
    from lowprec.build_optim import OptimHParams
    from lowprec.convert import convert_fp8
    from lowprec.data.errors import DataError
    from lowprec.data.loader import TokenBatches
    from lowprec.errors import CheckpointError, ConfigError, RecipeError, UserError
    from lowprec.float8 import Float8Linear, LinearFP8Config, linear_config
    from lowprec.model import ModelArgs, model_args
    from lowprec.recipe import Recipe
    from lowprec.recipes.catalog import get_recipe, recipe_names
    from lowprec.train.build import build
    from lowprec.train.loop import MetricSink, run_training
    from lowprec.train.spec import TrainSpec


def __getattr__(name: str) -> object:
    """Import the public ``name`` from its module on first access and cache it on the package.

    Raises ``AttributeError`` for a name that is not public (as a plain module would)."""
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'lowprec' has no attribute {name!r}") from None
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
