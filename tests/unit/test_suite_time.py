"""The per-directory time the suite prints at its end (``tests/suite_time.py``)."""

from __future__ import annotations

from types import SimpleNamespace as R

from suite_time import per_directory, table


def test_each_test_counts_once_with_its_setup_call_and_teardown_under_its_directory():
    reports = [
        R(nodeid="tests/unit/test_a.py::test_x", when="setup", duration=1.0),
        R(nodeid="tests/unit/test_a.py::test_x", when="call", duration=2.0),
        R(nodeid="tests/unit/test_a.py::test_x", when="teardown", duration=0.5),
        R(nodeid="tests/faults/test_b.py::test_y[p]", when="call", duration=10.0),
        R(nodeid="tests/unit/test_c.py::test_z", when="setup", duration=0.25),  # skipped at setup: still counted
        R(nodeid="tests/unit/test_a.py", when="collect", duration=7.0),  # collection is not a test's time
    ]
    rows = per_directory(reports)
    assert list(rows) == ["tests/faults", "tests/unit"]  # largest first
    assert rows == {"tests/faults": (1, 10.0), "tests/unit": (2, 3.75)}
    lines = table(rows)
    assert lines[1].split() == ["tests/faults", "1", "0.17"] and lines[-1].split() == ["total", "3", "0.23"]
