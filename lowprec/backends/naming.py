"""A recipe's one-line name (``short_str``), logged with every run (``recipe_short``) and printed by ``lowprec
recipes``. It lives beside the registry, not on the ``Recipe`` value, because one part of it is a backend fact:
whether ``fp8_format`` is a free choice worth naming (``Float8Backend.format_in_name``; torchao's scalings imply
it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lowprec.backends.registry import fp8_backend
from lowprec.recipe import short_tokens

if TYPE_CHECKING:
    from lowprec.recipe import Float8Spec, Recipe


def fp8_short(spec: Float8Spec) -> str:
    """The FP8 part of ``short_str``: ``off``, or ``backend:scaling`` and each setting that differs from the
    usual, e.g. ``lowprec:blockwise/e4m3/floor0.0001+fp8cache`` or, with an emulated accumulator,
    ``lowprec:blockwise/e4m3/acc13-truncate-g32-nopromo`` (bits, rounding and group when not the defaults,
    ``-nopromo`` without promotion): the fields' ``short`` tokens (``lowprec.recipe.spec_field``) in declaration
    order. Raises ``RecipeError`` for an unregistered backend."""
    if not spec.enabled:
        return "off"
    # every other token is declared with its field (``lowprec.recipe.spec_field(short=...)``), in field order
    return f"{spec.backend}:{spec.scaling}" + short_tokens(spec, fp8_backend(spec.backend))


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
