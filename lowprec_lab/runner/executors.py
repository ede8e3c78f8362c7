"""Where an ablation's runs are launched: the executor registry and the one scheduling loop they all run under.

An executor starts one job, a (recipe, seed), in a slot and reports its ``RunOutcome``; ``schedule`` fills the
slots, records each outcome as it lands, and stops starting jobs once a stop signal arrived. The registry
``lowprec_lab.plan.launcher.LAUNCHERS`` maps each ``launcher.name`` to its executor class (``executor_class``:
imported when asked) and holds each launcher's traits (``submitit``, ``cluster``,
``job_id_tag``, read through the ``LauncherSpec``'s properties), so no other module compares a launcher's name and
the plan never imports the runner. Adding a launcher is one class and one line of ``LAUNCHERS``.

Registered: ``local`` (``lowprec_lab.runner.scheduler``: in this process, or one worker process per slot),
``slurm`` and ``submitit_local`` (``lowprec_lab.runner.submitit_jobs``: one submitit job per run).
"""

from __future__ import annotations

import importlib
import signal
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from lowprec.errors import ConfigError
from lowprec.train.stop import StopSignal, local_stop
from lowprec_lab.plan.launcher import LAUNCHERS
from lowprec_lab.plan.placement import Slot

if TYPE_CHECKING:
    from lowprec.recipe import Recipe
    from lowprec_lab.runner.run import RunOutcome

Job = tuple["Recipe", int]
"""(recipe, seed) of one run."""


def executor_class(name: str) -> type:
    """The executor class registered as ``name`` (``lowprec_lab.plan.launcher.LAUNCHERS``: ``"module:Class"``,
    imported when asked). Raises ``ConfigError`` (one line) for a name not registered."""
    kind = LAUNCHERS.get(name)
    if kind is None:
        raise ConfigError(f"launcher.name={name} is not one of {', '.join(LAUNCHERS)}")
    module, cls = kind.executor.split(":")
    return getattr(importlib.import_module(module), cls)


@dataclass
class Launch:
    """What every job of one batch shares: the ``plan``, the MLflow ``tracker``, the parent run ``parent_id`` and
    the ``ablation_id``; ``data`` (the prepared ``TokenData``: runs trained in this process use it),
    ``continuations`` ((recipe name, seed) -> the interrupted run to continue in place) and ``display`` (the
    ablation's progress display, or None)."""

    plan: Any
    tracker: Any
    parent_id: str
    ablation_id: str
    data: Any = None
    continuations: dict = field(default_factory=dict)
    display: Any = None


class SlotLost(Exception):
    """Raised by ``Executor.start``: the slot can take no job any more (its worker died while idle); the job goes
    back to the front of the queue, the slot is not used again."""


class Executor(Protocol):
    """One way of running jobs, registered by ``launcher.name`` in ``LAUNCHERS``.

    The launcher's traits (``submitit``, ``cluster``, ``job_id_tag``) are its ``LAUNCHERS`` entry, read through
    ``plan.launcher``. Class attribute ``no_slot_reason``: the reason of a job left queued once every slot was
    lost."""

    no_slot_reason: str

    @classmethod
    def create(cls, launch: Launch, n_jobs: int) -> tuple[Executor, list[Slot]]:
        """The executor for ``n_jobs`` jobs of ``launch`` and the slots ``schedule`` fills (nothing started yet)."""

    def open(self, slots: list[Slot]) -> None:
        """Make the slots ready (start worker processes, the job folder); called once, before the first job."""

    def start(self, slot: Slot, job: Job) -> Hashable | RunOutcome:
        """Start ``job`` in ``slot``: a handle of the job in flight, or its ``RunOutcome`` at once (a job that
        could not be started, or one run to its end in this process). Raises ``SlotLost``."""

    def poll(self, handles: list) -> list[tuple[Any, RunOutcome | None]]:
        """Wait a while (at most the executor's poll interval) and return the jobs of ``handles`` that ended, each
        with its outcome, None for a job that never started (stopped before it began: nothing to record)."""

    def release(self, slot: Slot) -> bool:
        """A job of ``slot`` was recorded; True when the slot takes another job."""

    def stop(self, handles: list) -> None:
        """A stop signal arrived (called on every turn of the loop until the jobs ``handles`` have ended): ask the
        jobs in flight to stop after their current step."""

    def interrupt(self, handles: list) -> None:
        """``KeyboardInterrupt`` in this process: cancel what can be cancelled (it then propagates)."""

    def close(self, results: dict[int, RunOutcome]) -> None:
        """Every job has its outcome (``results``, by index in the jobs): release the workers."""

    def started(self, outcome: RunOutcome) -> bool:
        """Whether ``outcome`` counts as a run started in the stop summary (``ablation_stop``)."""


