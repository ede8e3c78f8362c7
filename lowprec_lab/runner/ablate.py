"""An ablation: recipes x seeds under one MLflow parent run, then the report."""

from __future__ import annotations

import secrets
import shlex
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from lowprec.errors import UserError
from lowprec.parallel.runtime import is_rank0
from lowprec.recipe import Recipe
from lowprec.train.build import resolve_device
from lowprec.train.meter import reporting_steps
from lowprec.train.stop import StopSignal
from lowprec_lab.plan.grid import POINT_TAG, point_text
from lowprec_lab.plan.plan import Plan
from lowprec_lab.report.build import build_report
from lowprec_lab.report.markdown import pct
from lowprec_lab.runner.dry_run import Corpus, plan_text
from lowprec_lab.runner.executors import Launch, launch
from lowprec_lab.runner.progress import AblationProgress, printable
from lowprec_lab.runner.resume import ResumePlan, end_leftovers, lock_ablation, plan_resume, reopen_parent
from lowprec_lab.runner.run import CONFIG_ARTIFACT, RunOutcome
from lowprec_lab.runner.session import RunSession
from lowprec_lab.runner.tracked_run import shared_tags
from lowprec_lab.runtime.startup import prepare_data, start_parallel
from lowprec_lab.stats.auto_seeds import replay_results
from lowprec_lab.stats.verdict import LEVEL
from lowprec_lab.studies import GROUP_TAG, report_studies
from lowprec_lab.tracking.tracker import ABLATION_TAG, dumps


@dataclass
class AblationOutcome:
    ablation_id: str
    parent_run_id: str
    runs: list[RunOutcome] = field(default_factory=list)
    report: Path | None = None
    wall_s: float = 0.0
    #: ``models``: every model's ablation id, in order (the ``ablation_group`` is the first)
    group: list[str] = field(default_factory=list)


def ablation_description(plan: Plan, how: str) -> str:
    """One line for the parent run's description in the MLflow UI: model, steps, recipes, seeds, control, margin."""
    t = plan.train
    names = [r.name for r in plan.recipes]
    return (
        f"model {plan.model_name}, {t.steps} steps of {t.batch_size}x{t.seq_len} tokens; recipes {', '.join(names)}; "
        f"{how} from seed {plan.seed}; control {plan.control}; margin {float(plan.margin):.2%}"
    )


def ablate(plan: Plan, echo=print) -> AblationOutcome:
    """``plan.group`` empty: ``ablate_one``. Otherwise one ``ablate_one`` per model's and grid point's plan, in order
    (``model=<name>`` and the point's settings, every other setting shared; each checked by preflight before the first
    trains), all tagged with the first one's id as ``ablation_group`` so the last one's studies read every ablation of
    the group; returns the last outcome (``group`` lists every id)."""
    if not plan.group:
        return ablate_one(plan, echo)
    group: str | None = None
    ids: list[str] = []
    for one in plan.group:
        out = ablate_one(one, echo, group=group)
        group = group or out.ablation_id
        ids.append(out.ablation_id)
    out.group = ids
    return out


