"""An ablation: recipes x seeds under one MLflow parent run, then the report."""

from __future__ import annotations

import copy
import secrets
import shlex
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf, open_dict

from experiments.plan.config import flat_params, model_node, parallel_from_cfg
from experiments.plan.preflight import preflight
from experiments.plan.startup import corpus_tags, prepare_data, start_parallel, warn_repeated_data
from experiments.report.build import build_report
from experiments.report.verdict_table import LEVEL
from experiments.runner.dry_run import PREPARE_HINT, Corpus, check_corpus_path, plan_text
from experiments.runner.orphans import close_orphans, owner_tags
from experiments.runner.placement import Placement, plan_placement
from experiments.runner.resume import ResumePlan, end_leftovers, lock_ablation, plan_resume, reopen_parent
from experiments.runner.run import CONFIG_ARTIFACT, RunOutcome, config_yaml
from experiments.runner.scheduler import cores, run_jobs, visible_gpus
from experiments.stats import SpendingPlan, check_margin
from experiments.stats.auto_seeds import plan_for, replay_results
from experiments.studies import GROUP_TAG, check_studies, report_studies
from experiments.tracking.tracker import ABLATION_TAG, dumps, make_tracker, provenance_tags
from lowprec.data import check_vocab_fits
from lowprec.errors import ConfigError, UserError
from lowprec.parallel.runtime import is_rank0
from lowprec.recipe import Recipe
from lowprec.train.build import resolve_device
from lowprec.train.stop import StopSignal
from recipes import get_recipe


@dataclass
class AblationOutcome:
    ablation_id: str
    parent_run_id: str
    runs: list[RunOutcome] = field(default_factory=list)
    report: Path | None = None
    wall_s: float = 0.0
    #: ``models``: every model's ablation id, in order (the ``ablation_group`` is the first)
    group: list[str] = field(default_factory=list)


def ablation_seeds(cfg: DictConfig) -> tuple[list[int], SpendingPlan | None]:
    """The seeds every recipe trains first and, for ``seeds=auto``, the alpha-spending plan of the later ones.

    ``seeds=N``: ``seed .. seed+N-1``, no plan. ``seeds=auto``: ``seed .. seed+2`` and the plan up to
    ``max_seeds``. Raises ``ConfigError`` for ``seeds`` < 1, not an int or ``auto``, or ``max_seeds`` < 3 with auto.
    """
    raw = cfg.seeds
    if raw == "auto":
        plan = plan_for(int(cfg.max_seeds), LEVEL)  # the report's level: its verdicts replay these looks
        return [int(cfg.seed) + i for i in range(plan.start)], plan
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ConfigError(f"seeds={raw} must be an integer >= 1 or auto")
    if raw < 1:
        raise ConfigError(f"seeds={raw} must be >= 1")
    return [int(cfg.seed) + i for i in range(raw)], None


def ablation_placement(cfg: DictConfig) -> Placement:
    """Where the runs train (``experiments.runner.placement.plan_placement``): ``cfg.workers`` on this device and
    layout; on CUDA over ``cfg.gpus`` GPUs (null: the visible ones). ``device=cuda:N`` is that one GPU.
    Raises ``ConfigError`` (one line) for ``gpus=0``, a layout larger than the node, or ``workers`` above the bound."""
    gpus = cfg.get("gpus")
    if gpus is not None and (isinstance(gpus, bool) or int(gpus) < 1):
        raise ConfigError(f"gpus={gpus}: name at least one GPU, or leave gpus unset (device=cpu trains on the CPU)")
    if cfg.get("dry_run") and gpus is not None:  # planning a node from another machine: no device query
        kind, device = ("cpu" if str(cfg.device) == "cpu" else "cuda"), None
    else:
        device = resolve_device(cfg.device)
        kind = device.type
    if kind != "cuda":
        visible = 0
    elif device is None:
        visible = int(gpus)
    else:
        seen = 1 if device.index is not None else visible_gpus()
        if gpus is not None and int(gpus) > seen:
            raise ConfigError(f"gpus={gpus} but this process sees {seen} GPU(s) (CUDA_VISIBLE_DEVICES); lower gpus=")
        visible = seen if gpus is None else int(gpus)
    k = parallel_from_cfg(cfg).world_size
    return plan_placement(visible, k, cfg.workers, kind, cores(), multi_gpu_slots=False)


