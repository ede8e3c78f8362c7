"""Fault injection for a test's commands: the ``LOWPREC_FAULTS`` environment variable read by
lowprec_lab/runner/faults.py (``key=value,key=value``), set around an in-process command or passed to a
subprocess's environment."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from lowprec_lab.runner.faults import ENV


@contextmanager
def injected(spec: str) -> Iterator[None]:
    """``LOWPREC_FAULTS=spec`` in this process's environment for the body (and the processes it starts), its
    earlier value restored after; an empty ``spec`` injects nothing."""
    old = os.environ.get(ENV)
    os.environ[ENV] = spec
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def env_with(spec: str) -> dict[str, str]:
    """This process's environment with ``LOWPREC_FAULTS=spec``, for a subprocess."""
    return {**os.environ, ENV: spec}
