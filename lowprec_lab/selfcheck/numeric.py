"""Quick numeric known-answer checks of lowprec's FP8 code (each about a second on one CPU thread).

Every check calls lowprec's own code path (``lowprec.numerics.scaling.quantize_operand``,
``lowprec.float8.gemm.fp8_gemm``) with the formats and knobs of the catalog's ``fp8_blockwise`` recipe, measures an
SQNR in dB (``lowprec.numerics.formats.sqnr_db``: ``20 log10(||ref|| / ||ref - approx||)``) on ``DRAWS`` random
draws, and returns the per-draw SQNRs of the recipe and the control paired by draw (``registry.Paired``, scale
``difference``, higher is better): the verdict is on the SQNR the recipe loses, at a margin of ``MARGIN_DB``.

- Limited-precision accumulation (DeepSeek-V3, arXiv 2412.19437, section 3.3.2): a 14-bit accumulator with no
  promotion over K = 4096 against the same accumulator promoted to FP32 every N_C = 128 elements.
- Granularity under outliers (DeepSeek-V3 section 3.3.1; outlier channels: Dettmers et al. 2022, "LLM.int8()",
  arXiv 2208.07339; massive activations: Sun et al. 2024, arXiv 2402.17762): e4m3 activations with a few outlier
  channels quantized tensorwise against per-token (rowwise) and 1x128-tile scaling.

What the granularity checks measure (measured, 8 draws of 128 x 4096): e4m3 is a floating format, so an element in
the normal range keeps its 3-bit mantissa whatever the scale; at x100 outliers the typical channels' SQNR is the same
(31.5-31.7 dB) under all three granularities. The x100 gains (tensorwise 31.5, rowwise 33.9, 1x128 41.7 dB over the
whole tensor) come from current scaling mapping each group's amax to 448 exactly: the outliers carry ~95% of the
energy, and a finer group codes more of them exactly. With power-of-2 scales (``fp8_rowwise``'s choice) the amax is
not exact and all three give 31.56 dB. Only at ~1e4x outliers does the dynamic-range loss DeepSeek-V3 describes
act (typical values pushed below e4m3's smallest normal under a tensor scale): the third check, which holds with
power-of-2 scales too. Per-token (rowwise) scales cannot isolate channel outliers: every row holds all of them.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import torch

from lowprec.float8.config import SCALING_PRESETS, LinearFP8Config, linear_config
from lowprec.float8.gemm import fp8_gemm
from lowprec.numerics.formats import fp8_to_float32, sqnr_db
from lowprec.numerics.scaling import QTensor, expand_scale, quantize_operand
from lowprec.recipes import CATALOG
from lowprec_lab.selfcheck.registry import INFERIOR, Paired, known_answer

#: Paired random draws per check (generator seeds 0 .. DRAWS-1).
DRAWS = 8
#: SQNR a recipe must lose beyond its whole 95% interval to be ``inferior`` (1 dB: 1.26x the noise power).
MARGIN_DB = 1.0
#: Accumulator mantissa bits of H800 FP8 tensor cores (DeepSeek-V3 section 3.3.2: "around 14 bits").
ACCUM_BITS = 14
#: GEMM shape of the accumulation check: (M, K) @ (N, K).T.
ACC_M, ACC_N, ACC_K = 128, 128, 4096
#: Activations of the granularity checks: (tokens, channels), outlier channels and their magnitudes.
ACT_TOKENS, ACT_CHANNELS, OUTLIER_CHANNELS = 128, 4096, 8
OUTLIER_FACTOR, MASSIVE_FACTOR = 100.0, 1e4
#: Output features of the GEMM whose output SQNR the granularity checks also report.
GEMM_N = 256


def blockwise_config(accum_mantissa_bits: int = ACCUM_BITS) -> LinearFP8Config:
    """The catalog's ``fp8_blockwise`` FP8 configuration with an ``accum_mantissa_bits``-bit accumulator: e4m3
    operands, 1x128 activation tiles, 128x128 weight blocks, ``promotion_interval`` 128 (N_C)."""
    spec = CATALOG["fp8_blockwise"].fp8
    return linear_config(replace(spec, gemm=replace(spec.gemm, accum_mantissa_bits=accum_mantissa_bits)))


def exact_dequantize(q: QTensor) -> torch.Tensor:
    """``q``'s values as float64 (R, K): FP8 codes decoded exactly, divided by the expanded scale in float64."""
    return fp8_to_float32(q.data).double() / expand_scale(q.scale, q.granularity, q.shape).double()