def ablate_one(plan: Plan, echo=print, group: str | None = None) -> AblationOutcome:
    """Run ``plan.recipes`` x seeds (``plan.seeds``; ``seeds=auto``: more only where the verdict is still open,
    ``plan.spending``) and write the report.

    The plan is checked (``lowprec_lab.plan.preflight``); data problems raise ``DataError`` before the parent run
    exists. A child that fails is recorded FAILED and the
    ablation continues. ``plan.resume`` (an ablation id) continues that ablation under its parent run
    (``lowprec_lab.runner.resume``: finished runs kept, interrupted ones continued from their checkpoints, the
    rest started); a command that is not the same ablation raises ``AblationResumeError`` before anything is
    written. A stop signal marks the parent KILLED and propagates as ``StopSignal`` with ``ablation_id`` set.
    """
    t0 = time.perf_counter()
    if plan.dry_run:  # the plan, printed: no data prepared unless it is already there, no MLflow run
        echo(dry_run_text(plan))
        return AblationOutcome("", "")
    # a submitit launcher's ablation is one process; each job runs its run's ranks (lowprec_lab.runner.job_ranks)
    dims = plan.parallel if plan.launcher.submitit else start_parallel(plan.parallel, plan.device)
    with ExitStack() as held:  # the ablation's lock, held until it ends: no resume of it meanwhile
        resume = _resume_plan(plan) if plan.resume else None  # reads MLflow, writes nothing
        if resume is not None and resume.lock is not None:
            held.callback(resume.lock.release)
        if resume is not None and resume.finished:  # nothing to do: its parent stays FINISHED, its report as it was
            if is_rank0():
                echo(resume.finished_line())
            return AblationOutcome(resume.ablation_id, resume.parent_id, list(resume.kept.values()))
        ab = _open_ablation(plan, echo, group, resume, held, dims)
        _train_all(ab, t0)
        n_failed, answer = _close_ablation(ab, t0)
        if answer is None:  # spooled: the report waits for ``lowprec sync``
            return ab.out
    out, echo = ab.out, ab.echo
    echo(f"ablation {ab.ablation_id} done in {out.wall_s:.0f} s ({n_failed} failed)")
    if out.report is not None:
        for line in answer:
            echo(line)
        echo(f"report: {out.report}")
        echo(f"        {out.report.with_name('report.html')}")
    return out


@dataclass
class _Ablation:
    """One ablation under way: its ``plan``, run ``session``, ids, the ``resume`` it continues (or None), this rank's
    ``echo`` (silent off rank 0), the wall time of earlier sessions (``before_s``) and the outcome so far."""

    plan: Plan
    session: RunSession
    ablation_id: str
    parent: str
    resume: ResumePlan | None
    echo: Callable
    how: str
    before_s: float
    out: AblationOutcome


def _open_ablation(plan: Plan, echo, group: str | None, resume: ResumePlan | None, held: ExitStack, dims):
    """``ablate_one``'s set-up: the data and tracker (``RunSession``), the runs dead processes left closed (not on a
    resume), the parent run started (its lock held by ``held``) or reopened; prints the ablation's first line."""
    check = None if resume is None else (lambda data: resume.check_corpus(data.fingerprint))
    session = RunSession.start(plan, "ablate", check)
    tracker = session.tracker
    if not is_rank0():
        echo = lambda *a, **k: None  # noqa: E731
    if resume is None:  # a resume continues its own dead runs; any other dead run is recorded FAILED
        session.close_orphans(echo)
    spending = plan.spending
    how = plan.seeds_text() if spending is None else f"seeds=auto (3 to {spending.max_seeds})"
    if resume is None:
        ablation_id = f"abl-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        if is_rank0():
            held.callback(lock_ablation(plan.paths.runs, ablation_id).release)
        parent = _start_parent(plan, tracker, ablation_id, session.data, group or ablation_id)
        tracker.set_description(parent, ablation_description(plan, how))
    else:
        ablation_id, parent = resume.ablation_id, resume.parent_id
        if is_rank0():
            reopen_parent(tracker, resume)
        for line in resume.describe():
            echo(line)
    before_s = resume.wall_s_before if resume is not None else 0.0  # earlier sessions' recorded wall time
    out = AblationOutcome(ablation_id, parent)
    ab = _Ablation(plan, session, ablation_id, parent, resume, echo, how, before_s, out)
    workers = plan.workers
    echo(
        f"ablation {ablation_id}: {len(plan.recipes)} recipes x {how} on model={plan.model_name}, "
        f"{plan.train.steps} steps each; layout {dims.short()}"
        + (f"; grid point {point_text(dict(plan.point))}" if plan.point else "")
        + (f"; {plan.placement.describe()}" if workers > 1 and not plan.launcher.submitit else "")
        + (f"; launcher={plan.launcher.name}: one job per run" if plan.launcher.submitit else "")
        + f"; data: {session.data.description}"
    )
    return ab


