"""Known-answer checks (``lowprec selfcheck``): cases whose verdict is known, run through the lab's statistics.

- ``registry``: ``Paired`` (what a check measures), ``CheckResult``, ``Registry`` and the ``known_answer`` decorator,
  ``judge`` (paired values -> verdict with ``lowprec_lab.stats``).
- ``numeric``: quick numeric checks of lowprec's FP8 code (limited-precision accumulation, scaling granularity).
- ``training``: training-based checks (optional module).
- ``runner``: ``run_checks``, ``format_table``, ``selfcheck_main`` (the CLI command).
"""

from lowprec_lab.selfcheck.registry import (
    REGISTRY,
    CheckResult,
    KnownAnswer,
    Paired,
    Registry,
    judge,
    known_answer,
)
from lowprec_lab.selfcheck.runner import format_table, load_checks, run_checks, selfcheck_main

__all__ = [
    "REGISTRY",
    "CheckResult",
    "KnownAnswer",
    "Paired",
    "Registry",
    "format_table",
    "judge",
    "known_answer",
    "load_checks",
    "run_checks",
    "selfcheck_main",
]
