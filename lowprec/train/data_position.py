"""Which batch each optimizer step trains on, when some batches are skipped.

Batches are a pure function of (seed, batch index) (``lowprec.data.TokenBatches``). Without skipped batches step s
trains on batch s. A rollback (``train.on_anomaly=rollback``) or ``train.skip_batches`` removes batch indices from
the stream, PaLM's remedy for loss spikes (Chowdhery et al. 2022, section 5.1: restart from a checkpoint before the
spike and skip the batches around it): step s then trains on the s-th batch index (from 0) that is not skipped, so
the run continues exactly as a run that never saw those batches. The skipped indices are part of a checkpoint's
trainer state, so a resumed run keeps skipping them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from lowprec.errors import CheckpointError


class DataPosition:
    """Step -> batch index with a sorted set of skipped batch indices (each >= 0)."""

    def __init__(self, skipped: Iterable[int] = ()):
        self.skipped: list[int] = sorted({int(b) for b in skipped})

    def batch(self, step: int) -> int:
        """The batch index optimizer step ``step`` (0-based) trains on: the ``step``-th index not skipped."""
        b = step
        for s in self.skipped:  # ascending: each skipped index at or before b pushes b one further
            if s <= b:
                b += 1
            else:
                break
        return b

    def skip(self, batch: int) -> None:
        """Never train on batch index ``batch`` (the steps from the one that used it shift by one batch)."""
        if batch not in self.skipped:
            bisect.insort(self.skipped, int(batch))

    def state_dict(self) -> dict:
        return {"skipped": list(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = sorted(int(b) for b in state["skipped"])


def resumed_position(saved: dict | None, step: int, skip_batches: Iterable[int], where: str) -> DataPosition:
    """The data position of a run resumed at ``step`` from a checkpoint whose saved position is ``saved``
    (``DataPosition.state_dict``; None for a checkpoint without one: no batch skipped), with ``train.skip_batches``
    added. Raises ``CheckpointError`` for a skipped batch behind the checkpoint's position (already trained on, or
    passed over: skipping it now would shift every batch from ``step`` on) naming ``where`` (the checkpoint)."""
    pos = DataPosition(saved["skipped"] if saved else ())
    first = pos.batch(step)
    behind = [b for b in skip_batches if b < first and b not in pos.skipped]
    if behind:
        raise CheckpointError(
            f"train.skip_batches holds {behind[0]}, a batch before checkpoint {where}'s position (its next step "
            f"trains on batch {first}): only batches ahead can be skipped on a resume"
        )
    return DataPosition([*pos.skipped, *skip_batches])
