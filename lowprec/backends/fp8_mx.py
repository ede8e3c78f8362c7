"""``recipe.fp8.backend='mx'``: lowprec's own block-scaled linear (``lowprec.float8.mx_linear.MXLinear``) for
``scaling`` ``mxfp8``, ``mxfp4`` and ``nvfp4``, with NVIDIA's NVFP4 stabilisers as recipe fields; exact emulation on
CPU, one native ``scaled_mm`` call per GEMM on CUDA sm100."""

from __future__ import annotations

import math

from lowprec.backends.fp8_lowprec import refuse_unimplemented, swap_module
from lowprec.backends.registry import Float8Backend, register_fp8_backend
from lowprec.errors import RecipeError
from lowprec.float8.mx_linear import MX_SCALINGS, MXLinear, mx_config
from lowprec.kernels.block_scaled_mm import HAS_BLOCK_SCALED_OP
from lowprec.recipe import Float8Spec, block_fields_of


class LowprecMX(Float8Backend):
    name = "mx"
    scalings = MX_SCALINGS
    module_class = "lowprec.float8.mx_linear.MXLinear"
    fused_casts = "block_scaled"
    block_fields = block_fields_of(Float8Spec, "mx")

    def validate(self, spec) -> None:
        super().validate(spec)
        if spec.cast.strategy != "current":
            raise RecipeError(
                f"recipe.fp8.cast.strategy={spec.cast.strategy!r} conflicts with recipe.fp8.backend='mx': "
                "block scales are computed from each block's own amax (current scaling)"
            )
        refuse_unimplemented(spec, self.name)
        if spec.scaling != "mxfp8" and spec.cast.fp8_format != "hybrid":
            raise RecipeError(
                f"recipe.fp8.cast.fp8_format={spec.cast.fp8_format!r} has no effect with "
                f"recipe.fp8.scaling={spec.scaling!r} (E2M1 elements); remove the override"
            )
        if spec.scaling == "nvfp4" and spec.block.mx_scale_mode != "rceil":
            raise RecipeError(
                f"recipe.fp8.block.mx_scale_mode={spec.block.mx_scale_mode!r} has no effect with "
                "recipe.fp8.scaling='nvfp4' (E4M3 block scales); remove the override"
            )
        if spec.block.weight_scaling_2d and spec.scaling != "nvfp4":
            raise RecipeError(
                f"recipe.fp8.block.weight_scaling_2d=true needs recipe.fp8.scaling='nvfp4' (16x16 tiles); "
                f"got {spec.scaling!r}"
            )

    def hardware_blocker(self, spec, capability) -> str | None:
        if capability[0] < 10:
            return (
                f"recipe.fp8.backend='mx' on a GPU needs block-scaled tensor cores (sm100: B200/GB200); "
                f"SM{capability[0]}{capability[1]} has none (lowprec emulates it exactly on CPU)"
            )
        return None

    def check_runtime(self, spec, device) -> None:
        if device.type != "cuda":
            return  # CPU: the exact emulation is the implementation
        super().check_runtime(spec, device)
        if not HAS_BLOCK_SCALED_OP:
            raise RecipeError(
                "recipe.fp8.backend='mx' on CUDA needs torch.nn.functional.scaled_mm with BlockWise1x32/1x16, "
                "which this torch lacks (run it on CPU, where lowprec emulates it exactly)"
            )

    def check_features(self, spec, fqn: str, in_features: int, out_features: int) -> None:
        """Refuse (``RecipeError``) a selected linear whose contraction dims the blocks do not divide: lowprec
        refuses rather than pads."""
        block = 16 if spec.scaling == "nvfp4" else 32
        bad = [d for d in (in_features, out_features) if d % block]
        if bad:
            raise RecipeError(
                f"recipe.fp8.scaling={spec.scaling!r} needs in_features and out_features of every selected linear "
                f"to be multiples of its {block}-element blocks (lowprec refuses rather than pads); {fqn} is "
                f"{in_features}->{out_features}: raise recipe.fp8.layers.min_features or add it to "
                "recipe.fp8.layers.keep_hp_fqns"
            )

    def check_shapes(self, spec, shapes, tokens) -> None:
        # Any number of tokens: MXLinear zero-pads the weight-gradient GEMM's token dimension to the block.
        for fqn, (fin, fout) in shapes.items():
            self.check_features(spec, fqn, fin, fout)

    def compile_blocker(self, spec, telemetry_every, device_type="cpu") -> str | None:
        return "the block-scaled linear (backend=mx) quantizes with data-dependent indexing; use train.compile=false"

    def convert(self, model, spec, fqns, fp8_weight_all_gather, fp8_kernel) -> None:
        cfg = mx_config(spec)
        modules = dict(model.named_modules())
        for fqn in fqns:
            self.check_features(spec, fqn, modules[fqn].in_features, modules[fqn].out_features)
        for fqn in fqns:
            new = MXLinear.from_linear(model.get_submodule(fqn), cfg)
            new.fp8_kernel = fp8_kernel
            swap_module(model, fqn, new)

    def kernel_of(self, module) -> str:
        return module.fp8_kernel

    def register_schedule(self, model, optimizer, spec, total_steps: int) -> list[str]:
        modules = [m for m in model.modules() if isinstance(m, MXLinear)]
        if not modules:
            return []
        at = spec.block.precision_switch_at
        switch = math.ceil(at * total_steps) if at is not None else -1
        for m in modules:
            m.hp_after_step.fill_(switch)
            m.sync_precision_switch()

        def count(opt, args, kwargs):
            for m in modules:
                m.steps_done += 1
                m.sync_precision_switch()

        optimizer.register_step_post_hook(count)
        out = [f"block-scaled step counter after the optimizer step ({len(modules)} linears)"]
        if switch >= 0:
            out.append(f"switch to high precision from step {switch} of {total_steps}")
        return out

    def estimate_notes(self) -> tuple[str, ...]:
        # Block scales live only inside a GEMM; the buffers per linear are tiny and not counted as FP8 state.
        return ("backend=mx keeps no scaling state; its per-linear buffers (RHT signs, step counters) are not counted",)

    def saved_input(self, spec, rows, in_features, device_type) -> tuple[str, int]:
        return ("cast", 0)  # the high-precision input; every GEMM re-quantizes it


register_fp8_backend(LowprecMX())
