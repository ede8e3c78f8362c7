"""One MLflow run's life: opened (or reopened), its work, and how it ends (``TrackedRun``).

Every way a run's work can end is recorded here, once: a return is the caller's (FINISHED, its summary), a
``StopSignal`` is KILLED with the signal's reason and where it stopped, ``KeyboardInterrupt`` is KILLED ("interrupted
by the user"), any other exception is FAILED with its reason, ``failure_kind`` and traceback. Each of these first
flushes what the run measured (its stability summary and its buffered metrics), in one place.

``shared_tags`` are the tags a child run and an ablation's parent run both carry: model, corpus, layout,
provenance and the owning process.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

from lowprec.data import TokenData
from lowprec.errors import DiskError, UserError
from lowprec.parallel.runtime import is_rank0
from lowprec.train.effective import EffectiveRecipeError
from lowprec.train.fault_points import reached
from lowprec.train.loop import AnomalyError
from lowprec.train.stop import StopSignal
from lowprec_lab.plan.plan import Plan
from lowprec_lab.runner.continued_runs import Continuation, reopen_run
from lowprec_lab.runner.orphans import owner_tags
from lowprec_lab.runtime.startup import corpus_tags
from lowprec_lab.tracking.tracker import MetricBuffer, provenance_tags


@dataclass
class RunOutcome:
    """What one run came to: its MLflow ``run_id`` ("" for a run never created), ``recipe`` (its name), ``seed``,
    ``status`` (FINISHED, FAILED or KILLED), the ``reason`` of a run that did not finish and the ``summary`` metrics
    of one that did."""

    run_id: str
    recipe: str
    seed: int
    status: str  # FINISHED | FAILED | KILLED
    reason: str = ""
    summary: dict | None = None
    #: The traceback of a failure that is not a user error (a bug); also logged as ``failure_traceback.txt``.
    traceback: str | None = None


#: ``failure_kind`` of a FAILED run (a tag): ``user_error`` (bad input the run met, e.g. a checkpoint of another
#: recipe), ``non_finite`` (a NaN/inf loss or gradient norm: the recipe's result), ``crash`` (anything else: a bug,
#: an injected crash, out of memory), ``disk`` (a full or read-only disk: ``lowprec.errors.DiskError``). An
#: ablation's resume keeps the first two as results (a rerun would fail the same way) and continues the others
#: (``lowprec_lab.runner.resume``).
RESULT_FAILURES = ("user_error", "non_finite")


def failure_kind(e: BaseException) -> str:
    """The ``failure_kind`` tag of a run that raised ``e`` (see ``RESULT_FAILURES``)."""
    if isinstance(e, AnomalyError):  # NonFiniteError, or an anomaly policy that gave up: the recipe's result
        return "non_finite"
    if isinstance(e, DiskError):  # told in one line like a user error, but a resume after freeing space continues
        return "disk"
    return "user_error" if isinstance(e, UserError) else "crash"


def shared_tags(plan: Plan, data: TokenData, device) -> dict[str, str]:
    """The tags of every run this process opens, child or parent: ``model``, the corpus (fingerprint, description,
    token counts and epochs), the parallel layout, provenance (``device``: a ``torch.device``; git, versions) and
    the owner tags (a later command ends the run FAILED if this process dies without a word, kill -9)."""
    dims = plan.parallel
    return {
        "model": plan.model_name,
        "corpus_fingerprint": data.fingerprint,
        "corpus": data.description,
        **corpus_tags(plan.train, data),
        "parallel": dims.short(),
        "world_size": str(dims.world_size),
        **provenance_tags(device),
        **owner_tags(),
    }


class TrackedRun:
    """A context manager around one MLflow run of ``recipe`` and ``seed``.

    Opening (``open``, or entering when not yet open) starts a run named ``name`` with ``tags`` under ``parent_id``,
    or, with ``continuation``, reopens ``continuation.run_id`` (RUNNING again, its id kept; ``tags`` are not set
    again: they are the first session's). ``buffer`` (a ``MetricBuffer``) holds the run's metrics; ``sink`` (a
    ``StabilityRecorder``, optional) its stability series.

    Leaving the body: without an exception the body has ended the run and set ``outcome``. A ``StopSignal`` ends
    it KILLED with ``stop.reason()`` and tags ``stopped_by``, ``stopped_after_step`` and ``resume_checkpoint``, sets
    ``stop.run_id`` and propagates; ``KeyboardInterrupt`` ends it KILLED ("interrupted by the user") and propagates;
    any other exception ends it FAILED with ``failure_reason`` ``"<type>: <message>"``, the ``failure_kind`` tag
    and ``failure_traceback.txt``, sets ``outcome`` (FAILED) and is suppressed. Each path flushes once first."""

    def __init__(
        self,
        tracker,
        name: str,
        tags: dict[str, str],
        recipe: str,
        seed: int,
        parent_id: str | None = None,
        continuation: Continuation | None = None,
    ):
        self.tracker, self.name, self.tags, self.parent_id = tracker, name, tags, parent_id
        self.recipe, self.seed, self.continuation = recipe, seed, continuation
        self.run_id: str | None = None
        self.buffer: MetricBuffer | None = None
        self.sink = None
        self.outcome: RunOutcome | None = None

    def open(self) -> str:
        """Start (or reopen) the run; returns its id. ``reached("run.created")`` right after a new run exists."""
        if self.continuation is None:
            self.run_id = self.tracker.start_run(self.name, self.tags, self.parent_id)
            reached("run.created")
        else:
            self.run_id = self.continuation.run_id
            if is_rank0():
                reopen_run(self.tracker, self.continuation)
        self.buffer = MetricBuffer(self.tracker, self.run_id)
        return self.run_id

    def __enter__(self) -> TrackedRun:
        if self.run_id is None:
            self.open()
        return self

    def finish(self, summary: dict, tags: dict[str, str] | None = None) -> RunOutcome:
        """End the run FINISHED (after setting ``tags``) and set ``outcome`` with ``summary``."""
        if tags:
            self.tracker.set_tags(self.run_id, tags)
        self.tracker.end_run(self.run_id, "FINISHED")
        self.outcome = RunOutcome(self.run_id, self.recipe, self.seed, "FINISHED", summary=summary)
        return self.outcome

    def _flush(self, e: BaseException) -> None:
        """What the run measured before ``e``: the stability summary (with the failing step of an anomaly, which
        never reached the sink: a NaN loss is the run's divergence) and the buffered metrics."""
        if self.sink is not None:
            if isinstance(e, AnomalyError):
                self.sink.record_failed_step(e.loss, e.grad_norm)
            self.sink.log_summary()
        self.buffer.flush()

    def __exit__(self, kind, e, tb) -> bool:
        if e is None:
            return False
        if not isinstance(e, Exception | KeyboardInterrupt | StopSignal):  # SystemExit: not the run's to record
            return False
        self._flush(e)
        tracker, run_id = self.tracker, self.run_id
        if isinstance(e, StopSignal):  # every step before it is logged; the run can resume from e.checkpoint
            tags = {"stopped_by": e.name, "stopped_after_step": str(e.step)}
            if e.checkpoint:
                tags["resume_checkpoint"] = str(e.checkpoint)
            tracker.set_tags(run_id, tags)
            tracker.end_run(run_id, "KILLED", e.reason())
            e.run_id = run_id
            return False
        if isinstance(e, KeyboardInterrupt):
            tracker.end_run(run_id, "KILLED", "interrupted by the user")
            return False
        # recorded, explained, and the caller goes on with the next run
        reason = f"{type(e).__name__}: {e}"
        if isinstance(e, EffectiveRecipeError):
            tracker.set_tags(run_id, {"effective_matches": "false"})
        text = "".join(traceback.format_exception(e))
        tracker.set_tags(run_id, {"failure_kind": failure_kind(e)})
        tracker.log_text(run_id, text, "failure_traceback.txt")
        tracker.end_run(run_id, "FAILED", reason)
        shown = None if isinstance(e, UserError) else text  # a user error is told in one line, not a traceback
        self.outcome = RunOutcome(run_id, self.recipe, self.seed, "FAILED", reason=reason, traceback=shown)
        return True
