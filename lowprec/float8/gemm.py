"""FP8 GEMM backends: ``out = a @ bt.T`` for quantized operands ``a`` (M, K) and ``bt`` (N, K).

- ``scaled_mm``: scaled FP8 matmuls (``lowprec.kernels.scaled_mm``: torch's public
  ``torch.nn.functional.scaled_mm`` where it exists, ``torch._scaled_mm`` otherwise). Tensorwise and rowwise
  operands run as one call (a tensorwise scale is broadcast to a per-row one when the other operand is
  rowwise). Tile (1x128) and block (128x128) operands run as one ``BlockWise1x128``/``BlockWise128x128`` call
  on the blockwise kernel chosen for the device (``lowprec.kernels.blockwise``: torch's cuBLASLt kernel on
  sm90 with CUDA 12.9+, else torchao's Triton GEMM), and on a CPU (``emulated``) as a loop over 128-wide K
  chunks of rowwise calls whose FP32 partial results are summed in FP32: all are DeepSeek-V3's promotion to
  FP32 every N_C = 128 elements (arXiv 2412.19437 section 3.3.2); CPU ``_scaled_mm`` rejects blockwise scales
  (docs/architecture.md, "Platform facts"). ``kernel`` says whether each call runs on the device's kernel
  (``native``) or as exact FP32 arithmetic (``emulated``, for CPUs whose FP8 kernel is slow; same numerics up
  to FP32 accumulation order).
- ``emulated``: dequantize both operands, FP32 matmul. The reference.

``promotion_interval`` (N_C) splits K into chunks whose partial sums are promoted to FP32;
``accum_mantissa_bits`` additionally emulates a limited-precision tensor-core accumulator inside each
chunk: raw FP8 products are accumulated 32 elements of K at a time (one WGMMA k-step) and the running sum
is rounded to that many mantissa bits after every step, before the chunk's scales are applied. With
``accum_mantissa_bits=14`` and no promotion, error grows with K as DeepSeek reports for H800.
``accum_rounding`` (truncation instead of round to nearest) and ``accum_group`` (products aligned to the largest
exponent in groups, each cut to the accumulator's precision) select the other accumulator models of
``lowprec.float8.accumulator``; their defaults are the model above.
"""

from __future__ import annotations

import torch

from lowprec.float8.accumulator import WGMMA_K, AccumulatorModel, limited_accumulation, round_mantissa
from lowprec.kernels.blockwise import BLOCKWISE_GEMMS, BLOCKWISE_RUNNERS, blockwise_scale_layout, select_blockwise_gemm
from lowprec.kernels.scaled_mm import SCALED_MM_KERNELS, ScaledMMCall
from lowprec.numerics.formats import fp8_to_float32
from lowprec.numerics.scaling import BLOCK, QTensor, expand_scale

BACKENDS = ("scaled_mm", "emulated")
__all__ = ["BACKENDS", "WGMMA_K", "fp8_gemm", "round_mantissa", "scaled_mm_calls"]


