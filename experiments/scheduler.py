"""Where an ablation's runs train: one after another in this process, or ``workers`` at a time in worker processes.

On a CPU, a small model's GEMMs split poorly across intra-op threads: two ``fp8_rowwise`` runs of ``tiny`` with one
thread each trained 544 + 574 tokens/s against 954-986 tokens/s for one run on both threads (2-core AVX2 EPYC,
nothing else running), about 1.15x; for the ``debug`` model of the tests the gain is larger (the second thread's
spin-wait costs more than it adds). ``workers=N`` therefore trains N runs at once, each in its own spawned process
with ``cores // N`` intra-op threads and its own MLflow client on the same store; every run is still one ``run_one``
call, recorded exactly as a sequential run is. Throughput figures of concurrent
runs are measured under each other's load: compare them only within one ablation (the report says how many runs
shared the machine: parent tag ``workers``).

A worker process that dies (killed, out of memory) breaks the pool: every run not finished by then fails with that
reason (a run left RUNNING in MLflow is marked FAILED), and the ablation goes on to its report. A worker whose
ablation process dies (kill -9) notices within a second: its run stops after the current step with its checkpoint,
recorded KILLED, and the worker exits, instead of training on unseen and racing a later ``resume=``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from multiprocessing import get_context

from omegaconf import DictConfig, OmegaConf

from experiments.continued_runs import Continuation
from experiments.run import RunOutcome, run_one
from lowprec.data import TokenData
from lowprec.errors import ConfigError
from lowprec.recipe import Recipe
from lowprec.train.stop import StopSignal, install_stop_handlers, local_stop, request_stop

Job = tuple[Recipe, int]
"""(recipe, seed) of one run."""
Continuations = dict[tuple[str, int], Continuation]
"""(recipe name, seed) -> the interrupted run to continue in place (an ablation's resume)."""


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_workers(workers, device_type: str, parallel: bool) -> int:
    """How many runs train at once. ``auto``: 1 on a GPU or under a parallel layout (one device per process
    already), else ``min(cores, 2)`` (measured on 2 cores only). An int >= 1: that many; > 1 only for one-process
    CPU runs. Raises ``ConfigError`` for anything else."""
    if workers == "auto":
        return 1 if device_type != "cpu" or parallel else min(cores(), 2)
    if isinstance(workers, bool) or not isinstance(workers, int):
        raise ConfigError(f"workers={workers} must be an integer >= 1 or auto")
    if workers < 1:
        raise ConfigError(f"workers={workers} must be >= 1")
    if workers > 1 and device_type != "cpu":
        raise ConfigError(f"workers={workers} trains runs side by side on the CPU; on {device_type} use workers=1")
    if workers > 1 and parallel:
        raise ConfigError(f"workers={workers} cannot combine with a parallel layout (parallel.*); use workers=1")
    return workers


# --- in the worker process ------------------------------------------------------------------------------------

_state: dict = {}


def _init_worker(threads: int, cfg: dict, parent: int) -> None:
    import torch

    from experiments.startup import prepare_data
    from experiments.tracking import make_tracker

    torch.set_num_threads(threads)
    install_stop_handlers()  # the ablation forwards its stop signal; each run stops after its current step
    _state.update(parent=parent, busy=False)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="lowprec-watch-parent").start()
    conf = OmegaConf.create(cfg)
    _state.update(cfg=conf, data=prepare_data(conf), tracker=make_tracker(conf))


def _watch_parent(parent: int, every_s: float = 1.0) -> None:
    """Once the ablation process ``parent`` is gone (kill -9 included: this process is re-parented), stop: a run in
    flight stops after its step with its checkpoint and is recorded KILLED (``_run_in_worker`` then exits), an idle
    worker exits at once (nothing would ever send it another run, nor end it)."""
    while os.getppid() == parent:
        time.sleep(every_s)
    if _state.get("busy"):
        request_stop(signal.SIGTERM)
    else:
        os._exit(0)


def _run_in_worker(
    recipe: Recipe, seed: int, parent_id: str, ablation_id: str, continuation: Continuation | None = None
) -> RunOutcome:
    s = _state
    s["busy"] = True
    try:
        return run_one(
            s["cfg"],
            recipe,
            seed,
            s["data"],
            s["tracker"],
            parent_id=parent_id,
            ablation_id=ablation_id,
            continuation=continuation,
        )
    except StopSignal as stop:  # recorded KILLED by run_one; a result, so the pool stays usable
        return RunOutcome(getattr(stop, "run_id", ""), recipe.name, seed, "KILLED", reason=stop.reason())
    finally:
        s["busy"] = False
        if os.getppid() != s["parent"]:  # the ablation died during the run, which is now recorded: nothing waits
            os._exit(0)


