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


_BUILDERS: list[Callable[[], Recipe]] = [fp32, bf16, bf16_pure, fp8_tensorwise, bf16_adamw8bit]

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
