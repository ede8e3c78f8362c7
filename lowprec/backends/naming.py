"""A recipe's one-line name (``short_str``), logged with every run (``recipe_short``) and printed by ``lowprec
recipes``. It lives beside the registry, not on the ``Recipe`` value, because one part of it is a backend fact:
whether ``fp8_format`` is a free choice worth naming (``Float8Backend.format_in_name``; torchao's scalings imply
it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lowprec.backends.registry import fp8_backend

if TYPE_CHECKING:
    from lowprec.recipe import Float8Spec, Recipe


def fp8_short(spec: Float8Spec) -> str:
    """The FP8 part of ``short_str``: ``off``, or ``backend:scaling`` and each setting that differs from the
    usual, e.g. ``lowprec:blockwise/e4m3/floor0.0001+fp8cache`` or, with an emulated accumulator,
    ``lowprec:blockwise/e4m3/acc13-truncate-g32-nopromo`` (bits, rounding and group when not the defaults,
    ``-nopromo`` without promotion). Raises ``RecipeError`` for an unregistered
    backend."""
    if not spec.enabled:
        return "off"
    s = f"{spec.backend}:{spec.scaling}"
    if spec.strategy == "delayed":
        s += f"/delayed{spec.amax_history_len}-{spec.amax_compute_algo}-m{spec.margin}"
    elif spec.strategy == "static":
        s += "/static"
    if fp8_backend(spec.backend).format_in_name and spec.scaling not in ("mxfp4", "nvfp4"):  # E2M1 only
        s += f"/{spec.fp8_format}"
    if spec.accum_mantissa_bits is not None:
        s += f"/acc{spec.accum_mantissa_bits}"
        s += "" if spec.accum_rounding == "nearest" else f"-{spec.accum_rounding}"
        s += "" if spec.accum_group is None else f"-g{spec.accum_group}"
        s += "" if spec.promotion else "-nopromo"
    if spec.grad_output_granularity is not None:
        s += f"/dy:{spec.grad_output_granularity}"
    if spec.amax_floor != 1e-12:
        s += f"/floor{spec.amax_floor:g}"
    if spec.cache_fp8_activations:
        s += "+fp8cache"
    if spec.e5m6_inputs:
        s += "+e5m6"
    if spec.swiglu_cache != "none":
        s += f"+swiglu:{spec.swiglu_cache}"
    if spec.mx_scale_mode != "rceil":
        s += f"/{spec.mx_scale_mode}"
    if spec.rht_size:
        s += f"+rht{spec.rht_size}"
    if spec.weight_scaling_2d:
        s += "+w2d"
    if spec.grad_rounding == "stochastic":
        s += "+sr"
    if spec.precision_switch_at is not None:
        s += f"+hp@{spec.precision_switch_at:g}"
    if spec.hp_last_blocks:
        s += f"+hplast{spec.hp_last_blocks}"
    return s


def short_str(recipe: Recipe) -> str:
    """One-line summary of ``recipe``, e.g. ``w=fp32 autocast=bf16 fp8=torchao:tensorwise opt=int8:bitsandbytes``
    (weights, autocast, ``fp8_short``, optimizer states, and ``CommSpec.short`` when not the default). Raises
    ``RecipeError`` for an unregistered FP8 backend."""
    w, c = recipe.weights, recipe.compute
    ws = (
        w.param_dtype
        + ("+master32" if w.master_dtype == "fp32" else "")
        + (f"/{w.update_rounding}" if w.update_rounding != "nearest" else "")
    )
    autocast = c.autocast_dtype + ("+dls" if c.loss_scaling == "dynamic" else "")
    autocast += "+reversed" if c.reduction_order == "reversed" else ""
    opt = (
        "param"
        if (recipe.optim.state, recipe.optim.impl) == ("param", "torch")
        else f"{recipe.optim.state}:{recipe.optim.impl}"
    )
    comm = recipe.comm.short()
    return f"w={ws} autocast={autocast} fp8={fp8_short(recipe.fp8)} opt={opt}" + (f" comm={comm}" if comm else "")
