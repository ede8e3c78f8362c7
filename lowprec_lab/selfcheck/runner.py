"""Run the known-answer checks and print their table: ``lowprec selfcheck [--quick]``.

Exit code 0 when every check reaches its expected verdict, 1 otherwise (a check that raised, or no check to run,
counts as a failure), 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from collections.abc import Sequence

from lowprec_lab.selfcheck import registry as _registry
from lowprec_lab.selfcheck.registry import ERROR, CheckResult, KnownAnswer, Registry, judge

#: Modules whose import registers checks in ``registry.REGISTRY``; ``training`` is optional.
CHECK_MODULES = ("lowprec_lab.selfcheck.numeric", "lowprec_lab.selfcheck.training")


def load_checks() -> Registry:
    """Import the check modules (``CHECK_MODULES``; a missing ``training`` module is skipped) and return
    ``registry.REGISTRY``. Raises whatever a present module raises on import."""
    for name in CHECK_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # the module exists but one of its imports is missing: a real error
                raise
    return _registry.REGISTRY


def run_check(check: KnownAnswer) -> CheckResult:
    """Run one check and judge it (``registry.judge``). A check that raises gives verdict ``error`` (failed), its
    one-line message in ``detail`` and the traceback in ``error``; nothing is raised."""
    t0 = time.perf_counter()
    try:
        measured = check.fn()
        return judge(check, measured, seconds=time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - reported as a failed check, traceback kept
        return CheckResult(
            name=check.name,
            expected=check.expected,
            verdict=ERROR,
            effect=None,
            lo=None,
            hi=None,
            unit="",
            margin=None,
            margin_unit="",
            n=0,
            passed=False,
            detail=f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
            why=check.why,
            seconds=time.perf_counter() - t0,
            error=traceback.format_exc(),
        )


def run_checks(quick: bool, registry: Registry | None = None, echo=None) -> list[CheckResult]:
    """Run the known-answer checks in registration order.

    Args:
        quick: only the checks registered with ``quick=True`` (seconds each on one CPU thread).
        registry: the checks to run; None: ``load_checks()`` (numeric, and training where present).
        echo: called with one progress line per finished check (e.g. ``print`` to stderr), or None.

    Returns:
        One ``CheckResult`` per check (failed ones included; a check never raises here).
    """
    reg = load_checks() if registry is None else registry
    out = []
    for check in reg.checks(quick):
        r = run_check(check)
        if echo is not None:
            echo(f"selfcheck: {r.name}: {r.verdict} ({'pass' if r.passed else 'FAIL'}, {r.seconds:.1f} s)")
        out.append(r)
    return out


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _num(x: float) -> str:
    return f"{x:+.3g}" if abs(x) < 1e4 else f"{x:+.3e}"


def format_effect(r: CheckResult) -> str:
    """``"+14.2 [+13.9, +14.5]"`` (mean loss and its 95% interval), ``"+0.2 (no interval)"``, or ``"-"``."""
    if r.effect is None:
        return "-"
    if r.lo is None or r.hi is None:
        return f"{_num(r.effect)} (no interval)"
    return f"{_num(r.effect)} [{_num(r.lo)}, {_num(r.hi)}]"


def format_table(results: Sequence[CheckResult]) -> str:
    """Markdown table, one row per check: name, expected verdict, verdict reached, effect with its 95% interval
    (> 0 = recipe worse), what the effect measures and the margin, pass/FAIL, the measured figures, why the
    configuration makes the effect visible; then one summary line."""
    head = "| check | expected | verdict | effect [95% CI] | effect measures (margin) | pass | measured | why |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in results:
        what = r.unit
        if r.margin is not None:
            what += f"; margin {r.margin:g}" + (f" {r.margin_unit}" if r.margin_unit else f" = {r.margin:.2%}")
        row = [
            r.name,
            r.expected,
            r.verdict,
            format_effect(r),
            what,
            "pass" if r.passed else "FAIL",
            r.detail,
            r.why,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    failed = [r.name for r in results if not r.passed]
    summary = f"{len(results) - len(failed)}/{len(results)} known-answer checks reached their expected verdict"
    if failed:
        summary += f"; failed: {', '.join(failed)}"
    return "\n".join(lines) + "\n\n" + summary


def exit_code(results: Sequence[CheckResult]) -> int:
    """0 when there is at least one result and every one passed, else 1."""
    return 0 if results and all(r.passed for r in results) else 1


def selfcheck_main(argv: Sequence[str], registry: Registry | None = None) -> int:
    """``lowprec selfcheck [--quick]``: run the checks, print the table to stdout (progress and tracebacks of
    checks that raised to stderr) and return the exit code (``exit_code``). argparse exits 2 on a bad argument."""
    p = argparse.ArgumentParser(prog="lowprec selfcheck", description="known-answer checks of the lab's verdicts")
    p.add_argument("--quick", action="store_true", help="only the fast checks (seconds on one CPU thread)")
    args = p.parse_args(list(argv))
    results = run_checks(args.quick, registry, echo=lambda s: print(s, file=sys.stderr, flush=True))
    if not results:
        print("lowprec selfcheck: no known-answer checks to run", file=sys.stderr)
        return 1
    print(format_table(results))
    for r in results:
        if r.error:
            print(f"\nselfcheck {r.name} raised:\n{r.error}", file=sys.stderr)
    return exit_code(results)
