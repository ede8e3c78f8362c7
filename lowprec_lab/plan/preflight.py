"""Everything that can be validated before any data work, MLflow run or torchrun launch.

A bad input (a value of the wrong type or range, a recipe that cannot run on this machine or layout,
an FP8 selection that selects nothing, a sequence longer than the model allows, a checkpoint of another
recipe) ends here in one ``UserError`` line, so no MLflow run is ever created for it.

Preflight is the construction of the ``Plan`` (lowprec_lab/plan/plan.py): ``preflight(cfg)`` converts every node to
its typed value and checks it, once, and what it returns is all the runner reads.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf, open_dict

from lowprec.backends import fp8_backend
from lowprec.build_parallel import check_layout
from lowprec.convert import require_fp8_selection
from lowprec.errors import ConfigError, UserError
from lowprec.kernels import check_cpu_kernels, resolve_kernels
from lowprec.recipe import Recipe
from lowprec.recipes import CATALOG, get_recipe
from lowprec.train.build import (
    build_model_meta,
    check_compile,
    check_fp8_fallback,
    check_fp8_shapes,
    check_runtime,
    resolve_device,
)
from lowprec.train.checkpoint import check_resume_recipe, read_trainer_state
from lowprec.train.checkpoint_files import newest_checkpoint
from lowprec.train.checkpoint_metadata import load_metadata
from lowprec.train.data_position import resumed_position
from lowprec.train.moe_balance import check_moe_layout
from lowprec_lab.plan.config import (
    data_from_cfg,
    launcher_from_cfg,
    model_from_cfg,
    model_node,
    optim_from_cfg,
    parallel_from_cfg,
    paths_from_cfg,
    recipe_from_cfg,
    spike_rule_from_cfg,
    tracking_from_cfg,
    train_from_cfg,
    train_resolved,
)
from lowprec_lab.plan.grid import apply_point, grid_points
from lowprec_lab.plan.launch import under_torchrun
from lowprec_lab.plan.launcher import check_launcher
from lowprec_lab.plan.placement import Placement, Slot, plan_placement, visible_gpus
from lowprec_lab.plan.plan import Plan, config_yaml, with_group

#: The default positive control (``controls=true``, ``positive_control`` null): a recipe that must come out
#: ``inferior``: FP8 casts without a scale flush small values, gradients above all, to zero. Measured on ``tiny``
#: at the default experiment's setting it ends 12% above ``bf16`` (docs/lr-study.md), where ``bf16_pure`` (+0.47%,
#: paired sd 0.50%), ``mxfp4`` (-0.11%, sd 0.89%) and ``fp16_noscale`` (better than ``bf16``) did not separate.
POSITIVE_CONTROL = "fp8_unscaled"

if TYPE_CHECKING:  # the run path imports this module; scipy/statsmodels only where used
    from lowprec_lab.stats.sequential import SpendingPlan

#: The ablation id ``lowprec ablate`` prints: ``abl-<date>-<time>-<4 hex digits>``.
ABLATION_ID = re.compile(r"abl-\d{8}-\d{6}-[0-9a-f]{4}")


class AblationResumeError(UserError):
    """``resume=`` of ``lowprec ablate`` names no ablation of the store, or one that does not match the command."""


def check_ablation_id(value) -> str:
    """``value`` if it has the form of an ablation id; else ``AblationResumeError`` (a path, a checkpoint folder)."""
    text = str(value)
    if not ABLATION_ID.fullmatch(text):
        raise AblationResumeError(
            f"resume={text} is not an ablation id: resume= of lowprec ablate takes the id the ablation printed "
            "(abl-YYYYMMDD-HHMMSS-xxxx), never a path; one run continues from its checkpoint with "
            "lowprec train ... resume=runs/checkpoints/<run id>"
        )
    return text


#: Seeds feed torch.manual_seed and numpy's generators: numpy takes 0 .. 2**32 - 1.
SEED_MAX = 2**32 - 1


def check_seed(cfg: DictConfig) -> None:
    """Refuse (``ConfigError``) a ``seed`` that is not an integer in [0, 2**32 - 1], or an ablation whose seeds
    ``seed .. seed + N - 1`` (``max_seeds`` under ``seeds=auto``; the largest count of seeds per recipe) leave
    that range."""
    seed = cfg.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ConfigError(f"seed={seed} must be an integer in [0, {SEED_MAX}]")
    if "seeds" in cfg:
        n = cfg.get("max_seeds", 8) if cfg.seeds == "auto" else cfg.seeds
        if isinstance(n, DictConfig):  # seeds per recipe: the control trains the most
            n = max([c for c in n.values() if isinstance(c, int) and not isinstance(c, bool)], default=1)
        if isinstance(n, int) and seed + n - 1 > SEED_MAX:
            raise ConfigError(f"seed={seed} with {n} seeds runs past {SEED_MAX}: lower seed")


#: URI schemes MLflow 3 has a tracking store for (``mlflow/tracking/_tracking_service/utils.py``'s registry); a
#: bare path is a file store.
TRACKING_SCHEMES = ("", "file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks", "uc")


def check_tracking_uri(uri: str) -> None:
    """Refuse (``ConfigError``) a ``tracking.uri`` whose scheme no MLflow tracking store takes."""
    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower() if "://" in uri else ""
    if scheme not in TRACKING_SCHEMES:
        raise ConfigError(
            f"tracking.uri={uri}: MLflow has no tracking store for {scheme!r}:// (sqlite:///PATH, http(s)://HOST, "
            "postgresql://..., mysql://..., or a folder)"
        )


def check_writable_dirs(cfg: DictConfig) -> None:
    """Refuse (``ConfigError``) a ``paths.runs`` or ``paths.reports`` that is not a folder this process can create
    and write in, before training (a full run must never end at its report)."""
    for key in ("runs", "reports"):
        if key not in cfg.paths:
            continue
        folder = Path(str(cfg.paths[key]))
        try:
            folder.mkdir(parents=True, exist_ok=True)
            ok = folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)
            reason = "not writable"
        except OSError as e:
            ok, reason = False, e.strerror or type(e).__name__
        if not ok:
            raise ConfigError(f"paths.{key}={folder} cannot hold lowprec's {key} ({reason}): name a writable folder")


def slurm_partition_gpus(gres: str) -> int:
    """GPUs of one node as ``sinfo``'s ``%G`` column says them (``gpu:8``, ``gpu:a100:4(S:0-1),shard:8``,
    ``(null)``: none): the counts of its ``gpu`` entries summed; a ``gpu`` entry without a count is one."""
    total = 0
    for entry in re.sub(r"\([^)]*\)", "", gres).split(","):
        fields = entry.strip().split(":")
        if fields[0] == "gpu":
            total += int(fields[-1]) if len(fields) > 1 and fields[-1].isdigit() else 1
    return total


def check_slurm_gpus(launcher, device: str, world_size: int, run=subprocess.run) -> None:
    """On ``launcher=slurm`` each job asks sbatch for ``world_size`` GPUs unless ``device=cpu``
    (``lowprec_lab.runner.submitit_jobs.job_gpus``); sbatch refuses every job of a partition without them
    (``Invalid generic resource (gres) specification``), and this process cannot see the compute nodes' GPUs
    (``device=auto`` resolves here, on the login node). So the partition's nodes are asked with ``sinfo`` (``run``:
    how it is run): ``ConfigError`` (one line) when none has ``world_size`` GPUs, when ``sinfo`` fails or lists no
    such partition. ``launcher`` is the ``LauncherSpec``; nothing is asked for other launchers or ``device=cpu``."""
    if not launcher.cluster or device == "cpu":
        return
    cmd = ["sinfo", "--noheader", "--format=%P|%G"]
    if launcher.partition:
        cmd += ["--partition", launcher.partition]
    what = f"launcher=slurm with device={device}: each job asks for {world_size} GPU(s)"
    try:
        r = run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"{what}, and sinfo, asked for the partition's GPUs, did not answer ({e})") from None
    if r.returncode != 0:
        first = (r.stderr.strip() or "no message").splitlines()[0]
        raise ConfigError(f"{what}, and sinfo, asked for the partition's GPUs, failed: {first}")
    rows = [line.split("|", 1) for line in r.stdout.splitlines() if "|" in line]
    if launcher.partition is None:  # the cluster's default partition, starred by sinfo
        rows = [(p, g) for p, g in rows if p.endswith("*")]
    name = launcher.partition or (rows[0][0].rstrip("*") if rows else "(the default)")
    if not rows:
        raise ConfigError(f"{what}, but sinfo lists no partition {name}; name one with launcher.partition=")
    gpus = max(slurm_partition_gpus(g) for _, g in rows)
    if gpus < world_size:
        gres = ", ".join(sorted({g.strip() for _, g in rows}))
        raise ConfigError(
            f"{what}, but the nodes of partition {name} have {gpus or 'none'} (sinfo gres: {gres}); "
            "train on their CPUs with device=cpu, or name a partition with GPUs (launcher.partition=)"
        )


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def ablation_seeds(cfg: DictConfig) -> tuple[list[int], SpendingPlan | None]:
    """The seeds every recipe trains first and, for ``seeds=auto``, the alpha-spending plan of the later ones.

    ``seeds=N``: ``seed .. seed+N-1``, no plan. ``seeds=auto``: ``seed .. seed+2`` and the plan up to
    ``max_seeds``. Seeds per recipe (``{others: N, ...}``): ``seed .. seed+N-1`` for the recipes not named
    (``recipe_seed_counts`` gives each its own). Raises ``ConfigError`` for ``seeds`` < 1, not an int, ``auto`` or
    a mapping with ``others``, or ``max_seeds`` < 3 with auto.
    """
    raw = cfg.seeds
    if isinstance(raw, DictConfig):
        if "others" not in raw:
            raise ConfigError(
                f"seeds={_text(raw)} has no others: N, the seeds of every recipe it does not name "
                "(seeds={others: 4, bf16_reordered: 8})"
            )
        raw = raw.others
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
            raise ConfigError(f"seeds.others={raw} must be an integer >= 1")
    if raw == "auto":
        from lowprec_lab.stats.auto_seeds import plan_for  # here: the run path imports this module, not scipy
        from lowprec_lab.stats.verdict import LEVEL

        plan = plan_for(int(cfg.max_seeds), LEVEL)  # the report's level: its verdicts replay these looks
        return [int(cfg.seed) + i for i in range(plan.start)], plan
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ConfigError(f"seeds={raw} must be an integer >= 1, auto, or per recipe ('seeds={{others: N, NAME: M}}')")
    if raw < 1:
        raise ConfigError(f"seeds={raw} must be >= 1")
    return [int(cfg.seed) + i for i in range(raw)], None


#: How to make the corpus ``data.source=tokens`` reads (said by every refusal that lacks it).
PREPARE_HINT = "prepare one with `lowprec data prepare source=... out=DIR`, then data.path=DIR"


def check_corpus_path(source: str, path: str | None) -> None:
    """``data.source=tokens`` needs ``data.path``: ``ConfigError`` naming ``lowprec data prepare`` otherwise."""
    if source == "tokens" and (path is None or str(path) in ("", "???")):
        raise ConfigError(f"data.source=tokens needs data.path (a folder of token shards): {PREPARE_HINT}")


def check_fused_casts(recipe: Recipe, spec, device) -> None:
    """``train.fused_casts=on`` for a recipe with lowprec FP8 or block-scaled (``mx``) linears on a CPU: the casts'
    probe compile runs here, so a machine that cannot compile them refuses the run (``ConfigError``, one line) before
    an MLflow run exists.
    On CUDA the build checks it (probing here would hold a CUDA context in the launching process); ``auto`` and
    ``off`` never refuse (``lowprec.kernels.fused_casts.resolve_fused_casts``)."""
    kind = fp8_backend(recipe.fp8.backend).fused_casts  # which casts the backend's linears fuse, if any
    if spec.fused_casts != "on" or device.type != "cpu" or kind is None:
        return
    from lowprec.kernels.fused_casts import resolve_fused_casts

    resolve_fused_casts(spec.fused_casts, device, bool(spec.compile), block_scaled=kind == "block_scaled")


def resolve_data_source(cfg: DictConfig) -> None:
    """Set ``cfg.data.source`` to the source that reads ``cfg.data.path`` (``lowprec.data.dataset.implied_source``:
    a token shard folder given with the default ``stdlib`` source is ``tokens``), in place, so the plan, the MLflow
    params and the corpus tags all name what the run reads; the change is said on stderr. Raises ``DataError``
    (one line) for a path the source would not read."""
    from lowprec.data.dataset import implied_source

    source, path = str(cfg.data.source), cfg.data.get("path")
    implied = implied_source(source, path)
    if implied != source:
        print(f"lowprec: data.path={path} holds token shards: data.source={implied}", file=sys.stderr)
        with open_dict(cfg):
            cfg.data.source = implied


def ablation_placement(cfg: DictConfig) -> Placement:
    """Where the runs train (``lowprec_lab.plan.placement.plan_placement``): ``cfg.workers`` on this device and
    layout; on CUDA over ``cfg.gpus`` GPUs (null: the visible ones). ``device=cuda:N`` is that one GPU. A dry run
    with ``gpus=`` plans that node without querying this machine's devices.
    Raises ``ConfigError`` (one line) for ``gpus=0``, a layout larger than the node, or ``workers`` above the bound."""
    gpus = cfg.get("gpus")
    if gpus is not None and (isinstance(gpus, bool) or int(gpus) < 1):
        raise ConfigError(f"gpus={gpus}: name at least one GPU, or leave gpus unset (device=cpu trains on the CPU)")
    if cfg.get("dry_run") and gpus is not None:  # planning a node from another machine: no device query
        kind, device = ("cpu" if str(cfg.device) == "cpu" else "cuda"), None
    else:
        device = resolve_device(cfg.device)
        kind = device.type
    k = parallel_from_cfg(cfg).world_size
    if k > 1 and under_torchrun() and not cfg.get("dry_run"):
        # Each rank of a torchrun launch (one node or several) trains every run of the ablation on its own local
        # device, one run at a time: the GPUs are torchrun's (--nproc_per_node), not this process's to place.
        if cfg.workers not in ("auto", 1):
            raise ConfigError(f"workers={cfg.workers}: a parallel layout trains one run at a time; use workers=auto")
        return Placement(kind, 0, k, (Slot(0),))
    if kind != "cuda":
        visible = 0
    elif device is None:
        visible = int(gpus)
    else:
        seen = 1 if device.index is not None else visible_gpus()
        if gpus is not None and int(gpus) > seen:
            raise ConfigError(f"gpus={gpus} but this process sees {seen} GPU(s) (CUDA_VISIBLE_DEVICES); lower gpus=")
        visible = seen if gpus is None else int(gpus)
    # a local parallel ablation runs under one torchrun (one slot); submitit's local jobs each start their own
    many = launcher_from_cfg(cfg).local_jobs
    return plan_placement(visible, k, cfg.workers, kind, cores(), multi_gpu_slots=many)


def ablation_recipes(cfg: DictConfig) -> list[Recipe]:
    """The recipes of ``cfg.recipes`` (catalog names), validated with the ablation's own fields.

    Raises ``ConfigError`` for an empty list, a repeated name, bad ``seeds``/``max_seeds`` (``ablation_seeds``),
    ``workers`` < 1, a ``control`` that is not one of the recipes or a ``report.margin`` that is not a number > 0,
    and ``RecipeError`` listing the catalog for an unknown name. (The ``studies`` are checked by the command line,
    ``lowprec_lab.cli.plan_of``: the studies' registry sits above this wing.)
    """
    return _ablation(cfg)[0]


def _ablation(cfg: DictConfig, recipes: list[Recipe] | None = None):
    """``ablation_recipes``'s checks, once: ``(recipes, seeds, spending plan, placement, control, (negative,
    positive) control or None, per-recipe seeds)``; with ``controls=true`` the two controls are appended to the
    recipes unless listed; the per-recipe seeds (``Plan.recipe_seeds``) are empty unless ``seeds`` is per recipe,
    and ``seeds`` is then the control's."""
    names = list(cfg.recipes)
    if not names:
        raise ConfigError("recipes=[] is empty; name at least one recipe (see `lowprec recipes`)")
    if len(set(names)) != len(names):
        raise ConfigError(f"recipes={names} names a recipe twice; seeds=N repeats each recipe")
    seeds, spending = ablation_seeds(cfg)
    placement = ablation_placement(cfg)
    if recipes is None:
        recipes = [get_recipe(n) for n in names]
    control = ablation_control(cfg, names)
    roles = ablation_controls(cfg, control)
    if roles is not None:
        extra = [n for n in roles if n not in names]
        recipes = [*recipes, *(get_recipe(n) for n in extra)]
    from lowprec_lab.stats.verdict import check_margin  # here: the run path imports this module, not scipy

    check_margin(cfg.report.margin)  # checked here, not at report time: a bad margin must not cost a training
    primary = ablation_primary(cfg, [r.name for r in recipes], control, roles)
    counts = recipe_seed_counts(cfg, [r.name for r in recipes], control, len(seeds))
    own: tuple[tuple[str, tuple[int, ...]], ...] = ()
    if counts:  # the control trains the most; every other recipe the first ``n`` of those
        seeds = [int(cfg.seed) + i for i in range(max(counts.values()))]
        own = tuple((name, tuple(seeds[:n])) for name, n in counts.items())
    return recipes, seeds, spending, placement, control, roles, own, primary


