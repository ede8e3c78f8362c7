"""E5M6: DeepSeek-V3's customized 12-bit storage format for specific activations, emulated exactly.

DeepSeek-V3 (arXiv 2412.19437, section 3.3.3, "Low-Precision Storage and Communication") keeps the input of the
Linear after the attention operator in "a customized E5M6 data format" with power-of-2 scaling factors. The
paper gives no bit layout beyond the name, so lowprec defines it IEEE-like, as FP16 (E5M10) with 4 fewer mantissa
bits (the way e5m2 is FP16 with 8 fewer): 1 sign bit, 5 exponent bits with bias 15, 6 explicit mantissa bits;
exponent field 31 is reserved for inf/NaN, so the largest finite value is ``(2 - 2**-6) * 2**15 = 65024``, the
smallest normal ``2**-14`` and the subnormals are ``m * 2**-20`` for ``m`` in 1..63 (smallest ``2**-20``).

Rounding is to nearest, ties to even (on the 6-bit mantissa, or on the ``2**-20`` grid below ``2**-14``).
Saturating: finite values beyond ``±65024`` become ``±65024`` (never inf, as lowprec's FP8 casts); NaN stays NaN.
There is no torch dtype: values are returned in float32, which holds every E5M6 value exactly.
"""

from __future__ import annotations

import torch

EXP_BITS = 5
MAN_BITS = 6
BIAS = 15
#: Largest finite E5M6 value, ``(2 - 2**-MAN_BITS) * 2**BIAS``.
MAX = (2.0 - 2.0**-MAN_BITS) * 2.0**BIAS
MIN_NORMAL = 2.0 ** (1 - BIAS)
MIN_SUBNORMAL = 2.0 ** (1 - BIAS - MAN_BITS)


@torch.no_grad()
def round_e5m6(x: torch.Tensor) -> torch.Tensor:
    """``x`` (any shape, any float dtype) rounded to the nearest E5M6 value (ties to even), saturated to
    ``±MAX``; float32, same shape. NaN stays NaN; ``±inf`` saturates to ``±MAX``.

    Computed in float64, where every step is exact: the spacing of E5M6 values at ``|x|`` is
    ``2**(max(e, -14) - 6)`` with ``e = floor(log2 |x|)``, and ``torch.round`` rounds halves to even.
    """
    xd = x.to(torch.float64).clamp(-MAX, MAX)
    # floor(log2 |xd|) from the float64 exponent field (xd is never a float64 subnormal: it holds a float32 value;
    # zero gives -1023, clamped like every exponent below E5M6's normal range). Not torch.frexp: its int32 exponent
    # beside float64 values made inductor's CPU vectorizer emit VectorizedN<int,4> - VectorizedN<int,2> (a C++
    # compile error, torch 2.13), so deepseek_v3 could not compile on a CPU.
    e = ((xd.view(torch.int64) >> 52) & 0x7FF) - 1023
    ulp = torch.exp2((torch.clamp(e, min=1 - BIAS) - MAN_BITS).to(torch.float64))
    return (torch.round(xd / ulp) * ulp).to(torch.float32)


@torch.no_grad()
def e5m6_tiles(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the 2-D activation ``x`` (R, K) in E5M6 with one power-of-2 scale per 1 x ``block`` tile along K
    (section 3.3.3: "power-of-2 scaling factors"), returning ``(values, scale)``: ``values`` float32 (R, K) is
    the dequantized E5M6 content ``round_e5m6(x * s) / s`` (exact: ``s`` is a power of 2) and ``scale`` float32
    (R, ceil(K/block)) the multiplying scales ``s = 2**floor(log2(MAX / amax))`` (1 for an all-zero tile).

    Raises ``ValueError`` for a tensor that is not 2-D. Emulation: the 12-bit payload is not packed, so the
    values occupy float32 memory; the estimator counts 1.5 bytes per element.
    """
    if x.dim() != 2:
        raise ValueError(f"e5m6_tiles needs a 2-D (rows, K) tensor; got shape {tuple(x.shape)}")
    r, k = x.shape
    nk = -(-k // block)
    xf = torch.nn.functional.pad(x.float(), (0, nk * block - k)).view(r, nk, block)
    amax = xf.abs().amax(dim=2).double()
    scale = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(MAX / amax))), torch.ones_like(amax))
    scale = scale.clamp(max=2.0**126).float()  # stays a finite float32 power of 2 for any amax
    values = round_e5m6(xf * scale[:, :, None]) / scale[:, :, None]
    values = values.view(r, nk * block)
    return (values if nk * block == k else values[:, :k].contiguous()), scale
