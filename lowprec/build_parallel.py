"""Build step 3: turn a recipe's communication intent and a ``ParallelDims`` into a sharded model.

Order (docs/architecture.md, "Build order"; torchtitan): FP8 weight all-gather wrappers (they must exist
before sharding), TP, then
FSDP2 ``fully_shard`` per block and root with the recipe's ``MixedPrecisionPolicy``, then communication
hooks (FP8 reduce-scatter, the uint8 all-gather that lets torchao's float8 all-gather run on gloo).
Everything here works on the meta device; parameters are materialised afterwards.

Build layer (beside ``lowprec.convert`` and ``lowprec.build_optim``): it reads the recipe and asks the backend
registry; the mechanisms it applies (``lowprec.parallel``) know nothing of recipes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from lowprec.backends import fp8_backend
from lowprec.parallel.dims import ParallelDims, dp_mesh
from lowprec.parallel.fp8_reduce_scatter import apply_fp8_reduce_scatter
from lowprec.parallel.fsdp import apply_fsdp
from lowprec.parallel.tp import apply_tp
from lowprec.recipe import DTYPES, Recipe, RecipeError


@dataclass
class ParallelPlan:
    """What step 3 built: the world mesh, the FSDP modules, the policy and the communication mechanisms."""

    dims: ParallelDims
    mesh: DeviceMesh
    mp_policy: MixedPrecisionPolicy | None
    fsdp_modules: list[FSDPModule] = field(default_factory=list)
    fp8_all_gather_fqns: list[str] = field(default_factory=list)
    #: Human-readable mechanisms, recorded in the effective recipe.
    mechanisms: dict[str, str] = field(default_factory=dict)

    @property
    def dp_mesh(self) -> DeviceMesh:
        return dp_mesh(self.mesh)

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]


def _fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]


def check_layout(recipe: Recipe, dims: ParallelDims) -> None:
    """Refuse a recipe whose communication dtypes this layout cannot honour (no silent fallback); needs no
    model or process group, so the command line calls it before launching ranks.

    Raises ``RecipeError``: FP8 weight all-gather or a low-precision reduce-scatter without FSDP, FP8
    activation all-gather without TP, lowprec's FP8 weight all-gather together with TP.
    """
    comm = recipe.comm
    if not dims.fsdp and (comm.weight_all_gather == "fp8" or comm.grad_reduce != "fp32"):
        raise RecipeError(
            f"recipe {recipe.name}: recipe.comm.weight_all_gather={comm.weight_all_gather!r} / "
            f"grad_reduce={comm.grad_reduce!r} need FSDP (parallel.dp_shard > 1); this layout is "
            f"{dims.short()}: add parallel.dp_shard=N or choose a recipe without FP8 communication"
        )
    if comm.activation_all_gather == "fp8" and dims.tp == 1:
        raise RecipeError(
            f"recipe {recipe.name}: recipe.comm.activation_all_gather='fp8' needs tensor parallelism (parallel.tp > 1)"
        )
    try:
        fp8_backend(recipe.fp8.backend).check_layout(recipe.fp8, comm, dims)
    except RecipeError as e:
        raise RecipeError(f"recipe {recipe.name}: {e}") from None


def parallelize(
    model: nn.Module, recipe: Recipe, dims: ParallelDims, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None
) -> ParallelPlan:
    """Apply TP and FSDP2 to ``model`` (on meta, already converted) as ``dims`` and ``recipe.comm`` say.

    Raises ``RecipeError`` for a communication dtype that this layout cannot honour (no silent fallback):
    FP8 weight all-gather or FP8 reduce-scatter without FSDP, FP8 activation all-gather without TP, and
    lowprec's FP8 weight all-gather combined with TP.
    """
    comm = recipe.comm
    plan = ParallelPlan(dims, mesh, mp_policy)
    check_layout(recipe, dims)
    backend = fp8_backend(recipe.fp8.backend)
    plan.mechanisms.update(backend.prepare_sharding(model, recipe.fp8, comm, dims))
    if dims.tp > 1:
        apply_tp(model, plan.tp_mesh, activation_all_gather=comm.activation_all_gather)
        plan.mechanisms["tp"] = (
            f"torchtitan plan, sequence parallel, activation all-gather {comm.activation_all_gather}"
        )
    plan.mechanisms.update(backend.after_tensor_parallel(model, dist.group.WORLD))
    if dims.fsdp or dims.dp_replicate > 1:
        plan.fsdp_modules = apply_fsdp(model, _fsdp_mesh(mesh, dims), mp_policy)
        plan.mechanisms.update(backend.finish_sharding(model, recipe.fp8, comm, dims))
        if comm.grad_reduce == "fp8":
            apply_fp8_reduce_scatter(model, block=comm.grad_reduce_block)
            plan.mechanisms["grad_reduce"] = f"lowprec Float8ReduceScatter e4m3, block {comm.grad_reduce_block}"
    return plan


def mixed_precision_policy(recipe: Recipe) -> MixedPrecisionPolicy:
    """FSDP2's policy for the recipe: parameters gathered in the compute dtype (autocast's dtype, or their
    own), gradients reduced in ``recipe.comm.grad_reduce`` (FP32 for ``fp8``: the FP8 reduce-scatter hook
    quantizes the FP32 buffer itself)."""
    param = None if recipe.compute.autocast_dtype == "none" else DTYPES[recipe.compute.autocast_dtype]
    reduce = torch.bfloat16 if recipe.comm.grad_reduce == "bf16" else torch.float32
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
