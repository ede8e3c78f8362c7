"""``lowprec ablate ... resume=ABLATION_ID``: continue an interrupted ablation under its own parent run.

What happens to each (recipe, seed) of the ablation, by the status of its child run in MLflow:

- FINISHED: kept, not rerun;
- FAILED with ``failure_kind`` ``user_error`` or ``non_finite`` (``lowprec_lab.runner.run.RESULT_FAILURES``): kept; it
  is a result (a recipe that diverges, a run whose input is refused), and a rerun would fail the same way;
- KILLED (a stop signal), FAILED by a crash (a bug, an injected crash, a worker process that died; a FAILED run
  without ``failure_kind``, from an older lowprec, counts as one), or RUNNING (its process died without a word: kill
  -9, out of memory): reopened in place, the same MLflow run marked RUNNING again, and continued from its newest
  complete checkpoint that its logged metrics reach (``lowprec_lab.runner.continued_runs.continue_from``), or from step
  0 when it has none; the steps it re-logs after that checkpoint are bit-identical recomputations of what it logged
  before (the report keeps one value per step);
- no child yet: started, as in a fresh ablation;
- a child whose record is incomplete (``lowprec_lab.tracking.runs.incomplete_record``: no params, its process killed
  as the run was created): marked FAILED with the reason (``failure_kind`` ``incomplete``), never continued, and its
  (recipe, seed) started again in a new run; the report leaves it out.

An interrupted run continues only from checkpoints inside this store's own folder of that run
(``<paths.runs>/checkpoints/<run id>``): a ``checkpoint_dir`` tag that points anywhere else is a record someone else
could have written, so it is never read and the run starts again from step 0, with a note saying why.

An ablation whose parent run FINISHED and that has nothing to continue or start (every run of its seeds kept) is
not reopened: the resume is a no-op with one line (``ResumePlan.finished``), and the parent stays FINISHED.

So the report has exactly one run per (recipe, seed), and the parent run, reopened too, ends FINISHED with the report
logged again. ``seeds=auto`` replays its looks from the kept and new results alike (``lowprec_lab.stats.auto_seeds``).

The configuration must be the ablation's: the resolved config (the parent's ``config.yaml``) is compared key by key,
except ``MAY_DIFFER``, and every recipe's hash with its runs' ``recipe_hash`` tags; the corpus fingerprint with the
parent's. The first difference is a one-line error, before anything is written to MLflow. So is an unknown id, a
path (``resume=`` of ``lowprec ablate`` takes the id the ablation printed, never a checkpoint), and an ablation
whose process still runs: every ablation holds ``<paths.runs>/locks/<id>.lock`` (``filelock``) while it runs.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout
from mlflow.tracking import MlflowClient

from lowprec_lab.plan.config import TrackingConfig, leaves
from lowprec_lab.plan.plan import Plan, settings_from_yaml
from lowprec_lab.plan.preflight import AblationResumeError, check_ablation_id
from lowprec_lab.runner.continued_runs import Continuation, continue_from, json_list
from lowprec_lab.runner.run import CONFIG_ARTIFACT, RESULT_FAILURES, RunOutcome
from lowprec_lab.tracking.runs import INCOMPLETE_KIND, incomplete_record
from lowprec_lab.tracking.tracker import ABLATION_TAG, PARENT_TAG, Tracker, check_reachable, dumps, resolve_uri

#: Configuration keys that may differ between an ablation and its resume: ``resume`` itself, the progress bar, and
#: ``workers`` (how many runs train at once; on a CPU it also sets each run's intra-op threads, which may change
#: the last bits of the numerics: resume with the same ``workers`` for bit-identical continuations), and ``gpus``,
#: ``hardware``, ``dry_run``, ``launcher`` (where the runs are placed or launched and what a plan predicts, never what
#: a run trains: an ablation started here may be resumed on SLURM and the other way round).
MAY_DIFFER = ("resume", "train.progress", "workers", "gpus", "hardware", "dry_run", "launcher")


def lock_ablation(runs: str, ablation_id: str) -> FileLock:
    """Hold ``<runs>/locks/<ablation_id>.lock`` (``runs``: ``paths.runs``; an OS file lock: released when the
    process dies, kill -9 included). Raises ``AblationResumeError`` when another process holds it: that ablation
    is still running."""
    path = Path(runs) / "locks" / f"{ablation_id}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise AblationResumeError(
            f"resume={ablation_id}: the ablation is still running in another process (it holds {path}); "
            "stop it first (SIGTERM), then resume"
        ) from None
    return lock


def _fmt(v) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    return str(v)


_ABSENT = object()


def _may_differ(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in MAY_DIFFER)


def _seeds_whole(settings: dict) -> dict:
    """``settings`` (a resolved configuration as plain data) with a mapping ``seeds`` as one JSON leaf, so a change
    of form (``4`` against ``{others: 4}``) reads as ``seeds`` differing."""
    if isinstance(settings.get("seeds"), dict):
        return {**settings, "seeds": json.dumps(settings["seeds"], sort_keys=True)}
    return settings


def config_difference(original: dict, now: dict) -> str | None:
    """The first key (in the ablation's order, then keys it lacks) whose value differs between the ablation's
    resolved configuration ``original`` and this command's ``now``, ignoring ``MAY_DIFFER``, as
    ``key=<now> differs from the ablation's <original>``; None when they match."""
    # ``seeds`` is an int, ``auto`` or a mapping per recipe: one value, whatever its form
    a, b = leaves(_seeds_whole(original)), leaves(_seeds_whole(now))
    for key in [*a, *(k for k in b if k not in a)]:
        if _may_differ(key) or a.get(key, _ABSENT) == b.get(key, _ABSENT):
            continue
        if key not in b:
            return f"the ablation's {key}={_fmt(a[key])} is not a key of this command's configuration"
        if key not in a:
            return f"{key}={_fmt(b[key])} is not a key of the ablation's configuration"
        return f"{key}={_fmt(b[key])} differs from the ablation's {_fmt(a[key])}"
    return None


def _read_only_client(tracking: TrackingConfig, ablation_id: str) -> tuple[MlflowClient, str, str]:
    """A client on the store ``tracking`` names and the experiment's id, without creating either (a missing
    sqlite file or experiment means there is no such ablation)."""
    uri = str(tracking.uri)
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not Path(uri[len(prefix) :]).exists():
        raise AblationResumeError(
            f"resume={ablation_id}: no ablation {ablation_id}: the tracking store {uri} does not exist"
        )
    check_reachable(uri)
    client = MlflowClient(resolve_uri(uri))
    exp = client.get_experiment_by_name(str(tracking.experiment))
    if exp is None:
        raise AblationResumeError(
            f"resume={ablation_id}: no ablation {ablation_id} in {uri} (no experiment {tracking.experiment!r})"
        )
    return client, exp.experiment_id, uri


@dataclass
class ResumePlan:
    """What a resume does with each (recipe name, seed) that already has a child run: ``kept`` (its outcome, as the
    ablation's summary and ``seeds=auto`` need it) or ``continued``; any other (recipe, seed) starts fresh.
    ``lock``: the ablation's lock, held by this process (None on ranks other than 0)."""

    ablation_id: str
    parent_id: str
    parent_status: str
    corpus_fingerprint: str
    #: Wall time of the earlier sessions as they recorded it (``wall_s`` of a finished or stopped parent; a session
    #: whose process was killed recorded none): the resumed ablation's ``wall_s`` adds its own.
    wall_s_before: float = 0.0
    kept: dict[tuple[str, int], RunOutcome] = field(default_factory=dict)
    continued: dict[tuple[str, int], Continuation] = field(default_factory=dict)
    incomplete: dict[str, str] = field(default_factory=dict)
    finished: bool = False
    lock: FileLock | None = field(default=None, compare=False, repr=False)

    def finished_line(self) -> str:
        """The one line of a resume of an ablation that already finished: nothing to do, and how to rebuild its
        report."""
        return (
            f"resume={self.ablation_id}: the ablation already finished ({len(self.kept)} run(s), parent run FINISHED); "
            f"nothing to resume, nothing changed; its report: lowprec report {self.ablation_id}"
        )

    def without_lock(self) -> ResumePlan:
        """The plan to send to the other ranks (a lock stays with its process)."""
        return dataclasses.replace(self, lock=None)

    def check_corpus(self, fingerprint: str) -> None:
        """Raises ``AblationResumeError`` when the corpus is not the one the ablation trained on."""
        if self.corpus_fingerprint and fingerprint != self.corpus_fingerprint:
            raise AblationResumeError(
                f"resume={self.ablation_id}: the corpus (fingerprint {fingerprint}) differs from the ablation's "
                f"({self.corpus_fingerprint})"
            )

    def describe(self) -> list[str]:
        """Lines for the terminal: what is kept, what continues from where."""
        lines = [
            f"resuming ablation {self.ablation_id} (parent run {self.parent_status}): {len(self.kept)} run(s) kept, "
            f"{len(self.continued)} continued, any other starts"
        ]
        for (name, seed), c in sorted(self.continued.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            where = Path(c.checkpoint).name if c.checkpoint else "step 0"
            lines.append(f"  {name:<16} seed {seed}: continues from {where} ({c.was})")
        for run_id, why in self.incomplete.items():
            lines.append(f"  run {run_id}: {why}; marked FAILED, its (recipe, seed) starts again")
        return lines


def _rank(run) -> tuple[int, int]:
    """Which child of a (recipe, seed) is the one to use when there are several: a finished one, then a kept
    failure, then the newest."""
    s, kind = run.info.status, run.data.tags.get("failure_kind")
    return (2 if s == "FINISHED" else 1 if s == "FAILED" and kind in RESULT_FAILURES else 0, run.info.start_time or 0)


def plan_resume(plan: Plan) -> ResumePlan:
    """Find the ablation ``plan.resume`` names, check that this command is the same ablation and decide what happens
    to each of its runs (module docstring). Reads MLflow and the checkpoint manifests; writes nothing to MLflow.
    Holds the ablation's lock from here on (``ResumePlan.lock``).

    Raises ``AblationResumeError`` for an id of no ablation in the store, a store or experiment that does not exist,
    an ablation still running, a configuration key that differs (the first one, named), or a recipe whose hash
    differs from its runs'.
    """
    ablation_id = check_ablation_id(plan.resume)
    recipes = plan.recipes
    client, experiment_id, uri = _read_only_client(plan.tracking, ablation_id)
    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{ABLATION_TAG}` = '{ablation_id}' and tags.`lowprec.kind` = 'ablation'",
    )
    if not found:
        raise AblationResumeError(f"resume={ablation_id}: no ablation {ablation_id} in {uri}")
    parent = found[0]
    lock = lock_ablation(plan.paths.runs, ablation_id)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            saved = client.download_artifacts(parent.info.run_id, CONFIG_ARTIFACT, tmp)
            original = settings_from_yaml(Path(saved).read_text())
        now = settings_from_yaml(plan.yaml())  # the same YAML round trip
        diff = config_difference(original, now)
        if diff:
            raise AblationResumeError(f"resume={ablation_id}: {diff}")
        children = client.search_runs(
            [experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'", max_results=10000
        )
        by_key: dict[tuple[str, int], object] = {}
        hashes = {r.name: r.hash() for r in recipes}
        incomplete: dict[str, str] = {}
        for run in sorted(children, key=_rank):
            why = incomplete_record(run)
            if why is not None:  # killed as it was created: not a run to keep or continue
                marked = run.info.status == "FAILED" and run.data.tags.get("failure_kind") == INCOMPLETE_KIND
                if not marked:
                    incomplete[run.info.run_id] = why
                continue
            tags = run.data.tags
            name = tags.get("recipe", "")
            if name in hashes and tags.get("recipe_hash") not in (None, hashes[name]):
                raise AblationResumeError(
                    f"resume={ablation_id}: recipe {name} hashes to {hashes[name]} here but ran as "
                    f"{tags['recipe_hash']} in the ablation (run {run.info.run_id}): its definition changed"
                )
            by_key[(name, int(tags.get("seed", -1)))] = run  # the best-ranked child of a key comes last
        ptags = parent.data.tags
        out = ResumePlan(
            ablation_id,
            parent.info.run_id,
            parent.info.status,
            ptags.get("corpus_fingerprint", ""),
            _float(ptags.get("wall_s")),
            incomplete=incomplete,
        )
        for key, run in by_key.items():
            _classify(client, out, key, run, plan.train.steps, plan.paths.runs)
        # FINISHED, nothing to continue or mark, every (recipe, seed) of its seeds kept: a finished ablation
        # (``seeds=auto`` added seeds only where its replay of these same results asked for them)
        wanted = {(r.name, s) for r, s in plan.jobs()}
        out.finished = (
            out.parent_status == "FINISHED" and not out.continued and not incomplete and wanted <= out.kept.keys()
        )
    except BaseException:
        lock.release()
        raise
    out.lock = lock
    return out


def _float(text: str | None) -> float:
    try:
        return float(text) if text else 0.0
    except ValueError:
        return 0.0


def _classify(client, plan: ResumePlan, key: tuple[str, int], run, steps: int, runs: str) -> None:
    status, tags, run_id = run.info.status, run.data.tags, run.info.run_id
    reason = tags.get("failure_reason", "")
    if status == "FINISHED":
        plan.kept[key] = RunOutcome(run_id, key[0], key[1], status, summary=dict(run.data.metrics))
    elif status == "FAILED" and tags.get("failure_kind") in RESULT_FAILURES:
        plan.kept[key] = RunOutcome(run_id, key[0], key[1], status, reason=reason)
    else:
        checkpoint, note = continue_from(client, run_id, tags.get("checkpoint_dir"), steps, runs)
        was = f"{status}: {reason or ('its process died' if status == 'RUNNING' else 'no reason recorded')}"
        plan.continued[key] = Continuation(run_id, checkpoint, was + (f" [{note}]" if note else ""))


def reopen_parent(tracker: Tracker, plan: ResumePlan) -> None:
    """Mark the ablation's parent run RUNNING again, drop the tags of its interruption and append this resume to its
    ``resumes`` tag (a JSON list); mark FAILED each child of ``plan.incomplete`` (``failure_kind`` ``incomplete``,
    the reason as ``failure_reason``): its (recipe, seed) starts again in a new run."""
    client = tracker.client
    for run_id, why in plan.incomplete.items():
        tracker.set_tags(run_id, {"failure_kind": INCOMPLETE_KIND})
        tracker.end_run(run_id, "FAILED", f"{why}; its (recipe, seed) started again in a new run")
    tags = client.get_run(plan.parent_id).data.tags
    for key in ("failure_reason", "stopped_by", "n_failed", "wall_s"):
        if key in tags:
            client.delete_tag(plan.parent_id, key)
    history = json_list(tags.get("resumes"))
    history.append(
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}: resumed from {plan.parent_status}; {len(plan.kept)} run(s) kept, "
        f"{len(plan.continued)} continued"
        + (f", {len(plan.incomplete)} incomplete started again" if plan.incomplete else "")
    )
    client.update_run(plan.parent_id, status="RUNNING")
    tracker.set_tags(plan.parent_id, {"resumes": dumps(history)})


def end_leftovers(tracker: Tracker, plan: ResumePlan) -> int:
    """End FAILED every child of the parent still RUNNING once the resumed ablation is done (a run of an earlier
    session that this one did not continue), so none stays RUNNING; returns how many."""
    runs = tracker.client.search_runs(
        [tracker.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{plan.parent_id}' and attributes.status = 'RUNNING'",
    )
    for r in runs:
        tracker.end_run(r.info.run_id, "FAILED", "left RUNNING by an earlier session of the ablation; not continued")
    return len(runs)