def accumulation_sqnr(seed: int) -> tuple[float, float, float]:
    """SQNR (dB) of three FP8 GEMMs with a ``ACCUM_BITS``-bit accumulator against the FP64 product of their own
    dequantized operands, so that only accumulation error is measured.

    Draw ``seed``: ``x`` (ACC_M, ACC_K) and ``w`` (ACC_N, ACC_K) standard normal float32, quantized to the recipe's
    e4m3 with current scaling. Returns ``(no_promotion, promoted, fp8_blockwise)``: rowwise operands accumulated
    over all of K in one chunk; the same operands promoted to FP32 every N_C = 128; the recipe's own 1x128 x
    128x128 operands (which lowprec always promotes every 128: a scale changes there).
    """
    fp8 = blockwise_config()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ACC_M, ACC_K, generator=g)
    w = torch.randn(ACC_N, ACC_K, generator=g)
    bits = fp8.gemm.accum_mantissa_bits

    def sqnr(a: QTensor, b: QTensor, promotion_interval: int | None) -> float:
        ref = exact_dequantize(a) @ exact_dequantize(b).t()
        out = fp8_gemm(a, b, torch.float32, promotion_interval=promotion_interval, accum_mantissa_bits=bits)
        return sqnr_db(ref, out)

    p2, nc = fp8.cast.power_of_2_scales, fp8.gemm.promotion_interval
    qa = quantize_operand(x, fp8.input.fmt, "rowwise", power_of_2=p2)
    qb = quantize_operand(w, fp8.weight.fmt, "rowwise", power_of_2=p2)
    ta = quantize_operand(x, fp8.input.fmt, fp8.input.granularity, power_of_2=p2)
    tb = quantize_operand(w, fp8.weight.fmt, fp8.weight.granularity, power_of_2=p2)
    return sqnr(qa, qb, None), sqnr(qa, qb, nc), sqnr(ta, tb, nc)


@known_answer(
    "accumulation: 14-bit, no promotion vs N_C=128",
    expected=INFERIOR,
    quick=True,
    why=(
        "K=4096 summed in one 14-bit register: the running sum grows ~sqrt(K), so each 32-wide step rounds away "
        "more of the products; promoting every 128 (N_C, DeepSeek-V3 s3.3.2) keeps the register's sum small; same "
        "e4m3 rowwise operands and their own FP64 product in both arms, so only accumulation differs"
    ),
)
def check_accumulation() -> Paired:
    """Known answer: with a 14-bit accumulator, no promotion over K = 4096 loses SQNR against N_C = 128."""
    draws = np.array([accumulation_sqnr(s) for s in range(DRAWS)])
    return Paired(
        recipe=draws[:, 0],
        control=draws[:, 1],
        margin=MARGIN_DB,
        scale="difference",
        higher_is_better=True,
        unit="dB",
        metric="GEMM SQNR",
        recipe_label="no promotion",
        control_label="N_C=128",
        detail=(
            f"fp8_blockwise operands (1x128 x 128x128, N_C=128) {draws[:, 2].mean():.4g} dB; "
            f"{ACC_M}x{ACC_K} @ {ACC_K}x{ACC_N}, {ACCUM_BITS}-bit accumulator"
        ),
    )


def outlier_activations(seed: int, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``seed``: activations (ACT_TOKENS, ACT_CHANNELS) float32, standard normal, with ``OUTLIER_CHANNELS``
    random channels (columns) multiplied by ``factor``; and the boolean (ACT_CHANNELS,) mask of typical channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ACT_TOKENS, ACT_CHANNELS, generator=g)
    channels = torch.randperm(ACT_CHANNELS, generator=g)[:OUTLIER_CHANNELS]
    x[:, channels] *= factor
    typical = torch.ones(ACT_CHANNELS, dtype=torch.bool)
    typical[channels] = False
    return x, typical


#: The granularities compared: tensorwise, rowwise (one scale per token) and the recipe's 1x128 activation tiles.
GRANULARITIES = (SCALING_PRESETS["tensorwise"][0], SCALING_PRESETS["rowwise"][0], SCALING_PRESETS["blockwise"][0])


