"""What ``lowprec recommend`` cites beside each row: the published loss evidence per recipe kind, and whether a row's
layout lies inside the published throughput measurements the cost model was checked against.

``PUBLISHED_EVIDENCE`` holds one citation per FP8 scaling (every ``Float8Backend.scalings`` value of the registry:
``tests/integration/test_recommend_catalog.py`` fails when a backend adds one without a citation), for 8-bit
optimizer states and for bf16. ``outside_published`` compares a layout with the points of
``lowprec/estimate/published.yaml`` (``lowprec_lab.sizing.cost_validation.load_points``): the cost model's held-out
error (``lowprec estimate --validate``) is known only near them.
"""

from __future__ import annotations

from functools import cache

from lowprec.recipe import Recipe
from lowprec_lab.sizing.cost_validation import load_points

#: Published loss evidence per recipe kind (the recipe's FP8 scaling, else its optimizer state, else bf16).
PUBLISHED_EVIDENCE = {
    "blockwise": "DeepSeek-V3 technical report (arXiv 2412.19437, section 3.3): 1x128/128x128 FP8 GEMMs with FP32 "
    "promotion, relative loss error below 0.25% against BF16 at about 1T tokens on its validation models",
    "tensorwise": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md and torchao torchao/float8/README.md "
    "(throughput); IBM+Meta 'Supercharging Training using float8 and FSDP2' (loss parity at 8B/100B tokens, "
    "70B/50B tokens)",
    "rowwise": "torchao torchao/float8/README.md (throughput); PyTorch blog 'Accelerating Large Scale Training and "
    "Convergence with PyTorch Float8 Rowwise on Crusoe 2K H200s' (comparable convergence)",
    "mxfp8": "Rouhani et al. 2023, 'Microscaling Data Formats for Deep Learning' (arXiv 2310.10537): generative "
    "language models trained with MXFP8 weights, activations and gradients close to their FP32 baselines; "
    "torchtitan torchtitan/components/quantization/mxfp8.md (B200 throughput)",
    "nvfp4": "NVIDIA, 'Pretraining Large Language Models with NVFP4' (arXiv 2509.25149): a 12B model over 10T "
    "tokens with its section-4 stabilisers, validation loss close to its FP8 baseline",
    "mxfp4": "arXiv 2509.25149 section 5: MXFP4 is the comparison NVFP4 beats (higher loss at 8B); published as a "
    "negative result, not as a training recipe",
    "int8": "Dettmers et al. 2021, '8-bit Optimizers via Block-wise Quantization' (arXiv 2110.02861): parity with "
    "32-bit Adam on their language-model pretraining and fine-tuning benchmarks",
    "bf16": "the reference: BF16 mixed precision with FP32 master weights (torchtitan's default)",
}
#: torchao's rowwise recipe with the weight-gradient GEMM in high precision: the rowwise evidence, a more precise GEMM
PUBLISHED_EVIDENCE["rowwise_with_gw_hp"] = PUBLISHED_EVIDENCE["rowwise"] + " (weight-gradient GEMM in high precision)"
NO_PUBLISHED = "none found for this recipe"

#: lowprec's own GPU measurement (docs/measurements.md, "GPU validation"): the only step lowprec itself timed on a GPU.
LOWPREC_GPU_CHECK = (
    "lowprec's own step, measured on one H100 (llama3_1b, one GPU, batch 1 x 8192, compile, selective AC: bf16, "
    "fp8_tensorwise, fp8_current, fp8_rowwise), came within 6% of the cost model (docs/measurements.md, GPU validation)"
)


def published_evidence(r: Recipe, control: str = "bf16") -> str:
    """The citation for ``r``'s kind: its FP8 scaling, else its 8-bit optimizer state, else bf16 for the control.
    A scaling missing from ``PUBLISHED_EVIDENCE`` raises ``KeyError``: a bug of this table, not of the input."""
    if r.fp8.enabled:
        return PUBLISHED_EVIDENCE[r.fp8.scaling]
    if r.optim.state == "int8":
        return PUBLISHED_EVIDENCE["int8"]
    if r.name == control:
        return PUBLISHED_EVIDENCE["bf16"]
    return NO_PUBLISHED


def _family(hardware: str) -> str:
    """``h100`` for ``h100_sxm``, ``h100_pcie`` and ``h100_96gb_500w``: a published point on one H100 variant counts
    for the others (the cost model scales peaks and bandwidths per part)."""
    return hardware.split("_", 1)[0]


@cache
def _throughput_points() -> tuple:
    return tuple(p for p in load_points())


def published_hardware() -> str:
    """The hardware families of the published points, e.g. ``B200, H100, H200, MI300X``."""
    return ", ".join(sorted({_family(p.hardware).upper() for p in _throughput_points()}))


def published_layouts(model: str) -> list[tuple[int, int, str]]:
    """``(dp_shard, tp, hardware)`` of every published point of ``model``, sorted."""
    return sorted({(p.dp_shard, p.tp, p.hardware) for p in _throughput_points() if p.model == model})


def outside_published(model: str, hardware: str, dp_shard: int, tp: int) -> str | None:
    """Why the layout ``dp_shard x tp`` of ``model`` on ``hardware`` lies outside every published point (one
    phrase), or ``None`` when a published point of the same model, hardware family and TP degree has an FSDP
    degree at or beyond it on both sides (``min <= dp_shard <= max``). The cost model's error is known only there."""
    pts = published_layouts(model)
    if not pts:
        return f"no published point of {model}"
    why = []
    fam = _family(hardware)
    if not any(_family(h) == fam for _, _, h in pts):
        parts = sorted({_family(h) for _, _, h in pts})
        why.append(f"no published {model} point on {fam} (only {', '.join(parts)})")
    same_tp = sorted({d for d, t, _ in pts if t == tp})
    if not same_tp or not same_tp[0] <= dp_shard <= same_tp[-1]:
        published = ", ".join(f"FSDP {d} x TP {t}" for d, t in sorted({(d, t) for d, t, _ in pts}))
        why.append(f"FSDP {dp_shard} x TP {tp} at {model} (published: {published})")
    return "; ".join(why) or None