# --- in the ablation process ----------------------------------------------------------------------------------


def run_jobs(
    cfg: DictConfig,
    jobs: Sequence[Job],
    data: TokenData,
    tracker,
    parent_id: str,
    ablation_id: str,
    workers: int,
    on_done: Callable[[RunOutcome], None] = lambda o: None,
    continuations: Continuations | None = None,
) -> list[RunOutcome]:
    """Train every (recipe, seed) of ``jobs`` under the parent run; ``on_done`` sees each outcome as it lands.
    A job in ``continuations`` continues that interrupted run in place (``run_one``'s ``continuation``).

    Returns the outcomes in the order of ``jobs``. ``KeyboardInterrupt`` cancels what has not started and
    propagates (each started run marks itself KILLED). A stop signal (``lowprec.train.stop``) received here is
    forwarded to the workers; the runs in flight stop after their current step (checkpointed, KILLED), none
    other starts, and ``StopSignal`` is raised with a summary once they have.
    """
    cont = continuations or {}
    if workers == 1 or len(jobs) == 1:
        out = []
        for recipe, seed in jobs:
            if local_stop():  # stopped between two runs: start no other
                raise _ablation_stop(out, len(jobs) - len(out))
            try:
                o = run_one(
                    cfg,
                    recipe,
                    seed,
                    data,
                    tracker,
                    parent_id=parent_id,
                    ablation_id=ablation_id,
                    continuation=cont.get((recipe.name, seed)),
                )
            except StopSignal as stop:
                o = RunOutcome(getattr(stop, "run_id", ""), recipe.name, seed, "KILLED", reason=stop.reason())
                on_done(o)
                raise _ablation_stop([*out, o], len(jobs) - len(out) - 1) from None
            on_done(o)
            out.append(o)
        return out
    threads = max(1, cores() // workers)
    plain = OmegaConf.to_container(cfg, resolve=True)
    results: dict[int, RunOutcome] = {}
    pool = ProcessPoolExecutor(
        workers, mp_context=get_context("spawn"), initializer=_init_worker, initargs=(threads, plain, os.getpid())
    )
    try:
        pending: dict[Future, int] = {
            pool.submit(_run_in_worker, recipe, seed, parent_id, ablation_id, cont.get((recipe.name, seed))): i
            for i, (recipe, seed) in enumerate(jobs)
        }
        forwarded = False
        while pending:
            done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            if local_stop() and not forwarded:  # this process got the signal: each worker stops after its step
                forward_stop(pool, pending)
                forwarded = True
            for f in done:
                i = pending.pop(f)
                try:
                    o = f.result()
                except Exception as e:  # the worker process died: the run is failed, the ablation goes on
                    recipe, seed = jobs[i]
                    o = RunOutcome(
                        "", recipe.name, seed, "FAILED", reason=f"worker process died: {type(e).__name__}: {e}"
                    )
                results[i] = o
                on_done(o)
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    if any(o.run_id == "" for o in results.values()):
        fail_orphans(tracker, parent_id)
    if local_stop():
        raise _ablation_stop(list(results.values()), len(jobs) - len(results))
    return [results[i] for i in range(len(jobs))]


def _ablation_stop(outcomes: list[RunOutcome], not_started: int) -> StopSignal:
    killed = [o for o in outcomes if o.status == "KILLED"]
    name = signal.Signals(local_stop()).name
    msg = f"stopped by {name}: {len(killed)} run(s) stopped after their current step and recorded KILLED"
    msg += f" (each tagged resume_checkpoint when it wrote one), {not_started} not started"
    return StopSignal(local_stop(), message=msg)


def forward_stop(pool: ProcessPoolExecutor, pending: dict[Future, int]) -> None:
    """Cancel the runs not started and send SIGTERM to every worker process: the runs in flight stop after their
    current step, write their checkpoint and are recorded KILLED (SIGTERM, not the signal received: a terminal's
    Ctrl-C already reached the workers, and a second SIGINT would stop them without their checkpoint)."""
    for f in list(pending):
        if f.cancel():
            pending.pop(f)
    for proc in list(getattr(pool, "_processes", {}).values()):
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGTERM)


def fail_orphans(tracker, parent_id: str) -> None:
    """Mark FAILED every child run of ``parent_id`` still RUNNING: its worker process died mid-run, so no one
    else will end it (its metrics so far are kept)."""
    runs = tracker.client.search_runs(
        [tracker.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}' and attributes.status = 'RUNNING'",
    )
    for r in runs:
        tracker.set_tags(r.info.run_id, {"failure_kind": "crash"})  # a resume continues it (experiments/run.py)
        tracker.end_run(r.info.run_id, "FAILED", "its worker process died during the run")
