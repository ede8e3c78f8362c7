"""The per-op cost model and its calibration on published measurements.

The validation tests read ``lowprec/estimate/published.yaml``: every held-out point must be predicted within
15%, and the predicted recipe order must be
the published one wherever a source measured several recipes in one layout."""

import dataclasses
import math

import pytest

from lowprec.estimate.cost_model import D0, Calibration, Layout, fsdp_comm_bytes, gemm_time, step_cost
from lowprec.estimate.hardware import get_hardware
from lowprec.estimate.memory_model import FRAGMENTATION, peak_breakdown
from lowprec.model import model_args
from lowprec.recipes import get_recipe
from lowprec_lab.cli import main
from lowprec_lab.sizing.cost_validation import (
    FITTED,
    fit_calibration,
    fit_fragmentation,
    load_points,
    predict_allocated_gib,
    recipe_ranking,
    summary,
    validate,
)
from lowprec_lab.sizing.estimate import MODEL_ERROR


@pytest.fixture(scope="module")
def rows():
    return validate()


def test_the_data_file_has_at_least_12_sourced_points():
    pts = load_points()
    assert len(pts) >= 12 and len({p.id for p in pts}) == len(pts)
    assert all(p.url.startswith("https://github.com/pytorch/") and p.table for p in pts)
    fit = [p for p in pts if p.split == "fit"]
    assert len(fit) == len(FITTED) and len(pts) - len(fit) >= 12


def test_held_out_points_are_within_15_percent(rows):
    for r in rows:
        if r.point.split != "held_out":
            continue
        assert abs(r.error) <= 0.15, (r.point.id, r.predicted, r.point.published)


def test_predicted_recipe_ranking_is_the_published_one(rows):
    pred, pub = recipe_ranking(rows, "predicted"), recipe_ranking(rows, "published")
    assert pred == pub
    # the order the issue asks for, on both vendors' torchao tables
    assert pub["ao/h100_96gb_500w/dp8xtp1/b1/compile"] == ["fp8_tensorwise_fsdp8", "fp8_rowwise", "bf16"]
    assert pub["ao/mi300x/dp8xtp1/b1/compile"] == ["fp8_tensorwise_fsdp8", "fp8_rowwise", "bf16"]


def test_shipped_calibration_is_the_fit_and_the_stated_error_is_the_table_s(rows):
    fitted = fit_calibration()
    for k in FITTED:
        assert getattr(fitted, k) == pytest.approx(getattr(Calibration(), k), rel=2e-3), k
    assert fit_fragmentation() == pytest.approx(FRAGMENTATION, rel=1e-3)
    assert MODEL_ERROR == pytest.approx(summary(rows)["held_out_max_abs_error"], abs=1e-3)


def test_a_wrong_calibration_fails_the_validation():
    """The validation can fail: FP8 GEMMs at 80% of the FP8 peak and rowwise as fast as tensorwise (the FP8
    gain the old peak blend implied) miss held-out points and break the granularity ranking."""
    bad = dataclasses.replace(Calibration(), gemm_eff_fp8=0.8, rowwise_gemm=1.0)
    rows = validate(bad, memory=lambda p: 1.0)
    assert summary(rows)["held_out_max_abs_error"] > 0.15


def test_memory_of_the_torchtitan_and_torchao_h100_points_within_15_percent(rows):
    for r in rows:
        p = r.point
        if p.memory_gib is not None and p.hardware.startswith("h100") and p.split == "held_out":
            assert abs(r.memory_error) <= 0.15, (p.id, r.predicted_memory_gib, p.memory_gib)


def test_gemm_time_from_first_principles():
    hw, cal = get_hardware("h100_sxm"), Calibration()
    m, k, n = 16384, 4096, 1024
    rate = 989e12 * cal.gemm_eff_bf16 * n / (n + D0["bf16"])
    assert gemm_time(m, k, n, "bf16", hw, cal) == pytest.approx(2 * m * k * n / rate)
    rate8 = 1979e12 * cal.gemm_eff_fp8 * n / (n + D0["fp8"])
    assert gemm_time(m, k, n, "fp8", hw, cal) == pytest.approx(2 * m * k * n / rate8)
    # a tiny GEMM is bandwidth bound: operands and output over 80% of 3.35 TB/s
    assert gemm_time(8, 8, 8, "bf16", hw, cal) >= (8 * 8 * 2 * 2 + 8 * 8 * 2) / (3.35e12 * 0.8)


