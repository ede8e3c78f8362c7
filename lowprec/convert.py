"""Converters: turn a recipe's FP8 intent into module swaps, selected by FQN filter.

Runs on the meta-device model before materialisation (build step 2), as torchtitan's
``Float8LinearConverter`` does; swapped modules keep their FQNs so checkpoints and filters agree.
Every backend sees the same selection (``fp8_candidate_fqns``), and a selected linear that a backend
cannot convert raises instead of silently staying in high precision.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from lowprec.recipe import Float8Spec, RecipeError

def fp8_candidate_fqns(model: nn.Module, spec: Float8Spec) -> list[str]:
    """FQNs of the ``nn.Linear`` modules the spec puts in FP8 (``Float8Spec.selects_linear``; empty when
    FP8 is off)."""
    if not spec.enabled:
        return []
    n_blocks = len(getattr(model, "layers", []))
    return [fqn for fqn, m in model.named_modules()
            if isinstance(m, nn.Linear) and spec.selects_linear(fqn, m.in_features, m.out_features, n_blocks)]


def require_fp8_selection(model: nn.Module, spec: Float8Spec) -> list[str]:
    """``fp8_candidate_fqns``, refusing a spec that asks for FP8 and selects no linear of ``model``.

    Raises ``RecipeError`` naming the filters (e.g. ``hp_first_blocks`` covering every block, or a
    ``min_features`` above every linear's width), so such a run stops before training instead of
    finishing in high precision.
    """
    fqns = fp8_candidate_fqns(model, spec)
    if spec.enabled and not fqns:
        raise RecipeError(
            f"recipe.fp8.backend={spec.backend!r} asks for FP8 but its filters select no linear of this model "
            f"(keep_hp_fqns={list(spec.keep_hp_fqns)}, hp_first_blocks={spec.hp_first_blocks}, "
            f"hp_last_blocks={spec.hp_last_blocks}, min_features={spec.min_features}); loosen them or use backend=none")
    return fqns


def _swap(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def convert_fp8(model: nn.Module, spec: Float8Spec, fsdp_fp8_all_gather: bool = False) -> list[str]:
    """Swap the selected linears for FP8 linears of ``spec.backend`` in place; returns the swapped FQNs.

    ``fsdp_fp8_all_gather``: for ``torchao`` (tensorwise), wrap the weights for torchao's FSDP2 float8
    all-gather (``enable_fsdp_float8_all_gather=True``); lowprec's own FP8 all-gather is applied in the
    parallelize step instead.

    - ``torchao``: ``torchao.float8.convert_to_float8_training`` with
      ``Float8LinearConfig.from_recipe_name(spec.scaling)`` (torchao/float8/float8_linear_utils.py); torchao
      needs GEMM dims divisible by 16 and raises ``ValueError`` naming the linears that are not.
    - ``lowprec``: ``lowprec.float8.Float8Linear`` with ``LinearFP8Config.from_spec(spec)``.
    - ``te``: ``transformer_engine.pytorch.Linear`` (imported here, lazily; see ``lowprec.float8.te``).
    """
    fqns = require_fp8_selection(model, spec)
    if not fqns:
        return []
    modules = dict(model.named_modules())
    if spec.backend == "torchao":
        bad = [f for f in fqns if modules[f].in_features % 16 or modules[f].out_features % 16]
        if bad:
            raise RecipeError(f"recipe.fp8 selects linears whose dims are not multiples of 16 (torchao needs it): {bad}; "
                          "raise recipe.fp8.min_features or add them to recipe.fp8.keep_hp_fqns")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        selected = set(fqns)
        config = Float8LinearConfig.from_recipe_name(spec.scaling)
        if fsdp_fp8_all_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(
            model,
            config=config,
            module_filter_fn=lambda mod, fqn: fqn in selected,
        )
    elif spec.backend == "lowprec":
        from lowprec.float8 import Float8Linear, LinearFP8Config

        cfg = LinearFP8Config.from_spec(spec)
        for f in fqns:
            _swap(model, f, Float8Linear.from_linear(modules[f], cfg))
    elif spec.backend == "te":
        from lowprec.float8.te import te_linear_from

        for f in fqns:
            _swap(model, f, te_linear_from(modules[f]))
    else:
        raise RecipeError(f"recipe.fp8.backend={spec.backend!r} has no converter")
    return fqns
