"""``recipe.fp8.backend='torchao'``: ``torchao.float8.Float8Linear`` through ``convert_to_float8_training``
(``torchao/float8/float8_linear_utils.py``), dynamic (current) scaling, its named recipes; FSDP2 float8
all-gather for tensorwise (``enable_fsdp_float8_all_gather``), made to run on gloo with a uint8 all-gather."""

from __future__ import annotations

import dataclasses

from lowprec.backends.fp8_lowprec import refuse_unimplemented
from lowprec.backends.registry import Float8Backend, register_fp8_backend
from lowprec.errors import RecipeError
from lowprec.parallel.fp8_all_gather import install_fp8_safe_all_gather

#: torchao recipe name -> the FP8 format it implies (HYBRID for tensorwise, all-e4m3 for rowwise).
_IMPLIED_FORMAT = {"tensorwise": "hybrid", "rowwise": "e4m3", "rowwise_with_gw_hp": "e4m3"}


class TorchaoFloat8(Float8Backend):
    name = "torchao"
    scalings = tuple(_IMPLIED_FORMAT)
    module_class = "torchao.float8.float8_linear.Float8Linear"
    format_in_name = False

    def validate(self, spec) -> None:
        if spec.scaling in ("nvfp4", "mxfp4", "mxfp8"):
            raise RecipeError(_no_block_scaled_training(spec.scaling))
        super().validate(spec)
        if spec.cast.strategy != "current":
            raise RecipeError(
                f"recipe.fp8.cast.strategy={spec.cast.strategy!r} conflicts with recipe.fp8.backend='torchao': torchao "
                "removed delayed scaling in 2025 and has no static scaling; use backend=lowprec"
            )
        implied = _IMPLIED_FORMAT[spec.scaling]
        if spec.cast.fp8_format != implied:
            raise RecipeError(
                f"recipe.fp8.cast.fp8_format={spec.cast.fp8_format!r} conflicts with recipe.fp8.backend='torchao' and "
                f"recipe.fp8.scaling={spec.scaling!r}, whose torchao recipe uses {implied!r}; "
                f"set recipe.fp8.cast.fp8_format={implied}"
            )
        refuse_unimplemented(spec, self.name)

    def supports_fp8_weight_all_gather(self, spec) -> bool:
        return spec.scaling == "tensorwise"  # torchao's only FSDP float8 all-gather

    def check_shapes(self, spec, shapes, tokens) -> None:
        # torchao's Float8Linear (torch._scaled_mm) needs both feature dims to be multiples of 16; checked here so
        # preflight refuses the run before MLflow sees it, not the build inside a started run.
        bad = [f for f, (fin, fout) in shapes.items() if fin % 16 or fout % 16]
        if bad:
            raise RecipeError(
                f"recipe.fp8 selects linears whose dims are not multiples of 16 (torchao needs it): {bad}; "
                "raise recipe.fp8.layers.min_features or add them to recipe.fp8.layers.keep_hp_fqns"
            )

    def convert(self, model, spec, fqns, fp8_weight_all_gather, fp8_kernel) -> None:
        modules = dict(model.named_modules())
        self.check_shapes(spec, {f: (modules[f].in_features, modules[f].out_features) for f in fqns}, 0)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # lazy: ~1 s of import

        config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(spec.scaling), pad_inner_dim=spec.gemm.pad_inner_dim
        )
        if fp8_weight_all_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        if fp8_kernel == "emulated":
            # torchao's own emulation (Float8LinearConfig.emulate, torchao/float8/float8_ops.py): dequantize each
            # operand in FP32 (x_fp8 / scale), FP32 matmul, one rounding to the output dtype. It divides before
            # accumulating where _scaled_mm scales after, so results can differ in the last FP32 bit.
            config = dataclasses.replace(config, emulate=True)
        selected = set(fqns)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn in selected)

    def kernel_of(self, module) -> str:
        return "emulated" if module.config.emulate else "native"

    def register_hooks(self, model, optimizer, fp8_weight_all_gather) -> list[str]:
        if not fp8_weight_all_gather:
            return []
        # torchao's FP8 all-gather: every FP8 weight's scale in one all-reduce after each optimizer step
        # (``precompute_float8_dynamic_scale_for_fsdp``), as torchtitan does.
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        optimizer.register_step_post_hook(lambda opt, args, kwargs: precompute_float8_dynamic_scale_for_fsdp(model))
        return ["torchao precompute_float8_dynamic_scale_for_fsdp after the optimizer step"]

    def prepare_sharding(self, model, spec, comm, dims) -> dict[str, str]:
        if comm.weight_all_gather == "fp8":
            _check_even(model, dims.dp_shard)
        return {}

    def finish_sharding(self, model, spec, comm, dims) -> dict[str, str]:
        if comm.weight_all_gather != "fp8" or not (dims.fsdp or dims.dp_replicate > 1):
            return {}
        install_fp8_safe_all_gather(model)
        return {"weight_all_gather": "torchao enable_fsdp_float8_all_gather (uint8 wire)"}

    def weight_state_bytes(self, n_fp8_linears, fp8_weight_all_gather) -> int:
        # torchao's FSDP float8 all-gather keeps each weight's precomputed fp32 scale inside the parameter
        # (WeightWithDynamicFloat8CastTensor._precomputed_scale).
        return 4 * n_fp8_linears if fp8_weight_all_gather else 0

    def saved_input(self, spec, rows, in_features, device_type) -> tuple[str, int]:
        # torchao's Float8Linear follows CUDA autocast only; on CPU it computes from the uncast input.
        return ("cast", 0) if device_type == "cuda" else ("raw", 0)


