"""The lab's typed door: what a ``lowprec train`` or ``lowprec ablate`` command will do, as one frozen value.

Hydra composes a ``DictConfig``; ``lowprec_lab.plan.preflight.preflight`` checks it and builds, once, a ``Plan``.
Every function below the door (``lowprec_lab/runner``, ``tracking``, ``report``, ``studies``, ``selfcheck``,
``stats``, ``planning``) takes the ``Plan`` or its typed parts, never the config (tests/unit/test_plan_door.py).
A ``Plan`` is picklable: the ablation's worker processes receive it as it is, instead of a config to re-compose
(lowprec_lab/runner/scheduler.py). The composed config itself travels only as data: ``settings`` (resolved, plain
``dict``) for the MLflow params, and YAML text for each run's ``config.yaml`` artifact (``yaml``), so the provenance
a run records is byte for byte what the composed config said.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from lowprec.build_optim import OptimHParams
from lowprec.data import DataSpec
from lowprec.model import ModelArgs
from lowprec.parallel import ParallelDims
from lowprec.recipe import Recipe
from lowprec.train.spec import TrainSpec
from lowprec_lab.plan.config import PathsConfig, TrackingConfig, flat_params
from lowprec_lab.plan.launcher import LauncherSpec
from lowprec_lab.plan.placement import Placement
from lowprec_lab.stats.stability import SpikeRule

if TYPE_CHECKING:  # the run path never needs scipy/statsmodels (lowprec_lab/stats/__init__.py)
    from lowprec_lab.stats.sequential import SpendingPlan


@dataclass(frozen=True)
class Plan:
    """One validated command. Built only by ``lowprec_lab.plan.preflight.preflight`` (or ``saved_plan``).

    ``command``: ``train`` or ``ablate``. ``recipes``: the recipes it trains (one for ``train``), validated against
    this machine, the model and the layout. ``seed``: the first seed; ``seeds``: those the control trains first
    (``seed .. seed+N-1``, N the most any recipe trains; ``seeds=auto``: the first 3) and ``spending`` the
    alpha-spending plan of the later ones (None unless ``seeds=auto``). ``recipe_seeds``: with seeds per recipe,
    every recipe's own seeds, ``((name, seeds), ...)``, each a prefix of ``seeds`` (empty: every recipe trains
    ``seeds``; ``seeds_of``, ``jobs``). ``control``: the report's reference recipe (None for ``train``).
    ``negative_control``/``positive_control``: with ``controls=true``, the recipes (among ``recipes``) that must come
    out non-inferior / inferior against the control (None otherwise). ``model_name``
    and ``model``: the size's name and its ``ModelArgs`` (or ``MoEArgs``). ``train``, ``optim``, ``parallel``,
    ``data``, ``stability``, ``tracking``, ``paths``: the typed nodes. ``device``: as given (``auto``,
    ``cpu``, ``cuda:N``; each process resolves it). ``placement``: where the runs train, one slot per worker
    (``lowprec_lab.plan.placement``; ``workers``: their count, ``auto`` resolved). ``trains``: per recipe name, the
    ``TrainSpec`` with ``train.compile``/``ac=auto`` resolved for that recipe and the tags saying so
    (``train_for``, ``train_tags``); ``train`` is the recipe-less resolution. ``dry_run``: print the plan, train
    nothing; ``gpus``: the node's GPUs to use or plan for (None: the visible ones); ``hardware``: the part a dry run
    predicts for (None: detected). ``launcher``: where the runs are launched (``LauncherSpec``: ``local``, or one
    submitit job per run on SLURM or on this machine; lowprec_lab/plan/launcher.py). ``resume``: a checkpoint
    folder (``train``) or an ablation id (``ablate``).
    ``name``, ``studies``, ``study``, ``margin``: the ablation's experiment name, studies and their settings, and the
    report's margin.
    ``group``: with ``models=[...]`` or a ``grid``, one ``Plan`` per model and grid point, in order (this one is the
    first); empty otherwise. ``point``: a grid plan's settings, ``((dotted key, value), ...)``.
    ``settings``: the composed config, resolved, as plain data (MLflow params: ``params``; ``config.yaml``:
    ``yaml``).
    """

    command: str
    recipes: tuple[Recipe, ...]
    seed: int
    seeds: tuple[int, ...]
    spending: SpendingPlan | None
    control: str | None
    model_name: str
    model: ModelArgs
    train: TrainSpec
    optim: OptimHParams
    parallel: ParallelDims
    data: DataSpec
    stability: SpikeRule
    tracking: TrackingConfig
    paths: PathsConfig
    device: str
    cpu_kernels: str
    placement: Placement
    resume: str | None
    name: str
    studies: tuple[str, ...]
    study: dict[str, Any]
    margin: float | None
    settings: dict[str, Any] = field(repr=False)
    #: the composed config as YAML (``config.yaml`` of the parent run; each child's differs in ``seed`` only)
    config_yaml: str = field(repr=False)
    launcher: LauncherSpec = LauncherSpec()
    group: tuple[Plan, ...] = ()
    trains: tuple[tuple[str, TrainSpec, dict[str, str]], ...] = ()
    dry_run: bool = False
    gpus: int | None = None
    hardware: str | None = None
    #: ``controls=true``: the recipe that must come out non-inferior (None without controls)
    negative_control: str | None = None
    #: ``controls=true``: the recipe that must come out inferior (None without controls)
    positive_control: str | None = None
    #: with ``grid``: this plan's point, ``((dotted key, value), ...)`` (lowprec_lab/plan/grid.py); empty otherwise
    point: tuple[tuple[str, Any], ...] = ()
    #: per recipe name, the seeds it trains when ``seeds`` is per recipe (``{others: N, ...}``); empty otherwise
    recipe_seeds: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: ``report.primary``: the comparisons tested right after the controls (lowprec_lab/stats/order.py)
    primary: tuple[str, ...] = ()

    def seeds_of(self, name: str) -> tuple[int, ...]:
        """The seeds recipe ``name`` trains first: its own when ``seeds`` is per recipe, else ``seeds``."""
        return dict(self.recipe_seeds).get(name, self.seeds)

    def jobs(self) -> list[tuple[Recipe, int]]:
        """Every (recipe, seed) the ablation trains first, seed-major (a short ablation still has paired seeds),
        in ``recipes`` order within a seed."""
        return [(r, s) for s in self.seeds for r in self.recipes if s in self.seeds_of(r.name)]

    def seeds_text(self) -> str:
        """The seeds in words: ``4 seeds``, or per recipe when they differ (``8 seeds of bf16, bf16_reordered; 3 of
        fp8_rowwise``)."""
        if not self.recipe_seeds:
            return f"{len(self.seeds)} seeds"
        return seeds_by_count({r.name: len(self.seeds_of(r.name)) for r in self.recipes}).replace(
            " of ", " seeds of ", 1
        )

    @property
    def workers(self) -> int:
        """Runs trained at once (``placement.workers``)."""
        return self.placement.workers

    def _train_entry(self, recipe: Recipe) -> tuple[TrainSpec, dict[str, str]] | None:
        for name, spec, tags in self.trains:
            if name == recipe.name:
                return spec, tags
        return None

    def train_for(self, recipe: Recipe) -> TrainSpec:
        """The ``TrainSpec`` ``recipe`` trains with: ``train.compile``/``ac=auto`` resolved for it (a recipe that
        cannot compile on this device falls back to eager); ``train`` for a recipe the plan was not built for (a
        saved plan's, whose recipes are empty)."""
        entry = self._train_entry(recipe)
        return self.train if entry is None else entry[0]

    def train_tags(self, recipe: Recipe) -> dict[str, str]:
        """The run's tags for ``auto`` (``lowprec_lab.plan.auto_train.Resolved.tags``: ``train_auto``,
        ``compile_fallback``); empty when nothing was ``auto`` or ``recipe`` is not one of the plan's."""
        entry = self._train_entry(recipe)
        return {} if entry is None else dict(entry[1])

    def yaml(self, seed: int | None = None) -> str:
        """The ``config.yaml`` artifact: the composed config, resolved, with the ``seed`` this run trained with (an
        ablation's runs differ only there); ``config_yaml`` when ``seed`` is None."""
        if seed is None:
            return self.config_yaml
        return OmegaConf.to_yaml(OmegaConf.create({**self.settings, "seed": seed}))

    def params(self, recipe: Recipe) -> dict[str, str]:
        """Flattened ``key -> value`` of the settings and ``recipe``, for MLflow params (``flat_params``)."""
        out = flat_params(self.settings, recipe)
        if "train.compile" in out and self._train_entry(recipe) is not None:
            spec = self.train_for(recipe)  # the values the run trains with, not an ``auto`` request (tagged)
            out |= {"train.compile": str(spec.compile), "train.ac": str(spec.ac)}
        if "train.timing_warmup_steps" in out:  # ``auto`` resolved, as the run measures with it
            out["train.timing_warmup_steps"] = str(self.train_for(recipe).timing_warmup_steps)
        return out


def seeds_by_count(counts: dict[str, int]) -> str:
    """Recipes grouped by their seed counts, most first: ``7 of bf16, bf16_reordered; 4 of fp8_tensorwise``."""
    by: dict[int, list[str]] = {}
    for name, n in counts.items():
        by.setdefault(n, []).append(name)
    return "; ".join(f"{n} of {', '.join(names)}" for n, names in sorted(by.items(), reverse=True))


def config_yaml(cfg: DictConfig, seed: int | None = None) -> str:
    """``cfg`` resolved, as YAML, with ``seed`` when given (a run's ``config.yaml`` artifact)."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if seed is not None:
        cfg.seed = seed
    return OmegaConf.to_yaml(cfg)


def settings_from_yaml(text: str) -> dict[str, Any]:
    """A ``config.yaml`` artifact read back as plain data, as OmegaConf reads YAML (``1e-3`` is a float)."""
    return OmegaConf.to_container(OmegaConf.create(text))


def with_group(plan: Plan, group: list[Plan]) -> Plan:
    """``plan`` carrying every model's plan of a ``models=[...]`` ablation."""
    return dataclasses.replace(plan, group=tuple(group))
