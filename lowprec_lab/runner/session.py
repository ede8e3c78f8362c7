"""The run session: what every entry point that trains runs shares (``RunSession``).

``lowprec train`` (``lowprec_lab.runner.train``), an ablation (``lowprec_lab.runner.ablate``) and the places its
runs train (in its own process and in worker processes: ``lowprec_lab.runner.scheduler``; a submitit job:
``lowprec_lab.runner.submitit_jobs``; each torchrun rank of a job: ``lowprec_lab.runner.job_ranks``) all set up a
run the same way: the plan's data prepared (from its cache), one MLflow client on the plan's store, and each
(recipe, seed, continuation) trained by ``lowprec_lab.runner.run.run_one``, whose ``TrackedRun``
(``lowprec_lab.runner.tracked_run``) records how it ended. A stop signal during a run is either the run's KILLED
outcome (an ablation's runs: the ablation counts it and goes on to stop) or propagated (``lowprec train``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lowprec.data import TokenData, check_vocab_fits
from lowprec.parallel.runtime import is_rank0
from lowprec.recipe import Recipe
from lowprec.train.stop import StopSignal
from lowprec_lab.plan.plan import Plan
from lowprec_lab.runner.continued_runs import Continuation
from lowprec_lab.runner.orphans import close_orphans
from lowprec_lab.runner.run import run_one
from lowprec_lab.runner.tracked_run import RunOutcome
from lowprec_lab.runtime.startup import prepare_data, warn_repeated_data
from lowprec_lab.tracking.tracker import make_tracker


@dataclass
class RunSession:
    """One process's runs of ``plan``: its prepared ``data`` (``TokenData``) and its MLflow ``tracker``."""

    plan: Plan
    data: TokenData
    tracker: object

    @classmethod
    def start(
        cls, plan: Plan, command: str | None = None, check: Callable[[TokenData], None] | None = None
    ) -> RunSession:
        """Prepare ``plan``'s data, then make its tracker. ``command`` (``"train"``, ``"ablate"``: the process the
        user started, not a worker or a job of it): the data's vocabulary is checked against the model's and, on
        rank 0, a corpus read more than once is warned about. ``check``: called with the data before the tracker
        exists (a resume's corpus check). Raises ``DataError`` (before any run exists) for data that cannot be
        prepared or does not fit the model, what ``check`` raises, ``TrackingError`` for a store that cannot be
        reached."""
        data = prepare_data(plan.data, plan.train.progress)
        if command is not None:
            check_vocab_fits(data, plan.model.vocab_size)
        if check is not None:
            check(data)
        tracker = make_tracker(plan.tracking.uri, plan.tracking.experiment, plan.paths.runs)
        if command is not None and is_rank0():
            warn_repeated_data(plan.data, plan.train, data, command)
        return cls(plan, data, tracker)

    def close_orphans(self, echo) -> None:
        """End FAILED every run of the store left RUNNING by a process that died, one ``echo`` line each."""
        for run_id in close_orphans(self.tracker, echo):
            echo(f"run {run_id} was left RUNNING by a process that died; recorded FAILED")

    def run(
        self,
        recipe: Recipe,
        seed: int,
        continuation: Continuation | None = None,
        parent_id: str | None = None,
        ablation_id: str | None = None,
        extra_tags: dict[str, str] | None = None,
        stop_raises: bool = False,
    ) -> RunOutcome:
        """Train ``recipe`` with ``seed`` (``run_one``: continuing ``continuation`` when given, under
        ``parent_id`` and ``ablation_id``, ``extra_tags`` set on the run) and return its outcome. A stop signal
        during the run (recorded KILLED by the run) is its KILLED outcome with the signal's reason, or with
        ``stop_raises`` propagates as ``StopSignal``; ``KeyboardInterrupt`` propagates."""
        try:
            return run_one(
                self.plan,
                recipe,
                seed,
                self.data,
                self.tracker,
                parent_id=parent_id,
                ablation_id=ablation_id,
                continuation=continuation,
                extra_tags=extra_tags,
            )
        except StopSignal as stop:
            if stop_raises:
                raise
            return RunOutcome(getattr(stop, "run_id", ""), recipe.name, seed, "KILLED", reason=stop.reason())
