"""Named recipes. Each is a small function so the catalog reads as a list of precision decisions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from lowprec.backends import check_recipe
from lowprec.float8.accumulator import HOPPER_ACCUMULATOR
from lowprec.recipe import (
    BlockSpec,
    CastSpec,
    CommSpec,
    ComputeSpec,
    Float8Spec,
    GemmSpec,
    LayersSpec,
    OptimSpec,
    Recipe,
    RecipeError,
    SavedSpec,
    WeightSpec,
)


def _fp8_with(spec: Float8Spec, **groups: dict) -> Float8Spec:
    """``spec`` with fields of its groups replaced, e.g. ``_fp8_with(s, cast={"amax_floor": 1e-4})``."""
    return replace(spec, **{g: replace(getattr(spec, g), **fields) for g, fields in groups.items()})


def fp32() -> Recipe:
    return Recipe(name="fp32", description="FP32 weights, compute and AdamW states: the numerical reference.")


def fp32_reordered() -> Recipe:
    return replace(
        fp32(),
        name="fp32_reordered",
        description="fp32 with every FP32 matmul of the training step summing its contraction in reverse order: the "
        "same mathematics, another rounding sequence; the noise study's negative control (experiment=noise).",
        compute=ComputeSpec(reduction_order="reversed"),
    )


def bf16() -> Recipe:
    return replace(
        fp32(),
        name="bf16",
        description="FP32 weights (they are the master) under BF16 autocast; FP32 AdamW states.",
        compute=ComputeSpec(autocast_dtype="bf16"),
    )


def bf16_reordered() -> Recipe:
    return replace(
        bf16(),
        name="bf16_reordered",
        description="bf16 with every matmul of the training step (the autocast BF16 GEMMs and any FP32 one) summing "
        "its contraction in reverse order: the same mathematics, other roundings; the negative control of an "
        "ablation against bf16 (ablate.controls=true).",
        compute=ComputeSpec(autocast_dtype="bf16", reduction_order="reversed"),
    )


def bf16_pure() -> Recipe:
    return replace(
        fp32(),
        name="bf16_pure",
        description="BF16 weights, gradients and AdamW states, no master copy: shows why masters exist.",
        weights=WeightSpec(param_dtype="bf16"),
    )


def fp8_tensorwise() -> Recipe:
    return replace(
        bf16(),
        name="fp8_tensorwise",
        description=(
            "bf16 + torchao Float8Linear, dynamic tensorwise scaling; tok_embeddings and output stay high precision."
        ),
        fp8=Float8Spec(backend="torchao", scaling="tensorwise"),
    )


def bf16_adamw8bit() -> Recipe:
    return replace(
        bf16(),
        name="bf16_adamw8bit",
        description="bf16 with bitsandbytes AdamW8bit: block-wise dynamic 8-bit m and v (256-element blocks).",
        optim=OptimSpec(state="int8", impl="bitsandbytes"),
    )


def fp8_current() -> Recipe:
    return replace(
        bf16(),
        name="fp8_current",
        description="bf16 + lowprec FP8 linears, tensorwise current scaling, HYBRID (e4m3 forward, e5m2 gradients).",
        fp8=Float8Spec(backend="lowprec", scaling="tensorwise", cast=CastSpec(strategy="current", fp8_format="hybrid")),
    )


def fp8_delayed() -> Recipe:
    return replace(
        fp8_current(),
        name="fp8_delayed",
        description="fp8_current with Transformer Engine's delayed scaling: amax_history_len 16, max, margin 0.",
        fp8=_fp8_with(
            fp8_current().fp8,
            cast={"strategy": "delayed", "amax_history_len": 16, "amax_compute_algo": "max", "margin": 0},
        ),
    )


def fp8_unscaled() -> Recipe:
    return replace(
        fp8_current(),
        name="fp8_unscaled",
        description=(
            "fp8_current cast without scaling (static scale 1 for input, weight and grad_output): the values below "
            "e4m3's and e5m2's smallest subnormals flush to zero, gradients above all, which is why FP8 training "
            "scales every tensor (Micikevicius et al. 2022, arXiv 2209.05433); a positive control of an ablation "
            "against bf16."
        ),
        fp8=_fp8_with(fp8_current().fp8, cast={"strategy": "static", "static_scales": (1.0, 1.0, 1.0)}),
    )


def fp8_rowwise() -> Recipe:
    return replace(
        fp8_current(),
        name="fp8_rowwise",
        description=(
            "bf16 + lowprec FP8 linears, rowwise scaling of every GEMM operand, all e4m3, power-of-2 "
            "scales (torchao's rowwise recipe)."
        ),
        fp8=Float8Spec(backend="lowprec", scaling="rowwise", cast=CastSpec(fp8_format="e4m3", power_of_2_scales=True)),
    )


def fp8_blockwise() -> Recipe:
    return replace(
        fp8_current(),
        name="fp8_blockwise",
        description=(
            "DeepSeek-V3 GEMM numerics: e4m3 everywhere, 1x128 activation/gradient tiles, 128x128 weight "
            "blocks, FP32 promotion every 128 (N_C), FP8-cached activations."
        ),
        fp8=Float8Spec(
            backend="lowprec",
            scaling="blockwise",
            cast=CastSpec(fp8_format="e4m3"),
            gemm=GemmSpec(promotion_interval=128),
            saved=SavedSpec(cache_fp8_activations=True),
        ),
    )


def te_delayed() -> Recipe:
    return replace(
        fp8_delayed(),
        name="te_delayed",
        description="fp8_delayed on Transformer Engine te.Linear under DelayedScaling (GPU only).",
        fp8=replace(fp8_delayed().fp8, backend="te"),
    )


def te_blockwise() -> Recipe:
    return replace(
        fp8_current(),
        name="te_blockwise",
        description="Transformer Engine Float8BlockScaling (1x128 / 128x128, e4m3; GPU only).",
        fp8=Float8Spec(backend="te", scaling="blockwise", cast=CastSpec(fp8_format="e4m3")),
    )


def bf16_master() -> Recipe:
    return replace(
        bf16_pure(),
        name="bf16_master",
        description=(
            "BF16 weights and gradients with an explicit FP32 master copy (Megatron/DeepSpeed style); "
            "FP32 AdamW states."
        ),
        weights=WeightSpec(param_dtype="bf16", master_dtype="fp32"),
    )


def bf16_sr() -> Recipe:
    return replace(
        bf16_pure(),
        name="bf16_sr",
        description="BF16 weights and moments, no master; updates written with stochastic rounding "
        "(torchao's bf16_stochastic_round).",
        weights=WeightSpec(param_dtype="bf16", update_rounding="stochastic"),
        optim=OptimSpec(state="param", impl="torchao"),
    )


def bf16_moments() -> Recipe:
    return replace(
        bf16(),
        name="bf16_moments",
        description="bf16 with BF16 AdamW m and v (DeepSeek-V3), FP32 weights.",
        optim=OptimSpec(state="bf16", impl="lowprec"),
    )


def bf16_adamw8bit_ao() -> Recipe:
    return replace(
        bf16(),
        name="bf16_adamw8bit_ao",
        description="bf16 with torchao AdamW8bit (block-wise 8-bit m and v, block 256; works on FSDP2 DTensors).",
        optim=OptimSpec(state="int8", impl="torchao"),
    )


def bf16_adamw4bit() -> Recipe:
    return replace(
        bf16(),
        name="bf16_adamw4bit",
        description="bf16 with torchao AdamW4bit (4-bit m and v, block 128).",
        optim=OptimSpec(state="int4", impl="torchao"),
    )


def fp8_msamp_o2() -> Recipe:
    return replace(
        fp8_current(),
        name="fp8_msamp_o2",
        description="fp8_current GEMMs + MS-AMP O2 optimizer states: FP8 e4m3 first moment, FP16 second moment, "
        "per-tensor scales (FP32 weights; no FP8 gradients or all-reduce).",
        optim=OptimSpec(state="fp8_fp16", impl="lowprec"),
    )


def fp16_amp() -> Recipe:
    return replace(
        bf16(),
        name="fp16_amp",
        description=(
            "FP16 autocast with dynamic loss scaling (GradScaler semantics), FP32 weights: the historical baseline."
        ),
        compute=ComputeSpec(autocast_dtype="fp16", loss_scaling="dynamic"),
    )


def fp16_noscale() -> Recipe:
    return replace(
        bf16(),
        name="fp16_noscale",
        description="FP16 autocast without loss scaling: shows gradient underflow (grad_underflow_share).",
        compute=ComputeSpec(autocast_dtype="fp16"),
    )


def deepseek_v3() -> Recipe:
    return replace(
        fp8_blockwise(),
        name="deepseek_v3",
        description=(
            "DeepSeek-V3 (arXiv 2412.19437 section 3.3): fp8_blockwise GEMMs with the reference kernels' amax floor "
            "1e-4, attention.wo inputs saved in E5M6 and SwiGLU inputs in FP8 (power-of-2 scales, output "
            "recomputed), FP32 master weights, BF16 AdamW moments."
        ),
        fp8=_fp8_with(
            fp8_blockwise().fp8,
            cast={"amax_floor": 1e-4},
            saved={"e5m6_inputs": ("attention.wo",), "swiglu_cache": "fp8"},
        ),
        optim=OptimSpec(state="bf16", impl="lowprec"),
    )


# deepseek_v3 with one choice undone: the component ablation of experiment=deepseek_v3 (DeepSeek-V3 3.3, B.2).


def deepseek_v3_no_promotion() -> Recipe:
    return replace(
        deepseek_v3(),
        name="deepseek_v3_no_promotion",
        description="deepseek_v3 without promotion: all of K in an emulated 14-bit accumulator (Hopper's, 3.3.2).",
        fp8=_fp8_with(deepseek_v3().fp8, gemm={"accum_mantissa_bits": 14, "promotion": False}),
    )


def deepseek_v3_no_promotion_hopper() -> Recipe:
    # The same ablation on the accumulator fitted to a Hopper measurement (lowprec.float8.accumulator, whose
    # HOPPER_ACCUMULATOR is the one place its parameters live); deepseek_v3_no_promotion keeps the paper's prose.
    acc = HOPPER_ACCUMULATOR
    return replace(
        deepseek_v3(),
        name="deepseek_v3_no_promotion_hopper",
        description=f"deepseek_v3 without promotion on the accumulator fitted to Hopper: {acc.describe()}.",
        fp8=_fp8_with(
            deepseek_v3().fp8,
            gemm={
                "accum_mantissa_bits": acc.bits,
                "accum_rounding": acc.rounding,
                "accum_group": acc.group,
                "promotion": False,
            },
        ),
    )


def deepseek_v3_tensorwise() -> Recipe:
    return replace(
        deepseek_v3(),
        name="deepseek_v3_tensorwise",
        description="deepseek_v3 with one scale per tensor instead of 1x128 tiles / 128x128 blocks (3.3.2).",
        fp8=replace(deepseek_v3().fp8, scaling="tensorwise"),
    )


def deepseek_v3_fp32_moments() -> Recipe:
    return replace(
        deepseek_v3(),
        name="deepseek_v3_fp32_moments",
        description="deepseek_v3 with FP32 instead of BF16 AdamW moments (3.3.3).",
        optim=OptimSpec(state="fp32", impl="lowprec"),
    )


def deepseek_v3_no_fp8_cache() -> Recipe:
    return replace(
        deepseek_v3(),
        name="deepseek_v3_no_fp8_cache",
        description="deepseek_v3 saving every activation for backward in the compute dtype: no FP8 linear-input "
        "cache, no E5M6 attention.wo input, no FP8 SwiGLU inputs (3.3.3).",
        fp8=replace(deepseek_v3().fp8, saved=SavedSpec()),
    )


def deepseek_v3_grad_blocks() -> Recipe:
    return replace(
        deepseek_v3(),
        name="deepseek_v3_grad_blocks",
        description="deepseek_v3 with 128x128 blocks instead of 1x128 tiles for activation gradients: the "
        "variant appendix B.2 reports diverging on a 16B MoE.",
        fp8=_fp8_with(deepseek_v3().fp8, cast={"grad_output_granularity": "block128x128"}),
    )


def fp8_tensorwise_fsdp8() -> Recipe:
    return replace(
        fp8_tensorwise(),
        name="fp8_tensorwise_fsdp8",
        description="torchtitan's float8 recipe: fp8_tensorwise with torchao's FSDP2 FP8 weight all-gather "
        "(scales precomputed after each optimizer step).",
        comm=CommSpec(weight_all_gather="fp8"),
    )


def fp8_comm8() -> Recipe:
    return replace(
        fp8_current(),
        name="fp8_comm8",
        description="fp8_current with FP8 on the wire both ways under FSDP2: e4m3 weight all-gather (lowprec "
        "fsdp_pre_all_gather) and MS-AMP-style FP8 gradient reduce-scatter (128-element blocks, FP32 sum).",
        comm=CommSpec(weight_all_gather="fp8", grad_reduce="fp8"),
    )


def deepseek_v3_comm8() -> Recipe:
    return replace(
        deepseek_v3(),
        name="deepseek_v3_comm8",
        description=(
            "deepseek_v3 with FP8 weight all-gather (per-row scales on the wire) and FP8 gradient reduce-scatter."
        ),
        comm=CommSpec(weight_all_gather="fp8", grad_reduce="fp8"),
    )


def mxfp8() -> Recipe:
    return replace(
        bf16(),
        name="mxfp8",
        description=(
            "bf16 + MXFP8 for all three GEMMs of the blocks' linears (OCP MX: e4m3 elements, 32-element blocks along "
            "K, E8M0 scales, torchao's RCEIL rounding) on lowprec's block-scaled linear (backend=mx; exact emulation "
            "on CPU). Linears narrower than one block stay BF16."
        ),
        fp8=Float8Spec(
            backend="mx", scaling="mxfp8", cast=CastSpec(fp8_format="e4m3"), layers=LayersSpec(min_features=32)
        ),
    )


def mxfp4() -> Recipe:
    return replace(
        bf16(),
        name="mxfp4",
        description=(
            "bf16 + MXFP4 (E2M1, 32-element blocks, E8M0 scales) for all three GEMMs, no stabilisers: the negative "
            "control NVFP4 is measured against (arXiv 2509.25149 section 5)."
        ),
        fp8=Float8Spec(backend="mx", scaling="mxfp4", layers=LayersSpec(min_features=32)),
    )


def nvfp4() -> Recipe:
    return replace(
        bf16(),
        name="nvfp4",
        description=(
            "NVIDIA's NVFP4 training recipe (arXiv 2509.25149 section 4): E2M1 in 16-element blocks with E4M3 block "
            "scales and an FP32 tensor scale for the blocks' linears; the last block in BF16 (4.1), a 16x16 random "
            "Hadamard transform on the weight-gradient GEMM inputs (4.2), 16x16 weight scale tiles (4.3), "
            "stochastic rounding of gradients (4.4)."
        ),
        fp8=Float8Spec(
            backend="mx",
            scaling="nvfp4",
            block=BlockSpec(rht_size=16, weight_scaling_2d=True, grad_rounding="stochastic"),
            layers=LayersSpec(hp_last_blocks=1),
        ),
    )


def _nvfp4_without(name: str, what: str, **groups: dict) -> Recipe:
    r = nvfp4()
    return replace(r, name=name, description=f"nvfp4 without {what}.", fp8=_fp8_with(r.fp8, **groups))


def nvfp4_no_rht() -> Recipe:
    return _nvfp4_without(
        "nvfp4_no_rht", "the random Hadamard transform on the weight-gradient GEMM", block={"rht_size": 0}
    )


def nvfp4_no_2d() -> Recipe:
    return _nvfp4_without(
        "nvfp4_no_2d", "2-D weight scaling (1x16 blocks along each GEMM's K)", block={"weight_scaling_2d": False}
    )


def nvfp4_no_sr() -> Recipe:
    return _nvfp4_without(
        "nvfp4_no_sr", "stochastic rounding (gradients round to nearest even)", block={"grad_rounding": "nearest"}
    )


def nvfp4_no_hp() -> Recipe:
    return _nvfp4_without(
        "nvfp4_no_hp", "the BF16 last block (every block's linears in NVFP4)", layers={"hp_last_blocks": 0}
    )


def te_mxfp8() -> Recipe:
    return replace(
        mxfp8(),
        name="te_mxfp8",
        description="Transformer Engine MXFP8BlockScaling (e4m3, 32-element blocks, E8M0; GPU sm100 only).",
        fp8=Float8Spec(
            backend="te", scaling="mxfp8", cast=CastSpec(fp8_format="e4m3"), layers=LayersSpec(min_features=32)
        ),
    )


def te_nvfp4() -> Recipe:
    return replace(
        nvfp4(),
        name="te_nvfp4",
        description="Transformer Engine NVFP4BlockScaling with its RHT, 2-D weight and SR stabilisers (sm100 only).",
        fp8=Float8Spec(
            backend="te",
            scaling="nvfp4",
            block=BlockSpec(rht_size=16, weight_scaling_2d=True, grad_rounding="stochastic"),
            layers=LayersSpec(hp_last_blocks=1),
        ),
    )


_BUILDERS: list[Callable[[], Recipe]] = [
    fp32,
    fp32_reordered,
    bf16,
    bf16_reordered,
    bf16_pure,
    fp8_tensorwise,
    bf16_adamw8bit,
    fp8_current,
    fp8_delayed,
    fp8_unscaled,
    fp8_rowwise,
    fp8_blockwise,
    te_delayed,
    te_blockwise,
    bf16_master,
    bf16_sr,
    bf16_moments,
    bf16_adamw8bit_ao,
    bf16_adamw4bit,
    fp8_msamp_o2,
    fp16_amp,
    fp16_noscale,
    deepseek_v3,
    deepseek_v3_no_promotion,
    deepseek_v3_no_promotion_hopper,
    deepseek_v3_tensorwise,
    deepseek_v3_fp32_moments,
    deepseek_v3_no_fp8_cache,
    deepseek_v3_grad_blocks,
    fp8_tensorwise_fsdp8,
    fp8_comm8,
    deepseek_v3_comm8,
    mxfp8,
    mxfp4,
    nvfp4,
    nvfp4_no_rht,
    nvfp4_no_2d,
    nvfp4_no_sr,
    nvfp4_no_hp,
    te_mxfp8,
    te_nvfp4,
]

#: name -> Recipe, in catalog order. Each passes the backend registry's checks as it is built (a ``Recipe`` is a
#: pure value: ``lowprec.backends.check_recipe``), so a catalog entry no backend can honour fails on import.
CATALOG: dict[str, Recipe] = {b.__name__: check_recipe(b()) for b in _BUILDERS}


def recipe_names() -> list[str]:
    return list(CATALOG)


def get_recipe(name: str) -> Recipe:
    """The named recipe. Raises ``RecipeError`` listing the catalog for an unknown name."""
    try:
        return CATALOG[name]
    except KeyError:
        raise RecipeError(f"unknown recipe {name!r}; known: {', '.join(CATALOG)}") from None
