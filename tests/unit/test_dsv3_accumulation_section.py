"""The DeepSeek-V3 study's "accumulation vs K" section takes its accumulator from one place,
``lowprec.float8.accumulator.HOPPER_ACCUMULATOR``, and says where its parameters come from."""

from __future__ import annotations

from lowprec.float8.accumulator import HOPPER_ACCUMULATOR, AccumulatorModel
from lowprec_lab.studies import deepseek_numerics as dn
from lowprec_lab.studies import deepseek_v3 as study

SETTINGS = study.Settings(k_max=4096, gemm_rows=8, intervals=(128,))


def test_section_reports_the_accumulator_and_its_source(tmp_path, monkeypatch):
    lines, _ = study._accumulation_section(None, "", SETTINGS, tmp_path)
    text = "\n".join(lines)
    assert HOPPER_ACCUMULATOR.describe() in text and HOPPER_ACCUMULATOR.source in text
    assert HOPPER_ACCUMULATOR.fitted and "H200" in HOPPER_ACCUMULATOR.source  # fitted to a measurement (README)

    unfitted = AccumulatorModel(14, "nearest", None, source="DeepSeek-V3 3.3.2", fitted=False)
    monkeypatch.setattr(dn, "HOPPER_ACCUMULATOR", unfitted)
    lines, head = study._accumulation_section(None, "", SETTINGS, tmp_path)
    text = "\n".join(lines)
    assert "not fitted to a measurement" in text and unfitted.describe() in text
    assert head["accumulator"]["bits"] == 14

    fitted = AccumulatorModel(12, "truncate", 32, source="fitted to a test GPU, 2026-01-01, cmd", fitted=True)
    monkeypatch.setattr(dn, "HOPPER_ACCUMULATOR", fitted)
    lines, head2 = study._accumulation_section(None, "", SETTINGS, tmp_path)
    text = "\n".join(lines)
    assert fitted.describe() in text and "fitted to a test GPU, 2026-01-01, cmd" in text
    assert "not fitted" not in text
    assert head2["accumulator"] == {**vars(fitted), "describe": fitted.describe()}
    # the section ran the fitted accumulator: a truncating 12-bit one loses far more than the default
    assert head2["k4096_no_promotion_max_rel_err"] > 5 * head["k4096_no_promotion_max_rel_err"]


def test_accumulation_errors_default_to_the_hopper_accumulator():
    a, b = dn.gaussian_operands(4, 4, 256)
    model = AccumulatorModel(HOPPER_ACCUMULATOR.bits, HOPPER_ACCUMULATOR.rounding, HOPPER_ACCUMULATOR.group)
    assert dn.accumulation_errors(a, b, [256], [None], "g") == dn.accumulation_errors(a, b, [256], [None], "g", model)
    other = dn.accumulation_errors(a, b, [256], [None], "g", AccumulatorModel(6, "floor", 8))
    assert other[0].rel_err > 10 * dn.accumulation_errors(a, b, [256], [None], "g")[0].rel_err


def test_headline_row_names_the_accumulator_the_section_ran(tmp_path):
    """The headline's accumulation row once said "14-bit accumulator" (the paper's H800) whatever the section ran;
    it names the emulated accumulator measured (``HOPPER_ACCUMULATOR``, 13 bits since the H200 fit)."""
    _, head = study._accumulation_section(None, "", SETTINGS, tmp_path)
    (row,) = [r for r in study._headline_table({"accumulation": head, "models": {}}, 0.0025) if "K = 4096" in r]
    assert f"measured: {HOPPER_ACCUMULATOR.describe()}" in row and "14-bit accumulator" not in row
    assert f"{100 * head['k4096_no_promotion_max_rel_err']:.3f}%" in row


def test_section_names_the_training_arm_on_the_same_accumulator(tmp_path):
    """Section 1 measures ``HOPPER_ACCUMULATOR``; the experiments train their no-promotion arm on it, and the section
    says which arm that is."""
    lines, _ = study._accumulation_section(None, "", SETTINGS, tmp_path)
    text = "\n".join(lines)
    assert study.HOPPER_ARM == "deepseek_v3_no_promotion_hopper"
    assert "section 4's `deepseek_v3_no_promotion_hopper` trains `deepseek_v3` without promotion" in text
    assert "fitted Hopper accumulator" in study.COMPONENT_CLAIMS[study.HOPPER_ARM]
    # an ablation without the arm (the full experiment on a CPU): the section says it was not trained and how to
    lines, _ = study._accumulation_section(None, "", SETTINGS, tmp_path, trained=False)
    text = "\n".join(lines)
    assert "section 4's" not in text
    assert "`deepseek_v3_no_promotion_hopper` trains `deepseek_v3` without promotion" in text
    assert "it is not in this ablation" in text and "Add it to `recipes` to train it." in text
