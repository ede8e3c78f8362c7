"""Converters: turn a recipe's FP8 intent into module swaps, selected by FQN filter.

Runs on the meta-device model before materialisation (build step 2), as torchtitan's
``Float8LinearConverter`` does; swapped modules keep their FQNs so checkpoints and filters agree.
Every backend sees the same selection (``fp8_candidate_fqns``), and a selected linear that a backend
cannot convert raises instead of silently staying in high precision.
"""

from __future__ import annotations

from torch import nn

from lowprec.backends import check_fp8, fp8_backend
from lowprec.kernels import EmulatedLinear, KernelPolicy, emulated_sdpa
from lowprec.model.llama import SwiGLU
from lowprec.recipe import Float8Spec, RecipeError


def fp8_candidate_fqns(model: nn.Module, spec: Float8Spec) -> list[str]:
    """FQNs of the ``nn.Linear`` modules the spec puts in FP8 (``Float8Spec.selects_linear``; empty when
    FP8 is off)."""
    if not spec.enabled:
        return []
    n_blocks = len(getattr(model, "layers", []))
    return [
        fqn
        for fqn, m in model.named_modules()
        if isinstance(m, nn.Linear) and spec.selects_linear(fqn, m.in_features, m.out_features, n_blocks)
    ]


def require_fp8_selection(model: nn.Module, spec: Float8Spec) -> list[str]:
    """``fp8_candidate_fqns``, refusing a spec that asks for FP8 and selects no linear of ``model``, an
    ``e5m6_inputs`` pattern that matches none of the selected linears, and ``swiglu_cache`` for a model without
    ``lowprec.model.llama.SwiGLU``.

    Raises ``RecipeError`` naming the filters (e.g. ``hp_first_blocks`` covering every block, or a
    ``min_features`` above every linear's width), so such a run stops before training instead of
    finishing in high precision.
    """
    check_expert_patterns(model, spec)
    fqns = fp8_candidate_fqns(model, spec)
    sel, saved = spec.layers, spec.saved
    if spec.enabled and not fqns:
        raise RecipeError(
            f"recipe.fp8.backend={spec.backend!r} asks for FP8 but its filters select no linear of this model "
            f"(recipe.fp8.layers: keep_hp_fqns={list(sel.keep_hp_fqns)}, hp_first_blocks={sel.hp_first_blocks}, "
            f"hp_last_blocks={sel.hp_last_blocks}, min_features={sel.min_features}); loosen them or use backend=none"
        )
    empty = [p for p in saved.e5m6_inputs if not any(f == p or f.endswith("." + p) for f in fqns)]
    if empty:
        raise RecipeError(
            f"recipe.fp8.saved.e5m6_inputs={list(saved.e5m6_inputs)}: {empty} match no FP8 linear of this model, "
            "so there is no such activation to keep in E5M6"
        )
    if spec.enabled and saved.swiglu_cache != "none" and not any(isinstance(m, SwiGLU) for m in model.modules()):
        raise RecipeError(
            f"recipe.fp8.saved.swiglu_cache={saved.swiglu_cache!r} asks for cached SwiGLU inputs but this model has no "
            "SwiGLU (lowprec.model.llama.SwiGLU); use swiglu_cache=none"
        )
    return fqns


def check_expert_patterns(model: nn.Module, spec: Float8Spec) -> None:
    """Refuse a ``keep_hp_fqns`` pattern that names experts (a dotted part containing ``expert``) and
    matches no linear of ``model``: a typo there (``moe.experts.16.w1`` in a 16-expert model, ``expert.w1``) would
    silently leave those experts in FP8. Raises ``RecipeError`` with an expert linear's FQN for comparison."""
    if not spec.enabled:
        return
    linears = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    for p in spec.layers.keep_hp_fqns:
        if not any("expert" in part for part in p.split(".")):
            continue
        if not any(fqn == p or fqn.endswith("." + p) for fqn in linears):
            example = next((f for f in linears if ".experts." in f), "none: this model has no experts")
            raise RecipeError(
                f"recipe.fp8.layers.keep_hp_fqns pattern {p!r} names experts but matches no linear of this model "
                f"(an expert linear: {example}); fix the pattern"
            )


def convert_fp8(
    model: nn.Module, spec: Float8Spec, fp8_weight_all_gather: bool = False, fp8_kernel: str = "native"
) -> list[str]:
    """Swap the selected linears for FP8 linears of ``spec.backend`` in place; returns the swapped FQNs.

    The selection is ``Float8Spec.selects_linear`` (an empty one is refused: ``require_fp8_selection``);
    the swap is the backend object's (``lowprec.backends``: lowprec's ``Float8Linear``, torchao's
    ``convert_to_float8_training``, Transformer Engine's ``te.Linear``). ``fp8_weight_all_gather``: the run
    gathers weights in FP8 under FSDP2 (torchao chooses its weight wrapper at conversion). ``fp8_kernel``:
    ``native`` | ``emulated`` (``KernelPolicy.fp8``). Raises ``RecipeError`` for a spec its backend refuses
    (``lowprec.backends.check_fp8``) or a selection ``require_fp8_selection`` refuses.
    """
    check_fp8(spec)
    fqns = require_fp8_selection(model, spec)
    if fqns:
        fp8_backend(spec.backend).convert(model, spec, fqns, fp8_weight_all_gather, fp8_kernel)
    return fqns


def convert_kernels(model: nn.Module, policy: KernelPolicy) -> list[str]:
    """Apply ``policy.bf16 == "emulated"`` in place (after ``convert_fp8``): every plain ``nn.Linear`` left
    becomes an ``EmulatedLinear`` (same parameters and FQNs) and every attention's ``sdpa`` kernel slot
    ``emulated_sdpa``; returns the swapped linears' FQNs. FP8 linears got their kernel at conversion; lowprec's
    also get the kernel of their blockwise GEMMs (``policy.blockwise``) here."""
    for m in model.modules():
        if hasattr(m, "blockwise_gemm"):  # lowprec's FP8 linears: the kernel of their tile/block GEMMs
            m.blockwise_gemm = policy.blockwise
    if policy.bf16 != "emulated":
        return []
    swapped = []
    for fqn, m in list(model.named_modules()):
        if type(m) is nn.Linear:
            parent, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(parent), name, EmulatedLinear.from_linear(m))
            swapped.append(fqn)
        elif hasattr(m, "sdpa"):
            m.sdpa = emulated_sdpa
    return swapped
