"""The suite's time per test directory, printed at the end of every pytest run (``tests/conftest.py``): where the
suite's minutes go, summed over setup, call and teardown of every test as the workers report them (under
pytest-xdist the sum is worker time, about twice the wall time on two workers)."""

from __future__ import annotations

from collections.abc import Iterable


def per_directory(reports: Iterable) -> dict[str, tuple[int, float]]:
    """``{directory: (tests, seconds)}`` from pytest reports (objects with ``nodeid``, ``when``, ``duration``):
    ``tests/unit/test_x.py::test_y`` counts under ``tests/unit``; a test counts once (its ``call`` report, or its
    ``setup`` when it never ran), its seconds are setup + call + teardown. Largest first."""
    seconds: dict[str, float] = {}
    tests: dict[str, set[str]] = {}
    for r in reports:
        when, nodeid = getattr(r, "when", None), getattr(r, "nodeid", "")
        if when not in ("setup", "call", "teardown") or "::" not in nodeid:
            continue
        path = nodeid.split("::", 1)[0].split("/")
        folder = "/".join(path[:2]) if len(path) > 2 else path[0]
        seconds[folder] = seconds.get(folder, 0.0) + float(r.duration)
        tests.setdefault(folder, set()).add(nodeid)
    return dict(sorted(((k, (len(tests[k]), s)) for k, s in seconds.items()), key=lambda kv: -kv[1][1]))


def table(rows: dict[str, tuple[int, float]]) -> list[str]:
    """The lines printed: one per directory (tests, minutes of worker time) and the total."""
    out = [f"{'directory':<22} {'tests':>6} {'worker min':>10}"]
    out += [f"{d:<22} {n:>6} {s / 60:>10.2f}" for d, (n, s) in rows.items()]
    total_n, total_s = sum(n for n, _ in rows.values()), sum(s for _, s in rows.values())
    out.append(f"{'total':<22} {total_n:>6} {total_s / 60:>10.2f}")
    return out