def _per_row_scale(q: QTensor, k0: int, k1: int) -> torch.Tensor:
    """The (rows, 1) float32 scale valid for K columns [k0, k1) of ``q`` (constant there by construction)."""
    r = q.shape[0]
    if q.granularity == "tensorwise":
        return q.scale.reshape(1, 1).expand(r, 1)
    if q.granularity == "rowwise":
        return q.scale.reshape(r, 1)
    if k0 % BLOCK == 0:  # a chunk on the 128-grid: read its scale column without expanding the whole tensor
        col = q.scale[:, k0 // BLOCK : k0 // BLOCK + 1]
        return col if q.granularity == "tile1x128" else col.repeat_interleave(BLOCK, dim=0)[:r]
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


def _call(a: torch.Tensor, bt: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, recipe: str, out_dtype):
    # Row-major a, column-major b, and *decoding* scales (1 / scale), as the kernels want.
    return ScaledMMCall(
        a.contiguous(), bt.contiguous().t(), sa.reciprocal(), recipe, sb.reciprocal(), recipe, out_dtype
    )


_NATIVE_BLOCKWISE_PAIRS = {
    ("tile1x128", "block128x128"): ("BlockWise1x128", "BlockWise128x128"),
    ("tile1x128", "tile1x128"): ("BlockWise1x128", "BlockWise1x128"),
    # torch's kernel only (torchao has no 128x128 x 1x128 GEMM): grad_output_granularity=block128x128's weight
    # gradient.
    ("block128x128", "tile1x128"): ("BlockWise128x128", "BlockWise1x128"),
}


def _native_blockwise_call(a: QTensor, bt: QTensor, out_dtype: torch.dtype, kernel: str) -> ScaledMMCall | None:
    """One blockwise call for ``a @ bt.T`` on ``kernel`` (``lowprec.kernels.blockwise``), or ``None`` when the
    pair or the shapes do not fit the kernel (K and a block operand's rows multiples of 128, every dim a
    multiple of 16). 128x128 x 128x128 (``grad_output_granularity=block128x128``'s input gradient) has no kernel."""
    recipes = _NATIVE_BLOCKWISE_PAIRS.get((a.granularity, bt.granularity))
    (m, k), n = a.shape, bt.shape[0]
    if recipes is None or k % BLOCK or m % 16 or n % 16:
        return None
    if (bt.granularity == "block128x128" and n % BLOCK) or (a.granularity == "block128x128" and m % BLOCK):
        return None
    if a.granularity == "block128x128" and kernel != "torch_scaled_mm_blockwise":
        return None
    return ScaledMMCall(
        a.data.contiguous(),
        bt.data.contiguous().t(),
        blockwise_scale_layout(a.scale, a.granularity, m, k, "a", kernel),
        recipes[0],
        blockwise_scale_layout(bt.scale, bt.granularity, n, k, "b", kernel),
        recipes[1],
        out_dtype,
    )


def scaled_mm_calls(
    a: QTensor,
    bt: QTensor,
    out_dtype: torch.dtype,
    promotion_interval: int | None = None,
    blockwise_gemm: str = "emulated",
) -> list[ScaledMMCall]:
    """The scaled matmul calls that compute ``a @ bt.T`` (the ``scaled_mm`` backend, module doc): one call, or
    one FP32-output call per K chunk whose results are summed in FP32 and rounded to ``out_dtype`` once.
    ``blockwise_gemm`` (``lowprec.kernels.blockwise.BLOCKWISE_GEMMS``): a blockwise kernel makes tile/block
    operands one ``BlockWise*`` call in that kernel's layouts where the shapes allow it; ``emulated`` makes them
    128-wide K chunks. These are exactly the arguments the kernels receive (a CPU test checks them against
    CUDA's contract)."""
    return _calls(a, bt, out_dtype, _chunk_bounds(a.shape[1], a, bt, promotion_interval), blockwise_gemm)


def _calls(a: QTensor, bt: QTensor, out_dtype: torch.dtype, chunks, blockwise_gemm: str) -> list[ScaledMMCall]:
    if blockwise_gemm not in BLOCKWISE_GEMMS:
        raise ValueError(f"unknown blockwise GEMM kernel {blockwise_gemm!r}; known: {BLOCKWISE_GEMMS}")
    k, n = a.shape[1], bt.shape[0]
    if len(chunks) == 1 and a.granularity == bt.granularity == "tensorwise":
        return [_call(a.data, bt.data, a.scale, bt.scale, "TensorWise", out_dtype)]
    if len(chunks) == 1:
        return [
            _call(
                a.data, bt.data, _per_row_scale(a, 0, k), _per_row_scale(bt, 0, k).reshape(1, n), "RowWise", out_dtype
            )
        ]
    if blockwise_gemm != "emulated":
        call = _native_blockwise_call(a, bt, out_dtype, blockwise_gemm)
        if call is not None:
            return [call]
    return [
        _call(
            a.data[:, k0:k1],
            bt.data[:, k0:k1],
            _per_row_scale(a, k0, k1),
            _per_row_scale(bt, k0, k1).reshape(1, n),
            "RowWise",
            torch.float32,
        )
        for k0, k1 in chunks
    ]


def fp8_gemm(
    a: QTensor,
    bt: QTensor,
    out_dtype: torch.dtype,
    backend: str = "scaled_mm",
    promotion_interval: int | None = None,
    accum_mantissa_bits: int | None = None,
    kernel: str = "native",
    promotion: bool = True,
    accum_rounding: str = "nearest",
    accum_group: int | None = None,
    blockwise_gemm: str | None = None,
) -> torch.Tensor:
    """``a @ bt.T`` -> (M, N) in ``out_dtype``. ``kernel`` (``native`` | ``emulated``) runs the ``scaled_mm``
    backend's calls on the device's kernel or as exact FP32 arithmetic (``lowprec.kernels``). ``promotion=False``
    (only with ``accum_mantissa_bits``) keeps all of K in the limited-precision accumulator, tile/block scales
    applied to each WGMMA step's products: Hopper without DeepSeek-V3's promotion. ``accum_rounding`` and
    ``accum_group``: the limited accumulator's rounding and alignment group (``lowprec.float8.accumulator
    .AccumulatorModel``; only with ``accum_mantissa_bits``). ``blockwise_gemm``: the kernel of tile/block GEMMs
    (``lowprec.kernels.blockwise``; a built model passes the one its build chose); ``None`` chooses it for the
    operands' device with ``select_blockwise_gemm`` (``BlockwiseKernelError`` on a GPU without one). Raises
    ``ValueError`` for an unknown backend, kernel or blockwise kernel, mismatched K, a promotion interval the
    scaling cannot honour, ``promotion=False`` without ``accum_mantissa_bits``, a bad accumulator model, or an
    alignment group that does not divide 128 with tile/block scales and no promotion."""
    (_, k), (_, k2) = a.shape, bt.shape
    if k != k2:
        raise ValueError(f"contraction dims differ: a is {a.shape}, bt is {bt.shape}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown GEMM backend {backend!r}; known: {BACKENDS}")
    if kernel not in SCALED_MM_KERNELS:
        raise ValueError(f"unknown FP8 GEMM kernel {kernel!r}; known: {tuple(SCALED_MM_KERNELS)}")
    if not promotion:
        if accum_mantissa_bits is None:
            raise ValueError("promotion=False needs accum_mantissa_bits (an FP32 accumulator has nothing to promote)")
        model = AccumulatorModel(accum_mantissa_bits, accum_rounding, accum_group)
        return _limited_accumulation(a, bt, [(0, k)], model).to(out_dtype)
    chunks = _chunk_bounds(k, a, bt, promotion_interval)
    if accum_mantissa_bits is not None:
        model = AccumulatorModel(accum_mantissa_bits, accum_rounding, accum_group)
        return _limited_accumulation(a, bt, chunks, model).to(out_dtype)
    if (accum_rounding, accum_group) != ("nearest", None):
        raise ValueError("accum_rounding and accum_group need accum_mantissa_bits (they model its accumulator)")
    if backend == "emulated":
        return _emulated_gemm(a, bt, out_dtype)
    if blockwise_gemm is None and {a.granularity, bt.granularity} & {"tile1x128", "block128x128"}:
        blockwise_gemm = select_blockwise_gemm(a.data.device)
    return _scaled_mm_gemm(a, bt, out_dtype, chunks, kernel, blockwise_gemm or "emulated")


def _emulated_gemm(a: QTensor, bt: QTensor, out_dtype: torch.dtype) -> torch.Tensor:
    # The reference: dequantize exactly, one FP32 matmul (FP32 accumulation over all of K).
    return (a.dequantize() @ bt.dequantize().t()).to(out_dtype)


def _scaled_mm_gemm(a: QTensor, bt: QTensor, out_dtype: torch.dtype, chunks, kernel, blockwise_gemm) -> torch.Tensor:
    run = SCALED_MM_KERNELS[kernel]
    if kernel == "emulated" and len(chunks) > 1:
        return _emulated_chunked(a, bt, out_dtype)
    calls = _calls(a, bt, out_dtype, chunks, blockwise_gemm if kernel == "native" else "emulated")
    if len(calls) == 1:
        if calls[0].recipe_a.startswith("BlockWise"):
            return BLOCKWISE_RUNNERS[blockwise_gemm](calls[0])
        return run(calls[0])
    out = torch.zeros(a.shape[0], bt.shape[0], dtype=torch.float32, device=a.data.device)
    for call in calls:
        out += run(call)
    return out.to(out_dtype)


def _decoded(q: QTensor) -> torch.Tensor:
    """``q``'s values times their decoding scale (``data * (1 / scale)``), float32 (R, K): one FP32 rounding per
    element, the scale broadcast block by block where the dims allow it."""
    dec = q.scale.float().reciprocal()
    data = fp8_to_float32(q.data)
    r, k = q.shape
    if q.granularity == "tile1x128" and k % BLOCK == 0:
        return (data.view(r, k // BLOCK, BLOCK) * dec[:, :, None]).view(r, k)
    if q.granularity == "block128x128" and k % BLOCK == 0 and r % BLOCK == 0:
        return (data.view(r // BLOCK, BLOCK, k // BLOCK, BLOCK) * dec[:, None, :, None]).view(r, k)
    return data * expand_scale(dec, q.granularity, q.shape)


def _emulated_chunked(a: QTensor, bt: QTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The K-chunked calls of ``_calls`` emulated in one FP32 matmul: each 128-wide chunk's decoding scales are
    folded into its operands (one FP32 rounding per element) and all of K is accumulated in FP32 at once. The
    chunked kernel accumulates each chunk's exact products and scales the FP32 partial sum; with an FP32
    accumulator the promotion itself changes nothing, so the two differ by FP32 roundings (of the folded
    products, and the summation order), the size of an accumulation reorder. One pass over the operands instead
    of one (M, N) accumulator per chunk: on a 2-core AVX2 CPU the per-chunk form cost 2.7x an FP32 step."""
    return (_decoded(a) @ _decoded(bt).t()).to(out_dtype)


def _limited_accumulation(a: QTensor, bt: QTensor, chunks, model: AccumulatorModel) -> torch.Tensor:
    m, n = a.shape[0], bt.shape[0]
    out = torch.zeros(m, n, dtype=torch.float32, device=a.data.device)
    ar, br = fp8_to_float32(a.data), fp8_to_float32(bt.data)
    tiled = {a.granularity, bt.granularity} & {"tile1x128", "block128x128"}
    step = model.group or WGMMA_K
    for k0, k1 in chunks:
        if tiled and k1 - k0 > BLOCK:
            # No promotion across tiles: each step's products take their tile's scales (the step divides 128, so
            # it never straddles two) and join the rounded running sum, which is never promoted.
            if BLOCK % step:
                raise ValueError(f"accum_group={step} must divide {BLOCK} for tile/block scales without promotion")

            def dec(s, e, k0=k0):
                g = k0 + s - (k0 + s) % BLOCK  # the step's scale group starts on the 128-grid
                return _per_row_scale(a, g, k0 + e) * _per_row_scale(bt, g, k0 + e).reshape(1, n)

            out += limited_accumulation(ar[:, k0:k1], br[:, k0:k1], model, step_divisor=dec)[0]
            continue
        acc = limited_accumulation(ar[:, k0:k1], br[:, k0:k1], model)[0]
        out += acc / _per_row_scale(a, k0, k1) / _per_row_scale(bt, k0, k1).reshape(1, n)
    return out
