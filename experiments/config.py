"""Hydra glue: register lowprec's own tables as config groups and turn a composed config into lowprec objects."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lowprec.data import DataSpec
from lowprec.errors import ConfigError
from lowprec.model import LLAMA_CONFIGS, ModelArgs, model_args
from lowprec.optim import OptimHParams
from lowprec.recipe import CommSpec, ComputeSpec, Float8Spec, OptimSpec, Recipe, RecipeError, WeightSpec
from lowprec.train.spec import TrainSpec
from recipes import CATALOG

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")

_registered = False


def register_configs() -> None:
    """Register ``model/<size>`` and ``recipe/<name>`` in Hydra's ConfigStore from LLAMA_CONFIGS and the catalog.

    The catalog stays the single source of truth; Hydra sees every field, so
    ``recipe.fp8.scaling=rowwise`` or ``model.n_layers=2`` override it and multirun can sweep it.
    """
    global _registered
    if _registered:
        return
    cs = ConfigStore.instance()
    for name, args in LLAMA_CONFIGS.items():
        cs.store(group="model", name=name, node={"name": name, **dataclasses.asdict(args)})
    for name, recipe in CATALOG.items():
        cs.store(group="recipe", name=name, node=recipe.to_dict())
    _registered = True


def _plain(node) -> dict:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def typed(cls: type, node, prefix: str) -> dict:
    """The fields of ``node`` checked and converted against the dataclass ``cls`` (OmegaConf structured
    config: ``"12"`` -> 12, ``"abc"`` for an int is refused). Raises ``ConfigError`` naming
    ``<prefix>.<field>`` for a value of the wrong type or an unknown key."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls), _plain(node))
    except OmegaConfBaseException as e:
        key = f"{prefix}.{e.full_key}" if getattr(e, "full_key", None) else prefix
        msg = (getattr(e, "msg", None) or str(e)).strip().splitlines()[0]
        raise ConfigError(f"{key}: {msg}") from None
    return OmegaConf.to_container(merged, resolve=True)


_RECIPE_GROUPS = {"weights": WeightSpec, "compute": ComputeSpec, "fp8": Float8Spec, "optim": OptimSpec, "comm": CommSpec}


def recipe_from_cfg(node) -> Recipe:
    """``Recipe`` from the ``recipe`` node; raises ``RecipeError`` naming bad fields or values."""
    d = _plain(node)
    for group, cls in _RECIPE_GROUPS.items():
        if isinstance(d.get(group), dict):
            try:
                d[group] = typed(cls, d[group], f"recipe.{group}")
            except ConfigError as e:
                raise RecipeError(str(e)) from None
    return Recipe.from_dict(d)


def model_from_cfg(node) -> ModelArgs:
    d = _plain(node)
    name = d.pop("name")
    base = model_args(name)  # ConfigError listing the sizes for an unknown name
    return dataclasses.replace(base, **typed(ModelArgs, {**dataclasses.asdict(base), **d}, "model"))


def train_from_cfg(cfg: DictConfig) -> TrainSpec:
    return TrainSpec(**typed(TrainSpec, cfg.train, "train"))


def optim_from_cfg(cfg: DictConfig) -> OptimHParams:
    return OptimHParams(**typed(OptimHParams, cfg.optim, "optim"))


def parallel_from_cfg(cfg: DictConfig):
    """``ParallelDims`` from the ``parallel`` node (one process when the node is absent)."""
    from lowprec.parallel import ParallelDims

    node = cfg.get("parallel")
    return ParallelDims(**typed(ParallelDims, node, "parallel")) if node is not None else ParallelDims()


def data_from_cfg(cfg: DictConfig) -> DataSpec:
    return DataSpec(**typed(DataSpec, cfg.data, "data"))


def flat_params(cfg: DictConfig, recipe: Recipe) -> dict[str, str]:
    """Flattened ``key -> value`` of the run's settings, for MLflow params."""
    out: dict[str, str] = {}

    def walk(prefix: str, obj) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = str(obj)

    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("recipe", None)
    plain.pop("recipes", None)
    plain.pop("hydra", None)
    walk("", plain)
    walk("recipe", recipe.to_dict())
    return out
