"""Where an ablation's runs train: one after another in this process, or ``workers`` at a time in worker processes.

On a CPU, a small model's GEMMs split poorly across intra-op threads: two ``fp8_rowwise`` runs of ``tiny`` with one
thread each trained 544 + 574 tokens/s against 954-986 tokens/s for one run on both threads (2-core AVX2 EPYC,
nothing else running), about 1.15x; for the ``debug`` model of the tests the gain is larger (the second thread's
spin-wait costs more than it adds). ``workers=N`` therefore trains N runs at once, each in its own worker process
with ``cores // N`` intra-op threads and its own MLflow client on the same store (its ``RunSession``); every run is
still one ``RunSession.run`` call, recorded exactly as a sequential run is. Throughput figures of concurrent runs are
measured under each other's load: compare them only within one ablation (the report says how many runs
shared the machine: parent tag ``workers``).

The workers are forked from a forkserver that has already imported torch, MLflow and the lab
(``lowprec.parallel.spawn.forkserver_context``, started once per ablation process): a spawned worker spent about
5 s of CPU on those imports before its first run. A forked worker inherits the forkserver's environment from the
server's start, so it is sent the ablation's environment and makes it its own first (``start_slot_pool``).

On CUDA each worker is a slot of ``lowprec_lab.plan.placement``: its process sets ``CUDA_VISIBLE_DEVICES``
naming its own GPU(s) only (``start_slot_pool``: first thing in it, before anything in it can initialise CUDA;
importing torch does not), so runs on distinct GPUs never share one, and each run is tagged with its ``gpus``.

Each worker has a pool of its own and one run at a time; the next queued run goes to the first worker free. A worker
process that dies (its GPU failed, killed, out of memory) fails its run in flight only (a run left RUNNING in MLflow
is marked FAILED): its slot is not used again (a failed GPU stays failed), the other workers take the queued runs,
and the ablation goes on to its report. Only when every worker has died do the runs left fail, not started.

A worker whose ablation process dies (kill -9; its forkserver then exits too) notices within a second: its run
stops after the current step with its checkpoint, recorded KILLED, and the worker exits, instead of training on
unseen and racing a later ``resume=``.

A stop signal never kills a worker: the workers start with the stop signals blocked (a signal that arrives while
one still imports waits), and unblock them once their handlers are installed. A worker asked to stop before a run
begins starts none (the ablation counts it "not started"). The runs the stop finds queued are cancelled by the
pool's own thread (``shutdown(cancel_futures=True)``), not by ``Future.cancel`` here: on Python 3.11 a pool that
breaks after a future was cancelled from outside raises ``InvalidStateError`` in that thread (CPython gh-107219,
fixed from 3.12 on).

Once every run has its outcome, a worker exits at once (``os._exit`` from ``atexit``), and the ablation waits at most
``EXIT_GRACE_S`` for that (``close_pool``). The pool's own shutdown waited without limit while each worker ran its
interpreter's final garbage collection: 5.8-6.7 s from the last run's end to the parent's with both cores busy
(``stress-ng --cpu 4`` on 2 cores), 15 s at a load of 14; now 0.1-0.2 s.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_sentinels

from lowprec.data import TokenData
from lowprec.parallel.spawn import add_forkserver_preload, apply_parent_state, forkserver_context, parent_state
from lowprec.recipe import Recipe
from lowprec.train.stop import STOP_SIGNALS, install_stop_handlers, local_stop, request_stop
from lowprec_lab.plan.placement import Placement, Slot, physical_ids
from lowprec_lab.plan.plan import Plan
from lowprec_lab.plan.preflight import cores
from lowprec_lab.runner.continued_runs import Continuation
from lowprec_lab.runner.executors import Launch, SlotLost, schedule
from lowprec_lab.runner.progress import AblationProgress
from lowprec_lab.runner.session import RunSession
from lowprec_lab.runner.tracked_run import RunOutcome

Job = tuple[Recipe, int]
"""(recipe, seed) of one run."""
Continuations = dict[tuple[str, int], Continuation]
"""(recipe name, seed) -> the interrupted run to continue in place (an ablation's resume)."""

# A worker's imports, done once in the forkserver instead of in each worker (module docstring); only a forkserver
# not yet started in this process takes them.
add_forkserver_preload("mlflow", "lowprec_lab.runner.scheduler")


def slot_env(slot: Slot) -> dict[str, str]:
    """The environment a slot's worker starts with: ``CUDA_VISIBLE_DEVICES`` naming its GPUs only (mapped through
    this process's own ``CUDA_VISIBLE_DEVICES``); empty for a CPU slot."""
    if not slot.gpus:
        return {}
    return {"CUDA_VISIBLE_DEVICES": physical_ids(slot.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))}


