"""Everything that can be validated before any data work, MLflow run or torchrun launch.

A bad input (a value of the wrong type or range, a recipe that cannot run on this machine or layout,
an FP8 selection that selects nothing, a sequence longer than the model allows, a checkpoint of another
recipe) ends here in one ``UserError`` line, so no MLflow run is ever created for it.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from experiments.plan.config import (
    data_from_cfg,
    model_from_cfg,
    optim_from_cfg,
    parallel_from_cfg,
    spike_rule_from_cfg,
    train_from_cfg,
)
from lowprec.build_optim import OptimHParams
from lowprec.build_parallel import check_layout
from lowprec.convert import require_fp8_selection
from lowprec.errors import ConfigError, UserError
from lowprec.kernels import check_cpu_kernels, resolve_kernels
from lowprec.model import ModelArgs
from lowprec.parallel import ParallelDims
from lowprec.recipe import Recipe
from lowprec.train import fault_points
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
from lowprec.train.spec import TrainSpec
from lowprec.train.stop import STOP_SIGNALS


@dataclass(frozen=True)
class Checked:
    """The validated run settings shared by every recipe of the command."""

    args: ModelArgs
    train: TrainSpec
    optim: OptimHParams
    dims: ParallelDims


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


#: ``faults.point_action``: what happens at ``faults.at_point``.
POINT_ACTIONS = ("kill", "stop")


def check_point(name: str | None, action: str, hit: int) -> None:
    """``faults.at_point``/``point_action``/``point_hit`` checked; raises ``ConfigError`` naming the bad one."""
    if name is not None and name not in fault_points.POINTS:
        raise ConfigError(f"faults.at_point={name} is not one of {', '.join(fault_points.POINTS)}")
    if action not in POINT_ACTIONS:
        raise ConfigError(f"faults.point_action={action} is not one of {', '.join(POINT_ACTIONS)}")
    if hit < 1:
        raise ConfigError(f"faults.point_hit={hit} must be >= 1 (1: the first time the point is reached)")


def stop_signal(name: str) -> int:
    """The signal ``faults.signal`` names; raises ``ConfigError`` for one that is not a stop signal."""
    known = {signal.Signals(s).name: s for s in STOP_SIGNALS}
    if name not in known:
        raise ConfigError(f"faults.signal={name} is not one of {', '.join(known)}")
    return known[name]


#: ``faults.nan_into``: where a NaN fault lands.
NAN_TARGETS = ("weight", "activation", "gradient")


def nan_target(name: str) -> str:
    """``faults.nan_into`` checked; raises ``ConfigError`` for another value."""
    if name not in NAN_TARGETS:
        raise ConfigError(f"faults.nan_into={name} is not one of {', '.join(NAN_TARGETS)}")
    return name


#: Seeds feed torch.manual_seed and numpy's generators: numpy takes 0 .. 2**32 - 1.
SEED_MAX = 2**32 - 1


def check_seed(cfg: DictConfig) -> None:
    """Refuse (``ConfigError``) a ``seed`` that is not an integer in [0, 2**32 - 1], or an ablation whose seeds
    ``seed .. seed + N - 1`` (``max_seeds`` under ``seeds=auto``) leave that range."""
    seed = cfg.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ConfigError(f"seed={seed} must be an integer in [0, {SEED_MAX}]")
    if "seeds" in cfg:
        n = cfg.get("max_seeds", 8) if cfg.seeds == "auto" else cfg.seeds
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


def preflight(cfg: DictConfig, recipes: list[Recipe]) -> Checked:
    """Validate ``cfg`` and each of ``recipes`` against this machine, the model and the layout.

    Raises a ``UserError`` subclass (``ConfigError``, ``RecipeError``, ``ParallelError``,
    ``CheckpointError``, ``AblationResumeError`` for an ablation's ``resume=`` that is no ablation id) with one line
    naming the field and the fix.
    """
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
    check_moe_layout(args, dims, spec)
    meta = build_model_meta(args)
    for r in recipes:
        check_runtime(r, device)
        check_fp8_fallback(r, spec)
        check_compile(r, train_from_cfg(cfg, r), device)  # train.compile=auto: eager where it cannot compile
        require_fp8_selection(meta, r.fp8)
        check_fp8_shapes(r, meta, spec)
        check_layout(r, dims)
    check_seed(cfg)
    check_tracking_uri(str(cfg.tracking.uri))
    check_writable_dirs(cfg)
    stop_signal(cfg.faults.signal)  # a fault-injection typo is refused here, not recorded as a failed run
    nan_target(cfg.faults.nan_into)
    check_point(cfg.faults.at_point, cfg.faults.point_action, int(cfg.faults.point_hit))
    resume = cfg.get("resume")
    if resume and "recipes" in cfg:  # lowprec ablate: resume= names an ablation (experiments/runner/resume.py)
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
    return Checked(args, spec, hp, dims)
