"""The two CPU paths compute the same numerics: ``cpu_kernels=emulated`` vs ``native`` over ``STEPS`` training steps
of every recipe with low-precision GEMMs, judged against the spread that FP32 reordering alone causes.

The yardstick is measured here, not chosen: the same run under ``ReversedReductionOrder`` (every FP32 matmul
summing its contraction backwards). In a low-precision recipe a one-ulp FP32 change flips a few BF16/FP8
roundings and the trajectory drifts to that recipe's rounding-noise floor, so a recipe's own reordering spread
is the scale of "the same numerics"; on ``debug`` (K = 32) FP8 sums are exact in FP32 and reordering changes
nothing in an FP8 recipe, so the spread of ``bf16`` (the same model with BF16 GEMMs) is its floor. Native vs
emulated must stay within ``MULTIPLE`` times that spread. ``fp32`` itself must be bit-identical (its GEMMs are
never emulated).
"""

from __future__ import annotations

import pytest

from benchmarks._support import max_gap, train_losses
from lowprec.recipes import CATALOG

MULTIPLE = 10
#: The spread and the gap are measured over the same steps, so they shrink together in a shorter run; the native FP8
#: runs (CPU ``_scaled_mm`` without FP8 instructions) are the slow part of this file, so the runs are kept short.
STEPS = 10


def _kernel_key(r) -> tuple:
    """What decides which scaled-matmul calls (or which torchao FP8 linear) a recipe's training step makes, and so
    what ``cpu_kernels`` switches: the autocast and parameter dtypes, the FP8 backend, the operand granularities
    (``scaling``, ``grad_output_granularity``), the FP8 formats and whether K is cut into promotion chunks.
    Everything else in the FP8 spec changes only the values fed to the same calls: how scales are chosen
    (``strategy``, ``amax_floor``, ``power_of_2_scales``, history, static scales) and what is saved for backward
    (``cache_fp8_activations``, ``e5m6_inputs``, ``swiglu_cache``: casts and elementwise recomputes, no GEMM)."""
    f = r.fp8
    scaling = (
        (f.scaling, f.cast.grad_output_granularity, f.cast.fp8_format, f.gemm.promotion_interval) if f.enabled else None
    )
    return r.compute.autocast_dtype, r.weights.param_dtype, f.backend, scaling


def _kernel_configurations() -> list[str]:
    """One recipe per distinct set of GEMM and attention kernels (``_kernel_key``) among the one-process catalog
    recipes with a low-precision GEMM: recipes that differ in their optimizer or loss scaling (``bf16_adamw8bit``,
    ``bf16_master``, ``fp16_noscale``, ...) or only in the values their FP8 casts produce (``fp8_delayed`` and
    ``fp8_unscaled`` run ``fp8_current``'s calls; ``deepseek_v3`` and ``deepseek_v3_no_fp8_cache`` run
    ``fp8_blockwise``'s) run exactly the kernels of the first one listed. Transformer Engine runs on CUDA only;
    the FP8-communication recipes need FSDP2 (their distributed tests run on ``auto``).

    ``deepseek_v3_tensorwise`` is left out: its calls are ``fp8_current``'s forward call (TensorWise e4m3 x e4m3)
    and, for the weight gradient, tensorwise operands cut into 128-wide promotion chunks; its native tensorwise
    GEMMs cost 30 s on a 2-core CPU, and that chunked call is checked by itself in
    ``test_single_gemms.test_fp8_gemm_kernels_agree`` (``tensorwise-chunked``)."""
    seen, out = set(), []
    for name, r in CATALOG.items():
        # fp32 and fp32_reordered (the reversed order is this test's yardstick) have no low-precision kernel
        if r.compute.autocast_dtype == "none" and r.weights.param_dtype == "fp32" and not r.fp8.enabled:
            continue
        if r.fp8.backend == "te" or "fp8" in (r.comm.weight_all_gather, r.comm.grad_reduce):
            continue
        if r.fp8.backend == "mx":  # block-scaled GEMMs have no CPU kernel: native and emulated are one code path
            continue
        # an emulated accumulator (deepseek_v3_no_promotion*) is one FP32 computation whatever cpu_kernels says
        # (fp8_gemm's limited accumulation takes no kernel): native and emulated are one code path there too
        if r.fp8.gemm.accum_mantissa_bits is not None or name == "deepseek_v3_tensorwise":
            continue
        key = _kernel_key(r)
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
        _RUNS[key] = train_losses(token_data, recipe, cpu_kernels, reorder=reorder, steps=STEPS)
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
