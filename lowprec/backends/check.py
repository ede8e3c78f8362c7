"""The recipe checks that need the backend registry: a ``Recipe`` is a pure value (``lowprec.recipe`` imports no
backend), so what only a backend object knows is checked here, where a recipe is built or planned.

Called by the catalog on load (``lowprec.recipes.catalog``), by ``lowprec.train.build.check_runtime`` (so by
preflight and by ``build``, before anything is built) and by ``lowprec.convert.convert_fp8``. The order is the one
a recipe was constructed in (fp8, optim, then the recipe's cross-group rules), so the first error named is the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lowprec.backends.registry import fp8_backend, optim_impl, optim_impls
from lowprec.errors import RecipeError
from lowprec.recipe import BLOCK_FIELDS, refuse_inert

if TYPE_CHECKING:
    from lowprec.recipe import Float8Spec, OptimSpec, Recipe


def check_fp8(spec: Float8Spec) -> None:
    """Refuse a ``Float8Spec`` its backend cannot honour: an unregistered ``backend``, a ``scaling`` or field the
    backend does not implement (``Float8Backend.validate``), a block-scaling field (``BLOCK_FIELDS``) of a backend
    without it. Raises ``RecipeError`` naming the field."""
    backend = fp8_backend(spec.backend)  # RecipeError listing the registered backends
    backend.validate(spec)  # ``none`` refuses FP8 fields that would be inert
    # after the backend's own check, so e.g. nvfp4 on torchao names the missing training path first
    unimplemented = tuple(f for f in BLOCK_FIELDS if f not in backend.block_fields)
    refuse_inert(spec, "fp8", unimplemented, f"fp8.backend={spec.backend!r} (a block-scaling field)")


def check_optim(spec: OptimSpec) -> None:
    """Refuse an ``OptimSpec`` whose ``state`` no registered implementation provides, or whose ``impl`` is not
    registered or has no such states. Raises ``RecipeError`` naming the implementations that do."""
    impls = optim_impls()
    states = tuple(dict.fromkeys(s for i in impls.values() for s in i.states))
    if spec.state not in states:
        raise RecipeError(f"recipe.optim.state={spec.state!r} is not one of {list(states)}")
    impl = optim_impl(spec.impl)  # RecipeError listing the registered implementations
    if spec.state not in impl.states:
        providers = [n for n, i in impls.items() if spec.state in i.states]
        raise RecipeError(
            f"recipe.optim.state={spec.state!r} conflicts with recipe.optim.impl={spec.impl!r}: "
            f"{impl.description or spec.impl} has no {spec.state} states; use impl in {providers}"
        )


def check_recipe(recipe: Recipe) -> Recipe:
    """Every backend-dependent check of ``recipe``: ``check_fp8``, ``check_optim``, FP8 weight all-gather only
    where the FP8 backend can move its weights in FP8, ``weights.update_rounding`` only with an optimizer
    implementation that has it. Returns ``recipe`` (so a catalog can check as it builds); raises ``RecipeError``."""
    check_fp8(recipe.fp8)
    check_optim(recipe.optim)
    f8 = recipe.fp8
    if recipe.comm.weight_all_gather == "fp8" and not fp8_backend(f8.backend).supports_fp8_weight_all_gather(f8):
        raise RecipeError(
            f"recipe.comm.weight_all_gather='fp8' conflicts with recipe.fp8.backend={f8.backend!r} / "
            f"scaling={f8.scaling!r}: FP8 weight all-gather needs FP8 linears from backend=lowprec, or "
            "backend=torchao with scaling=tensorwise (torchao's only FSDP float8 all-gather)"
        )
    rounding = recipe.weights.update_rounding
    if rounding not in optim_impl(recipe.optim.impl).roundings:
        able = [n for n, i in optim_impls().items() if rounding in i.roundings]
        raise RecipeError(
            f"recipe.weights.update_rounding={rounding!r} conflicts with recipe.optim.impl="
            f"{recipe.optim.impl!r}: use impl in {able}"
        )
    return recipe
