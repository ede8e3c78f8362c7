"""Fault injection for testing failure handling end to end (crash, NaN, a dying process), configured under
``faults.*``."""

from __future__ import annotations

import os

import torch

from lowprec.train.build import Built
from lowprec.train.loop import StepHook


class InjectedCrash(RuntimeError):
    """Raised by ``faults.crash_at_step``."""


def fault_hooks(faults, recipe_name: str) -> list[StepHook]:
    """Step hooks for the faults that target ``recipe_name`` (``faults.recipe`` null targets every run)."""
    if faults.recipe not in (None, recipe_name):
        return []
    hooks: list[StepHook] = []
    if faults.crash_at_step is not None:
        at = int(faults.crash_at_step)

        def crash(step: int, built: Built) -> None:
            if step == at:
                raise InjectedCrash(f"injected crash before step {step} (faults.crash_at_step)")

        hooks.append(crash)
    if faults.nan_at_step is not None:
        at_nan = int(faults.nan_at_step)

        def poison(step: int, built: Built) -> None:
            if step == at_nan:
                with torch.no_grad():
                    built.model.norm.weight.fill_(float("nan"))

        hooks.append(poison)
    if faults.exit_at_step is not None:
        at_exit = int(faults.exit_at_step)

        def die(step: int, built: Built) -> None:
            if step == at_exit:
                os._exit(13)  # no cleanup, no exception: what a kill -9 or the OOM killer leaves behind

        hooks.append(die)
    return hooks
