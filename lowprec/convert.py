"""Converters: turn a recipe's FP8 intent into module swaps, selected by FQN filter.

Runs on the meta-device model before materialisation (build step 2), as torchtitan's
``Float8LinearConverter`` does; the swapped modules keep their FQNs so checkpoints and filters agree.
"""

from __future__ import annotations

from torch import nn

from lowprec.recipe import Float8Spec


def fp8_candidate_fqns(model: nn.Module, spec: Float8Spec) -> list[str]:
    """FQNs of the ``nn.Linear`` modules the spec puts in FP8 (empty when FP8 is off)."""
    if not spec.enabled:
        return []
    return [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and not spec.keeps_high_precision(fqn)]


def convert_fp8(model: nn.Module, spec: Float8Spec) -> list[str]:
    """Swap the selected linears for FP8 linears in place; returns the swapped FQNs.

    ``torchao`` backend: ``torchao.float8.convert_to_float8_training`` with
    ``Float8LinearConfig.from_recipe_name(spec.scaling)`` (torchao/float8/float8_linear_utils.py).
    torchao needs both GEMM dims divisible by 16; a selected linear that is not raises ``ValueError``
    naming it rather than silently staying in high precision.
    """
    fqns = fp8_candidate_fqns(model, spec)
    if not fqns:
        return []
    modules = dict(model.named_modules())
    bad = [f for f in fqns if modules[f].in_features % 16 or modules[f].out_features % 16]
    if bad:
        raise ValueError(f"recipe.fp8 selects linears whose dims are not multiples of 16 (torchao needs it): {bad}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    selected = set(fqns)
    convert_to_float8_training(
        model,
        config=Float8LinearConfig.from_recipe_name(spec.scaling),
        module_filter_fn=lambda mod, fqn: fqn in selected,
    )
    return fqns
