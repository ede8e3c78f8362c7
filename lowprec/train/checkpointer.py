"""Checkpoint timing for the loop: resume at the start of a run, a checkpoint after every N-th step, and the reload
of ``train.on_anomaly=rollback``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lowprec.errors import CheckpointError, DiskError
from lowprec.train.build import Built
from lowprec.train.checkpoint import check_resume_recipe, load_checkpoint, read_trainer_state, save_checkpoint
from lowprec.train.checkpoint_files import prune, resolve_resume
from lowprec.train.data_position import resumed_position
from lowprec.train.ema import WeightEma
from lowprec.train.health import HealthMonitor
from lowprec.train.spec import TrainSpec


@dataclass(frozen=True)
class ResumePoint:
    """Where a run starts: ``step`` (optimizer steps already taken), and ``recipe_change``: ``{}``, or
    ``{"resume_recipe_change": {...}}`` when the checkpoint was written under another recipe (merged into the
    effective recipe so the switch is recorded)."""

    step: int = 0
    recipe_change: dict[str, Any] = field(default_factory=dict)
    #: The checkpoint folder loaded (after fallback), None for a fresh start.
    loaded: Path | None = None
    #: Why ``loaded`` is not simply the checkpoint asked for (a fallback, an unverifiable checkpoint), else "".
    note: str = ""


class Checkpointer:
    """Writes ``<directory>/step_<N>`` after every N-th step, N = ``spec.checkpoint_every`` (never when
    ``directory`` is None or N is 0), keeping the ``spec.keep_checkpoints`` newest (0: all), resumes a run from
    such a folder (``lowprec.train.checkpoint``), and reloads the newest one for a rollback. ``health``: the run's
    monitor, whose state every checkpoint carries and every load restores; ``ema``: the run's ``WeightEma``
    (``train.eval_ema``), likewise."""

    def __init__(
        self,
        built: Built,
        spec: TrainSpec,
        directory: str | Path | None,
        health: HealthMonitor,
        ema: WeightEma | None = None,
    ):
        self.built, self.spec, self.health, self.ema = built, spec, health, ema
        self.directory = Path(directory) if directory is not None else None
        #: The newest complete checkpoint of this run's trajectory (written, or resumed from): a rollback's target.
        self.newest: Path | None = None

    def resume(self, path: str | Path | None) -> ResumePoint:
        """Load the checkpoint ``path`` into the built objects (step 0 and nothing loaded for None): a checkpoint
        folder, or a run's checkpoint directory (its newest complete ``step_<N>``), verified against its manifest;
        a damaged one falls back to the previous complete checkpoint with a warning
        (``checkpoint_files.resolve_resume``). The health monitor continues from the checkpoint's state.

        Raises ``CheckpointError`` when no complete checkpoint is found, when it was written under another recipe
        and ``spec.resume_recipe_change`` is off, when it does not load, when its step leaves no step to run, or when
        ``spec.skip_batches`` names a batch before the checkpoint's data position, or when the run keeps a weight
        EMA and the checkpoint holds none (or another decay).
        """
        if path is None:
            return ResumePoint()
        path, note = resolve_resume(path)  # verified against its manifest, or the previous complete one
        b = self.built
        change = check_resume_recipe(path, b.recipe, self.spec.resume_recipe_change)
        step = load_checkpoint(path, b.model, b.optimizer, b.scheduler, b.loss_scaler)
        if step >= self.spec.steps:
            raise CheckpointError(
                f"checkpoint {str(path)!r} is at step {step}; train.steps={self.spec.steps} leaves nothing to run"
            )
        state = read_trainer_state(path).get("health")
        if state is not None:  # a checkpoint of an older lowprec has none: a fresh monitor, no skipped batches
            self.health.load_state_dict(state)
        saved = state["data"] if state is not None else None
        self.health.data = resumed_position(saved, step, self.spec.skip_batches, repr(str(path)))
        self._load_ema(path)
        self.health.checkpoint_written(step)
        self.newest = path
        return ResumePoint(step, change, path, note)

    def _load_ema(self, path: Path) -> None:
        if self.ema is not None:  # a checkpoint without one is refused: the average would restart mid-run
            self.ema.load_state_dict(read_trainer_state(path).get("ema"), repr(str(path)))

    def due(self, step: int) -> bool:
        every = self.spec.checkpoint_every
        return self.directory is not None and every > 0 and (step + 1) % every == 0

    def _save(self, step: int) -> Path:
        b = self.built
        path = self.directory / f"step_{step + 1}"
        try:
            save_checkpoint(
                path,
                b.model,
                b.optimizer,
                step + 1,
                b.scheduler,
                b.loss_scaler,
                b.recipe,
                self.health.state_dict(),
                self.ema.state_dict() if self.ema is not None else None,
            )
        except DiskError as e:  # the line the user reads says where the run can resume once space is back
            if self.newest is None:
                raise
            err = DiskError(f"{e}; the checkpoint before, {str(self.newest)!r}, is intact")
            err.errno = e.errno
            raise err from e
        self.newest = path
        self.health.checkpoint_written(step + 1)
        return path

    def save_on_stop(self, step: int) -> Path | None:
        """The checkpoint for a run stopped by a signal after step ``step``: the one just written if it was due,
        else one written now when ``checkpoint_every`` > 0 or ``checkpoint_on_signal`` (None otherwise, or
        without a directory)."""
        if self.directory is None or not (self.spec.checkpoint_every > 0 or self.spec.checkpoint_on_signal):
            return None
        if self.due(step):
            return self.directory / f"step_{step + 1}"
        return self._save(step)

    def maybe_save(self, step: int) -> Path | None:
        """Write the checkpoint due after step ``step`` (0-based; it records ``step + 1`` steps taken), if any;
        returns its folder."""
        if not self.due(step):
            return None
        path = self._save(step)
        if not dist.is_initialized() or dist.get_rank() == 0:
            prune(self.directory, self.spec.keep_checkpoints)
        return path

    def rollback(self) -> ResumePoint:
        """Reload the newest complete checkpoint of the run (verified; the previous complete one beside it if it is
        damaged) into the built objects, and the health monitor's histories with it (``HealthMonitor.rolled_back``:
        what the rollback decided stays). Returns where the run goes on (``note``: a fallback's warning).

        Raises ``CheckpointError`` when no checkpoint was written or resumed from, or none verifies.
        """
        if self.newest is None:
            raise CheckpointError("no checkpoint to roll back to")
        path, note = resolve_resume(self.newest)
        b = self.built
        step = load_checkpoint(path, b.model, b.optimizer, b.scheduler, b.loss_scaler)
        self.health.rolled_back(read_trainer_state(path).get("health"))
        self._load_ema(path)
        self.health.checkpoint_written(step)
        self.newest = path
        return ResumePoint(step, {}, path, note)
