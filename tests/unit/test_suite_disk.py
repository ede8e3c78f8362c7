"""The suite removes a passing test's temporary folder at once (pyproject.toml's pytest settings): kept to the end,
the folders held ~1.5 GB and filled CI's disk."""

from __future__ import annotations


def test_a_passing_tests_tmp_path_is_removed_and_a_failing_ones_kept(pytestconfig):
    assert pytestconfig.getini("tmp_path_retention_policy") == "failed"
