"""Hydra glue: every config group and node registered from its Python dataclass, and composed configs turned
into lowprec objects.

One source for defaults: the dataclasses (``TrainSpec``, ``OptimHParams``, ``ParallelDims``, ``DataSpec``,
``ModelArgs`` / ``MoEArgs`` via ``MODEL_CONFIGS``, recipes via the catalog, and the app-level ones below) hold every
default; ``register_configs`` stores them in Hydra's ConfigStore as structured configs, and the yaml files
under conf/ keep only what differs (which group options a command uses, Hydra's own settings, and each
experiment's values). While composing, Hydra refuses unknown keys and checks the type of every value in the
dataclass-typed nodes; the ``model`` and ``recipe`` nodes (stored as dicts) are type-checked by ``typed`` when
converted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, Container, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lowprec.backends import check_recipe
from lowprec.build_optim import OptimHParams
from lowprec.data import DataSpec
from lowprec.errors import ConfigError
from lowprec.model import MODEL_CONFIGS, ModelArgs, model_args
from lowprec.parallel import ParallelDims
from lowprec.recipe import CommSpec, ComputeSpec, Float8Spec, OptimSpec, Recipe, RecipeError, WeightSpec
from lowprec.recipes import CATALOG
from lowprec.train.spec import TrainSpec
from lowprec_lab.plan.launcher import LAUNCHER_OPTIONS, LauncherSpec
from lowprec_lab.stats.stability import SpikeRule

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


@dataclass(frozen=True)
class TrackingConfig:
    """Group ``tracking``. ``tracking/sqlite``: MLflow with an embedded sqlite store under the runs folder;
    any tracking URI works via ``tracking.uri=...``."""

    uri: str = "sqlite:///${paths.runs}/mlflow.db"
    experiment: str = "lowprec"


@dataclass(frozen=True)
class PathsConfig:
    """Where runs (MLflow store, checkpoints, multirun output), reports and the token cache live."""

    runs: str = "runs"
    reports: str = "reports"
    cache: str = f"${{oc.env:LOWPREC_CACHE,'{DataSpec.cache_dir}'}}"  # DataSpec's default unless $LOWPREC_CACHE


@dataclass(frozen=True)
class TrainNode(TrainSpec):
    """The ``train`` node: ``TrainSpec``'s fields, with ``compile`` and ``ac`` also ``auto`` (the default: resolved
    per device and recipe by ``lowprec_lab.plan.auto_train``; ``train_from_cfg`` returns the resolved
    ``TrainSpec``). Its values are checked once resolved, by ``TrainSpec`` itself."""

    compile: Any = "auto"
    ac: str = "auto"
    #: ``auto``: ``min(3, train.steps - 1)`` steps left out of the throughput means (a short run, e.g. the
    #: ``train.steps=2`` check of a printed command line, keeps one timed step); an int is taken as given.
    timing_warmup_steps: Any = "auto"

    def __post_init__(self) -> None:  # checked as a TrainSpec after ``auto`` is resolved (train_from_cfg)
        pass


@dataclass
class RunConfig:
    """The keys shared by ``lowprec train`` and ``lowprec ablate`` (conf/base.yaml picks the group options).

    ``device``: auto | cpu | cuda | cuda:N. ``cpu_kernels``: auto | native | emulated, which kernels run the
    low-precision GEMMs and attention on a CPU (``lowprec.kernels.policy``; never the numerics; a GPU run
    ignores it). ``resume``: for ``lowprec train``, a checkpoint folder
    (``${paths.runs}/checkpoints/<run id>/step_<N>``) to continue from; ``train.resume_recipe_change=true``
    allows one written under another recipe (recorded). For ``lowprec ablate``, the id of an interrupted ablation
    to continue (lowprec_lab/runner/resume.py). ``train.checkpoint_every=N`` writes one every N steps.
    """

    model: Any = MISSING  # group: model/<size> (MODEL_CONFIGS: Llama and MoE sizes)
    # group: data/<source> (DATA_SOURCES), each option a DataSpec node. Any, not DataSpec: a typed field would be
    # filled with DataSpec's defaults before the option merges in, and text/tokens' required `path: ???` (MISSING
    # never overrides a value) would compose as null.
    data: Any = MISSING
    optim: OptimHParams = MISSING  # group: optim/adamw
    tracking: TrackingConfig = MISSING  # group: tracking/sqlite
    parallel: ParallelDims = MISSING  # group: parallel/single
    seed: int = 0
    device: str = "auto"
    cpu_kernels: str = "auto"
    resume: str | None = None
    train: TrainNode = field(default_factory=TrainNode)
    paths: PathsConfig = field(default_factory=PathsConfig)
    stability: SpikeRule = field(default_factory=SpikeRule)


@dataclass
class TrainConfig(RunConfig):
    """``lowprec train``: one run of ``recipe`` (group: recipe/<name>, the catalog)."""

    recipe: Any = MISSING


@dataclass
class ReportConfig:
    """The report's verdicts (``report.*``, lowprec_lab/report/verdict_table.py). ``margin``: the relative
    non-inferiority margin on the validation loss (0.0025 = 0.25%, DeepSeek-V3's bar for FP8 against BF16); a
    recipe is non-inferior when the upper bound of its paired 95% interval is below +margin
    (lowprec_lab/stats/verdict.py). ``lowprec report ID`` uses the margin the ablation ran with unless
    ``report.margin=...`` is given. ``primary``: the ablation's primary comparisons (recipe names), tested right
    after the controls with the full alpha, the other recipes only where every primary one is conclusive in that
    direction (lowprec_lab/stats/order.py); stated before the run, so ``lowprec report`` has no override for it."""

    margin: float = 0.0025
    primary: list[str] = field(default_factory=list)


@dataclass
class AblateConfig(RunConfig):
    """``lowprec ablate``: ``recipes`` x ``seeds`` under one MLflow parent run; an ``experiment`` (conf/experiment/)
    sets ``name``, ``recipes`` and its own values. ``control``: the report's reference recipe for loss gaps and
    verdicts; it must be one of ``recipes`` (null: ``bf16`` when listed, else the first recipe). ``seeds``: N seeds
    ``seed .. seed+N-1`` per recipe, or ``auto``: 3, then one more at a time for the recipes whose verdict is still
    inconclusive, up to ``max_seeds`` (lowprec_lab/stats/auto_seeds.py), or per recipe (``{others: N, name: M}``).
    ``workers``: runs trained at once, each in
    its own process, or ``auto``: 2 on a CPU (sharing its cores), one per GPU on CUDA (each worker pinned to its own
    GPU(s), ``floor(gpus / GPUs per run)`` at a time; lowprec_lab/plan/placement.py). ``dry_run``: print the plan
    (runs, placement, tokens, corpus epochs, predicted wall time) and train nothing; ``gpus``: the node's GPUs to
    use or plan for; ``hardware``: the part the dry run predicts for (lowprec_lab/runner/dry_run.py)."""

    control: str | None = None
    #: add a negative and a positive control to ``recipes`` (unless listed), judged like every recipe: the report's
    #: first line says whether the experiment could see a difference of ``report.margin`` (negative control
    #: ``non-inferior``, positive ``inferior``); lowprec_lab/plan/preflight.py ``ablation_controls``
    controls: bool = False
    #: the recipe that must come out non-inferior (null: the control with ``compute.reduction_order=reversed`` from
    #: the catalog, e.g. ``bf16_reordered`` for ``bf16``); only with ``controls=true``
    negative_control: str | None = None
    #: the recipe that must come out inferior (null: ``fp8_unscaled``, preflight's ``POSITIVE_CONTROL``); only with
    #: ``controls=true``
    positive_control: str | None = None
    name: str = MISSING
    recipes: list[str] = MISSING
    #: an int >= 1; ``auto`` (lowprec_lab/stats/auto_seeds.py: 3 seeds, then more for inconclusive recipes only);
    #: or seeds per recipe, ``{others: N, <recipe>: M, ...}``, where a recipe's measured noise asks for more (or
    #: fewer) than the rest: the control trains the most any recipe trains, so each recipe pairs with it on all of
    #: its own; an entry for a recipe the ablation does not train does nothing
    #: (lowprec_lab/plan/preflight.py ``recipe_seed_counts``)
    seeds: Any = 1
    max_seeds: int = 8
    workers: Any = 1  # an int >= 1 or auto (lowprec_lab/plan/placement.py)
    #: the experiment's own reports beside report.md (lowprec_lab/studies: registered names)
    studies: list[str] = field(default_factory=list)
    #: each study's own settings under its name (``study.deepseek_v3.capture_batches=4``; the study documents them)
    study: dict[str, Any] = field(default_factory=dict)
    #: empty: the ablation runs on ``model``. A list of model names: one ablation per model (``model=<name>`` with
    #: every other setting shared), tagged with the first one's id as ``ablation_group``; the studies of the last
    #: one see every model's ablation
    models: list[str] = field(default_factory=list)
    #: empty: one ablation. Settings mirroring the config's nesting whose leaves are lists of >= 2 values
    #: (``grid.optim.lr=[0.001,0.002]``): one ablation per point of their product, every other setting shared,
    #: grouped like ``models`` (lowprec_lab/plan/grid.py; only model/optim/train/stability settings)
    grid: dict[str, Any] = field(default_factory=dict)
    report: ReportConfig = field(default_factory=ReportConfig)
    #: print the plan (runs, placement, steps, tokens, corpus epochs, predicted wall time) and train nothing
    dry_run: bool = False
    #: GPUs of the node to plan for (null: ``torch.cuda.device_count()``); plans a node from a laptop with dry_run
    gpus: int | None = None
    #: the part the dry run predicts for (``lowprec estimate``'s names; null: the detected GPU, else h100_sxm)
    hardware: str | None = None
    #: group: launcher/<name> (local | slurm | submitit_local): where the runs are launched
    #: (lowprec_lab/plan/launcher.py; slurm: one SLURM job per run through submitit)
    launcher: LauncherSpec = field(default_factory=LauncherSpec)


#: Group ``data``: what each source changes from ``DataSpec``'s defaults. ``stdlib``: the Python standard
#: library's .py sources (present on every machine), byte-level BPE, uint16 shards. ``text``: your own text
#: files, ``data=text data.path=/my/corpus ['data.pattern=**/*.txt']``. ``tokens``: pre-tokenized uint16
#: shards with meta.json (lowprec.data.shards format), ``data=tokens data.path=/dir``. Every source tokenizes
#: into ``${paths.cache}``.
DATA_SOURCES: dict[str, dict[str, Any]] = {
    "stdlib": dict(source="stdlib", pattern="**/*.py"),
    "text": dict(source="text", path=MISSING),
    "tokens": dict(source="tokens", path=MISSING),
}
DATA_CACHE_DIR = "${paths.cache}"

#: The group options registered from dataclasses: group -> option -> dataclass instance. ``optim/adamw``: the
#: AdamW hyper-parameters (the state precision is the recipe's ``optim`` group, not this one).
#: ``parallel/single``: one process; ``parallel.dp_shard=N`` (FSDP2), ``parallel.tp=N`` (tensor parallel with
#: sequence parallel) and ``parallel.dp_replicate=N`` (HSDP replicas) make ``lowprec train/ablate`` run under
#: torchrun with dp_replicate x dp_shard x tp ranks on this machine (README: multi-node).
GROUPS: dict[str, dict[str, Any]] = {
    "data": {name: DataSpec(**{"cache_dir": DATA_CACHE_DIR, **diff}) for name, diff in DATA_SOURCES.items()},
    "optim": {"adamw": OptimHParams()},
    "parallel": {"single": ParallelDims()},
    "tracking": {"sqlite": TrackingConfig()},
}
#: Groups of ``lowprec ablate`` alone (conf/ablate.yaml picks the option): ``launcher/<name>``.
ABLATE_GROUPS: dict[str, dict[str, Any]] = {"launcher": LAUNCHER_OPTIONS}

#: Root schemas, first in the defaults list of conf/train.yaml and conf/ablate.yaml.
SCHEMAS = {"train_schema": TrainConfig, "ablate_schema": AblateConfig}


def _writable(obj) -> DictConfig:
    """``OmegaConf.structured(obj)`` with the read-only flag cleared on every node: lowprec's dataclasses
    are frozen, which OmegaConf turns into read-only nodes, but Hydra merges yaml and overrides into them.
    (The composed config is still typed: a wrong type or an unknown key is refused.)"""
    node = OmegaConf.structured(obj)

    def clear(n: Container) -> None:
        OmegaConf.set_readonly(n, None)
        if isinstance(n, DictConfig) and not (n._is_missing() or n._is_none() or n._is_interpolation()):
            for key in n.keys():
                child = n._get_node(key)
                if isinstance(child, Container):
                    clear(child)

    clear(node)
    return node


_registered = False


def model_node(name: str) -> dict[str, Any]:
    """The ``model`` config group's option ``name`` as a plain mapping (``model=<name>``); ``ConfigError`` listing
    the sizes for an unknown name."""
    return {"name": name, **dataclasses.asdict(model_args(name))}


def register_configs() -> None:
    """Register every config group and the root schemas in Hydra's ConfigStore.

    ``model/<size>`` from MODEL_CONFIGS (Llama sizes and the ``moe_*`` DeepSeekMoE ones) and ``recipe/<name>`` from
    the catalog (the catalog stays the single source of truth; Hydra sees every field, so
    ``recipe.fp8.scaling=rowwise`` or ``model.n_layers=2`` override it and multirun can sweep it); ``data/*``,
    ``optim/adamw``, ``parallel/single`` and ``tracking/sqlite`` from ``GROUPS``; ``launcher/*`` from
    ``ABLATE_GROUPS``; ``train_schema`` and ``ablate_schema`` (``TrainConfig``, ``AblateConfig``: ``train``,
    ``paths`` and the top-level keys) from ``SCHEMAS``.
    """
    global _registered
    if _registered:
        return
    cs = ConfigStore.instance()
    for name in MODEL_CONFIGS:
        cs.store(group="model", name=name, node=model_node(name))
    for name, recipe in CATALOG.items():
        cs.store(group="recipe", name=name, node=recipe.to_dict())
    for group, options in {**GROUPS, **ABLATE_GROUPS}.items():
        for name, obj in options.items():
            cs.store(group=group, name=name, node=_writable(obj))
    for name, cls in SCHEMAS.items():
        cs.store(name=name, node=_writable(cls))
    _registered = True


def _plain(node) -> dict:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def typed(cls: type, node, prefix: str) -> dict:
    """The fields of ``node`` checked and converted against the dataclass ``cls`` (OmegaConf structured
    config: ``"12"`` -> 12, ``"abc"`` for an int is refused). Raises ``ConfigError`` naming
    ``<prefix>.<field>`` for a value of the wrong type or an unknown key."""
    try:
        # writable: a frozen dataclass's nested groups (``recipe.fp8.cast``) would refuse the merge otherwise
        merged = OmegaConf.merge(_writable(cls), _plain(node))
    except OmegaConfBaseException as e:
        key = f"{prefix}.{e.full_key}" if getattr(e, "full_key", None) else prefix
        msg = (getattr(e, "msg", None) or str(e)).strip().splitlines()[0]
        raise ConfigError(f"{key}: {msg}") from None
    return OmegaConf.to_container(merged, resolve=True)


_RECIPE_GROUPS = {
    "weights": WeightSpec,
    "compute": ComputeSpec,
    "fp8": Float8Spec,
    "optim": OptimSpec,
    "comm": CommSpec,
}


def recipe_from_cfg(node) -> Recipe:
    """``Recipe`` from the ``recipe`` node, through the backend registry's checks (``check_recipe``; the recipe is
    a pure value); raises ``RecipeError`` naming bad fields or values."""
    d = _plain(node)
    for group, cls in _RECIPE_GROUPS.items():
        if isinstance(d.get(group), dict):
            try:
                d[group] = typed(cls, d[group], f"recipe.{group}")
            except ConfigError as e:
                raise RecipeError(str(e)) from None
    return check_recipe(Recipe.from_dict(d))


def model_from_cfg(node) -> ModelArgs:
    d = _plain(node)
    name = d.pop("name")
    base = model_args(name)  # ConfigError listing the sizes for an unknown name
    # The size's own class (ModelArgs or MoEArgs): a field it does not have is refused, naming model.<field>.
    return dataclasses.replace(base, **typed(type(base), {**dataclasses.asdict(base), **d}, "model"))


def train_resolved(cfg: DictConfig, recipe: Recipe | None = None):
    """``cfg.train``'s ``compile`` / ``ac`` after ``auto`` (``lowprec_lab.plan.auto_train.Resolved``) on
    ``cfg.device`` for ``cfg.model``; with ``recipe``, a recipe that cannot compile there falls back to eager
    (``Resolved.fallback``). Raises ``ConfigError`` for a bad ``train.compile`` value or device."""
    from lowprec.model.moe import MoEArgs
    from lowprec.train.build import compile_blocker, resolve_device
    from lowprec_lab.plan.auto_train import resolve_compile_ac

    node = cfg.train
    want_c, want_ac = node.get("compile", False), node.get("ac", "none")
    if want_c != "auto" and want_ac != "auto":
        return resolve_compile_ac(want_c, want_ac, "cpu", False)  # nothing to resolve: no device query
    device = resolve_device(cfg.device).type
    moe = isinstance(model_from_cfg(cfg.model), MoEArgs)
    blocker = None
    if recipe is not None:
        blocker = compile_blocker(recipe, int(node.telemetry_every), device)
    return resolve_compile_ac(want_c, want_ac, device, moe, blocker)


def train_from_cfg(cfg: DictConfig, recipe: Recipe | None = None) -> TrainSpec:
    """``TrainSpec`` of ``cfg.train`` with ``auto`` resolved (``train_resolved``; per recipe when given)."""
    d = typed(TrainNode, cfg.train, "train")
    r = train_resolved(cfg, recipe)
    return TrainSpec(**{**d, "compile": r.compile, "ac": r.ac, "timing_warmup_steps": timing_warmup(d)})


def timing_warmup(train: dict) -> int:
    """``train.timing_warmup_steps`` resolved: ``auto`` -> ``min(3, steps - 1)`` (at least 0), an int as given.
    Raises ``ConfigError`` for another value (``TrainSpec`` checks the int's range)."""
    value = train["timing_warmup_steps"]
    if value == "auto":
        return max(0, min(3, int(train["steps"]) - 1))
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"train.timing_warmup_steps={value!r} must be an integer >= 0 or auto")
    return value


def optim_from_cfg(cfg: DictConfig) -> OptimHParams:
    return OptimHParams(**typed(OptimHParams, cfg.optim, "optim"))


def parallel_from_cfg(cfg: DictConfig):
    """``ParallelDims`` from the ``parallel`` node (one process when the node is absent)."""
    node = cfg.get("parallel")
    return ParallelDims(**typed(ParallelDims, node, "parallel")) if node is not None else ParallelDims()


def spike_rule_from_cfg(cfg: DictConfig) -> SpikeRule:
    """``SpikeRule`` from the ``stability`` node (the default rule when absent); ``ConfigError`` naming
    ``stability.<field>`` for a value out of range."""
    node = cfg.get("stability")
    if node is None:
        return SpikeRule()
    try:
        return SpikeRule(**typed(SpikeRule, node, "stability"))
    except ValueError as e:
        raise ConfigError(f"stability: {e}") from None


def data_from_cfg(cfg: DictConfig) -> DataSpec:
    return DataSpec(**typed(DataSpec, cfg.data, "data"))


def check_store_uri(uri: str) -> None:
    """Refuse (``ConfigError``, one line) a ``tracking.uri`` MLflow would fail on with a traceback: a file store
    (``file://...`` or a bare folder: MLflow 3 keeps it in maintenance mode and refuses to open it), or a database
    URI (``postgresql://``, ``mysql://``, ``mssql://``, with or without ``+driver``) whose driver is not installed
    (SQLAlchemy imports it only when MLflow opens the store)."""
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    if scheme in ("", "file"):
        raise ConfigError(
            f"tracking.uri={uri}: MLflow's file store is not supported (MLflow 3 keeps it in maintenance mode); "
            "use sqlite:///PATH/mlflow.db or an http(s):// tracking server"
        )
    if scheme.split("+", 1)[0] not in ("postgresql", "postgres", "mysql", "mariadb", "mssql", "oracle"):
        return
    from sqlalchemy.engine import make_url  # MLflow's own dependency; imported only for a database URI

    try:
        dialect = make_url(uri).get_dialect()
    except Exception as e:  # ArgumentError for a URI it cannot parse, NoSuchModuleError for an unknown +driver
        raise ConfigError(f"tracking.uri: {scheme}://... is not a database URI SQLAlchemy can open ({e})") from None
    try:
        dialect.import_dbapi()
    except ImportError as e:
        raise ConfigError(
            f"tracking.uri: a {scheme}:// store needs the database driver {getattr(e, 'name', None) or e}, which is "
            "not installed (pip install it, or name another with +driver)"
        ) from None


def tracking_from_cfg(cfg: DictConfig) -> TrackingConfig:
    """``TrackingConfig`` from the ``tracking`` node, its ``${paths.runs}`` resolved; ``ConfigError`` for a URI
    MLflow cannot open here (``check_store_uri``)."""
    tracking = TrackingConfig(**typed(TrackingConfig, cfg.tracking, "tracking"))
    check_store_uri(tracking.uri)
    return tracking


def launcher_from_cfg(cfg: DictConfig) -> LauncherSpec:
    """The ``LauncherSpec`` of ``cfg.launcher`` (``local`` when the config has none: ``lowprec train``, or an
    ablation saved before launchers existed). Raises ``ConfigError`` naming ``launcher.<field>`` for a wrong type or an
    unknown key."""
    node = cfg.get("launcher")
    if node is None:
        return LauncherSpec()
    d = typed(LauncherSpec, node, "launcher")
    return LauncherSpec(**{**d, "setup": tuple(str(s) for s in d["setup"])})


def paths_from_cfg(cfg: DictConfig) -> PathsConfig:
    """``PathsConfig`` from the ``paths`` node, ``${oc.env:LOWPREC_CACHE,...}`` resolved."""
    return PathsConfig(**typed(PathsConfig, cfg.paths, "paths"))


def leaves(d: dict, prefix: str = "") -> dict[str, object]:
    """``{"a.b.c": value}`` for every leaf of the nested dict ``d`` (an empty dict is a leaf), in ``d``'s order."""
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def flat_params(cfg: DictConfig | dict, recipe: Recipe) -> dict[str, str]:
    """Flattened ``key -> value`` of the run's settings (a composed config, or its resolved plain form), for MLflow
    params (empty groups left out). ``train.compile``/``ac`` as written; ``Plan.params`` puts the resolved ``auto``
    values in."""
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    for key in ("recipe", "recipes", "hydra"):
        plain.pop(key, None)
    both = leaves(plain) | leaves(recipe.to_dict(), "recipe.")
    return {k: str(v) for k, v in both.items() if v != {}}
