"""``recipe.fp8.backend='te'``: Transformer Engine's ``te.Linear`` under ``te.fp8_autocast`` (GPU only; TE is
an optional extra imported lazily by ``lowprec.float8.te``, so this module imports without it)."""

from __future__ import annotations

from lowprec.backends.fp8_lowprec import refuse_unimplemented, swap_module
from lowprec.backends.registry import Float8Backend, register_fp8_backend
from lowprec.errors import RecipeError
from lowprec.float8.te import require_te, te_context, te_linear_from
from lowprec.recipe import Float8Spec, block_fields_of, refuse_inert


class TransformerEngineFloat8(Float8Backend):
    name = "te"
    scalings = ("tensorwise", "blockwise", "mxfp8", "nvfp4")
    module_class = "transformer_engine.pytorch.module.linear.Linear"
    #: NVFP4BlockScaling's switches (``disable_rht``, ``disable_2d_quantization``, ``disable_stochastic_rounding``)
    block_fields = block_fields_of(Float8Spec, "te")

    def validate(self, spec) -> None:
        super().validate(spec)
        if spec.scaling != "nvfp4":
            refuse_inert(spec, "fp8", self.block_fields, f"fp8.scaling={spec.scaling!r} with backend='te'")
        elif spec.block.rht_size not in (0, 16):
            raise RecipeError(
                f"recipe.fp8.block.rht_size={spec.block.rht_size} conflicts with recipe.fp8.backend='te': "
                "Transformer Engine's NVFP4 random Hadamard transform is 16x16 (block.rht_size=16) or off (0)"
            )
        # the accumulator emulation, the FP8 activation cache and the scale options are lowprec's: TE would train
        # without them and the run would claim them
        refuse_unimplemented(spec, self.name)

    def hardware_blocker(self, spec, capability) -> str | None:
        if spec.scaling in ("mxfp8", "nvfp4") and capability[0] < 10:
            return (
                f"recipe.fp8.scaling={spec.scaling!r} with backend='te' needs Blackwell (sm100) block-scaled "
                f"tensor cores; SM{capability[0]}{capability[1]} has none (backend=mx emulates it on CPU)"
            )
        return super().hardware_blocker(spec, capability)

    def check_runtime(self, spec, device) -> None:
        require_te()
        import torch

        # TE runs on CUDA only: the current device's capability, whatever ``device`` says
        why = self.hardware_blocker(spec, torch.cuda.get_device_capability())
        if why is not None:
            raise RecipeError(why)

    def compile_blocker(self, spec, telemetry_every, device_type="cpu") -> str | None:
        return "Transformer Engine's te.Linear runs its own kernels outside torch.compile (use train.compile=false)"

    def convert(self, model, spec, fqns, fp8_weight_all_gather, fp8_kernel) -> None:
        if fp8_kernel != "native":  # TE runs on CUDA only, and a GPU never emulates (lowprec.kernels.policy)
            raise RecipeError(f"recipe.fp8.backend='te' has no emulated kernels (cpu_kernels gave {fp8_kernel!r})")
        for fqn in fqns:
            swap_module(model, fqn, te_linear_from(model.get_submodule(fqn)))

    def precision_context(self, spec):
        return te_context(spec)

    def scaling_state_bytes(self, spec, n_fp8_linears) -> int:
        # Approximate, not measured here: fp8_meta holds per linear 3 forward and 2 backward tensors, each
        # amax_history_len history entries plus scale and scale_inv.
        return n_fp8_linears * 5 * (spec.cast.amax_history_len + 2) * 4 if spec.cast.strategy == "delayed" else 0

    def saved_input(self, spec, rows, in_features, device_type) -> tuple[str, int]:
        return ("own", rows * in_features + 4)  # approximate, unverified: the FP8 input and its scale_inv

    def estimate_notes(self) -> tuple[str, ...]:
        return ("Transformer Engine figures (scaling state, saved FP8 inputs) are approximate and unmeasured",)


register_fp8_backend(TransformerEngineFloat8())
