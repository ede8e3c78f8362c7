"""The stop handlers a ``lowprec`` command installs in the test process, taken back afterwards."""

from __future__ import annotations

import contextlib
import signal

from lowprec.train.stop import STOP_SIGNALS, clear_stop


@contextlib.contextmanager
def restored_stop_handlers():
    """Run the body with no stop request recorded, then forget any it recorded and put the process's own handlers
    of ``STOP_SIGNALS`` back (``lowprec_lab.cli`` installs lowprec's in whatever process runs a command: pytest's)."""
    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    clear_stop()
    try:
        yield
    finally:
        clear_stop()
        for s, h in saved.items():
            signal.signal(s, h)
