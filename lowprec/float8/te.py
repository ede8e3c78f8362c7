"""Transformer Engine adapter (GPU only, imported lazily).

``te.Linear`` replaces the selected linears; the forward runs under ``te.fp8_autocast`` with the recipe's
``DelayedScaling`` / ``Float8CurrentScaling`` / ``Float8BlockScaling`` / ``MXFP8BlockScaling`` /
``NVFP4BlockScaling``
(``transformer_engine/common/recipe/__init__.py``). On a machine without CUDA or without the ``te`` extra
every entry point raises ``RecipeError`` before training; there is no fallback to another backend.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from lowprec.errors import RecipeError


def require_te():
    """``transformer_engine.pytorch``, or ``RecipeError`` saying why it cannot run here."""
    if not torch.cuda.is_available():
        raise RecipeError(
            "recipe.fp8.backend='te' needs a CUDA GPU: Transformer Engine has no CPU kernels "
            "(use backend=lowprec for the same scalings on CPU)"
        )
    try:
        import transformer_engine.pytorch as te
    except ImportError as e:
        raise RecipeError(f"recipe.fp8.backend='te' needs Transformer Engine: pip install -e '.[te]' ({e})") from e
    return te


def te_fp8_recipe(spec):
    """The Transformer Engine recipe object for a ``Float8Spec``."""
    require_te()
    from transformer_engine.common import recipe as te_recipe

    fmt = te_recipe.Format.HYBRID if spec.cast.fp8_format == "hybrid" else te_recipe.Format.E4M3
    if spec.scaling == "mxfp8":
        return te_recipe.MXFP8BlockScaling(fp8_format=fmt)
    if spec.scaling == "nvfp4":
        # NVFP4BlockScaling (TE 2.8+): RHT on the wgrad inputs, 2-D weight scaling and SR of gradients are on by
        # default; each lowprec stabiliser field maps to one of its switches.
        return te_recipe.NVFP4BlockScaling(
            disable_rht=spec.block.rht_size == 0,
            disable_2d_quantization=not spec.block.weight_scaling_2d,
            disable_stochastic_rounding=spec.block.grad_rounding != "stochastic",
        )
    if spec.scaling == "blockwise":
        return te_recipe.Float8BlockScaling(fp8_format=te_recipe.Format.E4M3)
    cast = spec.cast
    if cast.strategy == "delayed":
        return te_recipe.DelayedScaling(
            fp8_format=fmt,
            amax_history_len=cast.amax_history_len,
            amax_compute_algo=cast.amax_compute_algo,
            margin=cast.margin,
        )
    if cast.strategy == "current":
        return te_recipe.Float8CurrentScaling(fp8_format=fmt)
    raise RecipeError(f"recipe.fp8.cast.strategy={cast.strategy!r} has no Transformer Engine recipe")


def te_linear_from(mod: nn.Linear) -> nn.Module:
    """A ``te.Linear`` with ``mod``'s shape, dtype and device (``meta`` is deferred-init in TE)."""
    te = require_te()
    return te.Linear(
        mod.in_features,
        mod.out_features,
        bias=mod.bias is not None,
        params_dtype=mod.weight.dtype,
        device=mod.weight.device,
    )


def te_context(spec) -> Callable[[], AbstractContextManager]:
    te = require_te()
    fp8_recipe = te_fp8_recipe(spec)
    return lambda: te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe)