def ablation_workers(cfg: DictConfig) -> int:
    """Runs trained at once (``ablation_placement``)."""
    return ablation_placement(cfg).workers


def ablation_recipes(cfg: DictConfig) -> list[Recipe]:
    """The recipes of ``cfg.recipes`` (catalog names), validated with the ablation's own fields.

    Raises ``ConfigError`` for an empty list, a repeated name, bad ``seeds``/``max_seeds`` (``ablation_seeds``),
    ``workers`` < 1, a ``control`` that is not one of the recipes or a ``report.margin`` that is not a number > 0,
    and ``RecipeError`` listing the catalog for an unknown name.
    """
    names = list(cfg.recipes)
    if not names:
        raise ConfigError("recipes=[] is empty; name at least one recipe (see `lowprec recipes`)")
    if len(set(names)) != len(names):
        raise ConfigError(f"recipes={names} names a recipe twice; seeds=N repeats each recipe")
    ablation_seeds(cfg)
    ablation_workers(cfg)
    recipes = [get_recipe(n) for n in names]
    ablation_control(cfg, names)
    study = cfg.get("study")
    check_studies(list(cfg.get("studies") or []), OmegaConf.to_container(study) if study else {})
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


def ablation_description(cfg: DictConfig, names: list[str], how: str, control: str) -> str:
    """One line for the parent run's description in the MLflow UI: model, steps, recipes, seeds, control, margin."""
    t = cfg.train
    return (
        f"model {cfg.model.name}, {t.steps} steps of {t.batch_size}x{t.seq_len} tokens; recipes {', '.join(names)}; "
        f"{how} from seed {cfg.seed}; control {control}; margin {float(cfg.report.margin):.2%}"
    )


def ablate(cfg: DictConfig, echo=print) -> AblationOutcome:
    """``cfg.models`` empty: ``ablate_one``. Otherwise one ``ablate_one`` per listed model, in order (``model=<name>``
    with every other setting shared), all tagged with the first one's id as ``ablation_group`` so the last one's
    studies read every model's ablation; returns the last outcome (``group`` lists every id). Raises ``ConfigError``
    for an unknown model name or ``resume`` with ``models`` (resume each ablation by its id), before any training."""
    models = list(cfg.get("models") or [])
    if not models:
        return ablate_one(cfg, echo)
    if cfg.get("resume"):
        raise ConfigError(f"resume={cfg.resume} with models={models}: resume each model's ablation by its own id")
    nodes = {m: model_node(m) for m in models}  # ConfigError for an unknown name
    cfgs = []
    for m in models:
        one = copy.deepcopy(cfg)
        with open_dict(one):
            one.model = OmegaConf.create(nodes[m])
            one.models = []
        preflight(one, ablation_recipes(one))  # every model's recipes checked before the first trains
        cfgs.append(one)
    group: str | None = None
    ids: list[str] = []
    for one in cfgs:
        out = ablate_one(one, echo, group=group)
        group = group or out.ablation_id
        ids.append(out.ablation_id)
    out.group = ids
    return out