def _train_all(ab: _Ablation, t0: float) -> None:
    """``ablate_one``'s runs: every recipe x seed (seed-major), then, for ``seeds=auto``, a seed more where the
    verdict is still open; each outcome shown as it lands and appended to ``ab.out.runs`` (a resume's kept runs in
    their place). Ctrl-C ends the parent KILLED; a stop signal ends it KILLED with the runs finished so far and
    propagates with ``ablation_id`` set."""
    plan, tracker, parent, resume, out = ab.plan, ab.session.tracker, ab.parent, ab.resume, ab.out
    recipes, spending, control = list(plan.recipes), plan.spending, plan.control
    names = [r.name for r in recipes]
    # One display for every run's progress: live bars on a terminal (rank 0), plain lines elsewhere.
    live = is_rank0() and plan.train.progress and sys.stderr.isatty()
    display = AblationProgress(ab.echo, live=live, auto=spending is not None)
    # Other ranks draw no bar of their own over rank 0's (their steps are rank 0's steps).
    quiet_rank = reporting_steps(lambda r: None) if not is_rank0() else nullcontext()

    def show(o: RunOutcome) -> None:
        if o.status == "FINISHED":
            s = o.summary
            display.result(
                f"  {o.recipe:<16} seed {o.seed}: val_loss {s['final_val_loss']:.4f}  "
                f"{s['mean_tokens_per_s']:.0f} tok/s  {s['state_bytes_per_param']:.2f} B/param"
            )
        else:
            display.result(f"  {o.recipe:<16} seed {o.seed}: {o.status} ({o.reason})")

    kept = resume.kept if resume is not None else {}

    def train(jobs: list[tuple[Recipe, int]]) -> None:
        for r, s in jobs:
            if (r.name, s) in kept:
                display.line(f"  {r.name:<16} seed {s}: {kept[r.name, s].status} before the resume, kept")
        todo = [(r, s) for r, s in jobs if (r.name, s) not in kept]
        display.add_runs(len(todo))
        cont = resume.continued if resume is not None else None
        # the launcher's executor (lowprec_lab.runner.executors): this process, worker processes, or one
        # submitit job per run (SLURM, or this machine's local executor)
        batch = Launch(plan, tracker, parent, ab.ablation_id, ab.session.data, cont or {}, display)
        ran = iter(launch(batch, todo, show))
        out.runs.extend(kept[r.name, s] if (r.name, s) in kept else next(ran) for r, s in jobs)

    by_name = dict(zip(names, recipes, strict=True))
    try:
        with display, quiet_rank:
            train(plan.jobs())  # seed-major: a short ablation still has paired seeds
            while spending is not None:
                state = auto_state(out.runs, control, names, plan.seed, spending, plan.margin)
                if state.next_seed is None:
                    break
                display.line(
                    f"  seeds=auto: seed {state.next_seed} for {', '.join(state.wanting)} (still inconclusive)"
                )
                train([(by_name[n], state.next_seed) for n in [control, *state.wanting]])
    except KeyboardInterrupt:
        tracker.end_run(parent, "KILLED", "interrupted by the user")
        raise
    except StopSignal as stop:
        done = sum(o.status == "FINISHED" for o in out.runs)
        tracker.set_tags(parent, {"stopped_by": stop.name, "wall_s": f"{ab.before_s + time.perf_counter() - t0:.1f}"})
        tracker.end_run(parent, "KILLED", f"stopped by {stop.name} after {done} finished run(s)")
        stop.ablation_id = ab.ablation_id  # the command line prints the resume command with it
        raise


