"""Named recipes. Each is a small function so the catalog reads as a list of precision decisions."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from lowprec.recipe import ComputeSpec, Float8Spec, OptimSpec, Recipe, RecipeError, WeightSpec


def fp32() -> Recipe:
    return Recipe(name="fp32", description="FP32 weights, compute and AdamW states: the numerical reference.")


def bf16() -> Recipe:
    return replace(
        fp32(),
        name="bf16",
        description="FP32 weights (they are the master) under BF16 autocast; FP32 AdamW states.",
        compute=ComputeSpec(autocast_dtype="bf16"),
    )


def bf16_pure() -> Recipe:
    return replace(
        fp32(),
        name="bf16_pure",
        description="BF16 weights, gradients and AdamW states, no master copy: shows why masters exist.",
        weights=WeightSpec(param_dtype="bf16"),
    )


def fp8_tensorwise() -> Recipe:
    return replace(
        bf16(),
        name="fp8_tensorwise",
        description="bf16 + torchao Float8Linear, dynamic tensorwise scaling; tok_embeddings and output stay high precision.",
        fp8=Float8Spec(backend="torchao", scaling="tensorwise"),
    )


def bf16_adamw8bit() -> Recipe:
    return replace(
        bf16(),
        name="bf16_adamw8bit",
        description="bf16 with bitsandbytes AdamW8bit: block-wise dynamic 8-bit m and v (256-element blocks).",
        optim=OptimSpec(state="int8", impl="bitsandbytes"),
    )


def fp8_current() -> Recipe:
    return replace(
        bf16(),
        name="fp8_current",
        description="bf16 + lowprec FP8 linears, tensorwise current scaling, HYBRID (e4m3 forward, e5m2 gradients).",
        fp8=Float8Spec(backend="lowprec", scaling="tensorwise", strategy="current", fp8_format="hybrid"),
    )


def fp8_delayed() -> Recipe:
    return replace(
        fp8_current(),
        name="fp8_delayed",
        description="fp8_current with Transformer Engine's delayed scaling: amax_history_len 16, max, margin 0.",
        fp8=replace(fp8_current().fp8, strategy="delayed", amax_history_len=16, amax_compute_algo="max", margin=0),
    )


def fp8_rowwise() -> Recipe:
    return replace(
        fp8_current(),
        name="fp8_rowwise",
        description="bf16 + lowprec FP8 linears, rowwise scaling of every GEMM operand, all e4m3, power-of-2 scales (torchao's rowwise recipe).",
        fp8=Float8Spec(backend="lowprec", scaling="rowwise", fp8_format="e4m3", power_of_2_scales=True),
    )


def fp8_blockwise() -> Recipe:
    return replace(
        fp8_current(),
        name="fp8_blockwise",
        description="DeepSeek-V3 GEMM numerics: e4m3 everywhere, 1x128 activation/gradient tiles, 128x128 weight blocks, "
                    "FP32 promotion every 128 (N_C), FP8-cached activations.",
        fp8=Float8Spec(backend="lowprec", scaling="blockwise", fp8_format="e4m3", promotion_interval=128,
                       cache_fp8_activations=True),
    )


def te_delayed() -> Recipe:
    return replace(
        fp8_delayed(),
        name="te_delayed",
        description="fp8_delayed on Transformer Engine te.Linear under DelayedScaling (GPU only).",
        fp8=replace(fp8_delayed().fp8, backend="te"),
    )


def te_blockwise() -> Recipe:
    return replace(
        fp8_current(),
        name="te_blockwise",
        description="Transformer Engine Float8BlockScaling (1x128 / 128x128, e4m3; GPU only).",
        fp8=Float8Spec(backend="te", scaling="blockwise", fp8_format="e4m3"),
    )


_BUILDERS: list[Callable[[], Recipe]] = [
    fp32, bf16, bf16_pure, fp8_tensorwise, bf16_adamw8bit,
    fp8_current, fp8_delayed, fp8_rowwise, fp8_blockwise, te_delayed, te_blockwise,
]

#: name -> Recipe, in catalog order.
CATALOG: dict[str, Recipe] = {b.__name__: b() for b in _BUILDERS}


def recipe_names() -> list[str]:
    return list(CATALOG)


def get_recipe(name: str) -> Recipe:
    """The named recipe. Raises ``RecipeError`` listing the catalog for an unknown name."""
    try:
        return CATALOG[name]
    except KeyError:
        raise RecipeError(f"unknown recipe {name!r}; known: {', '.join(CATALOG)}") from None