def ablation_primary(cfg: DictConfig, names: list[str], control: str, roles: tuple[str, str] | None) -> tuple:
    """``report.primary``: the ablation's primary comparisons, tested right after the controls with the full alpha
    (``lowprec_lab.stats.order``), as a tuple of recipe names (empty: one stage for every recipe).

    Raises ``ConfigError`` (one line) under ``seeds=auto``, for a name that is not one of the ablation's recipes
    (``names``, its controls included), the control itself or one of its controls (which are tested first,
    alone), or a name given twice: each would make the order say something else than what was asked."""
    primary = [str(n) for n in (cfg.report.get("primary") or [])]
    if primary and str(cfg.seeds) == "auto":
        raise ConfigError(
            "report.primary needs a fixed seed count: under seeds=auto each look is one Holm family, since the looks "
            "stop recipes one at a time (drop report.primary or set seeds=N)"
        )
    for n in primary:
        if n not in names:
            raise ConfigError(f"report.primary names {n}, which this ablation does not train (recipes={names})")
        if n == control:
            raise ConfigError(f"report.primary names the control {n}: name the recipes compared with it")
        if roles is not None and n in roles:
            raise ConfigError(f"report.primary names the control recipe {n}: the controls are tested first, alone")
    if len(set(primary)) != len(primary):
        raise ConfigError(f"report.primary={primary} names a recipe twice")
    return tuple(primary)