def ablate_one(cfg: DictConfig, echo=print, group: str | None = None) -> AblationOutcome:
    """Run ``cfg.recipes`` x seeds (``cfg.seed``, ``cfg.seed+1``, ...; ``seeds=auto``: more only where the verdict
    is still open) and write the report.

    Every recipe name and field is validated before any training (``RecipeError``); data problems
    raise ``DataError`` before the parent run exists. A child that fails is recorded FAILED and the
    ablation continues. ``cfg.resume`` (an ablation id) continues that ablation under its parent run
    (``experiments.runner.resume``: finished runs kept, interrupted ones continued from their checkpoints, the
    rest started); a command that is not the same ablation raises ``AblationResumeError`` before anything is
    written. A stop signal marks the parent KILLED and propagates as ``StopSignal`` with ``ablation_id`` set.
    """
    t0 = time.perf_counter()
    recipes = ablation_recipes(cfg)
    names = [r.name for r in recipes]
    seeds, plan = ablation_seeds(cfg)
    placement = ablation_placement(cfg)
    workers = placement.workers
    control = ablation_control(cfg, names)
    if not cfg.get("dry_run"):  # a dry run plans without the corpus and says how many tokens it needs
        check_corpus_path(str(cfg.data.source), cfg.data.get("path"))
    args = preflight(cfg, recipes).args  # every check that needs no data, before the parent run exists
    if cfg.get("dry_run"):  # the plan, printed: no data prepared unless it is already there, no MLflow run
        echo(dry_run_text(cfg, recipes, seeds, plan))
        return AblationOutcome("", "")
    dims = start_parallel(cfg)
    with ExitStack() as held:  # the ablation's lock, held until it ends: no resume of it meanwhile
        resume = _resume_plan(cfg, recipes) if cfg.get("resume") else None  # reads MLflow, writes nothing
        if resume is not None and resume.lock is not None:
            held.callback(resume.lock.release)
        data = prepare_data(cfg)
        check_vocab_fits(data, args.vocab_size)
        if resume is not None:
            resume.check_corpus(data.fingerprint)
        tracker = make_tracker(cfg)
        if is_rank0():
            warn_repeated_data(cfg, data, "ablate")
        if not is_rank0():
            echo = lambda *a, **k: None  # noqa: E731
        if resume is None:  # a resume continues its own dead runs; any other dead run is recorded FAILED
            for run_id in close_orphans(tracker, echo):
                echo(f"run {run_id} was left RUNNING by a process that died; recorded FAILED")
        how = f"{len(seeds)} seeds" if plan is None else f"seeds=auto (3 to {plan.max_seeds})"
        if resume is None:
            ablation_id = f"abl-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
            if is_rank0():
                held.callback(lock_ablation(cfg, ablation_id).release)
            parent = _start_parent(
                cfg, tracker, ablation_id, recipes, seeds, plan, placement, control, data, dims, group or ablation_id
            )
            tracker.set_description(parent, ablation_description(cfg, names, how, control))
        else:
            ablation_id, parent = resume.ablation_id, resume.parent_id
            if is_rank0():
                reopen_parent(tracker, resume)
            for line in resume.describe():
                echo(line)
        out = AblationOutcome(ablation_id, parent)
        before_s = resume.wall_s_before if resume is not None else 0.0  # earlier sessions' recorded wall time
        echo(
            f"ablation {ablation_id}: {len(recipes)} recipes x {how} on model={cfg.model.name}, "
            f"{cfg.train.steps} steps each; layout {dims.short()}"
            + (f"; {placement.describe()}" if workers > 1 else "")
            + f"; data: {data.description}"
        )

        def show(o: RunOutcome) -> None:
            if o.status == "FINISHED":
                s = o.summary
                echo(
                    f"  {o.recipe:<16} seed {o.seed}: val_loss {s['final_val_loss']:.4f}  "
                    f"{s['mean_tokens_per_s']:.0f} tok/s  {s['state_bytes_per_param']:.2f} B/param"
                )
            else:
                echo(f"  {o.recipe:<16} seed {o.seed}: {o.status} ({o.reason})")

        kept = resume.kept if resume is not None else {}

        def train(jobs: list[tuple[Recipe, int]]) -> None:
            for r, s in jobs:
                if (r.name, s) in kept:
                    echo(f"  {r.name:<16} seed {s}: {kept[r.name, s].status} before the resume, kept")
            todo = [(r, s) for r, s in jobs if (r.name, s) not in kept]
            cont = resume.continued if resume is not None else None
            ran = iter(run_jobs(cfg, todo, data, tracker, parent, ablation_id, placement, show, cont))
            out.runs.extend(kept[r.name, s] if (r.name, s) in kept else next(ran) for r, s in jobs)

        by_name = dict(zip(names, recipes, strict=True))
        try:
            train([(r, s) for s in seeds for r in recipes])  # seed-major: a short ablation still has paired seeds
            while plan is not None:
                state = auto_state(out.runs, control, names, int(cfg.seed), plan, cfg.report.margin)
                if state.next_seed is None:
                    break
                echo(f"  seeds=auto: seed {state.next_seed} for {', '.join(state.wanting)} (still inconclusive)")
                train([(by_name[n], state.next_seed) for n in [control, *state.wanting]])
        except KeyboardInterrupt:
            tracker.end_run(parent, "KILLED", "interrupted by the user")
            raise
        except StopSignal as stop:
            done = sum(o.status == "FINISHED" for o in out.runs)
            tracker.set_tags(parent, {"stopped_by": stop.name, "wall_s": f"{before_s + time.perf_counter() - t0:.1f}"})
            tracker.end_run(parent, "KILLED", f"stopped by {stop.name} after {done} finished run(s)")
            stop.ablation_id = ablation_id  # the command line prints the resume command with it
            raise
        if resume is not None and is_rank0():
            end_leftovers(tracker, resume)
        n_failed = sum(o.status != "FINISHED" for o in out.runs)
        out.wall_s = before_s + time.perf_counter() - t0
        tracker.set_tags(parent, {"n_failed": str(n_failed), "wall_s": f"{out.wall_s:.1f}"})
        tracker.end_run(parent, "FINISHED")
        # The report reads every run from the store: first what the runs spooled while the server did not answer.
        left = tracker.drain_spools([parent, *(o.run_id for o in out.runs if o.run_id)])
        if left:
            echo(
                f"ablation {ablation_id} done in {out.wall_s:.0f} s ({n_failed} failed); the {tracker.spool.what} "
                f"{tracker.spool.down}: {len(left)} run(s) spooled in {left[0].parent}; lowprec sync "
                f"{shlex.quote(str(left[0].parent))} {shlex.quote('tracking.uri=' + tracker.uri)}, then "
                f"lowprec report {ablation_id}"
            )
            return out
        if is_rank0():
            out.report = build_report(
                tracker, ablation_id, Path(cfg.paths.reports), margin=cfg.report.margin, after=report_studies
            )
    echo(f"ablation {ablation_id} done in {out.wall_s:.0f} s ({n_failed} failed); report: {out.report}")
    return out


