"""Runs whose process died: ended FAILED by the next lowprec command that can prove the death.

A process killed with SIGKILL (``kill -9``, the OOM killer, a scheduler's hard kill after its grace period) runs no
handler, so its MLflow run would stay RUNNING for good. Every run records which
process owns it: tag ``lowprec.owner`` = ``<host>:<pid>:<start time>`` (the start time in clock ticks since boot,
field 22 of ``/proc/<pid>/stat`` as psutil reads it, so a recycled pid is not taken for the owner),
``lowprec.owner_pidns`` (the PID namespace, ``pid:[<inode>]`` from ``/proc/self/ns/pid``) and
``lowprec.owner_boot`` (the kernel's boot id, ``/proc/sys/kernel/random/boot_id``; psutil reads neither). A pid
means nothing outside its PID namespace: two containers that share a hostname (host networking) each have their
own pid 1234.

``lowprec train`` and ``lowprec ablate`` look for RUNNING runs of their experiment owned by this hostname and end
FAILED only those whose owner is provably dead: same boot and PID namespace and no process with that pid and start
time, or a different boot id and a run started before this machine booted (it rebooted since). Everything else is
left RUNNING: a run of another host; a run of another PID namespace of this boot (another container: its
processes cannot be seen from here), said in one line and the run's tag ``lowprec.orphan_check``; a different boot
id of a run started after this boot (another machine with the same hostname). Runs from before the namespace and
boot tags existed keep the older rule (host, pid and start time). A command whose ``/proc`` shows another PID
namespace than its own (``unshare -p -f`` without ``--mount-proc``) checks no pid at all: every pid it would read
there is another process (``procfs_is_ours``); the runs it owns record no start time.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import psutil

from lowprec_lab.tracking.spool import SpoolError, drop_note, read_note, spool_path

OWNER_TAG = "lowprec.owner"
PIDNS_TAG = "lowprec.owner_pidns"
BOOT_TAG = "lowprec.owner_boot"
CHECK_TAG = "lowprec.orphan_check"
#: Why no owner can be checked from a process whose ``/proc`` shows another PID namespace (``procfs_is_ours``).
NOT_OUR_PROC = (
    "this command's /proc belongs to another PID namespace (unshare -p without --mount-proc?): "
    "no process can be checked from here"
)


def procfs_is_ours() -> bool:
    """True when ``/proc`` shows this process's own PID namespace: ``/proc/self`` names ``os.getpid()``. False in a
    PID namespace without its own ``/proc`` (``unshare -p -f`` without ``--mount-proc``, a container that bind-mounts
    the host's): there ``/proc/<pid>`` is another namespace's process of that number, so no pid can be checked."""
    try:
        return int(os.readlink("/proc/self")) == os.getpid()
    except (OSError, ValueError):
        return False


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of ``/proc/<pid>/stat``), a decimal string;
    None when there is no such process, it cannot be read, or ``/proc`` belongs to another PID namespace
    (``procfs_is_ours``). Ticks since boot, not psutil's default seconds since the epoch: those add ``btime``, which
    moves when the wall clock is stepped, and the tags of runs already stored hold ticks."""
    if not procfs_is_ours():
        return None
    try:
        proc = psutil.Process(pid)
        try:
            since_boot = proc.create_time(monotonic=True)  # psutil >= 7.1: ticks / CLK_TCK, no wall clock
        except TypeError:  # older psutil: the epoch time it derived from the same ticks and btime
            since_boot = proc.create_time() - psutil.boot_time()
    except (psutil.Error, OSError):
        return None
    # psutil divides the integer ticks by CLK_TCK: the product rounds back to them exactly.
    return str(round(since_boot * os.sysconf("SC_CLK_TCK")))


def pid_namespace() -> str | None:
    """This process's PID namespace, ``pid:[<inode>]`` (``/proc/self/ns/pid``), None without procfs. Namespace
    inodes are unique among the namespaces alive on one boot of a kernel."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def boot_id() -> str | None:
    """The kernel's boot id (a UUID, new at every boot), None without procfs."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def boot_time_s() -> float | None:
    """When this machine booted, seconds since the epoch (psutil's ``boot_time``: ``btime`` of ``/proc/stat`` on
    Linux), None when it cannot be read."""
    try:
        return psutil.boot_time()
    except (RuntimeError, OSError):
        return None


def owner() -> str:
    """``<host>:<pid>:<start ticks>`` of this process (start ticks empty without a procfs of its own PID
    namespace)."""
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_ticks(pid) or ''}"


def owner_tags() -> dict[str, str]:
    """The tags that mark a run as this process's: ``OWNER_TAG``, ``PIDNS_TAG`` and ``BOOT_TAG`` (the last two
    empty strings without procfs)."""
    return {OWNER_TAG: owner(), PIDNS_TAG: pid_namespace() or "", BOOT_TAG: boot_id() or ""}


def owner_alive(tag: str) -> bool | None:
    """Whether the process named by an ``owner()`` string is still running, by host, pid and start time alone
    (right only within one PID namespace: see ``owner_state``): None when it cannot be told (another host, no
    procfs, a malformed tag)."""
    try:
        host, pid, ticks = tag.rsplit(":", 2)
        pid_i = int(pid)
    except ValueError:
        return None
    if host != socket.gethostname() or not ticks or not procfs_is_ours():
        return None
    return _start_ticks(pid_i) == ticks