def recipe_seed_counts(cfg: DictConfig, names: list[str], control: str, n: int) -> dict[str, int]:
    """Per recipe of ``names`` (the ablation's, its controls included), how many seeds it trains when ``seeds`` is
    per recipe (``{}`` otherwise): a named recipe its own count, any other ``n`` (``seeds.others``), the control the
    most of all (its own entry included), so each recipe pairs with the control on every seed it trains. An entry
    for a catalog recipe this ablation does not train does nothing (an experiment's sizing of a recipe that
    ``recipes=`` took out; what each recipe trained is the ablation's first line and its ``recipe_seeds`` tag).

    Raises ``ConfigError`` (one line) for a name the catalog does not have, a count that is not an integer >= 1,
    or a control's own count below another recipe's.
    """
    if not isinstance(cfg.seeds, DictConfig):
        return {}
    asked = {k: v for k, v in cfg.seeds.items() if k != "others"}
    for name, count in asked.items():
        if name not in CATALOG:
            raise ConfigError(f"seeds.{name}: no recipe {name} in the catalog (see `lowprec recipes`)")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"seeds.{name}={count} must be an integer >= 1")
    counts = {name: int(asked.get(name, n)) for name in names}
    most = max(counts.values())
    if control in asked and counts[control] < most:
        raise ConfigError(
            f"seeds.{control}={counts[control]}: {control} is the control, which trains the most seeds any recipe "
            f"trains ({most}); raise it or leave it out"
        )
    counts[control] = most
    return counts