def _init_slot(state: tuple, env: dict[str, str], initializer, initargs: tuple) -> None:
    # First: the ablation's environment as it is now (the forkserver's is that of its own start), then the slot's.
    apply_parent_state(state)
    os.environ.update(env)
    if initializer is not None:
        initializer(*initargs)


def start_slot_pool(slot: Slot, initializer=None, initargs=()) -> ProcessPoolExecutor:
    """A one-process pool for ``slot``, its worker started now (a ``ProcessPoolExecutor`` starts its process on the
    first submit, so this submits a no-op). One pool per slot: a worker that dies (its GPU failed, or it was killed)
    breaks its own pool only, so only its run fails.

    The worker is forked from this process's forkserver (``lowprec.parallel.spawn.forkserver_context``), not
    spawned. It inherits the forkserver's environment, which is this process's at the forkserver's start; so before
    ``initializer(*initargs)`` it makes this process's environment and this thread's signal mask, as they are now,
    its own, then sets ``slot_env(slot)``: a variable set here since (a test's, ``LOWPREC_FAULTS``) reaches it, and
    nothing in it initialises CUDA before its ``CUDA_VISIBLE_DEVICES`` is the slot's."""
    pool = ProcessPoolExecutor(
        1,
        mp_context=forkserver_context(),
        initializer=_init_slot,
        initargs=(parent_state(), slot_env(slot), initializer, initargs),
    )
    pool.submit(int)  # starts the worker
    return pool


def worker_visible_devices() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as a worker process sees it (run in the worker: what its runs can reach)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


# --- in the worker process ------------------------------------------------------------------------------------

_state: dict = {}


@dataclass(frozen=True)
class NotStarted:
    """A worker's answer for a run it did not start: it had been asked to stop by ``signum``."""

    signum: int