def ablation_stop(outcomes: list[RunOutcome], not_started: int) -> StopSignal:
    """The ``StopSignal`` an ablation stopped by this process's stop signal raises: how many of ``outcomes`` were
    stopped and recorded KILLED, and ``not_started``."""
    killed = [o for o in outcomes if o.status == "KILLED"]
    name = signal.Signals(local_stop()).name
    msg = f"stopped by {name}: {len(killed)} run(s) stopped after their current step and recorded KILLED"
    msg += f" (each tagged resume_checkpoint when it wrote one), {not_started} not started"
    return StopSignal(local_stop(), message=msg)


def schedule(
    jobs: Sequence[Job],
    executor: Executor,
    slots: Sequence[Slot],
    on_done: Callable[[RunOutcome], None] = lambda o: None,
) -> list[RunOutcome]:
    """Run every job of ``jobs`` with ``executor``, one job at a time in each of ``slots``; ``on_done`` sees each
    outcome as it lands. Returns the outcomes in the order of ``jobs``.

    A job the executor records as failed is one outcome: the others go on. A slot lost (``SlotLost``, or
    ``release`` False) takes no other job; the jobs left once every slot is lost are FAILED with the executor's
    ``no_slot_reason``. A stop signal (``lowprec.train.stop``) starts no other job and is passed on to the jobs in
    flight (``Executor.stop``); once they have ended, ``StopSignal`` is raised with a summary
    (``ablation_stop``). ``KeyboardInterrupt`` is passed to the executor (``interrupt``) and propagates."""
    from lowprec_lab.runner.run import RunOutcome

    if not jobs:  # nothing to run: no worker started, no job folder made
        return []
    if local_stop():  # stopped before this batch of runs: start nothing
        raise ablation_stop([], len(jobs))
    free = list(slots)
    executor.open(list(free))
    queue = list(enumerate(jobs))  # (index in jobs, job) not yet started
    flight: dict[Any, tuple[int, Slot]] = {}  # handle -> (index in jobs, slot)
    results: dict[int, RunOutcome] = {}

    def record(i: int, slot: Slot, o: RunOutcome) -> None:
        results[i] = o
        on_done(o)
        if executor.release(slot):
            free.append(slot)

    try:
        while flight or (queue and free):
            if local_stop():
                queue.clear()  # not started
                executor.stop(list(flight))
            while queue and free and not local_stop():
                i, job = queue.pop(0)
                slot = free.pop(0)
                try:
                    started = executor.start(slot, job)
                except SlotLost:
                    queue.insert(0, (i, job))
                    continue
                if isinstance(started, RunOutcome):
                    record(i, slot, started)
                else:
                    flight[started] = (i, slot)
            if flight:
                for handle, o in executor.poll(list(flight)):
                    i, slot = flight.pop(handle)
                    if o is None:  # stopped before it began: nothing recorded
                        free.append(slot)
                    else:
                        record(i, slot, o)
    except KeyboardInterrupt:
        executor.interrupt(list(flight))
        raise
    if queue and not local_stop():  # every slot lost: nothing is left to run them
        for i, (recipe, seed) in queue:
            o = RunOutcome("", recipe.name, seed, "FAILED", reason=executor.no_slot_reason)
            results[i] = o
            on_done(o)
    executor.close(results)
    if local_stop():
        started = [o for o in results.values() if executor.started(o)]
        raise ablation_stop(started, len(jobs) - len(started))
    return [results[i] for i in range(len(jobs))]


def launch(launch: Launch, jobs: Sequence[Job], on_done: Callable[[RunOutcome], None] = lambda o: None):
    """Run ``jobs`` with the executor registered as ``launch.plan.launcher.name`` (``schedule``). Returns the
    outcomes in the order of ``jobs``; raises as ``schedule`` does."""
    if not jobs:
        return []
    executor, slots = executor_class(launch.plan.launcher.name).create(launch, len(jobs))
    return schedule(jobs, executor, slots, on_done)
