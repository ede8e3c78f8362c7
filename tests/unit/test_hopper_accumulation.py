"""``benchmarks/hopper_accumulation.py`` without a GPU: the one-line refusal, the operands (exact e4m3 values,
prefixes of one another), the emulated table written as JSON, and the fit recovering the accumulator that
produced a measurement."""

from __future__ import annotations

import json

import pytest
import torch
from bench_scripts import assert_needs_cuda, load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("hopper_accumulation")


def test_without_cuda_it_exits_2_with_one_line():
    assert_needs_cuda("hopper_accumulation", timeout_s=120)


def test_operands_are_e4m3_values_and_prefixes(bench):
    for ds in bench.DATASETS:
        a, b = bench.operands(ds, 8, 4, 512, seed=1)
        assert torch.equal(a, a.to(torch.float8_e4m3fn).float()) and torch.equal(b, b.to(torch.float8_e4m3fn).float())
        a2, _ = bench.operands(ds, 8, 4, 512, seed=1)
        assert torch.equal(a, a2)
    pos, _ = bench.operands("positive", 8, 4, 512)
    assert bool((pos >= 0).all())
    out, _ = bench.operands("outliers", 8, 4, 512)
    assert int((out.abs().amax(0) > 20).sum()) == bench.OUTLIER_CHANNELS  # x100 channels, all in the first 256
    assert bool((out[:, 256:].abs() < 20).all())


def test_emulated_table_and_the_fit_recover_the_model(bench, tmp_path, capsys):
    out = tmp_path / "m.json"
    argv = ["--emulate", "--bits", "9", "--rounding", "truncate", "--group", "8"]
    assert (
        bench.main([*argv, "--k-max", "1024", "--block", "12", "--datasets", "gaussian,positive", "--out", str(out)])
        == 0
    )
    assert "gaussian" in capsys.readouterr().out
    measured = json.loads(out.read_text())
    assert measured["config"] == {
        "m": 12, "n": 12, "k_max": 1024, "block": 12, "seed": 0, "datasets": ["gaussian", "positive"]
    }  # fmt: skip
    rows = {(r["dataset"], r["k"], r["accumulation"]): r["block"] for r in measured["rows"]}
    assert len(rows) == 2 * 3 * 2
    # the emulated truncating accumulator: error grows with K, promotion every 128 removes most of it
    assert rows[("positive", 1024, "fast")]["rel_err"] > 2 * rows[("positive", 256, "fast")]["rel_err"]
    assert rows[("positive", 1024, "promoted")]["rel_err"] < rows[("positive", 1024, "fast")]["rel_err"] / 3
    grid = {"bits": (8, 9, 10), "rounding": ("nearest", "truncate"), "group": (None, 8)}
    ranking = bench.fit_accumulator(measured, grid)
    best = ranking[0]
    assert (best["bits"], best["rounding"], best["group"]) == (9, "truncate", 8)
    assert best["score"] == 0 and best["max_factor"] == 1
    assert ranking[1]["score"] > 0 and len(ranking) == 12
    bench.print_fit(ranking, measured)
    measured["rows"][0]["operands"] += 1.0  # operands regenerated differently (another torch's random numbers)
    with pytest.raises(ValueError, match="gaussian operands regenerated here differ"):
        bench.fit_accumulator(measured, grid)
    assert "rounding='truncate'" in capsys.readouterr().out


def test_the_measurement_runs_its_scaled_mm_calls_on_a_cpu(bench):
    # the CUDA path's calls, layouts and statistics, on CPU _scaled_mm (FP32 accumulation: errors near FP32's)
    args = bench.argparse.Namespace(datasets=["gaussian"], m=32, n=16, k_max=512, block=8, seed=0)
    rows = bench.measure(args, "cpu")
    assert [(r["k"], r["accumulation"]) for r in rows] == [
        (256, "fast"),
        (256, "promoted"),
        (512, "fast"),
        (512, "promoted"),
    ]
    assert all(r["full"]["rel_err"] < 1e-6 and r["block"]["max_rel_err"] <= r["full"]["max_elem_rel_err"] for r in rows)
    assert rows[2]["full"]["rel_err"] > 0  # FP32 rounding of a K = 512 sum, against FP64