def owner_state(tags: dict[str, str], started_ms: int | None) -> tuple[bool | None, str]:
    """Whether the owner of a run with ``tags`` (its MLflow tags) and start time ``started_ms`` (ms since the
    epoch, MLflow's ``start_time``) is alive: True, False (provably dead), or None (cannot be told from here), and
    why, one clause (empty when the answer needs no explanation).

    False only for the same boot and PID namespace with no process of that pid and start time, or for a boot id
    that differs from this machine's when the run started before this machine booted (a reboot ended every
    process). A run without ``PIDNS_TAG``/``BOOT_TAG`` (recorded before they existed) is judged by ``owner_alive``.
    """
    tag = tags.get(OWNER_TAG, "")
    alive = owner_alive(tag)
    if PIDNS_TAG not in tags and BOOT_TAG not in tags:
        ours = tag.startswith(f"{socket.gethostname()}:")
        return alive, NOT_OUR_PROC if alive is None and ours and not procfs_is_ours() else ""
    if not tag.startswith(f"{socket.gethostname()}:"):
        return None, "owned by another host"
    theirs_boot, mine_boot = tags.get(BOOT_TAG, ""), boot_id()
    if not theirs_boot or not mine_boot:
        return None, "no boot id to compare"
    if theirs_boot != mine_boot:
        booted = boot_time_s()
        if started_ms is not None and booted is not None and started_ms / 1000 < booted:
            return False, "this host rebooted since the run started"
        return None, f"owned by boot {theirs_boot} of a machine named {socket.gethostname()}, not this one"
    if not procfs_is_ours():
        return None, NOT_OUR_PROC
    theirs_ns, mine_ns = tags.get(PIDNS_TAG, ""), pid_namespace()
    if not theirs_ns or theirs_ns != mine_ns:
        return None, (
            f"its process runs in another PID namespace ({theirs_ns or 'unknown'}) of this host, e.g. another "
            "container: whether it is alive cannot be seen from here"
        )
    return alive, ""


def close_orphans(tracker, echo=None) -> list[str]:
    """End FAILED every RUNNING run of ``tracker``'s experiment owned by this hostname whose owner process is
    provably dead (``owner_state`` False); returns their run ids. Reason (``failure_reason``): ``its process
    (<owner>) died during the run (found by a later lowprec command)``, or ``... died in a reboot of its host ...``;
    tag ``orphan_closed=true``. A run whose process left a stop note (``lowprec_lab.tracking.spool.write_note``: it
    stopped on a disk that took neither the store's writes nor the spool's) is closed with the note's
    ``failure_kind`` (``disk``) and reason. A dead run whose spool is malformed is left RUNNING with one line
    (the spool waits for the user), so that it does not stop this command. A run whose owner cannot be checked
    because it lives in another PID namespace or boot is left RUNNING, tagged ``lowprec.orphan_check`` with why,
    and named in one line to ``echo`` (a ``print``-like callable; None: silent). A ``NullTracker`` (ranks other
    than 0) closes nothing."""
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
        tags = r.data.tags
        tag = tags.get(OWNER_TAG, "")
        state, why = owner_state(tags, r.info.start_time)
        if state is False:
            try:
                if _spooled(tracker, r.info.run_id):
                    continue
            except SpoolError as e:  # a malformed spool waits for the user; it must not stop every later command
                note = f"left RUNNING: its spool cannot be replayed: {e}"
                tracker.set_tags(r.info.run_id, {CHECK_TAG: note[:8000]})
                if echo is not None:
                    echo(f"run {r.info.run_id} ({tag}) {note}")
                continue
            how = "died in a reboot of its host during the run" if why else "died during the run"
            reason = f"its process ({tag}) {how} (found by a later lowprec command)"
            tags = {"orphan_closed": "true"}
            folder = getattr(getattr(tracker, "spool", None), "folder", None)
            last = read_note(folder, r.info.run_id) if folder is not None else None
            if last is not None:  # it stopped on a full disk that took neither the store nor the spool
                tags["failure_kind"] = last["failure_kind"]
                reason = f"its process ({tag}) stopped: {last['reason']} (found by a later lowprec command)"
            tracker.set_tags(r.info.run_id, tags)
            tracker.end_run(r.info.run_id, "FAILED", reason)
            if folder is not None:
                drop_note(folder, r.info.run_id)
            closed.append(r.info.run_id)
        elif state is None and why:
            note = f"left RUNNING: {why}"
            if tags.get(CHECK_TAG) != note:
                tracker.set_tags(r.info.run_id, {CHECK_TAG: note})
            if echo is not None:
                echo(f"run {r.info.run_id} ({tag}) {note}")
    return closed


def _spooled(tracker, run_id: str) -> bool:
    """Replay the spool a dead run's process left (its store was full or unreachable: ``lowprec_lab.tracking.spool``);
    True when the run needs no closing here: its spool ended it, or the store still does not take the spool's writes
    (it waits for ``lowprec sync``; a FAILED status written now would land after the spooled FINISHED)."""
    spool = getattr(tracker, "spool", None)
    if spool is None or not spool_path(spool.folder, run_id).exists():
        return False
    if tracker.drain_spools([run_id]):
        return True
    return tracker.client.get_run(run_id).info.status != "RUNNING"
