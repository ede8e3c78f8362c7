"""The config of ``lowprec estimate`` and ``lowprec recommend``: ``lowprec train``'s schema (``model=``, ``recipe=``,
``train.*``, ``parallel.*``, ``model.<field>``, ``recipe.<group>.<field>`` and every other key of ``train``, with its
defaults) plus each command's own top-level keys, composed by Hydra from conf/estimate.yaml and conf/recommend.yaml,
and turned here, once, into a typed query (``EstimateQuery``, ``RecommendQuery``): nothing below this door sees the
composed ``DictConfig``.

``train.compile=auto`` and ``train.ac=auto`` (train's defaults) are resolved for the part named by ``hardware=``
(``resolve_on_hardware``: ``lowprec_lab.plan.auto_train`` at that part's device type, per recipe), not for the
machine the command runs on: the prediction is of the run on that part, and each query keeps what it assumed.

A key the commands took before the vocabulary was shared (``batch=``, ``seq=``, ``recompute=``, ``compile=``) is
refused with one line naming the key that replaced it (``OLD_KEYS``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from lowprec.errors import ConfigError
from lowprec.estimate.hardware import Hardware, get_hardware
from lowprec.model import ModelArgs, MoEArgs
from lowprec.parallel import ParallelDims
from lowprec.recipe import Recipe
from lowprec.recipes import CATALOG, get_recipe
from lowprec.train.moe_balance import check_moe_layout
from lowprec.train.spec import TrainSpec
from lowprec_lab.plan.auto_train import Resolved, hardware_device_type, resolve_compile_ac
from lowprec_lab.plan.config import (
    RunConfig,
    TrainConfig,
    _writable,
    model_from_cfg,
    parallel_from_cfg,
    recipe_from_cfg,
    register_configs,
    train_from_cfg,
)

#: The old keys of estimate/recommend -> the ``lowprec train`` key that replaced each (one line says so).
OLD_KEYS = {
    "batch": "train.batch_size=N (the global batch, as lowprec train takes it: N / data-parallel ranks per GPU)",
    "seq": "train.seq_len=N",
    "recompute": "train.ac=none|selective|full",
    "compile": "train.compile=true|false",
}


@dataclass
class EstimateConfig(TrainConfig):
    """``lowprec estimate``: the run ``lowprec train`` would make with the same keys, on ``hardware``
    (``lowprec.estimate.hardware``). ``efficiency``: also print the flat-MFU step time at this MFU (null: not
    printed; the per-op cost model is always used). ``async_tp``: the cost model hides TP traffic too (needs
    ``parallel.tp > 1``; ``lowprec train`` has no async TP)."""

    hardware: str = "h100_sxm"
    efficiency: float | None = None
    async_tp: bool = False


@dataclass
class RecommendConfig(RunConfig):
    """``lowprec recommend``: which recipe and layout to pretrain ``model`` with on ``gpus`` GPUs of ``hardware`` for
    ``tokens`` tokens, with the loss at most ``max_loss_gap`` (relative: ``0.0025`` or ``0.25%``) worse than bf16's.
    ``recipes``: the candidates (null: the catalog). ``ablate_steps``: steps of the printed evidence ablation.
    ``train.batch_size``, ``train.seq_len``, ``train.ac``, ``parallel.tp`` and ``parallel.dp_shard`` pin what they
    name; unset, recommend chooses (batch 1 per data-parallel rank, the model's ``max_seq_len``, the lightest AC that
    fits, every layout)."""

    hardware: str = MISSING
    gpus: int = MISSING
    tokens: float = MISSING
    max_loss_gap: str = "0.25%"
    recipes: list[str] | None = None
    ablate_steps: int = 1000


SCHEMAS = {"estimate_schema": EstimateConfig, "recommend_schema": RecommendConfig}
#: each command's own keys (beside train's), for the one-line errors and shell completion
OWN_KEYS = {
    "estimate": ("hardware", "efficiency", "async_tp"),
    "recommend": ("hardware", "gpus", "tokens", "max_loss_gap", "recipes", "ablate_steps"),
}

_registered = False


def register_planning_configs() -> None:
    """``register_configs`` and the two root schemas of conf/estimate.yaml and conf/recommend.yaml."""
    global _registered
    register_configs()
    if not _registered:
        for name, cls in SCHEMAS.items():
            ConfigStore.instance().store(name=name, node=_writable(cls))
        _registered = True


def override_key(override: str) -> str:
    """The key of a Hydra override (``+train.ac=full`` -> ``train.ac``)."""
    return override.partition("=")[0].lstrip("+~")


def check_old_keys(command: str, overrides: list[str]) -> None:
    """Refuse (``ConfigError``, one line) a key that ``command`` took before it shared ``lowprec train``'s."""
    for o in overrides:
        new = OLD_KEYS.get(override_key(o))
        if new is not None:
            raise ConfigError(f"{override_key(o)}= is gone: lowprec {command} takes lowprec train's keys, {new}")


