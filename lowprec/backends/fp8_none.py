"""``recipe.fp8.backend='none'``: no FP8 GEMMs. Its validation refuses FP8 fields that would be inert."""

from __future__ import annotations

from lowprec.backends.registry import Float8Backend, register_fp8_backend
from lowprec.recipe import field_paths, refuse_inert


class NoFloat8(Float8Backend):
    """Every linear stays in the compute dtype; the FP8 fields of the spec must keep their defaults (set,
    they would change the recipe's hash without changing what runs)."""

    name = "none"
    enabled = False

    def validate(self, spec) -> None:
        names = tuple(p for p in field_paths(type(spec)) if p != "backend")
        refuse_inert(spec, "fp8", names, "fp8.backend='none'")

    def convert(self, model, spec, fqns, fp8_weight_all_gather, fp8_kernel) -> None:
        pass

    def fallback_blocker(self, spec, comm) -> str | None:
        return None  # no FP8 linear to watch: the setting has nothing to do (an ablation's BF16 control)


register_fp8_backend(NoFloat8())
