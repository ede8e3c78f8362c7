"""``lowprec train``: one run of one recipe and seed, tracked in MLflow."""

from __future__ import annotations

import sys

from lowprec.backends import short_str
from lowprec.parallel.runtime import is_rank0
from lowprec_lab.plan.plan import Plan
from lowprec_lab.runner.session import RunSession
from lowprec_lab.runner.tracked_run import RunOutcome
from lowprec_lab.runtime.startup import start_parallel


def train(plan: Plan, echo=print) -> RunOutcome:
    """Train ``plan.recipes[0]`` with ``plan.seed`` (a checked ``train`` plan: ``lowprec_lab.plan.preflight``) and
    return its ``RunOutcome``; a failure is recorded on the run (FAILED, with its reason), its traceback printed on
    stderr when it is not a user error. Raises ``DataError`` (before any run exists) for data that cannot be
    prepared or whose vocabulary exceeds the model's, and what ``RunSession.run`` propagates (a stop signal, Ctrl-C)."""
    recipe = plan.recipes[0]
    dims = start_parallel(plan.parallel, plan.device)
    session = RunSession.start(plan, "train")
    if not is_rank0():
        echo = lambda *a, **k: None  # noqa: E731
    session.close_orphans(echo)
    echo(
        f"train {recipe.name} ({short_str(recipe)}) on model={plan.model_name}, {plan.train.steps} steps, seed "
        f"{plan.seed}" + (f", layout {dims.short()} ({dims.world_size} ranks)" if dims.enabled else "")
    )
    o = session.run(recipe, plan.seed, stop_raises=True)
    if o.status == "FINISHED":
        s = o.summary
        echo(
            f"FINISHED run {o.run_id}: val_loss {s['final_val_loss']:.4f}, {s['mean_tokens_per_s']:.0f} tokens/s, "
            f"{s['state_bytes_per_param']:.2f} state B/param; tracking: {session.tracker.uri}"
        )
    else:
        echo(f"FAILED run {o.run_id}: {o.reason}")
        if o.traceback:  # not a user error: a bug, whose traceback is also the run's failure_traceback.txt artifact
            print(o.traceback, file=sys.stderr)
    return o
