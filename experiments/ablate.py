"""An ablation: recipes x seeds under one MLflow parent run, then the report."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from experiments.config import flat_params
from experiments.preflight import preflight
from experiments.report import build_report
from experiments.run import RunOutcome, run_one
from experiments.startup import prepare_data, start_parallel
from experiments.stats import check_margin
from experiments.tracking import ABLATION_TAG, dumps, make_tracker, provenance_tags
from lowprec.data import check_vocab_fits
from lowprec.errors import ConfigError
from lowprec.parallel.runtime import is_rank0
from lowprec.recipe import Recipe
from lowprec.train.build import resolve_device
from recipes import get_recipe


@dataclass
class AblationOutcome:
    ablation_id: str
    parent_run_id: str
    runs: list[RunOutcome] = field(default_factory=list)
    report: Path | None = None
    wall_s: float = 0.0


def ablation_recipes(cfg: DictConfig) -> list[Recipe]:
    """The recipes of ``cfg.recipes`` (catalog names), validated with the ablation's own fields.

    Raises ``ConfigError`` for an empty list, a repeated name, ``seeds`` < 1, a ``control`` that is not one of
    the recipes or a ``report.margin`` that is not a number > 0, and ``RecipeError`` listing the catalog for an
    unknown name.
    """
    names = list(cfg.recipes)
    if not names:
        raise ConfigError("recipes=[] is empty; name at least one recipe (see `lowprec recipes`)")
    if len(set(names)) != len(names):
        raise ConfigError(f"recipes={names} names a recipe twice; seeds=N repeats each recipe")
    if int(cfg.seeds) < 1:  # the schema makes it an int
        raise ConfigError(f"seeds={cfg.seeds} must be >= 1")
    recipes = [get_recipe(n) for n in names]
    ablation_control(cfg, names)
    check_margin(cfg.report.margin)  # checked here, not at report time: a bad margin must not cost a training
    return recipes


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


def ablate(cfg: DictConfig, echo=print) -> AblationOutcome:
    """Run ``cfg.recipes`` x ``cfg.seeds`` seeds (``cfg.seed``, ``cfg.seed+1``, ...) and write the report.

    Every recipe name and field is validated before any training (``RecipeError``); data problems
    raise ``DataError`` before the parent run exists. A child that fails is recorded FAILED and the
    ablation continues.
    """
    t0 = time.perf_counter()
    recipes = ablation_recipes(cfg)
    names = [r.name for r in recipes]
    seeds = [int(cfg.seed) + i for i in range(int(cfg.seeds))]
    control = ablation_control(cfg, names)
    args = preflight(cfg, recipes).args  # every check that needs no data, before the parent run exists
    dims = start_parallel(cfg)
    data = prepare_data(cfg)
    check_vocab_fits(data, args.vocab_size)
    device = resolve_device(cfg.device)
    tracker = make_tracker(cfg)
    if not is_rank0():
        echo = lambda *a, **k: None  # noqa: E731
    ablation_id = f"abl-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    parent = tracker.start_run(
        ablation_id,
        {
            ABLATION_TAG: ablation_id,
            "lowprec.kind": "ablation",
            "experiment": str(cfg.get("name", "")),
            "recipes": dumps(names),
            "seeds": dumps(seeds),
            "control": control,
            "model": cfg.model.name,
            "corpus_fingerprint": data.fingerprint,
            "corpus": data.description,
            "parallel": dims.short(),
            "world_size": str(dims.world_size),
            **provenance_tags(device),
        },
    )
    tracker.log_params(parent, {k: v for k, v in flat_params(cfg, recipes[0]).items() if not k.startswith("recipe.")})
    out = AblationOutcome(ablation_id, parent)
    echo(
        f"ablation {ablation_id}: {len(recipes)} recipes x {len(seeds)} seeds on model={cfg.model.name}, "
        f"{cfg.train.steps} steps each; layout {dims.short()}; data: {data.description}"
    )
    try:
        for recipe in recipes:
            for seed in seeds:
                o = run_one(cfg, recipe, seed, data, tracker, parent_id=parent, ablation_id=ablation_id)
                out.runs.append(o)
                if o.status == "FINISHED":
                    s = o.summary
                    echo(
                        f"  {recipe.name:<16} seed {seed}: val_loss {s['final_val_loss']:.4f}  "
                        f"{s['mean_tokens_per_s']:.0f} tok/s  {s['state_bytes_per_param']:.2f} B/param"
                    )
                else:
                    echo(f"  {recipe.name:<16} seed {seed}: FAILED ({o.reason})")
    except KeyboardInterrupt:
        tracker.end_run(parent, "KILLED", "interrupted by the user")
        raise
    n_failed = sum(o.status != "FINISHED" for o in out.runs)
    out.wall_s = time.perf_counter() - t0
    tracker.set_tags(parent, {"n_failed": str(n_failed), "wall_s": f"{out.wall_s:.1f}"})
    tracker.end_run(parent, "FINISHED")
    if is_rank0():
        out.report = build_report(tracker, ablation_id, Path(cfg.paths.reports), margin=cfg.report.margin)
    echo(f"ablation {ablation_id} done in {out.wall_s:.0f} s ({n_failed} failed); report: {out.report}")
    return out