def _text(node) -> str:
    """A config node as the command line would write it (``{others: 4, fp8_rowwise: 3}``)."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in node.items()) + "}"


def default_negative_control(control: str) -> str | None:
    """The catalog recipe that is ``control`` with ``compute.reduction_order=reversed`` and nothing else changed
    (``fp32`` -> ``fp32_reordered``, ``bf16`` -> ``bf16_reordered``): the same mathematics, other roundings, so it
    must come out non-inferior. None when the catalog has none (or ``control`` is not a catalog recipe)."""
    base = CATALOG.get(control)
    if base is None or base.compute.reduction_order == "reversed":
        return None
    for name, r in CATALOG.items():
        if r.compute.reduction_order != "reversed":
            continue
        natural = dataclasses.replace(r.compute, reduction_order="natural")
        if dataclasses.replace(r, name=base.name, description=base.description, compute=natural) == base:
            return name
    return None


def ablation_controls(cfg: DictConfig, control: str) -> tuple[str, str] | None:
    """``(negative, positive)`` control recipes with ``controls=true`` (None when off): ``negative_control``, or
    ``default_negative_control(control)``; ``positive_control``, or ``POSITIVE_CONTROL``.

    Raises ``ConfigError`` (one line) for a control named while ``controls`` is off (it would be ignored), a control
    without a default negative control, a name not in the catalog, a control equal to ``control`` or the two
    controls equal."""
    neg, pos = cfg.get("negative_control"), cfg.get("positive_control")
    if not cfg.get("controls"):
        for key, value in (("negative_control", neg), ("positive_control", pos)):
            if value is not None:
                raise ConfigError(f"{key}={value} is set but controls=false: add controls=true, or unset {key}")
        return None
    if neg is None:
        neg = default_negative_control(control)
        if neg is None:
            raise ConfigError(
                f"controls=true: control={control} has no default negative control (no catalog recipe is {control} "
                "with compute.reduction_order=reversed); set negative_control=NAME, a recipe that must come out "
                "non-inferior"
            )
    pos = POSITIVE_CONTROL if pos is None else pos
    for key, value in (("negative_control", neg), ("positive_control", pos)):
        if value not in CATALOG:
            raise ConfigError(f"{key}={value} is not a catalog recipe (`lowprec recipes` lists them)")
        if value == control:
            raise ConfigError(f"{key}={value} is the control itself: name another recipe as {key}")
    if neg == pos:
        raise ConfigError(f"negative_control and positive_control are both {neg}: one recipe cannot be both")
    return str(neg), str(pos)


def ablation_control(cfg: DictConfig, names: list[str]) -> str:
    """The control recipe: ``cfg.control``, which must be one of ``names``; when null, ``bf16`` (the usual
    mixed-precision baseline) if listed, else the first recipe. Raises ``ConfigError`` for a control not listed:
    comparing against a recipe that never ran would leave every verdict without a reference."""
    if cfg.control is None:
        return "bf16" if "bf16" in names else names[0]
    if cfg.control not in names:
        raise ConfigError(
            f"control={cfg.control} is not among recipes={names}; add it to recipes or set control to one of them"
        )
    return cfg.control


def preflight(cfg: DictConfig, recipes: list[Recipe] | None = None) -> Plan:
    """Validate ``cfg`` and each of its recipes against this machine, the model and the layout, and return the
    command's ``Plan``. ``recipes``: the ones to check instead of the config's (``recipe`` of ``lowprec train``,
    ``recipes`` of ``lowprec ablate``). An ablation with ``models=[...]`` is checked for every model before the
    first trains; its plan carries one plan per model (``Plan.group``).

    ``cfg.data.source`` is set, in place, to the source ``data.path`` implies (``resolve_data_source``).

    Raises a ``UserError`` subclass (``ConfigError``, ``DataError``, ``RecipeError``, ``ParallelError``,
    ``CheckpointError``, ``AblationResumeError`` for an ablation's ``resume=`` that is no ablation id) with one line
    naming the field and the fix.
    """
    resolve_data_source(cfg)  # first: every plan below (one per model) reads the source the path implies
    ablation = "recipes" in cfg
    models = list(cfg.get("models") or []) if ablation else []
    points = grid_points(cfg) if ablation else []  # ConfigError for a bad axis, before anything else is read
    if not models and not points:
        return _preflight_one(cfg, recipes)
    if cfg.get("resume"):
        what = f"models={models}" if models else "a grid"
        raise ConfigError(f"resume={cfg.resume} with {what}: resume each ablation of the group by its own id")
    nodes = {m: model_node(m) for m in models}  # ConfigError for an unknown name
    changed = model_changes(cfg) if models else {}
    group = []
    for m in models or [None]:
        for point in points or [{}]:
            one = copy.deepcopy(cfg)
            with open_dict(one):
                if m is not None:  # the size, with the settings the command changed (model.qk_norm=true) kept
                    one.model = OmegaConf.create({**nodes[m], **{k: v for k, v in changed.items() if k in nodes[m]}})
                    one.models = []
                apply_point(one, point)
            plan = _preflight_one(one, recipes)  # every point's recipes checked before the first trains
            group.append(dataclasses.replace(plan, point=tuple(point.items())))
    return with_group(group[0], group)


def model_changes(cfg: DictConfig) -> dict:
    """The ``model`` settings ``cfg`` changes from its size's defaults (an experiment's ``model.qk_norm: true``, a
    ``model.n_layers=2`` on the command line): ``models=[...]`` keeps them for every model of the group, as it keeps
    every other setting; ``{}`` for a model that is not a named size."""
    try:
        base = model_node(str(cfg.model.name))
    except ConfigError:
        return {}
    node = OmegaConf.to_container(cfg.model, resolve=True)
    return {k: v for k, v in node.items() if k != "name" and k in base and base[k] != v}


def _preflight_one(cfg: DictConfig, recipes: list[Recipe] | None) -> Plan:
    ablation = None
    if "recipes" in cfg:  # lowprec ablate
        # first: a launcher that cannot submit from here is said before the device and data are looked at
        check_launcher(launcher_from_cfg(cfg), parallel_from_cfg(cfg).world_size)
        check_slurm_gpus(launcher_from_cfg(cfg), str(cfg.device), parallel_from_cfg(cfg).world_size)
        if not cfg.get("dry_run"):  # a dry run plans without the corpus and says how many tokens it needs
            check_corpus_path(str(cfg.data.source), cfg.data.get("path"))
        ablation = _ablation(cfg, recipes)
        recipes = ablation[0]
    elif recipes is None:
        recipes = [recipe_from_cfg(cfg.recipe)]
    args = model_from_cfg(cfg.model)
    spec = train_from_cfg(cfg)
    hp = optim_from_cfg(cfg)
    dims = parallel_from_cfg(cfg)
    data_from_cfg(cfg)
    spike_rule_from_cfg(cfg)
    device = resolve_device(cfg.device)
    check_cpu_kernels(cfg.cpu_kernels)
    if device.type == "cpu" and cfg.cpu_kernels == "native":
        warning = resolve_kernels("native", device).warning  # allowed, but said (and tagged on the run)
        if warning:
            print(f"lowprec: warning: {warning}", file=sys.stderr)
    if spec.seq_len > args.max_seq_len:
        raise ConfigError(
            f"train.seq_len={spec.seq_len} exceeds model.max_seq_len={args.max_seq_len}; "
            "lower train.seq_len or raise model.max_seq_len"
        )
    if dims.enabled:
        dims.check(batch_size=spec.batch_size, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads)
    if spec.eval_ema is not None and dims.enabled:
        raise ConfigError(
            "train.eval_ema is not implemented for a parallel layout (its average would live on the "
            "local shards): use parallel=single, or leave train.eval_ema unset"
        )
    check_moe_layout(args, dims, spec)
    meta = build_model_meta(args)
    trains = []
    for r in recipes:
        check_runtime(r, device)
        check_fp8_fallback(r, spec)
        own = train_from_cfg(cfg, r)  # train.compile=auto: eager where this recipe cannot compile
        check_compile(r, own, device)
        check_fused_casts(r, own, device)
        trains.append((r.name, own, train_resolved(cfg, r).tags()))
        require_fp8_selection(meta, r.fp8)
        check_fp8_shapes(r, meta, spec)
        check_layout(r, dims)
    check_seed(cfg)
    check_tracking_uri(str(cfg.tracking.uri))
    check_writable_dirs(cfg)
    resume = cfg.get("resume")
    if resume and "recipes" in cfg:  # lowprec ablate: resume= names an ablation (lowprec_lab/runner/resume.py)
        check_ablation_id(resume)
    elif resume:
        newest = newest_checkpoint(resume)  # verified by the run itself, which may fall back to an earlier one
        # a checkpoint someone sent is data: its DCP metadata is read with an allow-list before any run exists
        meta = Path(newest) / ".metadata"
        if meta.is_file():
            load_metadata(meta.read_bytes(), str(meta))
        for r in recipes:
            check_resume_recipe(newest, r, spec.resume_recipe_change)
        if spec.skip_batches:
            trainer = read_trainer_state(newest)
            saved = (trainer.get("health") or {}).get("data")
            resumed_position(saved, int(trainer["step"]), spec.skip_batches, repr(str(newest)))
    return _plan(cfg, recipes, args, spec, hp, dims, ablation, tuple(trains))


def _plan(cfg: DictConfig, recipes: list[Recipe], args, spec, hp, dims, ablation=None, trains=()) -> Plan:
    """The ``Plan`` of a checked ``cfg``: the typed nodes and the ablation's own fields (``ablation``: what
    ``_ablation`` returned; None for ``train``, or for a saved ablation config, whose control is taken as it is:
    one worker, on the CPU). ``trains``: per recipe, its resolved ``TrainSpec`` and tags (``Plan.trains``)."""
    seeds, spending, control, study, margin = [int(cfg.seed)], None, None, {}, None
    recipe_seeds: tuple = ()
    primary: tuple[str, ...] = ()
    placement = Placement("cpu", 0, 1, (Slot(0),))
    roles = None
    settings = OmegaConf.to_container(cfg, resolve=True)
    if ablation is not None:
        _, seeds, spending, placement, control, roles, recipe_seeds, primary = ablation
        if roles is not None:  # the resolved names reach the parent run's params: ``lowprec report ID`` reads them
            settings["negative_control"], settings["positive_control"] = roles
    elif cfg.get("controls"):  # a saved ablation config holds the names its preflight resolved
        roles = (cfg.get("negative_control"), cfg.get("positive_control"))
    if "recipes" in cfg:
        control = control or cfg.get("control")
        study = cfg.get("study")
        study = OmegaConf.to_container(study, resolve=True) if study else {}
        margin = float(cfg.report.margin) if "report" in cfg else None
    return Plan(
        command="ablate" if "recipes" in cfg else "train",
        recipes=tuple(recipes),
        seed=int(cfg.seed),
        seeds=tuple(seeds),
        spending=spending,
        control=control,
        model_name=str(cfg.model.name),
        model=args,
        train=spec,
        optim=hp,
        parallel=dims,
        data=data_from_cfg(cfg),
        stability=spike_rule_from_cfg(cfg),
        tracking=tracking_from_cfg(cfg),
        paths=paths_from_cfg(cfg),
        device=str(cfg.device),
        cpu_kernels=str(cfg.cpu_kernels),
        placement=placement,
        resume=str(cfg.resume) if cfg.get("resume") else None,
        name=str(cfg.get("name") or ""),
        studies=tuple(cfg.get("studies") or ()),
        study=study,
        margin=margin,
        settings=settings,
        config_yaml=config_yaml(OmegaConf.create(settings)),
        trains=trains,
        dry_run=bool(cfg.get("dry_run", False)),
        gpus=None if cfg.get("gpus") is None else int(cfg.gpus),
        hardware=str(cfg.hardware) if cfg.get("hardware") else None,
        launcher=launcher_from_cfg(cfg),
        negative_control=roles[0] if roles else None,
        positive_control=roles[1] if roles else None,
        recipe_seeds=recipe_seeds,
        primary=primary,
    )


def saved_plan(text: str) -> Plan:
    """A run's ``config.yaml`` artifact (``Plan.yaml``) as a ``Plan``, typed but not checked against this machine
    (a report may be rebuilt anywhere): its ``recipes`` are left empty (each run's recipe is its tags), its
    ``seeds`` is its ``seed`` alone and its ``workers`` 1. Raises ``ConfigError`` for a node that no longer
    converts."""
    cfg = OmegaConf.create(text)
    args, spec, hp, dims = model_from_cfg(cfg.model), train_from_cfg(cfg), optim_from_cfg(cfg), parallel_from_cfg(cfg)
    return _plan(cfg, [], args, spec, hp, dims)