@dataclass(frozen=True)
class EstimateQuery:
    """What ``lowprec estimate`` predicts: ``model`` (its name) with ``args`` (overrides applied), ``recipes`` (one,
    or the catalog when ``all_recipes``), the run's ``train`` settings and ``dims``; ``batch_per_rank`` is
    ``train.batch_size / dims.dp``; the estimator's own ``hardware``, ``efficiency``, ``async_tp``, ``emulate``.
    ``train.compile`` / ``train.ac`` are resolved on ``hardware`` (``resolve_on_hardware``; with the one recipe's
    compile fallback when not ``all_recipes``); ``assumed``: recipe name -> its ``Resolved`` there (a recipe that
    cannot compile falls back to eager under ``auto``, as ``lowprec train`` runs it)."""

    model: str
    args: ModelArgs
    recipes: tuple[Recipe, ...]
    all_recipes: bool
    train: TrainSpec
    dims: ParallelDims
    hardware: str
    efficiency: float | None
    async_tp: bool
    emulate: bool
    assumed: dict[str, Resolved] = field(default_factory=dict)

    @property
    def batch_per_rank(self) -> int:
        return self.train.batch_size // self.dims.dp


def resolve_on_hardware(cfg: DictConfig, args: ModelArgs, hw: Hardware, recipe: Recipe | None = None) -> Resolved:
    """``cfg.train.compile`` / ``cfg.train.ac`` after ``auto`` for a run on the part ``hw`` (its device type,
    ``hardware_device_type``), not on this machine: the rule ``lowprec train`` and its dry run apply on their device
    (``lowprec_lab.plan.auto_train.resolve_compile_ac``). With ``recipe``, one that cannot compile there
    (``compile_blocker``) falls back to eager under ``auto``. Raises ``ConfigError`` for a bad ``train.compile``."""
    from lowprec.train.build import compile_blocker  # torch and the model: only once the keys are read

    device = hardware_device_type(hw)
    blocker = None if recipe is None else compile_blocker(recipe, int(cfg.train.telemetry_every), device)
    return resolve_compile_ac(cfg.train.compile, cfg.train.ac, device, isinstance(args, MoEArgs), blocker)


def _with_resolved(cfg: DictConfig, r: Resolved) -> DictConfig:
    """``cfg`` with ``train.compile`` / ``train.ac`` set to ``r``'s values (nothing left to resolve on a device)."""
    return OmegaConf.merge(cfg, {"train": {"compile": r.compile, "ac": r.ac}})


