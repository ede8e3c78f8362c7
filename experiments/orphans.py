"""Runs whose process died: ended FAILED by the next lowprec command on the same host.

A process killed with SIGKILL (``kill -9``, the OOM killer, a scheduler's hard kill after its grace period) runs no
handler, so its MLflow run stays RUNNING for good (issue 15: "0 runs left RUNNING"). Every run records which
process owns it (tag ``lowprec.owner`` = ``<host>:<pid>:<start time>``, the start time in clock ticks since boot
from ``/proc/<pid>/stat``, so a recycled pid is not taken for the owner). ``lowprec train`` and ``lowprec ablate``
look for RUNNING runs of their experiment owned by a process of this host that no longer exists and end them
FAILED with the reason. Runs owned by another host are left alone: nothing here can tell whether their process is
alive.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from experiments.spool import spool_path

OWNER_TAG = "lowprec.owner"


def _start_ticks(pid: int) -> str | None:
    """Field 22 of ``/proc/<pid>/stat`` (the process's start time in clock ticks since boot), None when there is
    no such process or no procfs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after its closing one.
    return stat[stat.rindex(")") + 2 :].split()[19]


def owner() -> str:
    """``<host>:<pid>:<start ticks>`` of this process (start ticks empty without procfs)."""
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_ticks(pid) or ''}"


def owner_tags() -> dict[str, str]:
    """The tag that marks a run as this process's."""
    return {OWNER_TAG: owner()}


def owner_alive(tag: str) -> bool | None:
    """Whether the process named by an ``owner()`` string is still running: None when it cannot be told (another
    host, no procfs, a malformed tag)."""
    try:
        host, pid, ticks = tag.rsplit(":", 2)
        pid_i = int(pid)
    except ValueError:
        return None
    if host != socket.gethostname() or not ticks or not Path("/proc/self/stat").exists():
        return None
    return _start_ticks(pid_i) == ticks


def close_orphans(tracker) -> list[str]:
    """End FAILED every RUNNING run of ``tracker``'s experiment whose owner process on this host has died; returns
    their run ids. Reason (``failure_reason``): ``its process (<owner>) died during the run (found by a later
    lowprec command)``; tag ``orphan_closed=true``. A ``NullTracker`` (ranks other than 0) closes nothing."""
    client = getattr(tracker, "client", None)
    if client is None or not hasattr(client, "search_runs"):
        return []
    host = socket.gethostname()
    runs = client.search_runs(
        [tracker.experiment_id],
        filter_string=f"attributes.status = 'RUNNING' and tags.`{OWNER_TAG}` LIKE '{host}:%'",
        max_results=1000,
    )
    closed = []
    for r in runs:
        tag = r.data.tags.get(OWNER_TAG, "")
        if owner_alive(tag) is False:
            if _spooled(tracker, r.info.run_id):
                continue
            tracker.set_tags(r.info.run_id, {"orphan_closed": "true"})
            tracker.end_run(
                r.info.run_id, "FAILED", f"its process ({tag}) died during the run (found by a later lowprec command)"
            )
            closed.append(r.info.run_id)
    return closed


def _spooled(tracker, run_id: str) -> bool:
    """Replay the spool a dead run's process left (its store was full or unreachable: ``experiments.spool``); True
    when the run needs no closing here: its spool ended it, or the store still does not take the spool's writes
    (it waits for ``lowprec sync``; a FAILED status written now would land after the spooled FINISHED)."""
    spool = getattr(tracker, "spool", None)
    if spool is None or not spool_path(spool.folder, run_id).exists():
        return False
    if tracker.drain_spools([run_id]):
        return True
    return tracker.client.get_run(run_id).info.status != "RUNNING"