def test_e2m1_recipes_run_at_the_fp4_peak_on_blackwell():
    b200, cal = get_hardware("b200"), Calibration()
    assert (b200.peak_tflops("fp4"), b200.peak_tflops("fp6"), get_hardware("gb200").peak_tflops("fp4")) == (
        9000.0,
        4500.0,
        10000.0,
    )
    with pytest.raises(ValueError, match="no fp4 peak"):
        get_hardware("h100").peak_tflops("fp4")
    m, k, n = 16384, 4096, 4096  # compute bound: twice the FP8 rate, the FP8 efficiency (nothing to fit FP4 on)
    rate4 = 9000e12 * cal.gemm_eff_fp8 * b200.gemm_rel_fp8 * n / (n + D0["fp8"])
    assert gemm_time(m, k, n, "fp4", b200, cal) == pytest.approx(2 * m * k * n / rate4)
    args, lo = model_args("llama3_8b"), Layout(dp_shard=8, batch=2, seq=8192, ac="selective")
    gemm = {r: step_cost(args, get_recipe(r), b200, lo).gemm for r in ("bf16", "mxfp8", "nvfp4")}
    assert gemm["nvfp4"] < gemm["mxfp8"] < gemm["bf16"]


def test_granularity_and_strategy_change_the_step():
    args, hw = model_args("llama3_8b"), get_hardware("h100_sxm")
    lo = Layout(dp_shard=8, batch=2, seq=8192, ac="selective")
    t = {n: step_cost(args, get_recipe(n), hw, lo) for n in ("bf16", "fp8_current", "fp8_delayed", "fp8_rowwise")}
    assert t["fp8_current"].step_time_s < t["fp8_rowwise"].step_time_s < t["bf16"].step_time_s
    # delayed scaling skips the amax pre-pass: one read of each high-precision tensor less
    assert t["fp8_delayed"].fp8_casts < t["fp8_current"].fp8_casts
    assert t["bf16"].fp8_casts == 0.0
    # eager (no compile) adds the separate transposed-copy kernel and the unfused elementwise chains
    eager = step_cost(args, get_recipe("fp8_current"), hw, dataclasses.replace(lo, compile=False))
    assert eager.fp8_casts > t["fp8_current"].fp8_casts and eager.kernels > t["fp8_current"].kernels
    with pytest.raises(ValueError, match="fp8"):
        step_cost(args, get_recipe("fp8_current"), get_hardware("a100"), lo)


def test_communication_bytes_and_overlap():
    args, hw = model_args("llama3_8b"), get_hardware("h100_sxm")
    one = step_cost(args, get_recipe("bf16"), hw, Layout(dp_shard=1, batch=1))
    assert one.fsdp_comm == one.tp_comm == one.exposed_comm == 0.0
    c8 = step_cost(args, get_recipe("bf16"), hw, Layout(dp_shard=8, batch=1))
    # the meter's bytes (fsdp_comm_bytes), ring (n-1)/n, over NVLink 450 GB/s
    ag, rs = fsdp_comm_bytes(args, get_recipe("bf16"))
    assert c8.fsdp_comm == pytest.approx((ag + rs) * 7 / 8 / 450e9)
    fp8ag = step_cost(args, get_recipe("fp8_tensorwise_fsdp8"), hw, Layout(dp_shard=8, batch=1))
    assert fp8ag.fsdp_comm < c8.fsdp_comm
    # across nodes the same bytes move at 50 GB/s per GPU
    c128 = step_cost(args, get_recipe("bf16"), hw, Layout(dp_shard=128, batch=1))
    assert c128.fsdp_comm == pytest.approx((ag + rs) * 127 / 128 / 50e9)
    a70 = model_args("llama3_70b")
    lo = Layout(dp_shard=32, tp=8, batch=16, seq=8192, ac="full")
    plain = step_cost(a70, get_recipe("fp8_tensorwise_fsdp8"), hw, lo)
    asyn = step_cost(a70, get_recipe("fp8_tensorwise_fsdp8"), hw, dataclasses.replace(lo, async_tp=True))
    assert plain.tp_comm > 0 and asyn.exposed_comm < plain.exposed_comm and asyn.step_time_s < plain.step_time_s


#: MiB per optimizer step on rank 0 measured by ``benchmarks/comm_bytes.py`` (lowprec's CommMeter, FSDP2 world
#: size 2, gloo): (all-gather, reduce-scatter). tiny: docs/gpu-node.md's table; debug: ``--model debug --steps 1``.
METERED = {
    ("tiny", "bf16"): (27.3, 31.0),
    ("tiny", "fp32"): (54.5, 31.0),
    ("tiny", "fp8_comm8"): (21.6, 8.0),
    ("tiny", "fp8_tensorwise_fsdp8"): (21.6, 31.0),
    ("debug", "bf16"): (2.047, 2.094),
    ("debug", "fp8_comm8"): (2.024, 0.540),
    ("debug", "deepseek_v3_comm8"): (2.026, 0.540),
}


