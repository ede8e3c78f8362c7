"""Known-answer checks (``lowprec selfcheck``): the quick checks reach their expected verdicts, the CLI prints the
table and exits 0, and a check whose expectation is not met (or that raises) makes the exit code 1."""

from __future__ import annotations

import numpy as np
import pytest

from lowprec_lab.cli import main
from lowprec_lab.selfcheck.registry import (
    ERROR,
    INCONCLUSIVE,
    INFERIOR,
    NON_INFERIOR,
    Paired,
    Registry,
    judge,
)
from lowprec_lab.selfcheck.runner import exit_code, format_table, load_checks, run_checks, selfcheck_main


@pytest.fixture(scope="module")
def quick_results():
    return run_checks(quick=True)


def test_quick_checks_reach_expected_verdicts(quick_results):
    names = [r.name for r in quick_results]
    assert len(names) >= 4 and len(set(names)) == len(names)
    for r in quick_results:
        assert r.verdict == r.expected, (r.name, r.verdict, r.effect, r.lo, r.hi, r.detail, r.error)
        assert r.passed and r.error is None
        assert r.lo is not None and r.hi is not None and r.lo <= r.effect <= r.hi
        assert r.n >= 3 and r.why  # 8 random draws per numeric check, 3 seeds per training check
    assert exit_code(quick_results) == 0
    # the negative control is a real one: reversing the FP32 reductions changed the losses, and the rule kept it
    (neg,) = [r for r in quick_results if r.name.startswith("negative control")]
    assert "largest per-seed gap 0 nats" not in neg.detail and neg.verdict == "non-inferior"


def test_quick_subset_is_registered_quick():
    reg = load_checks()
    quick = {c.name for c in reg.checks(quick=True)}
    assert quick and quick <= {c.name for c in reg.checks(quick=False)}


def test_cli_selfcheck_quick_prints_table(capsys):
    assert main(["selfcheck", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| check | expected | verdict | effect [95% CI] |")
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    assert len(rows) == len(load_checks().checks(quick=True))
    assert all(
        ("| inferior | inferior |" in row or "| non-inferior | non-inferior |" in row) and "| pass |" in row
        for row in rows
    )
    assert "known-answer checks reached their expected verdict" in out and "failed:" not in out


def test_cli_selfcheck_rejects_bad_flag():
    with pytest.raises(SystemExit) as e:
        main(["selfcheck", "--slow"])
    assert e.value.code == 2


@pytest.fixture
def fake_registry():
    """A temporary registry: one check that reaches its expected verdict, one that does not, one that raises."""
    reg = Registry()

    @reg.known_answer("fake: same values, expected inferior", expected=INFERIOR, why="no effect exists", quick=True)
    def _miss():  # identical arms: the loss is 0 +- noise, never beyond the margin
        rng = np.random.default_rng(0)
        v = 30 + rng.normal(0, 0.1, 8)
        return Paired(v, v + rng.normal(0, 0.01, 8), margin=1.0, scale="difference", higher_is_better=True, unit="dB")

    @reg.known_answer("fake: loss 5 dB, expected inferior", expected=INFERIOR, why="5 dB lost", quick=True)
    def _hit():
        c = 30 + np.random.default_rng(1).normal(0, 0.1, 8)
        return Paired(c - 5, c, margin=1.0, scale="difference", higher_is_better=True, unit="dB")

    @reg.known_answer("fake: raises", expected=NON_INFERIOR, why="a bug", quick=False)
    def _boom():
        raise RuntimeError("broken check")

    return reg


def test_unmet_expectation_exits_1(fake_registry, capsys):
    assert selfcheck_main(["--quick"], registry=fake_registry) == 1
    out = capsys.readouterr().out
    assert "| fake: same values, expected inferior | inferior | non-inferior |" in out and "| FAIL |" in out
    assert "| fake: loss 5 dB, expected inferior | inferior | inferior |" in out
    assert "1/2 known-answer checks" in out and "failed: fake: same values, expected inferior" in out


def test_raising_check_fails_with_traceback(fake_registry, capsys):
    results = run_checks(quick=False, registry=fake_registry)
    boom = results[-1]
    assert boom.verdict == ERROR and not boom.passed and "RuntimeError: broken check" in boom.detail
    assert "Traceback" in boom.error
    assert selfcheck_main([], registry=fake_registry) == 1
    assert "RuntimeError: broken check" in capsys.readouterr().err


def test_passing_registry_exits_0_and_empty_exits_1(fake_registry):
    reg = Registry()
    hit = next(c for c in fake_registry if c.name.startswith("fake: loss"))
    reg.add(hit)
    assert selfcheck_main([], registry=reg) == 0
    assert selfcheck_main([], registry=Registry()) == 1


def test_registry_rejects_bad_registrations():
    reg = Registry()
    with pytest.raises(ValueError, match="expected"):
        reg.known_answer("x", expected="worse", why="")(lambda: None)
    reg.known_answer("x", expected=INFERIOR, why="")(lambda: None)
    with pytest.raises(ValueError, match="already registered"):
        reg.known_answer("x", expected=INFERIOR, why="")(lambda: None)


def test_relative_scale_uses_the_lab_verdicts():
    """A training-style check: per-seed losses (lower is better), relative margin, through ``stats.verdicts``."""
    reg = Registry()
    ctl = np.array([3.00, 3.10, 2.95, 3.05])

    @reg.known_answer("worse by ~5%", expected=INFERIOR, why="", quick=True)
    def _worse():
        return Paired(ctl * np.array([1.05, 1.051, 1.049, 1.05]), ctl, margin=0.01, unit="nats", metric="val loss")

    @reg.known_answer("same within 0.1%", expected=NON_INFERIOR, why="", quick=True)
    def _same():
        return Paired(ctl * np.array([1.001, 0.999, 1.0, 1.0005]), ctl, margin=0.01, unit="nats", metric="val loss")

    @reg.known_answer("noisy", expected=NON_INFERIOR, why="", quick=True)
    def _noisy():
        return Paired(ctl * np.array([1.03, 0.97, 1.02, 0.99]), ctl, margin=0.01, unit="nats", metric="val loss")

    worse, same, noisy = run_checks(quick=True, registry=reg)
    assert (worse.verdict, same.verdict, noisy.verdict) == (INFERIOR, NON_INFERIOR, INCONCLUSIVE)
    assert worse.effect == pytest.approx(0.05, abs=1e-3) and worse.lo > 0.01
    assert "relative" in worse.unit and "val loss" in worse.unit
    assert not noisy.passed and exit_code([worse, same, noisy]) == 1
    assert "| noisy | non-inferior | inconclusive |" in format_table([worse, same, noisy])


def test_judge_rejects_unpaired_or_bad_margin():
    reg = Registry()
    reg.known_answer("c", expected=INFERIOR, why="")(lambda: None)
    check = next(iter(reg))
    with pytest.raises(ValueError, match="paired"):
        judge(check, Paired([1.0, 2.0], [1.0], margin=1.0, scale="difference"))
    with pytest.raises(ValueError, match="margin"):
        judge(check, Paired([1.0, 2.0], [1.0, 2.0], margin=0.0, scale="difference"))
    with pytest.raises(ValueError, match="lower-is-better"):
        judge(check, Paired([1.0, 2.0], [1.0, 2.0], margin=0.1, higher_is_better=True))
