"""``benchmarks/gpu_suite.py`` without a GPU: the one-line refusal, and the pieces that need no GPU (layout
defaults, the command line it hands to ``lowprec train``, the per-GPU arithmetic of a result row, the published
rows beside it)."""

from __future__ import annotations

import argparse

import pytest
import torch
from bench_scripts import assert_needs_cuda, load_script

from lowprec.estimate.cost_model import Layout, step_cost
from lowprec.estimate.estimator import flops_per_token
from lowprec.estimate.hardware import get_hardware
from lowprec.model import model_args
from lowprec.recipes import get_recipe
from lowprec_lab.cli import compose


@pytest.fixture(scope="module")
def suite():
    return load_script("gpu_suite")


def test_without_cuda_it_exits_2_with_one_line():
    assert_needs_cuda("gpu_suite", timeout_s=300)


def test_layout_defaults(suite):
    assert suite.default_model(1) == "llama3_1b" and suite.default_model(8) == "llama3_8b"
    one, eight = suite.default_recipes(1), suite.default_recipes(8)
    assert one[0] == "bf16" and {"fp8_tensorwise", "fp8_blockwise", "te_delayed", "te_blockwise"} <= set(one)
    assert "fp8_comm8" not in one and {"fp8_comm8", "fp8_tensorwise_fsdp8"} <= set(eight)
    assert all(get_recipe(n).fp8.enabled for n in eight[1:])
    assert suite.skip_reason("fp8_comm8", 1) == "FP8 communication needs FSDP2 (2+ GPUs)"
    if not torch.cuda.is_available():
        assert suite.skip_reason("nvfp4", 1).startswith("block-scaled GEMMs (MXFP8/MXFP4/NVFP4) need Blackwell sm100")


def test_overrides_compose_to_compile_selective_ac_fsdp2(suite, tmp_path):
    a = argparse.Namespace(steps=50, local_batch=1, seq=8192, warmup=10)
    cfg = compose("train", suite.overrides("fp8_rowwise", "llama3_8b", 8, a, tmp_path))
    assert cfg.train.compile is True and cfg.train.ac == "selective" and cfg.parallel.dp_shard == 8
    assert (cfg.train.batch_size, cfg.train.seq_len, cfg.train.steps) == (8, 8192, 50)
    assert cfg.device == "cuda" and cfg.model.name == "llama3_8b" and cfg.recipe.name == "fp8_rowwise"


def test_result_row_is_per_gpu_and_sits_beside_published(suite):
    hw = get_hardware("h100")
    metrics = {"mean_tokens_per_s": 8 * 6000.0, "mem_peak_bytes": 40 * 2**30, "final_val_loss": 5.0}
    row = suite.summarize("bf16", "llama3_8b", 8, 8192, 1, metrics, [9.0, 7.0, 6.0], hw)
    fl = flops_per_token(model_args("llama3_8b"), 8192, get_recipe("bf16")).flops_per_token
    assert row["tokens_per_s_per_gpu"] == 6000.0 and row["peak_mem_gib"] == 40.0 and row["final_loss"] == 6.0
    assert row["mfu"] == pytest.approx(fl * 6000 / 1e12 / hw.bf16_tflops) == row["mfu_vs_bf16_peak"]
    pub = suite.published_for("bf16", "llama3_8b", 8, 1, 8192, 6000.0)
    assert [p["tokens_per_s_per_gpu"] for p in pub] == [6667, 6150] and all(p["same_setup"] for p in pub)
    assert pub[0]["measured_over_published"] == pytest.approx(6000 / 6667)
    assert not suite.published_for("bf16", "llama3_1b", 1, 1, 8192, 6000.0)[0]["same_setup"]
    # the prediction is the cost model's for the suite's layout, not the flat 40% efficiency
    want = step_cost(model_args("llama3_8b"), get_recipe("bf16"), hw, Layout(8, 1, 1, 8192, "selective", True))
    assert row["predicted_tokens_per_s_per_gpu"] == want.tokens_per_s_per_gpu
    assert row["measured_over_predicted"] == pytest.approx(6000.0 / want.tokens_per_s_per_gpu)
    assert sum(row["predicted_step_parts_s"].values()) == pytest.approx(want.step_time_s)
    assert 30 < row["predicted_allocated_gib"] < 80
    assert (
        suite.predicted(model_args("llama3_8b"), get_recipe("fp8_tensorwise"), 8, 1, 8192, get_hardware("a100")) is None
    )
    assert suite.published_for("fp8_current", "llama3_8b", 8, 1, 8192, 6000.0) == []