def _resume_plan(cfg: DictConfig, recipes: list[Recipe]) -> ResumePlan:
    """``plan_resume`` on rank 0 (it reads MLflow and holds the lock), its plan or its error sent to every rank."""
    if not dist.is_initialized():
        return plan_resume(cfg, recipes)
    box: list = [None]
    if is_rank0():
        try:
            box[0] = plan_resume(cfg, recipes)
        except UserError as e:
            box[0] = e
    mine = box[0]
    box = [mine.without_lock() if isinstance(mine, ResumePlan) else mine]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], UserError):
        raise box[0]
    return mine if is_rank0() else box[0]


def parent_run_name(cfg: DictConfig, ablation_id: str) -> str:
    """The parent run's name: what tells ablations apart first (experiment, model), the id last. MLflow's runs table
    cuts a long name at its end, and an id first (``abl-<date>-<time>-<hex>``) left only the date visible."""
    experiment = str(cfg.get("name") or "ablation")
    return f"{experiment} {cfg.model.name} {ablation_id}"


def _start_parent(cfg, tracker, ablation_id, recipes, seeds, plan, placement, control, data, dims, group) -> str:
    """The ablation's parent run: its tags, params (the settings shared by its runs) and ``config.yaml``."""
    seeds_tags = {"seeds": dumps(seeds)}
    if plan is not None:
        seeds_tags = {"seeds": "auto", "max_seeds": str(plan.max_seeds), "seed0": str(int(cfg.seed))}
    parent = tracker.start_run(
        parent_run_name(cfg, ablation_id),
        {
            ABLATION_TAG: ablation_id,
            "lowprec.kind": "ablation",
            "experiment": str(cfg.get("name", "")),
            "recipes": dumps([r.name for r in recipes]),
            **seeds_tags,
            "workers": str(placement.workers),
            # which GPU(s) each worker had (each run's own ``gpus`` tag names them); runs alone on their device(s)
            # measure their own throughput, which the report compares (``experiments.report.build.contention``)
            "placement": placement.to_json(),
            "runs_per_device": "1" if placement.alone_on_device else str(placement.workers),
            "control": control,
            "studies": dumps(list(cfg.get("studies") or [])),
            GROUP_TAG: group,
            "model": cfg.model.name,
            "corpus_fingerprint": data.fingerprint,
            "corpus": data.description,
            **corpus_tags(cfg, data),
            "parallel": dims.short(),
            "world_size": str(dims.world_size),
            **provenance_tags(resolve_device(cfg.device)),
            **owner_tags(),
        },
    )
    tracker.log_params(parent, {k: v for k, v in flat_params(cfg, recipes[0]).items() if not k.startswith("recipe.")})
    tracker.log_corpus(parent, data)
    tracker.log_text(parent, config_yaml(cfg), CONFIG_ARTIFACT)
    return parent


