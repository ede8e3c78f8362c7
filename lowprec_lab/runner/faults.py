"""Fault injection for testing failure handling end to end (crash, NaN, a dying process, a pre-emption signal, FP8
overflow, a kill or stop at a named point), configured by the environment variable ``LOWPREC_FAULTS``, never by the
user's config: it is a test channel, so it is neither in the Hydra schema nor in a run's MLflow params.

``LOWPREC_FAULTS`` holds a JSON object or ``key=value,key=value`` (``null`` for None), with the fields of
``FaultsConfig``. ``from_env`` reads it: the command refuses a bad value in one line before any run exists
(``lowprec_lab.cli.plan_of``), and each run reads it again to arm its hooks. Child processes inherit it: ablation
workers, torchrun ranks (``torchrun_env`` copies the environment) and submitit jobs (a local job's process, and
sbatch exports the submitting environment).

NaN faults are transient, as a flipped bit or a bad reduction is: each poisoned step is poisoned the first time it
runs only, so a rollback's replay of it runs clean (``lowprec.train.health``)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lowprec.errors import ConfigError
from lowprec.train import fault_points
from lowprec.train.build import Built
from lowprec.train.loop import StepHook
from lowprec.train.stop import STOP_SIGNALS
from lowprec_lab.plan.config import typed

#: The environment variable that carries the faults to inject (``from_env``).
ENV = "LOWPREC_FAULTS"


@dataclass(frozen=True)
class FaultsConfig:
    """The faults to inject (all None: none); they apply to the run of ``recipe`` (any recipe if None).

    ``crash_at_step``: raise RuntimeError before this step. ``nan_at_step``: poison with NaN before this step (the
    real NaN path); ``nan_into``: where it lands, ``weight`` (the final norm's weight), ``activation`` (the final
    norm's output) or ``gradient`` (the final norm weight's gradient); ``nan_steps``: how many consecutive steps
    from ``nan_at_step`` are poisoned, each the first time it runs (a rollback's replay runs clean).
    ``exit_at_step``: end the process at once before this step (``os._exit``: a worker killed mid-run).
    ``kill_at_step``: send SIGKILL to this process before this step (a real ``kill -9``: no handler, no flush).
    ``signal_at_step``: send ``signal`` (SIGTERM, SIGINT or SIGUSR1) to this process before this step, as a
    scheduler's pre-emption would (the run stops after that step). ``fp8_overflow_at_step``: for
    ``fp8_overflow_steps`` steps, multiply the input of the FP8 linear ``fp8_overflow_layer`` (None: the first) by
    ``fp8_overflow_factor`` to the power 1, 2, ...: a delayed-scaling layer saturates on each of them.
    ``at_point``: a named point (``lowprec.train.fault_points.POINTS``) where, the ``point_hit``-th time it is
    reached, ``point_action`` happens: ``kill`` or ``stop`` (``arm_point``)."""

    recipe: str | None = None
    crash_at_step: int | None = None
    nan_at_step: int | None = None
    nan_into: str = "weight"
    nan_steps: int = 1
    exit_at_step: int | None = None
    kill_at_step: int | None = None
    signal_at_step: int | None = None
    signal: str = "SIGTERM"
    fp8_overflow_at_step: int | None = None
    fp8_overflow_steps: int = 3
    fp8_overflow_layer: str | None = None
    fp8_overflow_factor: float = 1000.0
    at_point: str | None = None
    point_action: str = "kill"
    point_hit: int = 1


def parse(text: str) -> FaultsConfig:
    """``FaultsConfig`` from the text of ``LOWPREC_FAULTS``: a JSON object, or ``key=value`` pairs separated by
    commas (``null`` or ``none`` for None); empty text: no fault. Every value is checked (type, signal, NaN target,
    point, action, hit). Raises ``ConfigError`` (one line naming the variable and the bad key or value)."""
    text = text.strip()
    if not text:
        return FaultsConfig()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{ENV}: not a JSON object ({e.msg} at character {e.pos})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{ENV}: not a JSON object")
    else:
        raw = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"{ENV}: {item.strip()!r} is not key=value (pairs separated by commas)")
            value = value.strip()
            raw[key.strip()] = None if value.lower() in ("null", "none") else value
    faults = FaultsConfig(**typed(FaultsConfig, raw, ENV))
    stop_signal(faults.signal)
    nan_target(faults.nan_into)
    check_point(faults.at_point, faults.point_action, faults.point_hit)
    return faults


def from_env(environ: Mapping[str, str] | None = None) -> FaultsConfig:
    """The faults ``LOWPREC_FAULTS`` asks for in ``environ`` (default ``os.environ``; unset: no fault); raises
    ``ConfigError`` for a bad value (``parse``)."""
    return parse((os.environ if environ is None else environ).get(ENV, ""))


#: ``point_action``: what happens at ``at_point``.
POINT_ACTIONS = ("kill", "stop")


def check_point(name: str | None, action: str, hit: int) -> None:
    """``at_point``/``point_action``/``point_hit`` checked; raises ``ConfigError`` naming the bad one."""
    if name is not None and name not in fault_points.POINTS:
        raise ConfigError(f"{ENV}: at_point={name} is not one of {', '.join(fault_points.POINTS)}")
    if action not in POINT_ACTIONS:
        raise ConfigError(f"{ENV}: point_action={action} is not one of {', '.join(POINT_ACTIONS)}")
    if hit < 1:
        raise ConfigError(f"{ENV}: point_hit={hit} must be >= 1 (1: the first time the point is reached)")


def stop_signal(name: str) -> int:
    """The signal ``signal`` names; raises ``ConfigError`` for one that is not a stop signal."""
    known = {signal.Signals(s).name: s for s in STOP_SIGNALS}
    if name not in known:
        raise ConfigError(f"{ENV}: signal={name} is not one of {', '.join(known)}")
    return known[name]


#: ``nan_into``: where a NaN fault lands.
NAN_TARGETS = ("weight", "activation", "gradient")


def nan_target(name: str) -> str:
    """``nan_into`` checked; raises ``ConfigError`` for another value."""
    if name not in NAN_TARGETS:
        raise ConfigError(f"{ENV}: nan_into={name} is not one of {', '.join(NAN_TARGETS)}")
    return name


class InjectedCrash(RuntimeError):
    """Raised by ``crash_at_step``."""


def fault_hooks(faults: FaultsConfig, recipe_name: str) -> list[StepHook]:
    """Step hooks for the faults that target ``recipe_name`` (``faults.recipe`` None targets every run); arms
    ``faults.at_point`` too (``arm_point``), so a point fault follows the same targeting."""
    fault_points.disarm()  # a point armed for an earlier run of this process (an in-process ablation) is not this one's
    if faults.recipe not in (None, recipe_name):
        return []
    if faults.at_point is not None:
        arm_point(faults.at_point, faults.point_action, int(faults.point_hit))
    hooks: list[StepHook] = []
    if faults.crash_at_step is not None:
        at = int(faults.crash_at_step)

        def crash(step: int, built: Built) -> None:
            if step == at:
                raise InjectedCrash(f"injected crash before step {step} ({ENV} crash_at_step)")

        hooks.append(crash)
    if faults.nan_at_step is not None:
        hooks.append(nan_hook(int(faults.nan_at_step), int(faults.nan_steps), nan_target(faults.nan_into)))
    if faults.fp8_overflow_at_step is not None:
        at, n = int(faults.fp8_overflow_at_step), int(faults.fp8_overflow_steps)
        hooks.append(fp8_overflow_hook(at, n, faults.fp8_overflow_layer, float(faults.fp8_overflow_factor)))
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


def arm_point(name: str, action: str, hit: int = 1) -> None:
    """Arm the named point ``name`` (``lowprec.train.fault_points.POINTS``: inside a checkpoint save, or the metric
    flush) in this process: the ``hit``-th time the code reaches it, ``action`` happens there:

    - ``kill``: SIGKILL to this process (a real ``kill -9`` at that place: no handler, no flush, no cleanup);
    - ``stop``: SIGSTOP to this process, so that a harness that waits for the stopped state injects its fault at
      that place (SIGKILL, a disk filled to the last byte, a file system remounted read-only) and then sends
      SIGCONT: the run goes on into the fault (benchmarks/faults.py).

    Under torchrun each rank counts and acts for itself (``save.trainer_state`` and later save points, and
    ``log.flush``, are reached on rank 0 only). Raises ``ConfigError`` for an unknown point or action.
    """
    check_point(name, action, hit)
    seen = [0]
    signum = signal.SIGKILL if action == "kill" else signal.SIGSTOP

    def act(point: str) -> None:
        seen[0] += 1
        if seen[0] == hit:
            os.kill(os.getpid(), signum)

    fault_points.arm(name, act)


def nan_hook(at: int, steps: int, into: str) -> StepHook:
    """Poison steps ``at`` .. ``at + steps - 1``, each the first time it runs, with a NaN ``into``:

    - ``weight``: the final norm's weight is filled with NaN before the step (it stays NaN until a checkpoint is
      reloaded);
    - ``activation``: one element of the final norm's output is NaN in the step's training forward (validation and
      the saved-bytes probe run clean), so the loss is NaN;
    - ``gradient``: the final norm weight's gradient is NaN in the step's backward, so the loss is finite and the
      gradient norm NaN.
    """
    fired: set[int] = set()
    armed = [False]
    installed: list = []

    def activation(mod, inputs, out):
        if not (armed[0] and mod.training):
            return out
        out = out.clone()
        out.view(-1)[0] = float("nan")
        return out

    def gradient(grad):
        return torch.full_like(grad, float("nan")) if armed[0] else grad

    def poison(step: int, built: Built) -> None:
        if not installed:  # on the built model, once
            norm = built.model.norm
            if into == "activation":
                installed.append(norm.register_forward_hook(activation))
            elif into == "gradient":
                installed.append(norm.weight.register_hook(gradient))
            else:
                installed.append(None)
        armed[0] = at <= step < at + steps and step not in fired
        if armed[0]:
            fired.add(step)
            if into == "weight":
                with torch.no_grad():
                    built.model.norm.weight.fill_(float("nan"))

    return poison


def fp8_overflow_hook(at: int, steps: int, layer: str | None, factor: float) -> StepHook:
    """Scale the input of the FP8 linear ``layer`` (default: the first one converted) by ``factor ** (k + 1)`` in the
    training forward of step ``at + k``, k = 0 .. ``steps`` - 1: each step's amax is ``factor`` times the last, so a
    delayed-scaling layer (whose scale comes from earlier amaxes) saturates on every one of those steps, as after a
    sudden jump of its activations."""
    state = {"k": -1, "handle": None}

    def scale_input(mod, args):
        if state["k"] < 0 or not mod.training:
            return None
        return (args[0] * factor ** (state["k"] + 1), *args[1:])

    def overflow(step: int, built: Built) -> None:
        if state["handle"] is None:
            fqn = layer or (built.fp8_fqns[0] if built.fp8_fqns else None)
            if fqn is None or fqn not in built.fp8_fqns:
                raise ConfigError(f"{ENV}: fp8_overflow_layer={fqn} is not an FP8 linear of recipe {built.recipe.name}")
            state["handle"] = built.model.get_submodule(fqn).register_forward_pre_hook(scale_input)
        state["k"] = step - at if at <= step < at + steps else -1

    return overflow