@functools.lru_cache(maxsize=4)
def granularity_sqnr(factor: float) -> dict[str, np.ndarray]:
    """Per-draw SQNRs (dB) of e4m3 activations with outlier channels ``factor``x, quantized with current scaling.

    Returns ``{granularity: array (DRAWS, 3)}`` over ``GRANULARITIES``; columns: the whole tensor against the
    original, the typical (non-outlier) channels alone, and the output of a GEMM with a standard normal FP64
    weight (GEMM_N, ACT_CHANNELS) (only the activations quantized; FP64 products). Cached: the checks share draws.
    """
    fmt = blockwise_config().input.fmt
    out = {gran: [] for gran in GRANULARITIES}
    for seed in range(DRAWS):
        x, typical = outlier_activations(seed, factor)
        w = torch.randn(GEMM_N, ACT_CHANNELS, generator=torch.Generator().manual_seed(10_000 + seed)).double()
        y = x.double() @ w.t()
        for gran in GRANULARITIES:
            xq = exact_dequantize(quantize_operand(x, fmt, gran))
            out[gran].append((sqnr_db(x, xq), sqnr_db(x[:, typical], xq[:, typical]), sqnr_db(y, xq @ w.t())))
    return {gran: np.array(v) for gran, v in out.items()}


def _granularity_paired(factor: float, control: str, column: int, metric: str) -> Paired:
    s = granularity_sqnr(factor)
    means = ", ".join(
        f"{g} {s[g][:, 0].mean():.4g}/{s[g][:, 1].mean():.4g}/{s[g][:, 2].mean():.4g}" for g in GRANULARITIES
    )
    return Paired(
        recipe=s["tensorwise"][:, column],
        control=s[control][:, column],
        margin=MARGIN_DB,
        scale="difference",
        higher_is_better=True,
        unit="dB",
        metric=metric,
        recipe_label="tensorwise",
        control_label=control,
        detail=(
            f"{OUTLIER_CHANNELS} of {ACT_TOKENS}x{ACT_CHANNELS} channels x{factor:g}, e4m3; SQNR dB whole/typical "
            f"channels/GEMM output: {means}"
        ),
    )


@known_answer(
    "outliers x100: tensorwise vs rowwise",
    expected=INFERIOR,
    quick=True,
    why=(
        "8 channels x100 carry ~95% of the energy; e4m3 is floating, so typical values keep 3 mantissa bits under "
        "any scale (typical-channel SQNR equal); current scaling codes each group's amax exactly (amax x scale = "
        "448): a per-token scale makes each row's largest outlier exact, a tensor scale one element (power-of-2 "
        "scales: no gain)"
    ),
)
def check_outliers_rowwise() -> Paired:
    """Known answer: under outlier channels, tensorwise e4m3 loses whole-tensor SQNR against per-token scales."""
    return _granularity_paired(OUTLIER_FACTOR, "rowwise", 0, "activation SQNR")


@known_answer(
    "outliers x100: tensorwise vs 1x128 tiles",
    expected=INFERIOR,
    quick=True,
    why=(
        "a 1x128 tile mostly holds one outlier channel, so each outlier is its tile's amax and coded exactly, "
        "isolating the outliers (DeepSeek-V3 s3.3.1; outlier channels: LLM.int8()); tensorwise codes them with "
        "e4m3's 2^-4 relative step, and they carry ~95% of the energy (power-of-2 scales: no gain at x100)"
    ),
)
def check_outliers_tiles() -> Paired:
    """Known answer: under outlier channels, tensorwise e4m3 loses whole-tensor SQNR against 1x128 tiles."""
    return _granularity_paired(OUTLIER_FACTOR, SCALING_PRESETS["blockwise"][0], 0, "activation SQNR")


@known_answer(
    "massive outliers x1e4: tensorwise vs 1x128 tiles, typical channels",
    expected=INFERIOR,
    quick=True,
    why=(
        "at ~1e4x (massive activations) a tensor scale maps typical values (~1) to ~0.01, below e4m3's smallest "
        "normal 2^-6, into subnormals with fewer mantissa bits; tiles without an outlier keep their own scale: "
        "the dynamic-range loss of DeepSeek-V3 s3.3.1, which at x100 e4m3's range still absorbs"
    ),
)
def check_massive_outliers() -> Paired:
    """Known answer: with 1e4x outlier channels, tensorwise e4m3 loses SQNR on the typical channels vs 1x128."""
    return _granularity_paired(MASSIVE_FACTOR, SCALING_PRESETS["blockwise"][0], 1, "typical-channel SQNR")