def _no_block_scaled_training(scaling: str) -> str:
    """Why ``backend=torchao`` cannot train ``scaling`` here: the installed torchao's NVFP4 and MXFP4 configs are
    inference-only (``NVFP4DynamicActivationNVFP4WeightConfig``, ``MXDynamicActivationMXWeightConfig``); its MXFP8
    training (``torchao.prototype.moe_training.MXFP8TrainingOpConfig``) is not wired into lowprec yet."""
    try:
        import torchao

        version = torchao.__version__
    except ImportError:
        version = "not installed"
    if scaling == "mxfp8":
        return (
            f"recipe.fp8.scaling='mxfp8' with backend='torchao' is not wired in lowprec (torchao {version}'s "
            "MXFP8TrainingOpConfig); use backend=mx (recipe=mxfp8), lowprec's exact MXFP8 linear"
        )
    return (
        f"recipe.fp8.scaling={scaling!r} conflicts with recipe.fp8.backend='torchao': the installed torchao "
        f"({version}) has no {scaling.upper()} training path (its {scaling.upper()} configs are inference-only); "
        f"use backend=mx (recipe={scaling}) or backend=te on a Blackwell GPU"
    )


def _check_even(model, dp_shard: int) -> None:
    """torchao's FSDP2 float8 all-gather breaks when a weight's rows do not split evenly over the shards
    (pytorch/ao#3982: a collective size mismatch; measured here at dp_shard=3). Refuse before training."""
    uneven = [
        n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear" and m.weight.shape[0] % dp_shard
    ]
    if uneven:
        raise RecipeError(
            f"recipe.comm.weight_all_gather='fp8' with backend=torchao needs every FP8 weight's rows divisible by "
            f"parallel.dp_shard={dp_shard} (torchao's float8 all-gather fails on uneven shards, pytorch/ao#3982); "
            f"{len(uneven)} are not, e.g. {uneven[0]}. Use backend=lowprec (e.g. recipe=fp8_comm8), whose FP8 "
            "all-gather handles uneven shards, or a dp_shard that divides the weights"
        )


register_fp8_backend(TorchaoFloat8())
