"""Launching under torchrun: a ``lowprec train/ablate`` call with a parallel layout re-executes itself as
``torchrun --standalone --nproc_per_node=N -m experiments ...`` on one machine. Multi-node runs call
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


def torchrun_command(nproc: int, argv: list[str], module: str = "experiments") -> list[str]:
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


def spawn_torchrun(
    nproc: int, argv: list[str], module: str = "experiments", extra: tuple[int, ...] = (), once: bool = False
) -> int:
    """Run ``torchrun_command`` in the foreground; returns its exit code (non-zero if any rank failed).

    ``OMP_NUM_THREADS`` is left to torchrun (1 per rank unless set); CPU ranks share the machine's cores.
    A stop signal (``STOP_SIGNALS``) to this process goes on to torchrun; ``extra`` signals go on as SIGTERM
    (torchrun forwards SIGTERM to its ranks; e.g. SLURM's SIGUSR2 would end torchrun itself); ``once``: only the
    first signal goes on (a submitit job: its controller repeats SIGTERM, and a second one interrupts torchrun's
    own shutdown, which then kills the ranks before their checkpoint).
    """
    env = dict(os.environ)
    # Ranks must not share inductor's on-disk cache (torchao's compiled optimizer step crashed when they did).
    env.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    env.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    proc = subprocess.Popen(torchrun_command(nproc, argv, module), env=env)
    sent: list[int] = []

    def forward(signum, frame) -> None:
        if once and sent:
            return
        sent.append(signum)
        proc.send_signal(signum if signum in STOP_SIGNALS else signal.SIGTERM)

    # A signal to this process goes on to torchrun, which forwards it to every rank (lowprec.train.stop); without
    # this, a SIGTERM would end this process alone and leave torchrun and the ranks running.
    previous = {s: signal.signal(s, forward) for s in (*STOP_SIGNALS, *extra)}
    try:
        return proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