def _run_settings(cfg: DictConfig):
    """(args, train, dims) of ``cfg`` with the checks ``lowprec train``'s preflight makes of them without data:
    ``train.seq_len`` within ``model.max_seq_len``, the batch and heads splitting over the layout, what a MoE
    model supports. HSDP replicas are refused: the estimator does not model them."""
    args = model_from_cfg(cfg.model)
    spec = train_from_cfg(cfg)
    dims = parallel_from_cfg(cfg)
    if spec.seq_len > args.max_seq_len:
        raise ConfigError(
            f"train.seq_len={spec.seq_len} exceeds model.max_seq_len={args.max_seq_len}; "
            "lower train.seq_len or raise model.max_seq_len"
        )
    if dims.dp_replicate > 1:
        raise ConfigError(
            f"parallel.dp_replicate={dims.dp_replicate}: HSDP replicas are not modelled by the estimator; "
            "estimate one replica (parallel.dp_shard, parallel.tp)"
        )
    dims.check(batch_size=spec.batch_size, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads)
    check_moe_layout(args, dims, spec)
    return args, spec, dims


def estimate_query(cfg: DictConfig, *, all_recipes: bool = False, emulate: bool = False) -> EstimateQuery:
    """The typed query of a composed conf/estimate.yaml (``all_recipes``: ``recipe=all`` was given, the catalog is
    estimated). Raises ``ConfigError``/``RecipeError``/``ParallelError`` (one line) for a bad value."""
    hw = get_hardware(cfg.hardware)  # ConfigError listing the parts for an unknown name
    recipes = tuple(CATALOG.values()) if all_recipes else (recipe_from_cfg(cfg.recipe),)
    args = model_from_cfg(cfg.model)
    assumed = {r.name: resolve_on_hardware(cfg, args, hw, r) for r in recipes}
    # train's settings: one recipe's own resolution; the catalog's AC (the same for every recipe) and auto's compile
    base = assumed[recipes[0].name] if not all_recipes else resolve_on_hardware(cfg, args, hw)
    args, spec, dims = _run_settings(_with_resolved(cfg, base))
    if cfg.efficiency is not None and not 0.0 < cfg.efficiency <= 1.0:
        raise ConfigError(f"efficiency={cfg.efficiency} must be in (0, 1]")
    if cfg.async_tp and dims.tp == 1:
        raise ConfigError("async_tp=true needs parallel.tp > 1")
    return EstimateQuery(
        cfg.model.name,
        args,
        recipes,
        all_recipes,
        spec,
        dims,
        cfg.hardware,
        cfg.efficiency,
        cfg.async_tp,
        emulate,
        assumed,
    )


@dataclass(frozen=True)
class RecommendQuery:
    """What ``lowprec recommend`` ranks (``RecommendConfig``): ``args`` of ``model``; the pinned ``batch_size``
    (global), ``ac``, ``tp``, ``dp_shard`` or ``None`` where recommend chooses; ``seq`` (``train.seq_len`` or the
    model's ``max_seq_len``); ``compile``: ``train.compile`` as given (``True``/``False``/``"auto"``), and
    ``assumed``: each candidate recipe's (the control's included) compile and AC resolved on ``hardware``
    (``resolve_on_hardware``; ``ac`` there is ``auto``'s choice, used only when ``train.ac`` is pinned);
    ``recipes`` (names; empty: the catalog);
    ``tracking_uri``: the store of the evidence; ``passthrough``: the user's other overrides of ``lowprec train``'s
    keys, carried into the printed command lines."""

    model: str
    args: ModelArgs
    hardware: str
    gpus: int
    tokens: float
    max_loss_gap: float
    seq: int
    compile: object
    recipes: tuple[str, ...] = ()
    batch_size: int | None = None
    ac: str | None = None
    tp: int | None = None
    dp_shard: int | None = None
    ablate_steps: int = 1000
    tracking_uri: str = "sqlite:///runs/mlflow.db"
    passthrough: tuple[str, ...] = field(default_factory=tuple)
    assumed: dict[str, Resolved] = field(default_factory=dict)


def loss_gap(value) -> float:
    """``max_loss_gap`` as a fraction: ``0.0025`` or ``0.25%``; ``ConfigError`` outside (0, 1)."""
    t = str(value).strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ConfigError(f"max_loss_gap={value!r} is not a number or a percentage like 0.25%") from None
    if not (0.0 < v < 1.0 and math.isfinite(v)):
        raise ConfigError(f"max_loss_gap={value!r} must be a relative gap in (0, 100%)")
    return v