def auto_state(runs: list[RunOutcome], control: str, names: list[str], seed0: int, plan, margin: float):
    """``experiments.stats.auto_seeds.replay_results`` on the outcomes so far (the report replays the same from
    MLflow)."""
    results = [(o.recipe, o.seed, o.summary["final_val_loss"] if o.status == "FINISHED" else None) for o in runs]
    others = [n for n in names if n != control]
    return replay_results(results, control, others, seed0, plan.max_seeds, margin, LEVEL)


def dry_run_text(cfg: DictConfig, recipes: list[Recipe], seeds: list[int], plan) -> str:
    """``experiments.runner.dry_run.plan_text`` for ``cfg``: the corpus read if it is already prepared (stdlib's
    cache, a token folder), the hardware named (``hardware=``), detected (CUDA device 0) or, planning ``gpus=`` from
    a machine without one, ``h100_sxm``. Raises ``ConfigError`` for a corpus smaller than one run's tokens."""
    from experiments.plan.config import TrainNode, data_from_cfg, model_from_cfg, typed
    from lowprec.estimate.hardware import cuda_device_hardware, get_hardware
    from lowprec.train.spec import TrainSpec

    placement = ablation_placement(cfg)
    node = typed(TrainNode, cfg.train, "train")
    spec = TrainSpec(**{**node, "compile": False, "ac": "none"})  # the loop's settings; compile/ac: ``asked``
    dspec = data_from_cfg(cfg)
    corpus = Corpus(None, f"data.source={dspec.source} data.path not set: {PREPARE_HINT}", dspec.allow_epochs)
    if dspec.source == "stdlib" or (dspec.path and Path(dspec.path).expanduser().exists()):
        data = prepare_data(cfg)
        corpus = Corpus(data.n_train_tokens, data.description, dspec.allow_epochs)
    elif dspec.path:
        corpus = Corpus(None, f"{dspec.path} does not exist yet ({PREPARE_HINT})", dspec.allow_epochs)
    hw, source = None, "a CPU plan: the cost model predicts GPUs only"
    if cfg.get("hardware"):
        hw, source = get_hardware(str(cfg.hardware)), "hardware="
    elif placement.device_type == "cuda":
        try:
            name, hw = cuda_device_hardware()
            source = f"detected: {name}"
        except (RuntimeError, LookupError):
            hw, source = get_hardware("h100_sxm"), "no GPU here: h100_sxm assumed, name it with hardware="
    return plan_text(
        cfg.model.name,
        model_from_cfg(cfg.model),
        recipes,
        seeds,
        spec,
        parallel_from_cfg(cfg),
        placement,
        corpus,
        hw,
        source,
        plan.max_seeds if plan is not None else None,
        (node["compile"], node["ac"]),
    )
