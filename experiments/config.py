"""Hydra glue: register lowprec's own tables as config groups and turn a composed config into lowprec objects."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from lowprec.data import DataSpec
from lowprec.model import LLAMA_CONFIGS, ModelArgs, model_args
from lowprec.optim import OptimHParams
from lowprec.recipe import Recipe
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


def recipe_from_cfg(node) -> Recipe:
    """``Recipe`` from the ``recipe`` node; raises ``RecipeError`` naming bad fields."""
    return Recipe.from_dict(_plain(node))


def model_from_cfg(node) -> ModelArgs:
    d = _plain(node)
    name = d.pop("name")
    return model_args(name, **d)


def train_from_cfg(cfg: DictConfig) -> TrainSpec:
    return TrainSpec(**_plain(cfg.train))


def optim_from_cfg(cfg: DictConfig) -> OptimHParams:
    return OptimHParams(**_plain(cfg.optim))


def parallel_from_cfg(cfg: DictConfig):
    """``ParallelDims`` from the ``parallel`` node (one process when the node is absent)."""
    from lowprec.parallel import ParallelDims

    node = cfg.get("parallel")
    return ParallelDims(**_plain(node)) if node is not None else ParallelDims()


def data_from_cfg(cfg: DictConfig) -> DataSpec:
    return DataSpec(**_plain(cfg.data))


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
