"""``recipe.fp8.backend='lowprec'``: lowprec's own FP8 linear (``lowprec.float8.Float8Linear``), every scaling
and strategy, on CPU and CUDA; FP8 weight all-gather through ``fsdp_pre_all_gather``
(``lowprec.parallel.fp8_all_gather``)."""

from __future__ import annotations

import math

from torch import nn

from lowprec.backends.registry import Float8Backend, register_fp8_backend
from lowprec.errors import RecipeError
from lowprec.float8 import Float8Linear, linear_config
from lowprec.float8.swiglu import Float8CachedSwiGLU
from lowprec.model.llama import SwiGLU
from lowprec.parallel.fp8_all_gather import enable_fp8_weight_all_gather, lowprec_wire_granularity
from lowprec.recipe import field_backends, field_value, unimplemented_fields


def swap_module(model: nn.Module, fqn: str, new: nn.Module) -> None:
    """Replace the submodule at ``fqn`` by ``new`` (same FQN, so checkpoints and filters agree)."""
    parent_name, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


class LowprecFloat8(Float8Backend):
    name = "lowprec"
    scalings = ("tensorwise", "rowwise", "blockwise")
    module_class = "lowprec.float8.linear.Float8Linear"
    fused_casts = "fp8"

    def validate(self, spec) -> None:
        super().validate(spec)
        refuse_unimplemented(spec, self.name)
        if spec.scaling == "blockwise" and spec.gemm.promotion_interval not in (None, 128):
            raise RecipeError(
                f"recipe.fp8.gemm.promotion_interval={spec.gemm.promotion_interval} conflicts with "
                "recipe.fp8.scaling='blockwise': "
                "its scales change every 128 elements of K, so partial sums are promoted every 128"
            )

    def supports_fp8_weight_all_gather(self, spec) -> bool:
        return True

    def convert(self, model, spec, fqns, fp8_weight_all_gather, fp8_kernel) -> None:
        # lowprec.convert.require_fp8_selection refused patterns that match nothing and a model without SwiGLU
        for fqn in fqns:
            new = Float8Linear.from_linear(model.get_submodule(fqn), linear_config(spec, fqn))
            new.fp8_kernel = fp8_kernel
            swap_module(model, fqn, new)
        if spec.saved.swiglu_cache == "fp8":
            for fqn in [f for f, m in model.named_modules() if isinstance(m, SwiGLU)]:
                swap_module(model, fqn, Float8CachedSwiGLU())

    def compile_blocker(self, spec, telemetry_every, device_type="cpu") -> str | None:
        if telemetry_every > 0:
            return (
                f"lowprec FP8 telemetry (train.telemetry_every={telemetry_every}) computes data-dependent "
                "statistics that cannot be traced; set train.telemetry_every=0 to compile"
            )
        return None

    def kernel_of(self, module) -> str:
        return module.fp8_kernel

    def needs_blockwise_gemm(self, spec) -> bool:
        return spec.enabled and linear_config(spec).runs_blockwise_gemm

    def blockwise_gemm_of(self, module) -> str | None:
        return module.blockwise_gemm if module.fp8_config.runs_blockwise_gemm else None

    def fallback_blocker(self, spec, comm) -> str | None:
        if comm.weight_all_gather == "fp8":
            return (
                "recipe.comm.weight_all_gather='fp8' gathers the weights in FP8, so a linear switched to BF16 would "
                "still compute from FP8-rounded weights; use weight_all_gather=compute"
            )
        return None

    def register_hooks(self, model, optimizer, fp8_weight_all_gather) -> list[str]:
        # Delayed scaling: after every optimizer step, roll each linear's amax histories and compute the next
        # step's scales (Transformer Engine updates at the same point).
        modules = [m for m in model.modules() if isinstance(m, Float8Linear) and len(m.scalers)]
        if not modules:
            return []

        def update(opt, args, kwargs):
            for m in modules:
                m.update_scales()

        optimizer.register_step_post_hook(update)
        return [f"delayed-scaling update after the optimizer step ({len(modules)} linears)"]

    def check_layout(self, spec, comm, dims) -> None:
        if comm.weight_all_gather == "fp8" and dims.tp > 1:
            raise RecipeError(
                "recipe.comm.weight_all_gather='fp8' with backend=lowprec is not supported together "
                "with parallel.tp > 1 yet; use tp=1 or weight_all_gather=compute"
            )

    def prepare_sharding(self, model, spec, comm, dims) -> dict[str, str]:
        if comm.weight_all_gather != "fp8":
            return {}
        # Tensorwise weights travel with one all-reduced scale, rowwise/blockwise ones with a scale per row.
        fqns = enable_fp8_weight_all_gather(model, lowprec_wire_granularity)
        return {"weight_all_gather": f"lowprec fsdp_pre_all_gather e4m3 ({len(fqns)} weights)"}

    def after_tensor_parallel(self, model, world_group) -> dict[str, str]:
        # Transformer Engine's reduce_amax: data-parallel ranks see different micro-batches and TP ranks
        # different shards, so each recorded amax is max-reduced over all ranks.
        n = 0
        for m in model.modules():
            if isinstance(m, Float8Linear) and len(m.scalers):
                m.amax_group = world_group
                n += 1
        return {"amax_reduction": f"delayed-scaling amax max-reduced over all ranks ({n} linears)"} if n else {}

    def scaling_state_bytes(self, spec, n_fp8_linears) -> int:
        # Per delayed role: amax_history (len) + scale (1), fp32; three roles per linear.
        return n_fp8_linears * 3 * (spec.cast.amax_history_len + 1) * 4 if spec.cast.strategy == "delayed" else 0

    def saved_input(self, spec, rows, in_features, device_type) -> tuple[str, int]:
        if not spec.saved.cache_fp8_activations:
            return ("cast", 0)
        return ("own", rows * in_features + _fp8_cache_scale_bytes(spec, rows, in_features))


def _fp8_cache_scale_bytes(spec, rows: int, in_features: int) -> int:
    if spec.cast.strategy == "delayed":
        return 0  # the scale saved is the module's ``scalers.input.scale`` buffer
    if spec.cast.strategy == "static" or spec.scaling == "tensorwise":
        return 4
    if spec.scaling == "rowwise":
        return 4 * rows
    return 4 * rows * math.ceil(in_features / 128)  # blockwise: 1x128 tiles along K


register_fp8_backend(LowprecFloat8())


def refuse_unimplemented(spec, backend: str) -> None:
    """Raise ``RecipeError`` naming the first field that ``spec`` (a ``Float8Spec``) sets although ``backend``
    (``lowprec``, ``torchao``, ``te``, ``mx``) does not implement it (``lowprec.recipe.unimplemented_fields``, from
    each field's ``spec_field(backends=...)``): the run would silently train without it. Block-scaling fields are
    ``lowprec.backends.check_fp8``'s."""
    for name, default in unimplemented_fields(type(spec), backend).items():
        if field_value(spec, name) == default:
            continue
        implementers = field_backends(type(spec), name)
        if backend == "mx" and implementers == ("lowprec",):
            why = "is an option of the per-tensor FP8 linear (backend=lowprec)"
        elif "lowprec" in implementers:
            why = "is a lowprec FP8 option"
        else:
            why = f"is implemented by backend in {list(implementers)} only"
        hint = "" if backend == "mx" else f" (use backend={implementers[0]})"
        raise RecipeError(f"recipe.fp8.{name} {why}; it conflicts with recipe.fp8.backend={backend!r}{hint}")
