"""Whether a planned part can run a recipe: the question training asks before it builds anything, asked of a part
from the hardware table instead of the machine's own GPU.

``lowprec.train.build.check_runtime`` refuses a recipe through its FP8 backend's ``check_runtime``, which decides
from the device's compute capability (``Float8Backend.hardware_blocker``). ``lowprec estimate`` and ``lowprec
recommend`` ask the same method with ``Hardware.compute_capability``, so a recipe that training refuses on an H100
(``mxfp8``, ``te_mxfp8``, ``nvfp4``: sm100 only) is never given a step time there. Only the hardware is judged: a
missing install (Transformer Engine, a torch without block-scaled ``scaled_mm``) is the run's machine's business.
"""

from __future__ import annotations

from lowprec.backends import check_recipe, fp8_backend
from lowprec.estimate.hardware import Hardware
from lowprec.recipe import Recipe


def hardware_blocker(recipe: Recipe, hw: Hardware) -> str | None:
    """Why ``recipe`` cannot run on ``hw`` (one line naming the part's compute capability and what the recipe
    needs), or ``None`` when training would accept it there. Raises ``RecipeError`` for a recipe the backend registry
    refuses (``lowprec.backends.check_recipe``, training's first check too), ``ValueError`` for a part whose compute
    capability the table does not give (a table entry without one is a bug of the table)."""
    check_recipe(recipe)
    if hw.compute_capability is None:
        raise ValueError(f"lowprec.estimate.hardware: {hw.name} has no compute_capability")
    return fp8_backend(recipe.fp8.backend).hardware_blocker(recipe.fp8, hw.compute_capability)
