"""Launching under torchrun: a ``lowprec train/ablate`` call with a parallel layout re-executes itself as
``torchrun --standalone --nproc_per_node=N -m lowprec_lab ...`` on one machine. Multi-node runs call
torchrun (or srun + torchrun) themselves with the same arguments; see the README."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from lowprec.train.stop import STOP_SIGNALS


def under_torchrun() -> bool:
    """True inside a process started by torchrun (or any launcher that sets ``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_command(nproc: int, argv: list[str], module: str = "lowprec_lab") -> list[str]:
    """The single-machine torchrun command line that runs ``python -m <module> <argv>`` on ``nproc`` ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        module,
        *argv,
    ]


def torchrun_env() -> dict[str, str]:
    """This process's environment for torchrun and its ranks."""
    env = dict(os.environ)
    # Ranks must not share inductor's on-disk cache (torchao's compiled optimizer step crashed when they did).
    env.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    env.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    # torchrun's own default (1 thread per rank), set here so that it does not print its banner saying so.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def spawn_torchrun(nproc: int, argv: list[str]) -> int:
    """Run ``torchrun_command`` in the foreground; returns its exit code (non-zero if any rank failed).

    ``OMP_NUM_THREADS``: 1 per rank unless set (torchrun's default, ``torchrun_env``); CPU ranks share the
    machine's cores.
    """
    proc = subprocess.Popen(torchrun_command(nproc, argv), env=torchrun_env())
    # A signal to this process goes on to torchrun, which forwards it to every rank (lowprec.train.stop); without
    # this, a SIGTERM would end this process alone and leave torchrun and the ranks running.
    previous = {s: signal.signal(s, lambda signum, frame: proc.send_signal(signum)) for s in STOP_SIGNALS}
    try:
        return proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
