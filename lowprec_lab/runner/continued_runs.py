"""The MLflow side of continuing an interrupted run: reopen it in place (an ablation's resume), or close it when
``lowprec train resume=`` continues it in a new run, and read back what it logged before its checkpoint.

An interrupted run is KILLED (a stop signal), FAILED by a crash (a bug, a worker process that died), or still
RUNNING in MLflow because its process died without a word (kill -9, the OOM killer, ``LOWPREC_FAULTS=exit_at_step=N``).
Its checkpoints live in ``runs/checkpoints/<run id>/step_<N>`` (the ``checkpoint_dir`` tag), so the folder name
is the run id.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from mlflow.exceptions import MlflowException

from lowprec.errors import CheckpointError
from lowprec.train.checkpoint_files import newest_checkpoint, step_folders, verify
from lowprec_lab.runner.orphans import BOOT_TAG, PIDNS_TAG, owner_state
from lowprec_lab.tracking.checkpoint_dirs import inside, own_checkpoint_dir, tagged_checkpoint_dir
from lowprec_lab.tracking.tracker import Tracker, dumps

#: Tags of an interruption that no longer describe a run once it continues (it ends again, with new ones).
STALE_TAGS = (
    "failure_reason",
    "failure_kind",
    "stopped_by",
    "stopped_after_step",
    "resume_checkpoint",
    "resume_note",
    "resumed_checkpoint",
    "resumed_step",
    "resumed_from",
)


@dataclass(frozen=True)
class Continuation:
    """A run of an ablation to reopen and continue in place (picklable: it travels to worker processes).

    ``run_id``: the MLflow run; ``checkpoint``: the ``step_<N>`` folder to continue from, or None to start again
    from step 0 (no complete checkpoint, or none that its logged metrics reach); ``was``: one line on how it
    ended (``KILLED: stopped by SIGTERM after step 3; ...``, ``RUNNING: its process died``).
    """

    run_id: str
    checkpoint: str | None
    was: str


def logged_steps(client, run_id: str, key: str = "loss") -> int:
    """How many steps from step 0 on the run has logged ``key`` for without a gap (the steps a kill -9 left in
    MLflow; metrics still buffered in the dead process are not there)."""
    steps = {m.step for m in client.get_metric_history(run_id, key)}
    n = 0
    while n in steps:
        n += 1
    return n


def continue_from(
    client, run_id: str, checkpoint_dir: str | None, steps: int, runs: str | Path
) -> tuple[str | None, str]:
    """The checkpoint a continued run starts from, and a note when it is not simply the newest.

    ``checkpoint_dir``: the run's tag, used only inside ``<runs>/checkpoints/<run id>`` (``tagged_checkpoint_dir``;
    ``runs``: this command's ``paths.runs``); a tag that points elsewhere, or a ``step_<N>`` that resolves outside
    it (a symlink), is never read and is named in the note. The newest ``step_<N>`` that verifies against its
    manifest, that leaves a step to run (N < ``steps``) and that the run's logged ``loss`` reaches (N <=
    ``logged_steps``: continuing from a later checkpoint would leave steps without metrics in the run's record
    forever). None (start again from step 0) when no checkpoint qualifies. A damaged checkpoint is skipped and named
    in the note.
    """
    folder_root, refused = tagged_checkpoint_dir(runs, run_id, checkpoint_dir)
    if folder_root is None:
        return None, refused
    root = own_checkpoint_dir(runs, run_id)
    logged = logged_steps(client, run_id)
    skipped: list[str] = []
    for n, folder in reversed(step_folders(folder_root)):
        if n >= steps:
            continue
        if not inside(folder.resolve(), root):
            skipped.append(f"{folder.name} (a link out of {root}: not read)")
            continue
        if n > logged:
            skipped.append(f"{folder.name} (only {logged} steps logged)")
            continue
        try:
            verify(folder)
        except CheckpointError as e:
            skipped.append(f"{folder.name} ({e})")
            continue
        return str(folder), "; ".join(skipped)
    return None, "; ".join(skipped) or "no complete checkpoint"


def reopen_run(tracker: Tracker, c: Continuation) -> None:
    """Mark ``c.run_id`` RUNNING again, drop the tags of its interruption (``STALE_TAGS``) and append ``c.was`` and
    where it continues from to its ``continuations`` tag (a JSON list: the run's history of interruptions)."""
    client = tracker.client
    tags = client.get_run(c.run_id).data.tags
    for key in STALE_TAGS:
        if key in tags:
            client.delete_tag(c.run_id, key)
    where = f"continued from {c.checkpoint}" if c.checkpoint else "started again from step 0 (no usable checkpoint)"
    history = json_list(tags.get("continuations")) + [f"{c.was}; {where}"]
    client.update_run(c.run_id, status="RUNNING")
    tracker.set_tags(c.run_id, {"continuations": dumps(history)})


def history_before(client, run_id: str, step: int) -> tuple[list[float], list[float], float]:
    """The run's logged ``loss`` and ``grad_norm`` of steps ``0 .. step-1`` (one value per step: a step logged twice
    was recomputed bit for bit) and its ``loss_scale_skipped_steps`` counter at step ``step-1`` (0 when absent):
    the series a continued run's stability metrics must start from."""

    def series(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, key) if m.step < step}

    loss, grad = series("loss"), series("grad_norm")
    skipped = series("loss_scale_skipped_steps")
    return (
        [loss[s] for s in sorted(loss)],
        [grad.get(s, float("nan")) for s in sorted(loss)],
        skipped[max(skipped)] if skipped else 0.0,
    )


