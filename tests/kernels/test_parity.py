"""The two CPU paths compute the same numerics: ``cpu_kernels=emulated`` vs ``native`` over 20 training steps of
every recipe with low-precision GEMMs, judged against the spread that FP32 reordering alone causes.

The yardstick is measured here, not chosen: the same run under ``ReversedReductionOrder`` (every FP32 matmul
summing its contraction backwards). In a low-precision recipe a one-ulp FP32 change flips a few BF16/FP8
roundings and the trajectory drifts to that recipe's rounding-noise floor, so a recipe's own reordering spread
is the scale of "the same numerics"; on ``debug`` (K = 32) FP8 sums are exact in FP32 and reordering changes
nothing in an FP8 recipe, so the spread of ``bf16`` (the same model with BF16 GEMMs) is its floor. Native vs
emulated must stay within ``MULTIPLE`` times that spread. ``fp32`` itself must be bit-identical (its GEMMs are
never emulated).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks._support import max_gap, train_losses
from lowprec.recipes import CATALOG

MULTIPLE = 10


def _kernel_configurations() -> list[str]:
    """One recipe per distinct set of GEMM and attention kernels among the one-process catalog recipes with a
    low-precision GEMM: the kernels depend on the autocast dtype, the parameter dtype and the FP8 spec only, so
    recipes that differ in their optimizer or loss scaling (``bf16_adamw8bit``, ``bf16_master``,
    ``deepseek_v3``, ``fp16_noscale``, ...) run exactly the kernels of the first one listed. Transformer Engine
    runs on CUDA only; the FP8-communication recipes need FSDP2 (their distributed tests run on ``auto``)."""
    seen, out = set(), []
    for name, r in CATALOG.items():
        # fp32 and fp32_reordered (the reversed order is this test's yardstick) have no low-precision kernel
        if r.compute.autocast_dtype == "none" and r.weights.param_dtype == "fp32" and not r.fp8.enabled:
            continue
        if r.fp8.backend == "te" or "fp8" in (r.comm.weight_all_gather, r.comm.grad_reduce):
            continue
        if r.fp8.backend == "mx":  # block-scaled GEMMs have no CPU kernel: native and emulated are one code path
            continue
        fp8 = r.fp8
        if fp8.accum_mantissa_bits is not None:  # an emulated accumulator is its own GEMM on every path, any model
            fp8 = replace(fp8, accum_mantissa_bits=1, accum_rounding="nearest", accum_group=None)
        key = (r.compute.autocast_dtype, r.weights.param_dtype, fp8)
        if key not in seen:
            seen.add(key)
            out.append(name)
    return out


RECIPES = _kernel_configurations()

_RUNS: dict[tuple[str, str, bool], list[float]] = {}


def _losses(token_data, recipe: str, cpu_kernels: str, reorder: bool = False) -> list[float]:
    """``train_losses`` (deterministic: seed 0, one thread), each configuration trained once per process: ``fp32``'s
    and ``bf16``'s runs serve the floor and their own tests."""
    key = (recipe, cpu_kernels, reorder)
    if key not in _RUNS:
        _RUNS[key] = train_losses(token_data, recipe, cpu_kernels, reorder=reorder)
    return list(_RUNS[key])


@pytest.fixture(scope="module")
def floor(token_data) -> dict:
    """FP32-reordering spreads of ``fp32`` and ``bf16`` (the floor for recipes whose own spread is zero)."""
    out = {}
    for name in ("fp32", "bf16"):
        base = _losses(token_data, name, "emulated")
        out[name] = max_gap(base, _losses(token_data, name, "emulated", reorder=True))
    assert out["fp32"] > 0, "reversing the reduction order changed nothing: the yardstick is broken"
    return out


def test_fp32_is_bit_identical(token_data):
    assert _losses(token_data, "fp32", "emulated") == _losses(token_data, "fp32", "native")


@pytest.mark.parametrize("recipe", RECIPES)
def test_emulated_matches_native_within_reordering_spread(token_data, floor, recipe):
    emulated = _losses(token_data, recipe, "emulated")
    spread = max(max_gap(emulated, _losses(token_data, recipe, "emulated", reorder=True)), floor["bf16"])
    gap = max_gap(emulated, _losses(token_data, recipe, "native"))
    assert gap <= MULTIPLE * spread, (
        f"{recipe}: native vs emulated losses differ by {gap:.3g}, more than {MULTIPLE} x the FP32-reordering "
        f"spread {spread:.3g} (fp32's own spread: {floor['fp32']:.3g})"
    )
