"""A pool worker's job that makes the worker's exit stall (``tests/faults/test_signals.py``): an ``atexit`` hook that
sleeps, as a finalization that never ends would."""

from __future__ import annotations

import atexit
import os
import time


def stall_at_exit(seconds: float = 600.0) -> int:
    """Register a hook that sleeps ``seconds`` when this process exits; returns this process's pid."""
    atexit.register(time.sleep, seconds)
    return os.getpid()