def _close_ablation(ab: _Ablation, t0: float) -> tuple[int, list[str] | None]:
    """``ablate_one``'s end: the resume's leftovers ended, the parent FINISHED with ``n_failed`` and ``wall_s``,
    the spooled writes drained, then (rank 0) the report and the verdicts' terminal lines. Returns the number of
    runs that failed and those lines (empty off rank 0), or None for the lines when runs are still spooled (the
    line saying how to sync them printed)."""
    plan, tracker, parent, out = ab.plan, ab.session.tracker, ab.parent, ab.out
    if ab.resume is not None and is_rank0():
        end_leftovers(tracker, ab.resume)
    n_failed = sum(o.status != "FINISHED" for o in out.runs)
    out.wall_s = ab.before_s + time.perf_counter() - t0
    tracker.set_tags(parent, {"n_failed": str(n_failed), "wall_s": f"{out.wall_s:.1f}"})
    tracker.end_run(parent, "FINISHED")
    # The report reads every run from the store: first what the runs spooled while the server did not answer.
    left = tracker.drain_spools([parent, *(o.run_id for o in out.runs if o.run_id)])
    if left:
        ab.echo(
            f"ablation {ab.ablation_id} done in {out.wall_s:.0f} s ({n_failed} failed); the {tracker.spool.what} "
            f"{tracker.spool.down}: {len(left)} run(s) spooled in {left[0].parent}; lowprec sync "
            f"{shlex.quote(str(left[0].parent))} {shlex.quote('tracking.uri=' + tracker.uri)}, then "
            f"lowprec report {ab.ablation_id}"
        )
        return n_failed, None
    answer: list[str] = []
    if is_rank0():
        out.report = build_report(
            tracker, ab.ablation_id, Path(plan.paths.reports), margin=plan.margin, after=report_studies
        )
        answer = verdict_summary(tracker, parent, [r.name for r in plan.recipes if r.name != plan.control])
    return n_failed, answer


def verdict_summary(tracker, parent_run_id: str, recipes: list[str]) -> list[str]:
    """The verdict table's short form for the terminal, read back from the parent run's records
    (``lowprec_lab.report.verdict_table``): a heading with the control and margin, then one line per recipe of
    ``recipes`` (the ablation's own names, in order): the effect on the final validation loss with its interval
    (``+`` is worse than the control), the verdict's label and the stability verdict. Store strings are shown as
    text (``printable``): no terminal control sequence reaches the screen from a tag."""
    run = tracker.client.get_run(parent_run_id)
    tags, metrics = run.data.tags, run.data.metrics
    control = printable(tags.get("verdict_control", "?"))
    if tags.get("verdict_status", "ok") != "ok":
        return [f"no verdicts: {printable(tags.get('verdict_reason', tags.get('verdict_status', '')))}"]
    margin = metrics.get("verdict/margin")
    head = f"verdicts on the final validation loss vs {control}" + (f" (margin {margin:.3%})" if margin else "")
    width = max([len(r) for r in recipes] + [6])
    lines = [_controls_summary(tags, margin), head + "; + is worse:"]
    lines.append(f"  {'recipe':<{width}}  {'effect [interval]':<30}  verdict")
    for r in recipes:
        e, lo, hi = (metrics.get(f"verdict/{k}.{r}") for k in ("effect", "lo", "hi"))
        if e is None:
            effect = "no interval"
        elif lo is None or hi is None:
            effect = pct(e)
        else:
            effect = f"{pct(e)} [{pct(lo)}, {pct(hi)}]"
        label = printable(tags.get(f"verdict_label.{r}", tags.get(f"verdict.{r}", "no-data")))
        stability = printable(tags.get(f"stability.{r}", "no-data"))
        lines.append(f"  {r:<{width}}  {effect:<30}  {label}; stability: {stability}")
    return lines


