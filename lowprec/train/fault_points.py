"""Named points inside a checkpoint save and the metric flush where a fault can be injected deterministically
(``LOWPREC_FAULTS`` ``at_point``, lowprec_lab/runner/faults.py; the fault campaign, benchmarks/faults.py).

A point is a call ``reached(name)`` in the code that does the work; it does nothing unless an action was armed for
that name. A kill or a full disk "somewhere during a save" from outside lands where the timing happens to put it;
at a named point it lands at the same place every time, in every process of a run.

``POINTS`` lists each point and the state the files are in when it is reached.
"""

from __future__ import annotations

from collections.abc import Callable

#: Point name -> where it is (the state on disk when it is reached).
POINTS = {
    "save.start": "the staging folder .step_<N>.partial exists, empty",
    "save.shards": "the first shard file (__<rank>_0.distcp) is part written: its first item only",
    "save.trainer_state": "every shard and DCP's .metadata are written, trainer_state.pt is not",
    "save.manifest": "every file of the checkpoint is written, manifest.json is not",
    "save.rename": "manifest.json is written, the staging folder is not yet renamed to step_<N>",
    "save.prune": "step_<N> is committed, the checkpoints train.keep_checkpoints drops are not yet deleted",
    "log.flush": "the metrics buffered since the last flush are about to be written to the tracking store",
    "run.created": "the run exists in the tracking store with its tags, its params are not yet written",
}

_armed: dict[str, Callable[[str], None]] = {}


def arm(name: str, action: Callable[[str], None]) -> None:
    """Call ``action(name)`` whenever ``reached(name)`` runs in this process. Raises ``KeyError`` for a name not in
    ``POINTS``."""
    if name not in POINTS:
        raise KeyError(f"no fault point {name!r}; known: {', '.join(POINTS)}")
    _armed[name] = action


def disarm() -> None:
    """Forget every armed action (tests run several runs in one process)."""
    _armed.clear()


def is_armed(name: str) -> bool:
    """True when an action waits at ``name`` (a save then takes the path that can reach it)."""
    return name in _armed


def reached(name: str) -> None:
    """The code is at point ``name``: run its armed action, if any (it may raise, stop or kill the process)."""
    action = _armed.get(name)
    if action is not None:
        action(name)