@contextmanager
def _stop_signals_blocked():
    """Block ``STOP_SIGNALS`` in this thread for the body. A worker started meanwhile takes this mask as its own
    (``start_slot_pool``; the forkserver it is forked from has them blocked too): a stop signal that reaches it
    before its handlers exist waits (pending) instead of killing it."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX
        yield
        return
    # Started first: starting it unblocks SIGINT and SIGTERM in this thread after blocking them for its own start
    # (bpo-33613, the same protection for the tracker process), which would undo the block below.
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)  # a signal that arrived meanwhile is handled now


def _exit_now() -> None:
    """A worker's exit, from ``atexit``: flush stdio and ``os._exit(0)``, skipping the rest of Python's
    finalization. The worker exits only once the pool has no run left for it, each one recorded and its outcome
    sent. What follows in a normal exit is the final garbage collection of torch's, MLflow's and Hydra's objects:
    4-6 s of CPU per worker with both cores busy (py-spy: ``gc_collect_main``), 8-15 s at a load of 14, during which
    the ablation waited in ``ProcessPoolExecutor.shutdown`` before its report."""
    for stream in (sys.stdout, sys.stderr):
        try:
            getattr(stream, "close_line", lambda: None)()  # a line still open in the ablation's display pipe
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to flush
            pass
    os._exit(0)


def _init_worker(
    threads: int, plan: Plan, parent: int, env: dict[str, str] | None = None, channel: Connection | None = None
) -> None:
    # The slot's environment was already made this process's (``start_slot_pool``); set again here so that a worker
    # started any other way is still pinned before its first CUDA call.
    os.environ.update(env or {})
    # Started with the stop signals blocked (``_stop_signals_blocked``): handlers first, then unblock, so a stop
    # that arrived during this process's imports is recorded now, not lost and not fatal.
    install_stop_handlers()  # the ablation forwards its stop signal; each run stops after its current step
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    atexit.register(_exit_now)  # after the imports' own handlers: it runs before them (LIFO), they are not needed
    if channel is not None:  # the ablation draws this worker's bar; its lines go above the bars, not across them
        from lowprec_lab.runner.progress import WorkerChannel

        _state["channel"] = WorkerChannel(channel)
        _state["channel"].install()

    import torch

    torch.set_num_threads(threads)
    started_from = _started_from(parent)
    _state.update(started_from=started_from, busy=False)
    threading.Thread(target=_watch_parent, args=(started_from,), daemon=True, name="lowprec-watch-parent").start()
    _state["session"] = RunSession.start(plan)


def _started_from(parent: int) -> int | None:
    """The process whose exit tells this worker that the ablation process ``parent`` is gone: the ablation's
    forkserver, which exits with it (the end of its pipe from the ablation), or ``parent`` itself for a worker
    spawned by it. ``None`` when that is already gone (this process was re-parented before it looked)."""
    ppid = os.getppid()
    if ppid == parent:
        return ppid
    try:
        with open(f"/proc/{ppid}/stat") as f:
            grandparent = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):  # no /proc to ask: the forkserver is taken to be the ablation's
        return ppid
    return ppid if grandparent == parent else None


def _watch_parent(started_from: int | None, every_s: float = 1.0) -> None:
    """Once the process this worker was started from (``started_from``: the forkserver, gone with the ablation
    process, kill -9 included) is gone, so that this process is re-parented, stop: a run in flight stops after its
    step with its checkpoint and is recorded KILLED (``_run_in_worker`` then exits), an idle worker exits at once
    (nothing would ever send it another run, nor end it)."""
    while started_from is not None and os.getppid() == started_from:
        time.sleep(every_s)
    if _state.get("busy"):
        request_stop(signal.SIGTERM)
    else:
        os._exit(0)


def _run_in_worker(
    recipe: Recipe, seed: int, parent_id: str, ablation_id: str, continuation: Continuation | None = None
) -> RunOutcome | NotStarted:
    if local_stop():  # asked to stop before this run began (forwarded, or sent to the process group): start none
        return NotStarted(local_stop())
    s = _state
    s["busy"] = True
    if s.get("channel") is not None:
        s["channel"].run_started(recipe.name, seed)
    try:
        # a stop is the run's KILLED outcome: a result, so the pool stays usable
        o = s["session"].run(recipe, seed, continuation, parent_id, ablation_id)
        # which GPU(s) ran it (the parent has the placement); a stopped run is recorded as it stopped
        if o.run_id and o.status != "KILLED" and worker_visible_devices() is not None:
            s["session"].tracker.set_tags(o.run_id, {"gpus": worker_visible_devices()})
        return o
    finally:
        s["busy"] = False
        if os.getppid() != s["started_from"]:  # the ablation died during the run, which is now recorded: nothing waits
            os._exit(0)


# --- in the ablation process ----------------------------------------------------------------------------------


class LocalExecutor:
    """The ``local`` launcher (registered in ``lowprec_lab.runner.executors``): every run in this process, one
    after another, when there is one slot or one run (a single GPU slot: CUDA device 0 of this process's own);
    otherwise ``create`` gives a ``PoolExecutor``."""

    no_slot_reason = "not started: no slot"

    def __init__(self, launch: Launch):
        self.launch = launch
        self.display = launch.display or AblationProgress()  # not live: draws nothing
        self.session = RunSession(launch.plan, launch.data, launch.tracker)

    @classmethod
    def create(cls, launch: Launch, n_jobs: int, workers: int | Placement | None = None):
        """In this process for one slot or one job, else a ``PoolExecutor`` over the slots of ``workers``
        (default: the plan's placement), as many as there are jobs."""
        workers = launch.plan.placement if workers is None else workers
        n_slots = workers.workers if isinstance(workers, Placement) else workers
        if n_slots == 1 or n_jobs == 1:
            return cls(launch), [Slot(0)]
        slots = list(workers.slots) if isinstance(workers, Placement) else [Slot(i) for i in range(workers)]
        return PoolExecutor(launch), slots[:n_jobs]

    def open(self, slots: list[Slot]) -> None:
        pass

    def start(self, slot: Slot, job: Job) -> RunOutcome:
        """Train ``job`` here, to its end; a stop signal during it is its KILLED outcome (recorded so by the run:
        ``RunSession.run``)."""
        recipe, seed = job
        ln = self.launch
        self.display.run_started(0, recipe.name, seed)
        with self.display.in_process(0):
            cont = ln.continuations.get((recipe.name, seed))
            return self.session.run(recipe, seed, cont, ln.parent_id, ln.ablation_id)

    def poll(self, handles: list) -> list:
        return []  # nothing runs in flight: each job ends in ``start``

    def release(self, slot: Slot) -> bool:
        self.display.run_ended(0)
        return True

    def stop(self, handles: list) -> None:
        pass  # the run in this process saw the signal itself

    def interrupt(self, handles: list) -> None:
        pass  # the run in this process marks itself KILLED

    def close(self, results: dict) -> None:
        pass

    def started(self, outcome: RunOutcome) -> bool:
        return True


class PoolExecutor:
    """``local`` with more than one slot: one worker process per slot (``start_slot_pool``), one run at a time
    each; a worker that dies fails its run in flight and its slot is not used again (module docstring)."""

    no_slot_reason = "not started: every worker process died"

    def __init__(self, launch: Launch):
        self.launch = launch
        self.display = launch.display or AblationProgress()  # not live: draws nothing
        self.pools: dict[int, tuple[ProcessPoolExecutor, list, threading.Thread | None]] = {}
        self.dead: set[int] = set()  # slots whose worker died: not used again (a failed GPU stays failed)
        self.jobs: dict[Future, tuple[Job, Slot]] = {}
        self.forwarded = False

    def open(self, slots: list[Slot]) -> None:
        threads = max(1, cores() // len(slots))
        plan = self.launch.plan
        with _stop_signals_blocked():  # each worker starts with the stop signals blocked
            for slot in slots:
                env = slot_env(slot)
                channel = self.display.channel(slot.index)
                pool = start_slot_pool(slot, _init_worker, (threads, plan, os.getpid(), env, channel))
                self.pools[slot.index] = (pool, *pool_internals(pool))
        if all(procs for _pool, procs, _m in self.pools.values()):  # each worker holds its end of its display pipe
            self.display.started()

    def start(self, slot: Slot, job: Job) -> Future:
        recipe, seed = job
        ln = self.launch
        pool = self.pools[slot.index][0]
        cont = ln.continuations.get((recipe.name, seed))
        try:
            f = pool.submit(_run_in_worker, recipe, seed, ln.parent_id, ln.ablation_id, cont)
        except BrokenProcessPool:  # its worker died while idle: the run goes back to the queue
            self.dead.add(slot.index)
            raise SlotLost from None
        self.jobs[f] = (job, slot)
        return f

    def poll(self, handles: list) -> list:
        done, _ = wait(handles, timeout=0.5, return_when=FIRST_COMPLETED)
        out: list = []
        for f in handles:
            if f.cancelled():  # by forward_stop: not started
                # ``wait`` never returns a future cancelled by the pool's shutdown (it is not "notified")
                out.append((f, None))
        for f in done:
            if f.cancelled():
                continue  # listed above
            (recipe, seed), slot = self.jobs[f]
            try:
                o = f.result()
            except Exception as e:  # the worker process died: its run is failed, the other workers go on
                self.dead.add(slot.index)
                o = RunOutcome("", recipe.name, seed, "FAILED", reason=f"worker process died: {type(e).__name__}: {e}")
            if isinstance(o, NotStarted):  # the worker had been asked to stop: so is the ablation
                request_stop(o.signum)
                o = None
            out.append((f, o))
        return out

    def release(self, slot: Slot) -> bool:
        self.display.run_ended(slot.index)
        return slot.index not in self.dead

    def stop(self, handles: list) -> None:
        if not self.forwarded:  # this process got the signal: each worker stops after its step
            for pool, procs, _m in self.pools.values():
                forward_stop(pool, procs)
            self.forwarded = True

    def interrupt(self, handles: list) -> None:
        for pool, _p, _m in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self, results: dict) -> None:
        for pool, procs, manager in self.pools.values():
            for pid in close_pool(pool, procs, manager):
                print(
                    f"worker process {pid} had not exited {EXIT_GRACE_S:.0f} s after its last run; killed (its runs "
                    "are recorded)",
                    file=sys.stderr,
                )
        if any(o.run_id == "" for o in results.values()):
            fail_orphans(self.launch.tracker, self.launch.parent_id)

    def started(self, outcome: RunOutcome) -> bool:
        return True


def run_jobs(
    plan: Plan,
    jobs: Sequence[Job],
    data: TokenData,
    tracker,
    parent_id: str,
    ablation_id: str,
    workers: int | Placement,
    on_done: Callable[[RunOutcome], None] = lambda o: None,
    continuations: Continuations | None = None,
    display: AblationProgress | None = None,
) -> list[RunOutcome]:
    """Train every (recipe, seed) of ``jobs`` under the parent run with the ``local`` launcher (``schedule``);
    ``on_done`` sees each outcome as it lands. ``workers``: the slots (a ``Placement``, or a count of CPU slots).
    A job in ``continuations`` continues that interrupted run in place (``run_one``'s ``continuation``).
    ``display``: the ablation's progress display (``lowprec_lab.runner.progress``), fed each worker's run and steps.

    Returns the outcomes in the order of ``jobs``. ``KeyboardInterrupt`` cancels what has not started and
    propagates (each started run marks itself KILLED). A stop signal (``lowprec.train.stop``) received here is
    forwarded to the workers; the runs in flight stop after their current step (checkpointed, KILLED), none
    other starts, and ``StopSignal`` is raised with a summary once they have. A stop signal that reached a worker
    alone (the process group's) stops the ablation the same way, once that worker declines its next run.
    """
    if not jobs:  # every run of this batch kept by a resume: no worker to start (and no slot to share cores)
        return []
    launch = Launch(plan, tracker, parent_id, ablation_id, data, continuations or {}, display)
    executor, slots = LocalExecutor.create(launch, len(jobs), workers)
    return schedule(jobs, executor, slots, on_done)


def pool_internals(pool: ProcessPoolExecutor) -> tuple[list, threading.Thread | None]:
    """The pool's worker processes (``multiprocessing.Process``) and its management thread, read right after the
    submits (the pool starts them there). Private attributes of CPython's ``ProcessPoolExecutor``, read here only:
    ``shutdown`` drops the pool's references to both."""
    return list((getattr(pool, "_processes", None) or {}).values()), getattr(pool, "_executor_manager_thread", None)


#: How long the ablation waits for its workers to exit once every run has its outcome (seconds). A worker exits in
#: well under a second (``_exit_now``); past this, it is stuck in its exit, with nothing of its own left to record.
EXIT_GRACE_S = 30.0


def close_pool(pool: ProcessPoolExecutor, procs: list, manager: threading.Thread | None, grace_s=EXIT_GRACE_S):
    """Shut ``pool`` down once every run has its outcome: its workers get their end-of-work sentinel and
    ``grace_s`` seconds to exit; those still alive then are killed. Returns the pids killed.

    Bounded on purpose: the plain ``pool.shutdown()`` waits for every worker to exit, without limit, and a worker
    whose exit stalls (its interpreter's finalization) kept the ablation from its report."""
    pool.shutdown(wait=False)
    deadline = time.monotonic() + grace_s
    alive = [p for p in procs if p.exitcode is None]
    while alive and time.monotonic() < deadline:
        wait_sentinels([p.sentinel for p in alive], timeout=max(0.0, deadline - time.monotonic()))
        alive = [p for p in alive if p.is_alive()]
    for p in alive:
        p.kill()
    if manager is not None:
        manager.join(grace_s)  # it reaps the workers; each one has exited or been killed
    return [p.pid for p in alive]


def forward_stop(pool: ProcessPoolExecutor, procs: list) -> None:
    """Cancel the runs not yet handed to a worker and send SIGTERM to every worker process: the runs in flight stop
    after their current step, write their checkpoint and are recorded KILLED, and a worker declines the runs
    already queued to it (``NotStarted``). SIGTERM, not the signal received: a terminal's Ctrl-C already reached
    the workers, and a second SIGINT would stop them without their checkpoint.

    The pool's own thread cancels (``shutdown(cancel_futures=True)``, which returns at once): it is the thread
    that fails every future with ``BrokenProcessPool`` when a worker dies, and on Python 3.11 it raised
    ``InvalidStateError`` on a future cancelled from this thread (CPython gh-107219)."""
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        if proc.is_alive():
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:  # it exited meanwhile
                pass


def fail_orphans(tracker, parent_id: str) -> None:
    """Mark FAILED every child run of ``parent_id`` still RUNNING: its worker process died mid-run, so no one
    else will end it (its metrics so far are kept)."""
    runs = tracker.client.search_runs(
        [tracker.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}' and attributes.status = 'RUNNING'",
    )
    for r in runs:
        tracker.set_tags(r.info.run_id, {"failure_kind": "crash"})  # a resume continues it (lowprec_lab/runner/run.py)
        tracker.end_run(r.info.run_id, "FAILED", "its worker process died during the run")