def supersede(tracker: Tracker, resume: str | Path, new_run_id: str, echo=print) -> str | None:
    """``lowprec train resume=<checkpoint>`` continues a run in the new run ``new_run_id``: tag it
    ``resumed_run_id`` with the run the checkpoint belongs to (its folder is named by the run id:
    ``runs/checkpoints/<run id>/step_<N>``).

    If that run is still RUNNING and its owner process is provably dead (``lowprec_lab.runner.orphans.owner_state``:
    kill -9, out of memory), or this command's orphan sweep just ended it, tag it ``continued_in_run`` and end it FAILED
    with ``its process died after step N; continued in run <new id>``, N the last step it is known to have
    completed (its newest logged step or the checkpoint's, whichever is later; steps after it whose metrics were
    still buffered died with the process).

    If it is RUNNING and its owner is alive, or cannot be checked from here (another host, another PID namespace),
    the new run is a fork (a branch from a checkpoint of a run that goes on training, as when a torchtitan user
    starts a second job from a live job's checkpoint folder): the old run is left RUNNING and tagged
    ``forked_in_run``, the new run ``resumed_while_running`` with why, and one line goes to ``echo``. Ending a live
    run would leave it training under a FAILED record whose later metrics arrive after its end. Runs from before
    the namespace tags (``PIDNS_TAG``) keep the older rule: ended unless their owner is provably alive.

    Returns the old run id, or None when the checkpoint's folder names no run of this tracking store (a
    checkpoint copied from elsewhere): then nothing is tagged.
    """
    try:
        ckpt = newest_checkpoint(resume)
    except CheckpointError:
        return None
    old_id = ckpt.parent.name
    try:
        old = tracker.client.get_run(old_id)
    except MlflowException:
        return None
    if old.info.experiment_id != tracker.experiment_id:
        return None
    tracker.set_tags(new_run_id, {"resumed_run_id": old_id})
    tags = old.data.tags
    if old.info.status == "RUNNING":
        alive, why = owner_state(tags, old.info.start_time)
        new_style = PIDNS_TAG in tags or BOOT_TAG in tags
        if alive is True or (alive is None and new_style):
            why = why or "its process is alive"
            tracker.set_tags(old_id, {"forked_in_run": new_run_id})
            tracker.set_tags(new_run_id, {"resumed_while_running": why})
            echo(f"run {old_id} is still RUNNING ({why}): left running; run {new_run_id} is a fork of it")
            return old_id
    tracker.set_tags(old_id, {"continued_in_run": new_run_id})
    # RUNNING: its process died; orphan_closed: it did, and this command's sweep (lowprec_lab.runner.orphans) ended it
    # FAILED a moment ago without knowing that it continues here
    if old.info.status == "RUNNING" or tags.get("orphan_closed") == "true":
        logged = [m.step for m in tracker.client.get_metric_history(old_id, "loss")]
        m = re.fullmatch(r"step_(\d+)", ckpt.name)
        ckpt_step = int(m.group(1)) if m else 0
        last = max([*logged, ckpt_step - 1])
        tracker.end_run(old_id, "FAILED", f"its process died after step {last}; continued in run {new_run_id}")
    return old_id


def json_list(text: str | None) -> list:
    """A JSON list from a tag (a ``resumes`` history); a tag that is not one is kept as its only item."""
    try:
        value = json.loads(text) if text else []
    except ValueError:
        return [text]
    return value if isinstance(value, list) else [value]
