"""Run a function on N local processes joined in a ``torch.distributed`` process group (tests, benchmarks).

Production runs launch with torchrun (``lowprec_lab.plan.launch``); this helper exists so that tests and
benchmarks can start a real gloo group from inside one Python process and collect each rank's result.

The ranks are forked from a multiprocessing forkserver that has already imported torch (``forkserver_context``):
a spawned rank spent about 5 s of CPU importing torch and the library before its first line of work, once per rank
and per call. The forkserver is started once per process and serves every later call.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from multiprocessing import forkserver, resource_tracker
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: The signals the forkserver starts with blocked: the stop signals of ``lowprec.train.stop.STOP_SIGNALS``, named
#: here because this package sits below ``lowprec.train`` (tests/unit/test_forkserver_starts.py keeps them equal).
SERVER_BLOCKED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

#: What the forkserver imports before it forks a process (``forkserver_context``): torch and the library's
#: training stack, which every rank of the tests and benchmarks imports. Imported there with no op run, so no
#: thread of torch's exists yet when a rank is forked.
_PRELOAD = ["torch", "torch.distributed", "lowprec.parallel.spawn", "lowprec.train.build", "lowprec.train.loop"]


def add_forkserver_preload(*modules: str) -> None:
    """Have the forkserver also import ``modules`` (dotted names) before it forks a process. Takes effect only for
    a forkserver not yet started in this process (the first ``forkserver_context`` user starts it); a module
    missing there is skipped by multiprocessing, and the process that needs it imports it itself."""
    for m in modules:
        if m not in _PRELOAD:
            _PRELOAD.append(m)


def forkserver_context() -> multiprocessing.context.ForkServerContext:
    """The ``forkserver`` multiprocessing context, its server running (started now if it is not, importing
    ``_PRELOAD``: ``add_forkserver_preload``).

    A process this context starts is forked from the server: it inherits the server's environment, signal mask
    and handlers from the server's own start, not this process's at the time of the call. multiprocessing sends
    the working directory, ``sys.path`` and ``sys.argv`` with each process; the caller must send the rest it needs
    (``parent_state`` / ``apply_parent_state``). The server starts with the stop signals blocked
    (``SERVER_BLOCKED``: ``lowprec.train.stop.STOP_SIGNALS``): a stop sent to the process group does not end it, and
    a process forked from it holds a stop that arrives before it has set its own mask (pending, not fatal)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    if hasattr(signal, "pthread_sigmask"):
        # Started first: its start unblocks SIGINT and SIGTERM in this thread (bpo-33613), which would undo the
        # block below; once running, ``forkserver.ensure_running`` finds it so.
        resource_tracker.ensure_running()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, SERVER_BLOCKED)
        try:
            forkserver.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return ctx


def parent_state() -> tuple[dict[str, str], set[int] | None]:
    """This process's environment and this thread's signal mask (``None`` where there are no signal masks), for
    ``apply_parent_state`` in a process started from the forkserver."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, []) if hasattr(signal, "pthread_sigmask") else None
    return dict(os.environ), mask


def apply_parent_state(state: tuple[dict[str, str], set[int] | None]) -> None:
    """Make ``state`` (``parent_state`` of the starting process) this process's environment and signal mask: what
    a spawned process would have started with. Call it first, before anything reads the environment."""
    env, mask = state
    os.environ.clear()
    os.environ.update(env)
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _worker(
    rank: int, fn: Callable, state: tuple, world_size: int, init_file: str, out_dir: str, backend: str, args: tuple
) -> None:
    apply_parent_state(state)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # Ranks share inductor's on-disk cache otherwise, which broke torchao's compiled optimizer step
    # (docs/architecture.md, "Platform facts").
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}
    )
    result: Any
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = ("ok", fn(rank, world_size, *args))
    except BaseException as e:  # handed back to the parent, which re-raises with the rank's traceback
        result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    try:
        if result[0] == "ok":
            dist.barrier()
    finally:
        dist.destroy_process_group()
        # The result is on disk; skip interpreter teardown, where background C++ threads (gloo, inductor
        # workers) occasionally abort the process ("terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout_s: float = 600
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes in one process group.

    ``fn`` must be a module-level function (it is pickled); its return values are read back with
    ``torch.load(weights_only=True)``, so they must be tensors, numbers, strings, ``None`` or lists, tuples and
    dicts of them (another type fails the call with ``UnpicklingError``). Returns the
    results ordered by rank. Raises ``RuntimeError`` carrying the first failing rank's traceback.

    The ranks are forked from this process's forkserver (``forkserver_context``), which imported torch once, instead
    of spawned. Each rank starts as a spawned one would: with this process's environment and this thread's signal
    mask as they are at the call (sent with it; the forkserver's own are those of its start), applied first thing.
    ``fn`` and ``args`` arrive through multiprocessing's own pickling from this process (no bytes from anywhere
    else), so a module they import is imported before that environment is applied; the preloaded ones already
    are. Then each sets ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, one intra-op thread and no shared inductor cache.
    """
    with tempfile.TemporaryDirectory(prefix="lowprec-ranks-") as tmp:
        init_file = str(Path(tmp) / "init")
        forkserver_context()  # the forkserver that start_processes uses: running, with its preload
        ctx = mp.start_processes(
            _worker,
            args=(fn, parent_state(), world_size, init_file, tmp, backend, args),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        try:
            while not ctx.join(timeout=timeout_s):
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            _collect(tmp, world_size, strict=False)  # raises the failing rank's own error when it wrote one
            raise RuntimeError(str(e)) from None
        results = _collect(tmp, world_size, strict=True)
    return results


def _collect(tmp: str, world_size: int, strict: bool) -> list[Any]:
    out = []
    for r in range(world_size):
        p = Path(tmp) / f"rank{r}.pt"
        if not p.exists():
            if strict:
                raise RuntimeError(f"rank {r} wrote no result")
            continue
        # Each rank of this call wrote it into the call's own TemporaryDirectory (mode 0700, removed on return);
        # read as data all the same (weights_only: tensors, containers, numbers and strings), never as code.
        status, value = torch.load(p, weights_only=True)
        if status == "error":
            raise RuntimeError(value)
        out.append(value)
    return out