def _controls_summary(tags: dict, margin: float | None) -> str:
    """The report's first line in short, from the parent's ``verdict_controls`` tag: whether the negative control
    came out non-inferior and the positive control inferior (the experiment could see the margin), or why not."""
    at = f" at the {margin:.3%} margin" if margin else ""
    status = tags.get("verdict_controls", "off")
    if status == "off":
        return f"controls: none; nothing shows the experiment could see a difference{at} (controls=true adds them)"
    names = [tags.get(f"verdict_{k}_control", "?") for k in ("negative", "positive")]
    got = ", ".join(
        f"{k} {printable(n)}: {printable(tags.get(f'verdict_label.{n}', 'no-data'))}"
        for k, n in zip(("negative", "positive"), names, strict=True)
    )
    if status == "passed":
        return f"controls passed{at} ({got})"
    return f"THE EXPERIMENT COULD NOT TELL{at}: a control failed ({got}); its verdicts are not evidence"


def _resume_plan(plan: Plan) -> ResumePlan:
    """``plan_resume`` on rank 0 (it reads MLflow and holds the lock), its plan or its error sent to every rank."""
    if not dist.is_initialized():
        return plan_resume(plan)
    box: list = [None]
    if is_rank0():
        try:
            box[0] = plan_resume(plan)
        except UserError as e:
            box[0] = e
    mine = box[0]
    box = [mine.without_lock() if isinstance(mine, ResumePlan) else mine]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], UserError):
        raise box[0]
    return mine if is_rank0() else box[0]


def parent_run_name(plan: Plan, ablation_id: str) -> str:
    """The parent run's name: what tells ablations apart first (experiment, model), the id last. MLflow's runs table
    cuts a long name at its end, and an id first (``abl-<date>-<time>-<hex>``) left only the date visible."""
    experiment = plan.name or "ablation"
    return f"{experiment} {plan.model_name} {ablation_id}"


def _start_parent(plan: Plan, tracker, ablation_id: str, data, group: str) -> str:
    """The ablation's parent run: its tags, params (the settings shared by its runs) and ``config.yaml``."""
    seeds_tags = {"seeds": dumps(list(plan.seeds))}
    if plan.recipe_seeds:  # the seeds the control trains above; each recipe's own count here
        seeds_tags["recipe_seeds"] = dumps({name: len(seeds) for name, seeds in plan.recipe_seeds})
    if plan.spending is not None:
        seeds_tags = {"seeds": "auto", "max_seeds": str(plan.spending.max_seeds), "seed0": str(plan.seed)}
    recipes = plan.recipes
    parent = tracker.start_run(
        parent_run_name(plan, ablation_id),
        {
            ABLATION_TAG: ablation_id,
            "lowprec.kind": "ablation",
            "experiment": plan.name,
            "recipes": dumps([r.name for r in recipes]),
            **seeds_tags,
            "launcher": plan.launcher.name,
            # which GPU(s) each worker had (each run's own ``gpus`` tag names them); runs alone on their device(s)
            # measure their own throughput, which the report compares (``lowprec_lab.report.build.contention``)
            "placement": plan.placement.to_json(),
            **_concurrency_tags(plan),
            "control": plan.control,
            "studies": dumps(list(plan.studies)),
            "primary": dumps(list(plan.primary)),
            GROUP_TAG: group,
            **({POINT_TAG: dumps(dict(plan.point))} if plan.point else {}),
            **shared_tags(plan, data, resolve_device(plan.device)),
        },
    )
    tracker.log_params(parent, {k: v for k, v in plan.params(recipes[0]).items() if not k.startswith("recipe.")})
    tracker.log_corpus(parent, data)
    tracker.log_text(parent, plan.yaml(), CONFIG_ARTIFACT)
    return parent


def _concurrency_tags(plan: Plan) -> dict[str, str]:
    """The parent's ``workers`` (runs at a time) and ``runs_per_device`` (1: each run alone on its device(s)). On
    SLURM every run is its own job on its own allocation: as many at a time as the cluster starts, each alone."""
    launcher = plan.launcher
    if launcher.cluster:
        return {"workers": str(launcher.max_running or len(plan.jobs())), "runs_per_device": "1"}
    workers = launcher.max_running if launcher.submitit and launcher.max_running else plan.workers
    alone = plan.placement.alone_on_device and workers <= plan.workers
    return {"workers": str(workers), "runs_per_device": "1" if alone else str(workers)}