@pytest.mark.parametrize("size, recipe", list(METERED))
def test_fsdp_bytes_are_the_metered_ones(size, recipe):
    ag, rs = fsdp_comm_bytes(model_args(size), get_recipe(recipe))
    want_ag, want_rs = METERED[size, recipe]
    assert ag / 2**20 == pytest.approx(want_ag, rel=0.005) and rs / 2**20 == pytest.approx(want_rs, rel=0.005)


def test_memory_model_adds_tp_buffers_working_set_and_fp8_copies():
    a70 = model_args("llama3_70b")
    pk = peak_breakdown(a70, get_recipe("fp8_tensorwise_fsdp8"), dp_shard=32, tp=8, batch=16, seq=8192, ac="full")
    assert pk.tp_buffers == 2 * 16 * 8192 * 8192 * 2
    assert pk.backward_working_set > 0 and pk.fp8_transposed > 0
    assert pk.allocated == pk.lower_bound + pk.backward_working_set + pk.tp_buffers + pk.fp8_transposed
    bf = peak_breakdown(model_args("llama3_8b"), get_recipe("bf16"), dp_shard=8, batch=2, seq=8192, ac="none")
    assert bf.tp_buffers == bf.fp8_transposed == bf.backward_working_set == 0
    # the 70B 2-D point the issue found 56.7 GiB short: now within 10% of torchtitan's 71.9 GiB
    p = next(p for p in load_points() if p.id == "tt_70b_256gpu_2d_fp8")
    assert abs(predict_allocated_gib(p) * FRAGMENTATION / 71.9 - 1) < 0.10


def test_cli_validate_prints_every_point_marked(capsys):
    assert main(["estimate", "--validate"]) == 0
    out = capsys.readouterr().out
    for p in load_points():
        assert p.id in out
    assert "held_out" in out and " fit " in out and "held-out points max" in out
    assert "matches the published one in every group" in out
    assert main(["estimate", "--validate", "model=llama3_8b"]) == 2


def test_layout_refuses_bad_fields():
    for kw, msg in (({"batch": 0}, "batch=0"), ({"ac": "sometimes"}, "ac='sometimes'"), ({"async_tp": True}, "tp > 1")):
        with pytest.raises(ValueError, match=msg):
            Layout(**kw)
    assert math.isfinite(
        step_cost(model_args("debug"), get_recipe("bf16"), get_hardware("h100"), Layout(seq=64)).step_time_s
    )


def test_the_estimator_pages_table_is_generated_from_the_data_file(rows):
    from lowprec_lab.sizing.cost_validation import TABLE_BEGIN, TABLE_END, markdown_table
    from lowprec_lab.sizing.fit_cost_model import estimator_page

    text = estimator_page().read_text()
    block = text[text.index(TABLE_BEGIN) + len(TABLE_BEGIN) : text.index(TABLE_END)].strip()
    assert block == markdown_table(rows)
    # the published points' corrections: torchtitan's batch 2, selective AC, the 96 GB / 500 W H100, FP8 all-gather
    row = next(line for line in block.splitlines() if "`tt_8b_8gpu_fp8`" in line)
    assert "batch 2" in row and "AC selective" in row and "h100_96gb_500w" in row and "`fp8_tensorwise_fsdp8`" in row


@pytest.mark.parametrize(("dtype", "mi300x", "h100"), [("bf16", 708.0, 794.5), ("fp8", 1273.0, 1402.6)])
def test_mi300x_gemms_run_at_amds_measured_ceiling_relative_to_the_h100s(dtype, mi300x, h100):
    # a large GEMM's achieved rate on MI300X over H100 SXM is AMD's MAF over Bekman's MAMF (hardware module doc),
    # with no fitted ROCm factor on GEMMs
    cal = Calibration()
    big = (16384, 8192, 8192)
    t_amd = gemm_time(*big, dtype, get_hardware("mi300x"), cal)
    t_nv = gemm_time(*big, dtype, get_hardware("h100_sxm"), cal)
    assert t_nv / t_amd == pytest.approx(mi300x / h100, rel=1e-9)
    assert gemm_time(*big, dtype, get_hardware("mi300x"), dataclasses.replace(cal, rocm_attention=0.1)) == t_amd
