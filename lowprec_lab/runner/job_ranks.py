"""One run of an ablation on the ranks of a parallel layout, inside one submitit job (``launcher=slurm`` or
``submitit_local`` with k = dp_replicate x dp_shard x tp > 1).

The job (``lowprec_lab.runner.submitit_jobs.run_job``) writes its arguments to ``ranks_args.pkl`` in its own job
folder and starts ``torchrun --standalone --nproc_per_node=k -m lowprec_lab.runner.job_ranks <job folder>``
(``run_ranks``: the command line ``lowprec train/ablate`` launch on one node, with the job's own signal handling).
Each rank joins the process group, prepares the data (rank 0 first) and calls ``run_one`` as the ranks of a local
parallel ablation do: rank 0 alone talks to MLflow (``make_tracker``), so the run's metrics are logged once. Rank 0 then
writes the ``RunOutcome`` as JSON (``outcome.json``, plain data) in the job folder, which the job reads back and
returns to the ablation process as its result.

The arguments file is a pickle the same job wrote a moment before in its own folder (the ``Plan`` is a frozen
dataclass tree with no JSON form); it is read only from the folder named on the command line, and through an
allow-list (``load_args``: lowprec's, the lab's and the catalog's dataclasses and enums, torch dtypes, paths, sets),
so a job folder on a shared filesystem that someone altered cannot make the ranks run code. Before the unpickler
runs, ``lowprec.train.pickle_limits.check_pickle`` walks the file and refuses one that would build more than 16
objects and characters per byte (plus 1 Mi) or nest deeper than 64 (nested paths that re-join their arguments grow
a few hundred bytes into gigabytes); after it, the loaded object is type-checked (``load_args``).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

from lowprec.train.pickle_limits import PickleLimitError, check_pickle
from lowprec.train.stop import STOP_SIGNALS, install_stop_handlers, local_stop, request_stop
from lowprec_lab.runner.tracked_run import RunOutcome

#: The job's arguments for its ranks, in the job folder.
ARGS = "ranks_args.pkl"
#: Rank 0's ``RunOutcome``, as JSON, in the job folder.
OUTCOME = "outcome.json"
#: The stop signal the job received, in the job folder: a rank that was still starting then reads it.
STOP = "stop_signal"


def write_args(folder: Path, **kwargs) -> None:
    """Write ``kwargs`` (``plan``, ``recipe``, ``seed``, ``parent_id``, ``ablation_id``, ``continuation``,
    ``tags``, ``threads``) for the ranks to ``folder / ARGS``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ARGS).write_bytes(pickle.dumps(kwargs))


#: Globals a job's arguments may name besides the project's own dataclasses and enums.
_PLAIN = {("builtins", "set"), ("builtins", "frozenset"), ("pathlib", "PosixPath"), ("pathlib", "Path")}
_PROJECT = ("lowprec_lab.", "lowprec.")


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _PLAIN:
        return True
    if module == "torch":  # dtypes pickle as globals of the torch module
        import torch

        return isinstance(getattr(torch, name, None), torch.dtype)
    if module.startswith(_PROJECT) or module == "recipes":
        obj = getattr(importlib.import_module(module), name, None)
        return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
    return False


class _ArgsUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise pickle.UnpicklingError(
                f"{ARGS} refers to {module}.{name}, which a job's arguments never hold: refusing to load it"
            )
        return super().find_class(module, name)


def load_args(folder: Path) -> dict:
    """The arguments ``write_args`` wrote to ``folder / ARGS``, walked by ``check_pickle`` (caps on what it
    builds), unpickled through the allow-list above and type-checked (``check_args``). Raises
    ``pickle.UnpicklingError`` (one line) for a file over the caps, a global outside the allow-list (a file altered
    to run code), or arguments of the wrong types."""
    data = (folder / ARGS).read_bytes()
    try:
        check_pickle(data)
    except PickleLimitError as e:
        raise pickle.UnpicklingError(f"{ARGS} in {str(folder)!r} is refused: {e}") from None
    return check_args(_ArgsUnpickler(io.BytesIO(data)).load(), folder)


def check_args(args, folder: Path) -> dict:
    """``args`` when it is what ``write_args`` writes: a dict of the names ``write_args`` documents, with
    ``plan`` a ``Plan``, ``recipe`` a ``Recipe``, ``seed`` an int, ``parent_id`` and ``ablation_id`` a string or
    None, ``continuation`` a ``Continuation`` or None, ``tags`` a dict of strings or None, ``threads`` an int or
    None. Raises ``pickle.UnpicklingError`` (one line) naming the first item that is not."""
    from lowprec.recipe import Recipe
    from lowprec_lab.plan.plan import Plan
    from lowprec_lab.runner.continued_runs import Continuation

    def of(*types):
        return lambda v: isinstance(v, types) and not isinstance(v, bool)

    def optional(check):
        return lambda v: v is None or check(v)

    def strings(v):
        return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())

    checks = {
        "plan": of(Plan),
        "recipe": of(Recipe),
        "seed": of(int),
        "parent_id": optional(of(str)),
        "ablation_id": optional(of(str)),
        "continuation": optional(of(Continuation)),
        "tags": optional(strings),
        "threads": optional(of(int)),
    }
    if not isinstance(args, dict):
        raise pickle.UnpicklingError(
            f"{ARGS} in {str(folder)!r} holds a {type(args).__name__}, not the job's arguments"
        )
    for key in sorted(args.keys() - checks.keys()):
        raise pickle.UnpicklingError(f"{ARGS} in {str(folder)!r} holds {key!r}, which a job's arguments never hold")
    for key in ("plan", "recipe", "seed"):
        if key not in args:
            raise pickle.UnpicklingError(f"{ARGS} in {str(folder)!r} has no {key!r}")
    for key, value in args.items():
        if not checks[key](value):
            raise pickle.UnpicklingError(
                f"{ARGS} in {str(folder)!r}: {key!r} is a {type(value).__name__}, which a job's {key} never is"
            )
    return {k: args.get(k) for k in checks}


