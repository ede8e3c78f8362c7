"""Build step 3: turn a recipe's communication intent and a ``ParallelDims`` into a sharded model.

Order (DESIGN.md, torchtitan): FP8 weight all-gather wrappers (they must exist before sharding), TP, then
FSDP2 ``fully_shard`` per block and root with the recipe's ``MixedPrecisionPolicy``, then communication
hooks (FP8 reduce-scatter, the uint8 all-gather that lets torchao's float8 all-gather run on gloo).
Everything here works on the meta device; parameters are materialised afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from lowprec.parallel.dims import ParallelDims
from lowprec.recipe import Recipe, RecipeError


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
        return self.mesh["dp"]

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
        raise RecipeError(f"recipe {recipe.name}: recipe.comm.weight_all_gather={comm.weight_all_gather!r} / "
                          f"grad_reduce={comm.grad_reduce!r} need FSDP (parallel.dp_shard > 1); this layout is "
                          f"{dims.short()}: add parallel.dp_shard=N or choose a recipe without FP8 communication")
    if comm.activation_all_gather == "fp8" and dims.tp == 1:
        raise RecipeError(f"recipe {recipe.name}: recipe.comm.activation_all_gather='fp8' needs tensor parallelism "
                          "(parallel.tp > 1)")
    if comm.weight_all_gather == "fp8" and recipe.fp8.backend == "lowprec" and dims.tp > 1:
        raise RecipeError(f"recipe {recipe.name}: recipe.comm.weight_all_gather='fp8' with backend=lowprec is not "
                          "supported together with parallel.tp > 1 yet; use tp=1 or weight_all_gather=compute")


def parallelize(model: nn.Module, recipe: Recipe, dims: ParallelDims, mesh: DeviceMesh,
                mp_policy: MixedPrecisionPolicy | None) -> ParallelPlan:
    """Apply TP and FSDP2 to ``model`` (on meta, already converted) as ``dims`` and ``recipe.comm`` say.

    Raises ``RecipeError`` for a communication dtype that this layout cannot honour (no silent fallback):
    FP8 weight all-gather or FP8 reduce-scatter without FSDP, FP8 activation all-gather without TP, and
    lowprec's FP8 weight all-gather combined with TP.
    """
    comm = recipe.comm
    plan = ParallelPlan(dims, mesh, mp_policy)
    check_layout(recipe, dims)
    if comm.weight_all_gather == "fp8" and recipe.fp8.backend == "lowprec":
        from lowprec.parallel.fp8_all_gather import enable_fp8_weight_all_gather, lowprec_wire_granularity

        # Tensorwise weights travel with one all-reduced scale, rowwise/blockwise ones with a scale per row.
        plan.fp8_all_gather_fqns = enable_fp8_weight_all_gather(model, lowprec_wire_granularity)
        plan.mechanisms["weight_all_gather"] = f"lowprec fsdp_pre_all_gather e4m3 ({len(plan.fp8_all_gather_fqns)} weights)"
    if comm.weight_all_gather == "fp8" and recipe.fp8.backend == "torchao":
        _check_even_for_torchao(model, dims)
    if dims.tp > 1:
        from lowprec.parallel.tp import apply_tp

        apply_tp(model, plan.tp_mesh, activation_all_gather=comm.activation_all_gather)
        plan.mechanisms["tp"] = f"torchtitan plan, sequence parallel, activation all-gather {comm.activation_all_gather}"
    _reduce_delayed_amax(model, plan)
    if dims.fsdp or dims.dp_replicate > 1:
        from lowprec.parallel.fsdp import apply_fsdp

        plan.fsdp_modules = apply_fsdp(model, _fsdp_mesh(mesh, dims), mp_policy)
        if comm.weight_all_gather == "fp8" and recipe.fp8.backend == "torchao":
            from lowprec.parallel.fp8_all_gather import install_fp8_safe_all_gather

            install_fp8_safe_all_gather(model)
            plan.mechanisms["weight_all_gather"] = "torchao enable_fsdp_float8_all_gather (uint8 wire)"
        if comm.grad_reduce == "fp8":
            from lowprec.parallel.fp8_reduce_scatter import apply_fp8_reduce_scatter

            apply_fp8_reduce_scatter(model, block=comm.grad_reduce_block)
            plan.mechanisms["grad_reduce"] = f"lowprec Float8ReduceScatter e4m3, block {comm.grad_reduce_block}"
    return plan


def _reduce_delayed_amax(model: nn.Module, plan: ParallelPlan) -> None:
    """lowprec FP8 linears with delayed scaling max-reduce each recorded amax over all ranks (TE's
    ``reduce_amax=True``): data-parallel ranks see different micro-batches and TP ranks different shards."""
    import torch.distributed as dist

    from lowprec.float8 import Float8Linear

    n = 0
    for m in model.modules():
        if isinstance(m, Float8Linear) and len(m.scalers):
            m.amax_group = dist.group.WORLD
            n += 1
    if n:
        plan.mechanisms["amax_reduction"] = f"delayed-scaling amax max-reduced over all ranks ({n} linears)"


def _check_even_for_torchao(model: nn.Module, dims: ParallelDims) -> None:
    """torchao's FSDP2 float8 all-gather breaks when a weight's rows do not split evenly over the shards
    (pytorch/ao#3982: a collective size mismatch; measured here at dp_shard=3). Refuse before training."""
    uneven = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"
              and m.weight.shape[0] % dims.dp_shard]
    if uneven:
        raise RecipeError(
            f"recipe.comm.weight_all_gather='fp8' with backend=torchao needs every FP8 weight's rows divisible by "
            f"parallel.dp_shard={dims.dp_shard} (torchao's float8 all-gather fails on uneven shards, pytorch/ao#3982); "
            f"{len(uneven)} are not, e.g. {uneven[0]}. Use backend=lowprec (e.g. recipe=fp8_comm8), whose FP8 "
            "all-gather handles uneven shards, or a dp_shard that divides the weights")


def mixed_precision_policy(recipe: Recipe) -> MixedPrecisionPolicy:
    """FSDP2's policy for the recipe: parameters gathered in the compute dtype (autocast's dtype, or their
    own), gradients reduced in ``recipe.comm.grad_reduce`` (FP32 for ``fp8``: the FP8 reduce-scatter hook
    quantizes the FP32 buffer itself)."""
    from lowprec.recipe import DTYPES

    param = None if recipe.compute.autocast_dtype == "none" else DTYPES[recipe.compute.autocast_dtype]
    reduce = torch.bfloat16 if recipe.comm.grad_reduce == "bf16" else torch.float32
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
