"""The first-step check of the effective recipe: what ran must be what was requested before a run counts."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from lowprec.train.build import Built
from lowprec.train.effective import (
    EffectiveRecipeError,
    check_effective,
    expected_effective,
    inspect_effective,
    record_linear_output_dtypes,
)

Effective = dict[str, Any]
"""``inspect_effective``'s summary of what ran (JSON-like: dtype -> element count maps, names, counts)."""


class EffectiveInspector:
    """Inspects the effective recipe once, after the first step whose update ran, and checks it.

    A step the loss scaler skipped (FP16 overflow at the initial scale is common) has created no optimizer
    state yet, so inspection waits for one that ran; the linears' output dtypes are recorded during that
    same step (``recording``), so the inspection needs no forward of its own, which would feed
    delayed-scaling histories. ``on_effective`` receives the summary before the check, so a wrong recipe is
    still recorded; ``extra`` (a resume's recipe change) is merged into it.
    """

    def __init__(self, built: Built, on_effective: Callable[[Effective], None], extra: Effective | None = None):
        self.built, self.on_effective, self.extra = built, on_effective, extra or {}
        self.effective: Effective = {}
        #: True once the effective recipe was inspected and matched the requested one.
        self.checked = False
        self._out_dtypes: dict[str, str] = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record each linear's output dtype during the block (one training step) until the check has run."""
        if self.checked:
            yield
            return
        with record_linear_output_dtypes(self.built.model) as seen:
            self._out_dtypes = seen
            yield

    def after_step(self, applied: bool = True) -> None:
        """Inspect, report and check after a step whose update ran (``applied``: not skipped by the loss scaler or
        the health policy); raises ``EffectiveRecipeError`` on a mismatch. Call before anything zeroes the
        gradients."""
        if self.checked or not applied:
            return
        self.effective = {**inspect_effective(self.built, self._out_dtypes), **self.extra}
        self.on_effective(self.effective)
        idle = self.effective.get("moe_idle_expert_linears", 0)  # experts no token reached in this step
        check_effective(self.effective, expected_effective(self.built, idle))
        self.checked = True

    def amend(self, extra: Effective) -> None:
        """Merge ``extra`` (a change of what runs during the run: the FP8 fallback's switched layers) into the
        effective recipe, and hand the amended recipe to ``on_effective`` again if it was already reported."""
        self.extra.update(extra)
        if self.effective:
            self.effective.update(extra)
            self.on_effective(self.effective)

    def finish(self, steps: range) -> None:
        """Raise ``EffectiveRecipeError`` if no step in ``steps`` (those this run took) ran an update."""
        if not self.checked:
            raise EffectiveRecipeError(
                f"no optimizer step ran in steps {steps.start}..{steps.stop - 1} (the loss scaler skipped every "
                "one), so the effective recipe could not be inspected"
            )
