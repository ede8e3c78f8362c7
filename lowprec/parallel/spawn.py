"""Run a function on N local processes joined in a ``torch.distributed`` process group (tests, benchmarks).

Production runs launch with torchrun (``lowprec_lab.plan.launch``); this helper exists so that tests and
benchmarks can start a real gloo group from inside one Python process and collect each rank's result.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, fn: Callable, world_size: int, init_file: str, out_dir: str, backend: str, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # Ranks share inductor's on-disk cache otherwise, which broke torchao's compiled optimizer step
    # (docs/architecture.md, "Platform facts").
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}
    )
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    result: Any
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
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes in one process group.

    ``fn`` must be a module-level function (it is pickled); its return values are read back with
    ``torch.load(weights_only=True)``, so they must be tensors, numbers, strings, ``None`` or lists, tuples and
    dicts of them (another type fails the call with ``UnpicklingError``). Returns the
    results ordered by rank. Raises ``RuntimeError`` carrying the first failing rank's traceback.
    """
    with tempfile.TemporaryDirectory(prefix="lowprec-ranks-") as tmp:
        init_file = str(Path(tmp) / "init")
        ctx = mp.start_processes(
            _worker,
            args=(fn, world_size, init_file, tmp, backend, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
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
