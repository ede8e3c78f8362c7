"""``recipe.fp8.backend='none'``: no FP8 GEMMs. Its validation refuses FP8 fields that would be inert."""

from __future__ import annotations

import dataclasses

from lowprec.backends.registry import Float8Backend, register_fp8_backend
from lowprec.errors import RecipeError


class NoFloat8(Float8Backend):
    """Every linear stays in the compute dtype; the FP8 fields of the spec must keep their defaults (set,
    they would change the recipe's hash without changing what runs)."""

    name = "none"
    enabled = False

    def validate(self, spec) -> None:
        for f in dataclasses.fields(spec):
            if f.name == "backend":
                continue
            default = tuple(f.default) if isinstance(f.default, (list, tuple)) else f.default
            if getattr(spec, f.name) != default:
                raise RecipeError(
                    f"recipe.fp8.{f.name}={getattr(spec, f.name)!r} has no effect with recipe.fp8.backend="
                    "'none'; remove the override (or enable the feature it belongs to)"
                )

    def convert(self, model, spec, fqns, fp8_weight_all_gather) -> None:
        pass


register_fp8_backend(NoFloat8())