def auto_state(runs: list[RunOutcome], control: str, names: list[str], seed0: int, plan, margin: float):
    """``lowprec_lab.stats.auto_seeds.replay_results`` on the outcomes so far (the report replays the same from
    MLflow)."""
    results = [(o.recipe, o.seed, o.summary["final_val_loss"] if o.status == "FINISHED" else None) for o in runs]
    others = [n for n in names if n != control]
    return replay_results(results, control, others, seed0, plan.max_seeds, margin, LEVEL)


def dry_run_text(plan: Plan) -> str:
    """``lowprec_lab.runner.dry_run.plan_text`` for ``plan``: the corpus read if it is already prepared (stdlib's
    cache, a token folder), the hardware named (``hardware=``), detected (CUDA device 0) or, planning ``gpus=`` from
    a machine without one, ``h100_sxm``. Raises ``ConfigError`` for a corpus smaller than one run's tokens."""
    import dataclasses

    from lowprec.estimate.hardware import cuda_device_hardware, get_hardware
    from lowprec_lab.plan.preflight import PREPARE_HINT

    asked = plan.settings["train"]  # compile/ac as requested: ``auto`` is resolved per recipe by plan_text
    spec = dataclasses.replace(plan.train, compile=False, ac="none")  # the loop's settings; compile/ac: ``asked``
    dspec = plan.data
    corpus = Corpus(None, f"data.source={dspec.source} data.path not set: {PREPARE_HINT}", dspec.allow_epochs)
    if dspec.source == "stdlib" or (dspec.path and Path(dspec.path).expanduser().exists()):
        data = prepare_data(dspec, plan.train.progress)
        corpus = Corpus(data.n_train_tokens, data.description, dspec.allow_epochs)
    elif dspec.path:
        corpus = Corpus(None, f"{dspec.path} does not exist yet ({PREPARE_HINT})", dspec.allow_epochs)
    hw, source = None, "a CPU plan: the cost model predicts GPUs only"
    if plan.hardware:
        hw, source = get_hardware(plan.hardware), "hardware="
    elif plan.placement.device_type == "cuda":
        try:
            name, hw = cuda_device_hardware()
            source = f"detected: {name}"
        except (RuntimeError, LookupError):
            hw, source = get_hardware("h100_sxm"), "no GPU here: h100_sxm assumed, name it with hardware="
    text = plan_text(
        plan.model_name,
        plan.model,
        plan.recipes,
        {r.name: plan.seeds_of(r.name) for r in plan.recipes},
        spec,
        plan.parallel,
        plan.placement,
        corpus,
        hw,
        source,
        plan.spending.max_seeds if plan.spending is not None else None,
        (asked.get("compile", False), asked.get("ac", "none")),
    )
    return text + launcher_line(plan)


def launcher_line(plan: Plan) -> str:
    """The dry run's line for a submitit launcher (one job per run, what each job asks for, the torchrun inside a
    job of a parallel layout); "" for ``local``."""
    from lowprec_lab.runner.submitit_jobs import job_gpus

    spec = plan.launcher
    if not spec.submitit:
        return ""
    n = len(plan.jobs())
    asks = [f"{job_gpus(plan)} GPU(s)", f"{spec.time} min"]
    asks += [f"{k} {v}" for k, v in (("partition", spec.partition), ("cpus", spec.cpus_per_task)) if v is not None]
    asks += [f"{spec.mem_gb:g} GB"] if spec.mem_gb is not None else []
    at_once = spec.max_running or (n if spec.cluster else plan.workers)
    k = plan.parallel.world_size
    inside = f"; each runs torchrun with {k} ranks ({plan.parallel.short()})" if k > 1 else ""
    line = f"launcher={spec.name}: {n} job(s), one per run, {min(at_once, n)} at a time; each asks {', '.join(asks)}"
    return "\n" + line + inside
