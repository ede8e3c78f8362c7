"""A grid of training settings: one ablation per point, every other setting shared.

``grid`` in an experiment (or on the command line) mirrors the config's own nesting, and each leaf is an axis,
a list of at least two values::

    grid:
      optim:
        lr: [0.00075, 0.0015, 0.003, 0.0045, 0.006]
      train:
        warmup_steps: [20, 40]

    lowprec ablate experiment=lr_sweep 'grid.optim.lr=[0.001,0.002]'      # an axis the experiment has
    lowprec ablate 'recipes=[bf16,fp32]' '+grid.optim.lr=[0.001,0.002]'  # a new axis: + as for study.*

The points are the Cartesian product of the axes, in the order written (the last axis varies fastest), after the
``models=[...]`` list when both are given. Each point is checked by preflight like any ablation before the first one
trains, and its ablation records the point on its parent run (tag ``grid_point``), so a study reads the whole grid
from the store (``lowprec_lab.studies.lr``). Only training settings can be an axis (``GRID_ROOTS``): a grid over
the recipes, the seeds or the control would change what the verdicts compare, not how the runs train.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from lowprec.errors import ConfigError

#: The config sections a grid axis may set: how the runs train (the model's options, the optimizer, the schedule
#: and the loop, the spike rule), never what the ablation compares.
GRID_ROOTS = ("model", "optim", "train", "stability")

#: Parent-run tag holding an ablation's grid point as JSON (``{"optim.lr": 0.003, ...}``).
POINT_TAG = "grid_point"

_MISSING = object()


def grid_axes(cfg: DictConfig) -> list[tuple[str, list[Any]]]:
    """The axes of ``cfg.grid`` as ``(dotted key, values)``, in the order written; empty when there is no grid.

    Raises ``ConfigError`` (one line) for a leaf that is not a list, an axis with fewer than 2 values or repeated
    values, a key outside ``GRID_ROOTS``, or a key the config does not have.
    """
    grid = cfg.get("grid") if isinstance(cfg, DictConfig) else None
    if not grid:
        return []
    axes: list[tuple[str, list[Any]]] = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, DictConfig | Mapping):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
            return
        if not isinstance(node, ListConfig | list | tuple):
            raise ConfigError(
                f"grid.{prefix}={node!r}: a grid axis is a list of at least 2 values "
                f"('grid.{prefix}=[a,b]'); for one value set {prefix}={node!r} instead"
            )
        values = list(OmegaConf.to_container(node) if isinstance(node, ListConfig) else node)
        axes.append((prefix, values))

    walk(grid, "")
    for key, values in axes:
        root = key.split(".", 1)[0]
        if root not in GRID_ROOTS or "." not in key:
            raise ConfigError(
                f"grid.{key}: only training settings can be an axis ({', '.join(r + '.*' for r in GRID_ROOTS)}); "
                "recipes, seeds and the control are what the verdicts compare"
            )
        if len(values) < 2:
            one = f"; for one value set {key}={values[0]}" if values else ""
            raise ConfigError(f"grid.{key}={values}: a grid axis needs at least 2 values{one}")
        if len({json.dumps(v, sort_keys=True, default=str) for v in values}) != len(values):
            raise ConfigError(f"grid.{key}={values} repeats a value: each point would train twice")
        current = OmegaConf.select(cfg, key, default=_MISSING, throw_on_missing=False)
        if current is _MISSING or isinstance(current, DictConfig | ListConfig):
            raise ConfigError(f"grid.{key}: the config has no setting {key} (see `lowprec ablate --help`)")
    return axes


def grid_points(cfg: DictConfig) -> list[dict[str, Any]]:
    """The points of ``cfg.grid`` (``grid_axes``): one ``{dotted key: value}`` per point, the last axis varying
    fastest; ``[]`` when there is no grid. Raises ``ConfigError`` as ``grid_axes``."""
    axes = grid_axes(cfg)
    if not axes:
        return []
    keys = [k for k, _ in axes]
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(v for _, v in axes))]


def apply_point(cfg: DictConfig, point: Mapping[str, Any]) -> None:
    """Set each ``key: value`` of ``point`` in ``cfg`` (in place) and clear its ``grid``: the point's own config."""
    for key, value in point.items():
        OmegaConf.update(cfg, key, value, merge=False)
    cfg.grid = {}


def point_text(point: Mapping[str, Any]) -> str:
    """``optim.lr=0.003 train.warmup_steps=40``: a point as the overrides that train it alone."""
    return " ".join(f"{k}={v}" for k, v in point.items())
