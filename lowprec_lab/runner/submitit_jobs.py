"""An ablation's runs as submitit jobs (``launcher=slurm`` or ``launcher=submitit_local``).

Each (recipe, seed) is one job: ``run_job`` (module level, so submitit pickles it by reference) receives the
``Plan`` as it is, prepares the data from the cache, makes its own MLflow client on the ablation's store and calls
``lowprec_lab.runner.run.run_one`` under the ablation's parent run, exactly as a worker process does
(``lowprec_lab.runner.scheduler``). With a parallel layout (k > 1 ranks) the job starts torchrun with the k ranks
on its node instead, each calling ``run_one`` (rank 0 logging), and returns rank 0's outcome
(``lowprec_lab.runner.job_ranks``). The job's id is a tag of its run (``slurm_job_id`` on SLURM,
``submitit_job_id`` with the local executor) from the moment the run starts or reopens.

The ablation process (``run_submitit``) submits the jobs (all at once on SLURM, where the cluster queues them;
``workers`` at a time with submitit's ``LocalExecutor``, which starts each job at once), polls them every
``launcher.poll_s`` and collects each one's ``RunOutcome`` from the JSON the job wrote in its folder
(``outcome.json``, or ``error.json`` for a job that raised), never from submitit's result pickle: the ablation
process unpickles nothing from the job folder (it asks submitit only for a job's state: ``sacct`` on SLURM, the
process locally, and whether the result pickle exists). The job folder is created 0700 and checked (a folder of
this user's, writable by no one else) before anything is read from it (``check_job_folder``). A job that ends
without a result (SLURM cancelled it, its time ran out, its node failed, it ran out of memory; locally: its process was
killed) leaves its run RUNNING: the ablation finds that run by parent, recipe and seed and ends it KILLED
(``CANCELLED``, ``TIMEOUT``, ``PREEMPTED``, a local interrupt: a stop from outside) or FAILED with
``failure_kind=crash`` (anything else), the reason naming the job and SLURM's state (``sacct``'s, as submitit reads
it). Either way ``resume=<ablation id>`` continues it from its newest checkpoint; the other runs go on and the
report is written.

Signals. In the job, SIGTERM/SIGINT/SIGUSR1 stop the run after its step with a checkpoint (``lowprec.train.stop``),
as on this machine, and so does SIGUSR2: submitit asks SLURM for it 90 s before the time limit (``--signal``), and
submitit's own handler would raise in the middle of a step. A stop signal to the ablation process stops every job:
locally SIGTERM to the job's controller, which forwards it to the job's process (sent again every few seconds, for
a job still importing when the first came); on SLURM ``scancel`` (SIGTERM to the job's step, SIGKILL after the
cluster's ``KillWait``; a job still pending never starts). The ablation then waits for the jobs, records what they
return and raises ``StopSignal`` like the local path, so ``resume=`` continues the runs stopped.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from lowprec.errors import ConfigError
from lowprec.recipe import Recipe
from lowprec.train.stop import install_stop_handlers, local_stop, request_stop
from lowprec_lab.plan.launcher import check_one_line, check_private_folder
from lowprec_lab.plan.placement import Slot, physical_ids
from lowprec_lab.plan.plan import Plan
from lowprec_lab.plan.preflight import cores
from lowprec_lab.runner import job_ranks
from lowprec_lab.runner.continued_runs import Continuation
from lowprec_lab.runner.executors import Launch, schedule
from lowprec_lab.runner.session import RunSession
from lowprec_lab.runner.tracked_run import RunOutcome
from lowprec_lab.tracking.tracker import PARENT_TAG

Job = tuple[Recipe, int]
"""(recipe, seed) of one run."""

#: SLURM job states (``sacct``) of a job ended from outside: its run is recorded KILLED (resume continues it);
#: ``INTERRUPTED`` is submitit's local executor's (its controller ended by a signal). Any other state without a
#: result (``OUT_OF_MEMORY``, ``NODE_FAIL``, ``FAILED``, a local process killed) is FAILED, ``failure_kind=crash``.
KILLED_STATES = ("CANCELLED", "TIMEOUT", "PREEMPTED", "DEADLINE", "INTERRUPTED")

#: The job's own outcome, as JSON, in its folder (``run_job`` writes it; the ranks of a parallel layout do).
OUTCOME = job_ranks.OUTCOME
#: What ``run_job`` raised (``{"error": "<type>: <message>"}``), in the job folder, for a job that returned nothing.
ERROR = "error.json"
#: The most bytes read of either file: an outcome is a few KiB.
MAX_JSON_BYTES = 1 << 20

#: Seconds between two SIGTERMs to a local job while the ablation stops (one that arrives while the job still
#: imports meets submitit's own handler, which ignores it).
RESEND_S = 2.0


# --- in the job -----------------------------------------------------------------------------------------------


def _stop_on(signum, frame) -> None:
    request_stop(signum)


def run_job(
    plan: Plan,
    recipe: Recipe,
    seed: int,
    parent_id: str,
    ablation_id: str,
    continuation: Continuation | None = None,
    threads: int | None = None,
) -> RunOutcome:
    """One run of an ablation, in a submitit job: ``run_one`` of ``recipe`` and ``seed`` under ``parent_id``,
    continuing ``continuation`` when given; ``threads``: torch's intra-op threads (None: torch's default, the CPUs
    SLURM gave the job). Returns the ``RunOutcome`` (KILLED for a run stopped by a signal, with its reason; a run
    never started when the stop came first has no run id), and writes it as JSON to ``OUTCOME`` in the job's
    folder, which is what the ablation reads (submitit's pickle of the return value is never read back). An
    exception is written to ``ERROR`` (its type and first line), then raised."""
    import submitit

    folder = Path(submitit.JobEnvironment().paths.folder)
    for name in (OUTCOME, ERROR):  # a requeued job's earlier files are not this one's
        (folder / name).unlink(missing_ok=True)
    try:
        outcome = _run_job(plan, recipe, seed, parent_id, ablation_id, continuation, threads)
    except Exception as e:
        lines = [line for line in str(e).splitlines() if line.strip()]
        text = f"{type(e).__name__}: {lines[0] if lines else 'no message'}"
        _write_json(folder / ERROR, {"error": text})
        raise
    job_ranks.write_outcome(folder / OUTCOME, outcome)
    return outcome


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)  # never read half written


def _run_job(plan, recipe, seed, parent_id, ablation_id, continuation, threads) -> RunOutcome:
    """``run_job``'s run, its outcome returned."""
    install_stop_handlers()
    signal.signal(signal.SIGUSR2, _stop_on)  # SLURM's time-limit warning: stop after the step, with a checkpoint
    import submitit
    import torch

    spec = plan.launcher
    env = submitit.JobEnvironment()
    tags = {"launcher": spec.name, spec.job_id_tag: str(env.job_id)}
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        tags["gpus"] = os.environ["CUDA_VISIBLE_DEVICES"]
    if plan.parallel.world_size > 1:
        return _run_on_ranks(plan, recipe, seed, parent_id, ablation_id, continuation, threads, tags, env)
    if threads:
        torch.set_num_threads(threads)
    session = RunSession.start(plan)
    if local_stop():
        return RunOutcome("", recipe.name, seed, "KILLED", reason=f"not started: stopped by signal {local_stop()}")
    # a stop is the run's KILLED outcome: a result, so the ablation sees it
    return session.run(recipe, seed, continuation, parent_id, ablation_id, extra_tags=tags)


def _run_on_ranks(plan, recipe, seed, parent_id, ablation_id, continuation, threads, tags, env) -> RunOutcome:
    """``run_job`` of a parallel layout: ``torchrun`` with the layout's k ranks on this node, each running
    ``lowprec_lab.runner.job_ranks`` (``run_one`` on every rank, rank 0 logging), and rank 0's outcome read back.
    A stop signal (or SLURM's SIGUSR2) goes on to the ranks (``job_ranks.run_ranks``). Raises
    ``RuntimeError`` naming torchrun's exit code when the ranks left no outcome (the ablation records the run
    FAILED, ``failure_kind=crash``)."""
    folder = Path(env.paths.folder)
    job_ranks.write_args(
        folder,
        plan=plan,
        recipe=recipe,
        seed=seed,
        parent_id=parent_id,
        ablation_id=ablation_id,
        continuation=continuation,
        tags=tags,
        threads=threads,
    )
    if local_stop():
        return RunOutcome("", recipe.name, seed, "KILLED", reason=f"not started: stopped by signal {local_stop()}")
    k = plan.parallel.world_size
    rc = job_ranks.run_ranks(k, folder)
    outcome = job_ranks.read_outcome(folder / OUTCOME)
    if outcome is None:
        raise RuntimeError(f"torchrun with {k} ranks exited {rc} without an outcome (see the job's log)")
    return outcome


# --- in the ablation process ----------------------------------------------------------------------------------


def job_folder(plan: Plan, ablation_id: str) -> Path:
    """submitit's folder for the ablation's jobs (pickles, logs): ``launcher.folder`` or
    ``<paths.runs>/submitit/<ablation id>``; each job writes in its own ``<job id>`` subfolder."""
    spec = plan.launcher
    return Path(spec.folder) if spec.folder else Path(plan.paths.runs) / "submitit" / ablation_id


def prepare_job_folder(folder: Path) -> None:
    """Create the ablation's job folder ``folder`` with mode 0700 (only this user can read or change what the jobs
    leave there: submitit's pickles, the outcome files, the logs), or check the one that exists
    (``check_job_folder``). Raises ``ConfigError`` (one line) for a path with a newline or control character (it
    goes into the sbatch script) or a folder that fails the check."""
    check_one_line("the job folder", str(folder))
    if not folder.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile: checked below like any folder found there
            pass
        else:
            os.chmod(folder, 0o700)  # mkdir's mode passes through the umask; 0700 needs no bit it could clear
    check_job_folder(folder)


def check_job_folder(folder: Path, job_id: str | None = None) -> None:
    """Refuse (``ConfigError``, one line) a job folder another user could have written: ``folder`` (the
    ablation's, followed if it is a link the user made) must be a folder owned by this user that neither group
    nor others may write (``check_private_folder``); with ``job_id``, so must its ``<job id>`` subfolder, which
    must not be a link. Called before anything is read from the folder."""
    check_private_folder(folder)
    if job_id is not None:
        check_private_folder(folder / job_id, follow=False)


def _read_json(path: Path) -> dict | None:
    """The JSON object of ``path`` (a regular file, opened without following a link, at most ``MAX_JSON_BYTES``);
    None when there is no such file. Raises ``ValueError`` for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"{path.name} cannot be opened ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(f"{path.name} is larger than {MAX_JSON_BYTES} bytes")
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError(f"{path.name} is not JSON") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return obj


#: ``RunOutcome``'s fields and the JSON types each may hold.
_OUTCOME_TYPES = {
    "run_id": (str,),
    "recipe": (str,),
    "seed": (int,),
    "status": (str,),
    "reason": (str,),
    "summary": (dict, type(None)),
    "traceback": (str, type(None)),
}


def read_job_outcome(folder: Path, recipe: str, seed: int) -> RunOutcome | str | None:
    """What the job of ``recipe`` and ``seed`` left in its ``folder``, read as JSON only: its ``RunOutcome``
    (``OUTCOME``), else the one line of what it raised (``ERROR``), else None (it wrote neither). Raises
    ``ValueError`` (one line) for a file that is not what a job writes: not a regular file, too large, not JSON,
    fields of other names or types, another run's recipe or seed."""
    rec = _read_json(folder / OUTCOME)
    if rec is not None:
        if set(rec) - set(_OUTCOME_TYPES) or not {"run_id", "recipe", "seed", "status"} <= set(rec):
            raise ValueError(f"{OUTCOME} holds the fields {sorted(rec)[:10]}, not a run's outcome")
        for key, value in rec.items():
            if not isinstance(value, _OUTCOME_TYPES[key]) or (key == "seed" and isinstance(value, bool)):
                raise ValueError(f"{OUTCOME}: {key} is a {type(value).__name__}, not a run's outcome")
        if (rec["recipe"], rec["seed"]) != (recipe, seed):
            raise ValueError(f"{OUTCOME} is the outcome of {rec['recipe'][:60]!r} seed {rec['seed']}, not this job's")
        return RunOutcome(**rec)
    err = _read_json(folder / ERROR)
    if err is not None:
        if not isinstance(err.get("error"), str):
            raise ValueError(f"{ERROR} holds no error message")
        lines = err["error"].splitlines() or ["no message"]
        return lines[0][:500]
    return None


def job_gpus(plan: Plan) -> int:
    """GPUs each job asks for: none for ``device=cpu`` (or a local job on a machine without CUDA), else the run's
    layout (one per rank; ``device=auto`` on SLURM asks for them, the login node need not have any)."""
    local_cpu = plan.launcher.local_jobs and plan.placement.device_type != "cuda"
    return 0 if plan.device == "cpu" or local_cpu else plan.parallel.world_size


def make_executor(plan: Plan, folder: Path):
    """The submitit executor of ``plan.launcher``: SLURM (``AutoExecutor(cluster="slurm")`` with the launcher's
    sbatch options) or ``LocalExecutor``. Each job: one node, one task, ``launcher.time`` minutes."""
    import submitit

    spec = plan.launcher
    if spec.cluster:
        ex = submitit.AutoExecutor(folder=folder / "%j", cluster="slurm")
        opts = {
            "slurm_partition": spec.partition,
            "cpus_per_task": spec.cpus_per_task,
            "mem_gb": spec.mem_gb,
            "slurm_account": spec.account,
            "slurm_qos": spec.qos,
            "slurm_constraint": spec.constraint,
            "slurm_setup": list(spec.setup) or None,
        }
        ex.update_parameters(
            timeout_min=spec.time,
            nodes=1,
            tasks_per_node=1,
            gpus_per_node=job_gpus(plan),
            **{k: v for k, v in opts.items() if v is not None},
        )
        return ex
    ex = submitit.LocalExecutor(folder=folder / "%j")
    ex.update_parameters(timeout_min=spec.time, **({"setup": list(spec.setup)} if spec.setup else {}))
    return ex


def _slots(plan: Plan, cap: int) -> list[Slot]:
    """The slots local jobs run in (a GPU slot's GPUs become the job's ``CUDA_VISIBLE_DEVICES``); on SLURM, ``cap``
    slots without GPUs (the cluster places the jobs)."""
    if plan.launcher.local_jobs and plan.placement.device_type == "cuda":
        return list(plan.placement.slots)[:cap]
    return [Slot(i) for i in range(cap)]


def _submit(executor, plan: Plan, slot: Slot, job: Job, parent_id, ablation_id, cont, threads):
    recipe, seed = job
    if plan.launcher.local_jobs:
        ids = physical_ids(slot.gpus, os.environ.get("CUDA_VISIBLE_DEVICES")) if slot.gpus else ""
        gpus = [int(g) for g in ids.split(",")] if ids else []
        executor.update_parameters(gpus_per_node=len(gpus), visible_gpus=gpus)
    else:
        executor.update_parameters(name=f"lowprec-{ablation_id}-{recipe.name}-s{seed}")
    job = executor.submit(run_job, plan, recipe, seed, parent_id, ablation_id, cont, threads)
    try:  # made by submitit in this process through the umask: owner only, as its parent
        os.chmod(job.paths.folder, 0o700)
    except OSError:  # a job array's folder, or one the job has not made yet: check_job_folder judges it later
        pass
    return job


def _stop_job(plan: Plan, job) -> None:
    """Ask ``job`` to stop: locally SIGTERM to its controller (which forwards it to the job's process), on SLURM
    ``scancel`` (SIGTERM, then SIGKILL after the cluster's KillWait; a pending job never starts)."""
    if plan.launcher.local_jobs:
        try:
            os.kill(int(job.job_id), signal.SIGTERM)  # a local job's id is its controller's pid
        except ProcessLookupError:  # it ended meanwhile
            pass
    else:
        job.cancel(check=False)


def _close_run(tracker, parent_id: str, recipe: str, seed: int, status: str, reason: str, tags: dict) -> str:
    """End ``status`` with ``reason`` the run of ``recipe`` and ``seed`` under ``parent_id`` that its job left
    RUNNING; returns its id ("" when the job never started one)."""
    runs = tracker.client.search_runs(
        [tracker.experiment_id],
        filter_string=(
            f"tags.`{PARENT_TAG}` = '{parent_id}' and tags.recipe = '{recipe}' and tags.seed = '{seed}' "
            "and attributes.status = 'RUNNING'"
        ),
    )
    for r in runs:
        tracker.set_tags(r.info.run_id, tags | ({"failure_kind": "crash"} if status == "FAILED" else {}))
        tracker.end_run(r.info.run_id, status, reason)
    return runs[0].info.run_id if runs else ""


def outcome_of(plan: Plan, job, recipe: str, seed: int, tracker, parent_id: str) -> RunOutcome:
    """The ``RunOutcome`` of a finished ``job``, read from the JSON it left in its folder (``read_job_outcome``,
    after ``check_job_folder``; submitit's result pickle is never read). When it left none (killed, cancelled,
    timed out, out of memory, its node failed), raised, or its folder or files fail the checks, its run, if it
    started one and left it RUNNING, is ended KILLED or FAILED (``KILLED_STATES``) with the reason."""
    name = plan.launcher.name
    folder = Path(job.paths.folder)
    try:
        check_job_folder(folder.parent, folder.name)
        found = read_job_outcome(folder, recipe, seed)
        if found is None and plan.launcher.cluster and (job.paths.result_pickle.exists() or _completed(job)):
            deadline = time.monotonic() + job._results_timeout_s  # a network filesystem may show it late
            while found is None and time.monotonic() < deadline:
                time.sleep(1)
                found = read_job_outcome(folder, recipe, seed)
    except (ConfigError, ValueError) as e:
        reason = f"{name} job {job.job_id}: its outcome was not read: {e}"
        run_id = _close_run(tracker, parent_id, recipe, seed, "FAILED", reason, {"job_state": str(job.state)})
        return RunOutcome(run_id, recipe, seed, "FAILED", reason=reason)
    if isinstance(found, RunOutcome):
        return found
    if isinstance(found, str):  # run_job itself raised (run_one records a run's own failures)
        reason = f"{name} job {job.job_id} raised: {found}"
        run_id = _close_run(tracker, parent_id, recipe, seed, "FAILED", reason, {"job_state": "FAILED"})
        return RunOutcome(run_id, recipe, seed, "FAILED", reason=reason)
    state = str(job.state)
    status = "KILLED" if state.upper().startswith(KILLED_STATES) else "FAILED"
    if plan.launcher.cluster:
        reason = f"SLURM job {job.job_id} ended {state} without a result"
    elif status == "KILLED":
        reason = f"{name} job {job.job_id} was interrupted ({state}) before it returned a result"
    else:
        reason = f"{name} job {job.job_id}: its process ended without a result (killed by a signal?)"
    reason += f"; log: {job.paths.stderr}"
    run_id = _close_run(tracker, parent_id, recipe, seed, status, reason, {"job_state": state})
    return RunOutcome(run_id, recipe, seed, status, reason=reason)


def _completed(job) -> bool:
    return str(job.state).upper().startswith("COMPLETED")


class SubmititExecutor:
    """One submitit job per run (module docstring); ``SlurmExecutor`` and ``SubmititLocalExecutor`` are its two
    registered launchers (``lowprec_lab.runner.executors``). A job that cannot be submitted is a FAILED run not
    started; a job's outcome is read from its folder's JSON only (``outcome_of``)."""

    no_slot_reason = "not started: no slot"

    def __init__(self, launch: Launch):
        self.launch = launch
        self.plan = launch.plan
        self.executor = None
        self.threads: int | None = None
        self.jobs: dict[object, tuple[Job, Slot]] = {}
        self.last_stop: float | None = None

    @classmethod
    def create(cls, launch: Launch, n_jobs: int):
        """At most ``launcher.max_running`` jobs in flight (default: every job on a cluster, ``workers`` here)."""
        plan = launch.plan
        spec = plan.launcher
        cap = max(1, min(n_jobs, spec.max_running or (n_jobs if spec.cluster else plan.workers)))
        return cls(launch), _slots(plan, cap)

    def open(self, slots: list[Slot]) -> None:
        folder = job_folder(self.plan, self.launch.ablation_id)
        prepare_job_folder(folder)
        self.executor = make_executor(self.plan, folder)
        self.threads = None if self.plan.launcher.cluster else max(1, cores() // len(slots))

    def start(self, slot: Slot, job: Job):
        recipe, seed = job
        ln = self.launch
        c = ln.continuations.get((recipe.name, seed))
        try:
            handle = _submit(self.executor, self.plan, slot, job, ln.parent_id, ln.ablation_id, c, self.threads)
        except Exception as e:  # sbatch refused it (a bad partition, account, limit): this run only
            return RunOutcome("", recipe.name, seed, "FAILED", reason=f"not submitted: {type(e).__name__}: {e}")
        self.jobs[handle] = (job, slot)
        return handle

    def poll(self, handles: list) -> list:
        out = []
        for job in handles:
            if job.done():
                (recipe, seed), _slot = self.jobs.pop(job)
                out.append(
                    (job, outcome_of(self.plan, job, recipe.name, seed, self.launch.tracker, self.launch.parent_id))
                )
        if len(out) < len(handles):
            time.sleep(self.plan.launcher.poll_s)
        return out

    def release(self, slot: Slot) -> bool:
        return True

    def stop(self, handles: list) -> None:
        now = time.monotonic()
        if self.last_stop is None or (not self.plan.launcher.cluster and now - self.last_stop > RESEND_S):
            for job in handles:
                _stop_job(self.plan, job)
            self.last_stop = now

    def interrupt(self, handles: list) -> None:
        for job in handles:
            job.cancel(check=False)

    def close(self, results: dict) -> None:
        pass

    def started(self, outcome: RunOutcome) -> bool:
        return bool(outcome.run_id)  # a job stopped before its run began returns an outcome without a run


class SlurmExecutor(SubmititExecutor):
    """``launcher=slurm``: each run a SLURM job (``sbatch`` through submitit), all submitted at once by default."""


class SubmititLocalExecutor(SubmititExecutor):
    """``launcher=submitit_local``: each run a process of this machine through submitit's ``LocalExecutor``."""


def run_submitit(
    plan: Plan,
    jobs: Sequence[Job],
    tracker,
    parent_id: str,
    ablation_id: str,
    on_done: Callable[[RunOutcome], None] = lambda o: None,
    continuations: dict[tuple[str, int], Continuation] | None = None,
) -> list[RunOutcome]:
    """Train every (recipe, seed) of ``jobs`` as one submitit job each (``plan.launcher``), under the parent run
    ``parent_id`` (``schedule`` with the launcher's ``SubmititExecutor``); ``on_done`` sees each outcome as it
    lands; a job in ``continuations`` continues that interrupted run in place. Returns the outcomes in the order of
    ``jobs``.

    At most ``launcher.max_running`` jobs are in flight (default: all of them on SLURM, ``workers`` locally). A job
    that cannot be submitted (sbatch refused it) is a FAILED run not started; the others go on. A stop signal to
    this process stops every job in flight (module docstring), submits no other, and raises ``StopSignal`` once the
    jobs have ended; ``KeyboardInterrupt`` cancels them and propagates."""
    from lowprec_lab.runner.executors import executor_class

    launch = Launch(plan, tracker, parent_id, ablation_id, None, continuations or {})
    executor, slots = executor_class(plan.launcher.name).create(launch, len(jobs))
    return schedule(jobs, executor, slots, on_done)
