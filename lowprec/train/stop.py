"""Stopping a run on a signal: SIGTERM, SIGINT and SIGUSR1 (SLURM's pre-emption warning with ``--signal``).

A cluster pre-empts a job with SIGTERM (or the signal ``sbatch --signal`` names) and kills it a grace period later.
The handlers here only record the request; the loop reads it after each optimizer step (``stop_requested``), so the
step in flight finishes, a checkpoint can be written, and the run raises ``StopSignal`` for the tracking code to
mark it KILLED with the step it reached. A second SIGINT (Ctrl-C twice) raises ``KeyboardInterrupt`` at once.

Under torchrun every rank receives the signal (torchrun forwards it), but not necessarily before the same step:
``stop_requested`` takes the maximum over ranks (one all-reduce of one integer per step), so every rank stops
after the same step and the collective checkpoint stays collective.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

#: The signals that ask a run to stop.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopSignal(BaseException):
    """Raised by the loop after the step during which a stop signal arrived.

    A ``BaseException`` (as ``KeyboardInterrupt``): code that records ordinary failures as FAILED must not take a
    stop for one. ``signum``: the signal; ``step``: the last optimizer step completed (0-based, -1 before any);
    ``checkpoint``: the folder written for the resume, or None; ``message``: the reason, when not one run's (an
    ablation's). ``exit_code`` is the shell's 128 + signal.
    """

    def __init__(self, signum: int, step: int = -1, checkpoint=None, message: str = ""):
        self.signum, self.step, self.checkpoint, self.message = int(signum), int(step), checkpoint, message
        super().__init__(self.reason())

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def reason(self) -> str:
        if self.message:
            return self.message
        where = f"after step {self.step}" if self.step >= 0 else "before its first step"
        ckpt = f"; checkpoint {self.checkpoint}" if self.checkpoint else "; no checkpoint written"
        return f"stopped by {self.name} {where}{ckpt}"


_requested: list[int] = []


def _handler(signum, frame) -> None:
    if _requested and signum == signal.SIGINT and _requested[0] == signal.SIGINT:
        raise KeyboardInterrupt  # Ctrl-C twice: stop now, without the checkpoint
    if not _requested:
        _requested.append(signum)


def install_stop_handlers() -> bool:
    """Route ``STOP_SIGNALS`` to the stop request (main thread only; returns False elsewhere, where Python
    cannot install handlers). Idempotent."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for s in STOP_SIGNALS:
        signal.signal(s, _handler)
    return True


def request_stop(signum: int) -> None:
    """Record a stop request as if ``signum`` had arrived (the ablation's workers are asked this way too)."""
    if not _requested:
        _requested.append(int(signum))


def clear_stop() -> None:
    """Forget a recorded request (tests; a process that goes on after a stopped run)."""
    _requested.clear()


def local_stop() -> int:
    """The signal this process was asked to stop by, 0 if none (no collective)."""
    return _requested[0] if _requested else 0


def stop_requested() -> int:
    """The stop signal, 0 if none; under ``torch.distributed``, the largest over ranks (a collective: call it
    at the same point on every rank)."""
    signum = local_stop()
    if dist.is_available() and dist.is_initialized():
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([signum], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        signum = int(t.item())
    return signum
