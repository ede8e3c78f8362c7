"""Fault injection for testing failure handling end to end (crash, NaN, a dying process, a pre-emption signal),
configured under ``faults.*``."""

from __future__ import annotations

import os
import signal

import torch

from lowprec.errors import ConfigError
from lowprec.train.build import Built
from lowprec.train.loop import StepHook
from lowprec.train.stop import STOP_SIGNALS


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
    if faults.kill_at_step is not None:
        at_kill = int(faults.kill_at_step)

        def kill9(step: int, built: Built) -> None:
            if step == at_kill:
                os.kill(os.getpid(), signal.SIGKILL)

        hooks.append(kill9)
    if faults.signal_at_step is not None:
        at_signal, signum = int(faults.signal_at_step), stop_signal(faults.signal)

        def preempt(step: int, built: Built) -> None:
            if step == at_signal:
                os.kill(os.getpid(), signum)  # delivered for real, to the handler the command installed

        hooks.append(preempt)
    return hooks


def stop_signal(name: str) -> int:
    """The signal ``faults.signal`` names; raises ``ConfigError`` for one that is not a stop signal."""
    known = {signal.Signals(s).name: s for s in STOP_SIGNALS}
    if name not in known:
        raise ConfigError(f"faults.signal={name} is not one of {', '.join(known)}")
    return known[name]
