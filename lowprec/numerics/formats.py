"""Low-precision number formats and saturating quantization.

Convention (docs/architecture.md, "Numerics conventions"): ``scale`` multiplies. ``x_fp8 = saturate(x_hp * scale)`` and
``x_hp ~ x_fp8 / scale``; the current-scaling scale is ``fmt.max / amax`` (torchao's
``amax_to_scale`` in ``torchao/float8/float8_utils.py``, which computes it in float64 and
stores float32). Transformer Engine stores ``scale_inv = 1 / scale`` next to its FP8 data; lowprec
stores ``scale`` and passes ``1 / scale`` to ``torch._scaled_mm``, whose scales dequantize.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Smallest amax used when computing a scale (torchao's ``EPS``), so an all-zero tensor gets a finite scale.
AMAX_EPS = 1e-12


@dataclass(frozen=True)
class Format:
    """An FP8 format: torch dtype, largest finite value, machine epsilon (spacing just above 1),
    smallest normal and smallest subnormal magnitudes."""

    name: str
    dtype: torch.dtype
    max: float
    eps: float
    min_normal: float
    min_subnormal: float


def _fmt(name: str, dtype: torch.dtype) -> Format:
    fi = torch.finfo(dtype)
    return Format(name, dtype, float(fi.max), float(fi.eps), float(fi.tiny), float(fi.smallest_normal) * float(fi.eps))


E4M3 = _fmt("e4m3", torch.float8_e4m3fn)  # max 448, eps 0.125
E5M2 = _fmt("e5m2", torch.float8_e5m2)  # max 57344, eps 0.25
E4M3FNUZ = _fmt("e4m3fnuz", torch.float8_e4m3fnuz)  # AMD MI300: max 240

FORMATS: dict[str, Format] = {f.name: f for f in (E4M3, E5M2, E4M3FNUZ)}


def get_format(name: str) -> Format:
    """Format by name (``e4m3``, ``e5m2``, ``e4m3fnuz``); raises ``ValueError`` listing the names."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown FP8 format {name!r}; known: {list(FORMATS)}") from None


@torch.no_grad()
def amax_to_scale(
    amax: torch.Tensor, fmt: Format, power_of_2: bool = False, margin: int = 0, amax_floor: float = AMAX_EPS
) -> torch.Tensor:
    """``scale = fmt.max / max(amax, amax_floor) / 2**margin`` as float32, same shape as ``amax``.

    Computed in float64 then cast, as torchao does, so eager and compiled code agree bit for bit.
    ``power_of_2`` rounds the scale down to a power of two (exact dequantization; torchao's
    ``round_scales_to_power_of_2``, TE's ``power_2_scale``). ``margin`` is TE's ``DelayedScaling.margin``.
    ``amax_floor``: ``AMAX_EPS`` is torchao's ``EPS``; DeepSeek's reference kernels clamp amax at 1e-4
    (DeepSeek-V3 ``inference/kernel.py`` ``act_quant``, DeepGEMM ``per_token_cast_to_fp8``).
    """
    scale = (fmt.max / torch.clamp(amax.to(torch.float64), min=amax_floor)).to(torch.float32)
    if margin:
        scale = scale / (2.0**margin)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``saturate(x * scale)`` cast to ``fmt.dtype``; ``scale`` must broadcast against ``x``.

    Values beyond ``±fmt.max`` saturate to ``±fmt.max`` (never inf); NaN stays NaN. The product is
    taken in float32 whatever ``x``'s dtype, as torchao's ``hp_tensor_and_scale_to_float8`` does.
    """
    y = x.to(torch.float32) * scale
    return y.clamp_(min=-fmt.max, max=fmt.max).to(fmt.dtype)  # in place: y is a fresh product


def dequantize(x_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x_fp8 / scale`` in ``dtype`` (float32 by default); ``scale`` must broadcast against ``x_fp8``."""
    return (fp8_to_float32(x_fp8) / scale).to(dtype)


#: Every 8-bit code of each FP8 dtype decoded by torch's own conversion (NaN codes included), built on first use.
_DECODE_TABLES: dict[torch.dtype, torch.Tensor] = {}


def fp8_to_float32(x_fp8: torch.Tensor) -> torch.Tensor:
    """``x_fp8.float()`` (any shape, any FP8 dtype), bit for bit, by a 256-entry table lookup.

    torch's CPU FP8 -> FP32 cast is scalar code (4.5 ms for 1.5 M elements on a 2-core AVX2 EPYC, against
    2.4 ms for the lookup), and the emulated FP8 GEMMs decode every operand. The table is torch's own cast
    of each code, so the two agree by construction; CUDA tensors and layouts other than contiguous or the
    transpose of contiguous take the cast.
    """
    if x_fp8.device.type != "cpu" or x_fp8.element_size() != 1 or torch.compiler.is_compiling():
        # Under torch.compile inductor fuses the cast; the module-level table would be a global side effect in
        # the traced graph (dynamo lifts it between autograd Functions as a free variable).
        return x_fp8.float()
    if x_fp8.is_contiguous():
        codes, back = x_fp8, lambda y: y.view(x_fp8.shape)
    elif x_fp8.dim() == 2 and x_fp8.t().is_contiguous():
        codes, back = x_fp8.t(), lambda y: y.view(x_fp8.shape[::-1]).t()
    else:
        return x_fp8.float()
    table = _DECODE_TABLES.get(x_fp8.dtype)
    if table is None:
        table = _DECODE_TABLES[x_fp8.dtype] = torch.arange(256, dtype=torch.uint8).view(x_fp8.dtype).float()
    return back(torch.index_select(table, 0, codes.reshape(-1).view(torch.uint8).int()))


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``20 log10(||ref|| / ||ref - approx||)`` in dB (inf if exact)."""
    ref = reference.double()
    noise = (ref - approx.double()).norm()
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(ref.norm() / noise))
