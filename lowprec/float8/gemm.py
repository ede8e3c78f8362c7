"""FP8 GEMM backends: ``out = a @ bt.T`` for quantized operands ``a`` (M, K) and ``bt`` (N, K).

- ``scaled_mm``: ``torch._scaled_mm`` (CPU and CUDA). Tensorwise and rowwise operands run as one call
  (a tensorwise scale is broadcast to a per-row one when the other operand is rowwise). Tile (1x128) and
  block (128x128) operands run as a loop over 128-wide K chunks of rowwise ``_scaled_mm`` whose FP32
  partial results are summed in FP32: DeepSeek-V3's promotion to FP32 every N_C = 128 elements
  (arXiv 2412.19437 section 3.3.2), since CPU ``_scaled_mm`` rejects blockwise scales
  (docs/architecture.md, "Platform facts").
- ``emulated``: dequantize both operands, FP32 matmul. The reference.

``promotion_interval`` (N_C) splits K into chunks whose partial sums are promoted to FP32;
``accum_mantissa_bits`` additionally emulates a limited-precision tensor-core accumulator inside each
chunk: raw FP8 products are accumulated 32 elements of K at a time (one WGMMA k-step) and the running sum
is rounded to that many mantissa bits after every step, before the chunk's scales are applied. With
``accum_mantissa_bits=14`` and no promotion, error grows with K as DeepSeek reports for H800.
"""

from __future__ import annotations

import torch

from lowprec.numerics.scaling import BLOCK, QTensor, expand_scale

BACKENDS = ("scaled_mm", "emulated")
WGMMA_K = 32


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Round float32 ``x`` to ``bits`` explicit mantissa bits (round to nearest, ties to even)."""
    if not 0 < bits < 23:
        raise ValueError(f"accum_mantissa_bits={bits} must be between 1 and 22")
    drop = 23 - bits
    i = x.contiguous().view(torch.int32)
    lsb = (i >> drop) & 1
    i = (i + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1)
    return i.view(torch.float32)


def _per_row_scale(q: QTensor, k0: int, k1: int) -> torch.Tensor:
    """The (rows, 1) float32 scale valid for K columns [k0, k1) of ``q`` (constant there by construction)."""
    r = q.shape[0]
    if q.granularity == "tensorwise":
        return q.scale.reshape(1, 1).expand(r, 1)
    if q.granularity == "rowwise":
        return q.scale.reshape(r, 1)
    return expand_scale(q.scale, q.granularity, q.shape)[:, k0 : k0 + 1]


def _chunk_bounds(k: int, a: QTensor, bt: QTensor, promotion_interval: int | None) -> list[tuple[int, int]]:
    blockwise = {a.granularity, bt.granularity} & {"tile1x128", "block128x128"}
    step = promotion_interval or (BLOCK if blockwise else k)
    if blockwise and step % BLOCK and step != k:
        raise ValueError(f"promotion_interval={step} must be a multiple of {BLOCK} for tile/block scaling")
    if blockwise and step != BLOCK:
        # a chunk spanning several 128-wide scale groups cannot be one scaled GEMM; the scales change inside it
        raise ValueError(f"tile/block scaling promotes every {BLOCK} elements; got promotion_interval={step}")
    return [(k0, min(k0 + step, k)) for k0 in range(0, k, step)]


def _scaled_mm(a: torch.Tensor, bt: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out_dtype) -> torch.Tensor:
    # _scaled_mm wants a row-major, b column-major, and *dequantization* scales (1 / scale).
    return torch._scaled_mm(
        a.contiguous(), bt.contiguous().t(), scale_a=sa.reciprocal(), scale_b=sb.reciprocal(), out_dtype=out_dtype
    )


def fp8_gemm(
    a: QTensor,
    bt: QTensor,
    out_dtype: torch.dtype,
    backend: str = "scaled_mm",
    promotion_interval: int | None = None,
    accum_mantissa_bits: int | None = None,
) -> torch.Tensor:
    """``a @ bt.T`` -> (M, N) in ``out_dtype``. Raises ``ValueError`` for an unknown backend, mismatched
    K, or a promotion interval the scaling cannot honour."""
    (_, k), (_, k2) = a.shape, bt.shape
    if k != k2:
        raise ValueError(f"contraction dims differ: a is {a.shape}, bt is {bt.shape}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown GEMM backend {backend!r}; known: {BACKENDS}")
    chunks = _chunk_bounds(k, a, bt, promotion_interval)
    if accum_mantissa_bits is not None:
        return _limited_accumulation(a, bt, chunks, accum_mantissa_bits).to(out_dtype)
    return _GEMMS[backend](a, bt, out_dtype, chunks)


def _emulated_gemm(a: QTensor, bt: QTensor, out_dtype: torch.dtype, chunks) -> torch.Tensor:
    # The reference: dequantize exactly, one FP32 matmul (FP32 accumulation over all of K).
    return (a.dequantize() @ bt.dequantize().t()).to(out_dtype)


def _scaled_mm_gemm(a: QTensor, bt: QTensor, out_dtype: torch.dtype, chunks) -> torch.Tensor:
    (m, k), n = a.shape, bt.shape[0]
    if len(chunks) == 1 and a.granularity == bt.granularity == "tensorwise":
        return _scaled_mm(a.data, bt.data, a.scale, bt.scale, out_dtype)
    if len(chunks) == 1:
        return _scaled_mm(a.data, bt.data, _per_row_scale(a, 0, k), _per_row_scale(bt, 0, k).reshape(1, n), out_dtype)
    out = torch.zeros(m, n, dtype=torch.float32, device=a.data.device)
    for k0, k1 in chunks:
        out += _scaled_mm(
            a.data[:, k0:k1],
            bt.data[:, k0:k1],
            _per_row_scale(a, k0, k1),
            _per_row_scale(bt, k0, k1).reshape(1, n),
            torch.float32,
        )
    return out.to(out_dtype)


#: ``recipe.fp8.gemm_backend`` -> the GEMM that runs it.
_GEMMS = {"scaled_mm": _scaled_mm_gemm, "emulated": _emulated_gemm}


def _limited_accumulation(a: QTensor, bt: QTensor, chunks, bits: int) -> torch.Tensor:
    m, n = a.shape[0], bt.shape[0]
    out = torch.zeros(m, n, dtype=torch.float32, device=a.data.device)
    ar, br = a.data.to(torch.float32), bt.data.to(torch.float32)
    for k0, k1 in chunks:
        acc = torch.zeros_like(out)
        for s in range(k0, k1, WGMMA_K):
            e = min(s + WGMMA_K, k1)
            acc = round_mantissa(acc + ar[:, s:e] @ br[:, s:e].t(), bits)
        out += acc / _per_row_scale(a, k0, k1) / _per_row_scale(bt, k0, k1).reshape(1, n)
    return out
