"""Known-answer checks: a registry of checks whose verdict is known in advance, and how a verdict is reached.

A check is a function with no arguments that measures one effect on paired draws (seeds, random draws) and returns
``Paired``: the per-draw values of the *recipe* (the configuration expected to differ) and of the *control*, draw i
paired with draw i. ``judge`` turns them into a verdict with the lab's own statistics (``lowprec_lab.stats``), and
the check passes when that verdict is the one registered as ``expected``. A check registers itself with the
``known_answer`` decorator; ``lowprec_lab.selfcheck.runner`` runs the registered checks and formats the table.

Verdicts (the vocabulary of ``lowprec_lab.stats.verdict``, so a known-answer check exercises the same decision
rule as the ablation report): the effect is the recipe's *loss* against the control, > 0 when the recipe is worse,
with its two-sided 95% paired t-interval ``[lo, hi]``, compared with a margin > 0 in the effect's unit:

- ``inferior``: ``lo > +margin`` (the recipe is worse than the control by more than the margin);
- ``non-inferior``: ``hi < +margin`` (the recipe is not worse by as much as the margin);
- ``inconclusive``: neither; ``no-interval``: one draw; ``error``: the check raised.

Two scales of the loss (``Paired.scale``):

- ``relative`` (training checks; lower is better, e.g. final validation loss in nats): the per-seed relative
  difference ``(recipe - control) / control`` through ``lowprec_lab.stats.verdicts`` (CONSORT non-inferiority rule,
  paired t-interval, with ``correction="none"``: each check is its own question, not one of a family of recipes
  against one control), margin relative (0.01 = 1%).
- ``difference`` (numeric checks; e.g. SQNR in dB, higher is better): the per-draw absolute loss, ``control -
  recipe`` when higher is better, ``recipe - control`` otherwise, in the values' unit; its paired t-interval
  (``scipy.stats.ttest_1samp(d).confidence_interval``, the method of ``lowprec_lab.stats.paired``) goes through
  ``lowprec_lab.stats.ci_verdict``, margin in the same unit. For SQNR the loss is the *SQNR lost* by the recipe:
  ``inferior`` at margin 1 dB means the 95% paired interval of the SQNR difference lies entirely more than 1 dB on
  the recipe's worse side (its noise power is more than 1.26x the control's). There is no separate ``worse``
  verdict: a dB loss is a lower-is-better difference like any other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from lowprec_lab.stats.paired import check_level, t_interval
from lowprec_lab.stats.verdict import INCONCLUSIVE, INFERIOR, NO_INTERVAL, NON_INFERIOR, ci_verdict, verdicts

#: The verdict of a check that raised instead of returning its measurement.
ERROR = "error"
#: The verdicts a known-answer check may expect.
EXPECTABLE = (NON_INFERIOR, INFERIOR)
SCALES = ("relative", "difference")
#: Two-sided confidence level of every check's interval.
LEVEL = 0.95


@dataclass(frozen=True)
class Paired:
    """What a check function returns: paired per-draw values of the recipe and the control.

    Fields:
        recipe, control: 1-D sequences of n floats, draw (seed) i of the recipe paired with draw i of the control,
            in ``unit``. n >= 2 for an interval (one draw gives ``no-interval``, which no check can expect).
        margin: > 0; relative (0.01 = 1%) for ``scale="relative"``, in ``unit`` for ``scale="difference"``.
        scale: ``"relative"`` (lower is better, control values > 0; ``lowprec_lab.stats.verdicts``) or
            ``"difference"`` (absolute loss in ``unit``); see the module docstring.
        higher_is_better: the values improve upward (SQNR); only with ``scale="difference"``.
        unit: the values' unit, e.g. ``"dB"`` or ``"nats"``.
        metric: what the values are, e.g. ``"SQNR of the GEMM output vs FP64"`` or ``"final val loss"``.
        recipe_label, control_label: short names of the two arms for the table (e.g. ``"no promotion"``).
        detail: extra measured facts for the table (one line), appended after the two means.
    """

    recipe: Sequence[float]
    control: Sequence[float]
    margin: float
    scale: str = "relative"
    higher_is_better: bool = False
    unit: str = ""
    metric: str = ""
    recipe_label: str = "recipe"
    control_label: str = "control"
    detail: str = ""


@dataclass(frozen=True)
class CheckResult:
    """One known-answer check's outcome (one row of the table).

    Fields:
        name: the check's registered name. expected: the verdict it must reach (one of ``EXPECTABLE``).
        verdict: the verdict reached (``lowprec_lab.stats.VERDICTS`` or ``ERROR``).
        effect: mean paired loss of the recipe against the control (> 0 = recipe worse), or None (error).
        lo, hi: its two-sided 95% paired t-interval, None with one draw or on error.
        unit: what ``effect`` measures, e.g. ``"GEMM SQNR lost (control - recipe), dB"``.
        margin: the margin the interval was compared with, in the effect's unit (None on error).
        margin_unit: the margin's unit (``"dB"``), ``""`` when relative (0.01 = 1%).
        n: paired draws. passed: ``verdict == expected``.
        detail: the measured figures (means of both arms, extra facts) or the error's one line.
        why: one line: why this configuration makes the effect visible.
        seconds: wall time of the check. error: the traceback when the check raised, else None.
    """

    name: str
    expected: str
    verdict: str
    effect: float | None
    lo: float | None
    hi: float | None
    unit: str
    margin: float | None
    margin_unit: str
    n: int
    passed: bool
    detail: str
    why: str
    seconds: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class KnownAnswer:
    """A registered check: ``fn() -> Paired``, the verdict it must reach, whether ``--quick`` runs it, and why."""

    name: str
    expected: str
    quick: bool
    why: str
    fn: Callable[[], Paired] = field(repr=False)


class Registry:
    """Known-answer checks by name, in registration order. ``REGISTRY`` is the one ``lowprec selfcheck`` runs;
    tests build their own."""

    def __init__(self) -> None:
        self._checks: dict[str, KnownAnswer] = {}

    def add(self, check: KnownAnswer) -> KnownAnswer:
        """Register ``check``. Raises ValueError for a duplicate name or an ``expected`` not in ``EXPECTABLE``."""
        if check.expected not in EXPECTABLE:
            raise ValueError(f"check {check.name!r}: expected={check.expected!r} must be one of {EXPECTABLE}")
        if check.name in self._checks:
            raise ValueError(f"a known-answer check named {check.name!r} is already registered")
        self._checks[check.name] = check
        return check

    def known_answer(self, name: str, *, expected: str, why: str, quick: bool = False):
        """Decorator registering ``fn() -> Paired`` as the check ``name`` (see ``known_answer``); returns ``fn``."""

        def register(fn: Callable[[], Paired]) -> Callable[[], Paired]:
            self.add(KnownAnswer(name=name, expected=expected, quick=quick, why=why, fn=fn))
            return fn

        return register

    def checks(self, quick: bool = False) -> list[KnownAnswer]:
        """The registered checks in order; only those registered with ``quick=True`` when ``quick``."""
        return [c for c in self._checks.values() if c.quick or not quick]

    def __iter__(self) -> Iterator[KnownAnswer]:
        return iter(self._checks.values())

    def __len__(self) -> int:
        return len(self._checks)


#: The checks ``lowprec selfcheck`` runs (filled by importing ``numeric`` and ``training``: ``runner.load_checks``).
REGISTRY = Registry()


def known_answer(name: str, *, expected: str, why: str, quick: bool = False):
    """Register ``fn() -> Paired`` in ``REGISTRY`` as a known-answer check.

    Args:
        name: unique name (the table's first column).
        expected: ``"inferior"`` (the recipe is worse than the control by more than ``Paired.margin``) or
            ``"non-inferior"`` (it is not worse by as much as the margin): see the module docstring.
        why: one line: why the configuration makes the effect visible (printed in the table).
        quick: run it in ``lowprec selfcheck --quick`` (and so in the test suite): seconds on one CPU thread.

    Raises:
        ValueError: duplicate name or an ``expected`` not in ``EXPECTABLE`` (at registration).
    """
    return REGISTRY.known_answer(name, expected=expected, why=why, quick=quick)


def judge(check: KnownAnswer, m: Paired, level: float = LEVEL, seconds: float = 0.0) -> CheckResult:
    """The verdict of ``check`` on its measurement ``m`` (rules: module docstring).

    Returns:
        ``CheckResult`` with the mean paired loss (> 0 = recipe worse), its ``level`` t-interval, the verdict and
        ``passed = verdict == check.expected``; ``detail`` gives each arm's mean in ``m.unit``.

    Raises:
        ValueError: unknown scale, ``higher_is_better`` with the relative scale, margin not finite and > 0,
            arrays not 1-D, of different lengths, empty or not finite (relative scale: see
            ``lowprec_lab.stats.paired.relative_differences``).
    """
    level = check_level(level)
    if m.scale not in SCALES:
        raise ValueError(f"check {check.name!r}: scale={m.scale!r} must be one of {SCALES}")
    margin = float(m.margin)
    if not (math.isfinite(margin) and margin > 0):
        raise ValueError(f"check {check.name!r}: margin={m.margin!r} must be finite and > 0")
    rec, ctl = np.asarray(m.recipe, dtype=np.float64), np.asarray(m.control, dtype=np.float64)
    if rec.ndim != 1 or ctl.ndim != 1 or rec.size != ctl.size or rec.size == 0:
        raise ValueError(
            f"check {check.name!r}: recipe and control must be 1-D, non-empty and paired draw by draw "
            f"(got shapes {rec.shape} and {ctl.shape})"
        )
    metric = m.metric or "value"
    if m.scale == "relative":
        if m.higher_is_better:
            raise ValueError(f"check {check.name!r}: the relative scale is lower-is-better; use scale='difference'")
        v = verdicts({check.name: (rec, ctl)}, margin, level, correction="none", metric=metric, bootstrap=False)
        v = v[check.name]
        effect, lo, hi, verdict = v.effect.mean, v.effect.lo, v.effect.hi, v.verdict
        unit, margin_unit = f"relative loss of {metric}, (recipe - control)/control", ""
    else:
        if not (np.isfinite(rec).all() and np.isfinite(ctl).all()):
            raise ValueError(f"check {check.name!r}: non-finite values (recipe {rec}, control {ctl})")
        d = ctl - rec if m.higher_is_better else rec - ctl
        effect = float(d.mean())
        lo, hi = t_interval(d, level)
        verdict = ci_verdict(lo, hi, margin)
        sign = "control - recipe" if m.higher_is_better else "recipe - control"
        unit = f"{metric} lost ({sign})" + (f", {m.unit}" if m.unit else "")
        margin_unit = m.unit
    u = f" {m.unit}" if m.unit else ""
    detail = (
        f"mean {metric}: {m.recipe_label} {rec.mean():.4g}{u}, {m.control_label} {ctl.mean():.4g}{u} "
        f"({rec.size} paired draws)"
    )
    if m.detail:
        detail += f"; {m.detail}"
    return CheckResult(
        name=check.name,
        expected=check.expected,
        verdict=verdict,
        effect=float(effect),
        lo=lo,
        hi=hi,
        unit=unit,
        margin=margin,
        margin_unit=margin_unit,
        n=int(rec.size),
        passed=verdict == check.expected,
        detail=detail,
        why=check.why,
        seconds=seconds,
    )


__all__ = [
    "ERROR",
    "EXPECTABLE",
    "INCONCLUSIVE",
    "INFERIOR",
    "LEVEL",
    "NON_INFERIOR",
    "NO_INTERVAL",
    "REGISTRY",
    "CheckResult",
    "KnownAnswer",
    "Paired",
    "Registry",
    "judge",
    "known_answer",
]