#: keys recommend prints itself in its command lines (chosen or pinned), never passed through
_PRINTED = ("model", "recipe", "recipes", "parallel.dp_shard", "parallel.tp", "parallel.dp_replicate")
_PRINTED_TRAIN = ("train.batch_size", "train.seq_len", "train.ac", "train.compile")


def recommend_query(cfg: DictConfig, overrides: list[str]) -> RecommendQuery:
    """The typed query of a composed conf/recommend.yaml; ``overrides`` (the command line) say what is pinned.
    Raises ``ConfigError`` (one line) for a missing or bad value."""
    keys = {override_key(o) for o in overrides}
    if "model" not in keys:
        raise ConfigError("model= is required (the model to pretrain, e.g. model=llama3_8b)")
    for k in ("hardware", "gpus", "tokens"):
        if OmegaConf.is_missing(cfg, k):
            raise ConfigError(f"{k}= is required")
    for k in ("gpus", "ablate_steps"):
        if cfg[k] < 1:
            raise ConfigError(f"{k}={cfg[k]} must be >= 1")
    if not (cfg.tokens > 0 and math.isfinite(cfg.tokens)):
        raise ConfigError(f"tokens={cfg.tokens:g} must be a finite number > 0")
    hw = get_hardware(cfg.hardware)  # ConfigError listing the parts for an unknown name
    args = model_from_cfg(cfg.model)
    base = resolve_on_hardware(cfg, args, hw)  # train.compile / train.ac as lowprec train would run them there
    spec = train_from_cfg(_with_resolved(cfg, base))
    pinned = lambda k: k in keys  # noqa: E731
    seq = spec.seq_len if pinned("train.seq_len") else args.max_seq_len
    dims = parallel_from_cfg(cfg)
    if dims.dp_replicate > 1:
        raise ConfigError("parallel.dp_replicate: HSDP replicas are not modelled by recommend; pin parallel.dp_shard")
    if seq > args.max_seq_len:
        raise ConfigError(
            f"train.seq_len={seq} exceeds model.max_seq_len={args.max_seq_len}; "
            "lower train.seq_len or raise model.max_seq_len"
        )
    check_moe_layout(args, ParallelDims(tp=dims.tp), spec)  # what train refuses of a MoE model
    names = tuple(get_recipe(str(n)).name for n in cfg.recipes) if cfg.recipes is not None else ()
    if cfg.recipes is not None and not names:
        raise ConfigError("recipes=[] names no recipe: list some, e.g. 'recipes=[bf16,fp8_rowwise]', or leave it out")
    # every candidate and the control (a catalog recipe): resolved per recipe, as each would run there
    assumed = {n: resolve_on_hardware(cfg, args, hw, get_recipe(n)) for n in dict.fromkeys([*names, *CATALOG])}
    own = {*OWN_KEYS["recommend"], *_PRINTED, *_PRINTED_TRAIN}
    passthrough = tuple(o for o in overrides if override_key(o) not in own)
    return RecommendQuery(
        model=cfg.model.name,
        args=args,
        hardware=cfg.hardware,
        gpus=cfg.gpus,
        tokens=float(cfg.tokens),
        max_loss_gap=loss_gap(cfg.max_loss_gap),
        seq=seq,
        compile=cfg.train.compile,
        recipes=names,
        batch_size=spec.batch_size if pinned("train.batch_size") else None,
        ac=spec.ac if pinned("train.ac") else None,  # train.ac=auto: auto's choice on hardware
        tp=dims.tp if pinned("parallel.tp") else None,
        dp_shard=dims.dp_shard if pinned("parallel.dp_shard") else None,
        ablate_steps=cfg.ablate_steps,
        tracking_uri=str(cfg.tracking.uri),
        passthrough=passthrough,
        assumed=assumed,
    )