def write_outcome(path: Path, outcome: RunOutcome) -> None:
    """``outcome`` as JSON at ``path`` (written to a temporary name, then renamed: never read half written)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(outcome)))
    os.replace(tmp, path)


def read_outcome(path: Path) -> RunOutcome | None:
    """The ``RunOutcome`` rank 0 wrote at ``path``; None when there is none (the ranks died before the end)."""
    if not path.exists():
        return None
    return RunOutcome(**json.loads(path.read_text()))


#: Signals the job passes on to its ranks: the stop signals and SLURM's time-limit warning (SIGUSR2).
RANK_SIGNALS = (*STOP_SIGNALS, signal.SIGUSR2)


def _ignore_rank_signals() -> None:  # in torchrun's process, before exec: the ignored dispositions survive exec
    for s in RANK_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def run_ranks(k: int, folder: Path) -> int:
    """``torchrun --standalone --nproc_per_node=k -m lowprec_lab.runner.job_ranks <folder>`` in the foreground
    (``lowprec_lab.plan.launch``'s command line and environment); returns torchrun's exit code.

    Signals: torchrun itself ignores ``RANK_SIGNALS`` (it would end its ranks 30 s after a SIGTERM, before a long
    checkpoint, and a second SIGTERM, which SLURM sends to every process of the job's step while this process
    passes its own on, interrupts that shutdown); this process passes each one it receives to the ranks (torchrun's
    children, ``psutil``), whose handlers stop the run after its step with a checkpoint (``lowprec.train.stop``),
    and torchrun exits when they do."""
    import psutil

    from lowprec_lab.plan.launch import torchrun_command, torchrun_env

    (folder / STOP).unlink(missing_ok=True)  # a requeued job's earlier stop is not this one's
    env = torchrun_env()
    env["PET_SIGNALS_TO_HANDLE"] = "SIGHUP,SIGQUIT"  # torchrun's --signals_to_handle: not the ranks' signals
    proc = subprocess.Popen(
        torchrun_command(k, [str(folder)], module="lowprec_lab.runner.job_ranks"),
        env=env,
        preexec_fn=_ignore_rank_signals,
    )

    def to_ranks(signum, frame) -> None:
        request_stop(signum)
        # first the file: a rank still starting (its handlers not installed, the signal ignored) reads it after
        (folder / STOP).write_text(str(local_stop()))
        try:
            ranks = psutil.Process(proc.pid).children()
        except psutil.NoSuchProcess:  # torchrun has ended
            return
        for rank in ranks:
            try:
                rank.send_signal(signum)
            except psutil.NoSuchProcess:
                pass

    previous = {s: signal.signal(s, to_ranks) for s in RANK_SIGNALS}
    try:
        return proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _stop_on(signum, frame) -> None:
    request_stop(signum)


def main(argv: list[str]) -> int:
    """A rank's work (module docstring); ``argv``: the job folder. Returns 0 (a run's own failure is in its
    outcome, FAILED; only a crash of this process leaves no ``outcome.json``)."""
    install_stop_handlers()  # the job's stop signals (run_ranks): stop after the step, with a checkpoint
    signal.signal(signal.SIGUSR2, _stop_on)  # SLURM's time-limit warning
    import torch
    import torch.distributed as dist

    from lowprec.parallel.runtime import is_rank0
    from lowprec_lab.runner.session import RunSession
    from lowprec_lab.runtime.startup import start_parallel

    folder = Path(argv[0])
    if (folder / STOP).exists():  # the job was asked to stop before these handlers were in place
        request_stop(int((folder / STOP).read_text()))
    a = load_args(folder)
    plan, recipe, seed = a["plan"], a["recipe"], a["seed"]
    if a["threads"]:
        torch.set_num_threads(max(1, a["threads"] // plan.parallel.world_size))
    start_parallel(plan.parallel, plan.device)
    session = RunSession.start(plan)  # rank 0 talks to MLflow
    # a stop is the run's KILLED outcome (recorded by rank 0): a result, so the ablation sees it
    outcome = session.run(recipe, seed, a["continuation"], a["parent_id"], a["ablation_id"], extra_tags=a["tags"])
    if is_rank0():
        write_outcome(folder / OUTCOME, outcome)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
