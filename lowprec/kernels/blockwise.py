"""Which kernel runs lowprec's blockwise FP8 GEMMs (DeepSeek-V3 1x128 tiles x 128x128 blocks) on a device.

Three kernels, chosen once per device by ``select_blockwise_gemm`` and recorded in the effective recipe
(``kernels.fp8_blockwise_gemm``):

- ``torch_scaled_mm_blockwise``: torch's own cuBLASLt kernel behind ``torch.nn.functional.scaled_mm``
  (``aten._scaled_mm_v2``, torch >= 2.10): ``BlockWise1x128 x BlockWise128x128`` (output and input-gradient GEMMs),
  ``BlockWise1x128 x BlockWise1x128`` (weight-gradient GEMM) and ``BlockWise128x128 x BlockWise1x128`` (the weight
  gradient with ``grad_output_granularity=block128x128``; 128x128 x 128x128 has no kernel and runs K-chunked).
  torch accepts them on compute capability 9.x only, with cuBLASLt >= 12.9 (``aten/src/ATen/native/cuda/
  ScaledBlas.cpp``: ``_check_deepseek_support``, ``_scaled_block1x128_block128x128``,
  ``_scaled_block128x128_block1x128``, ``_scaled_block1x128_block1x128``; the kernels came with
  pytorch/pytorch#158037, torch 2.9, the ``round_up(K/128, 4)`` padding of 128x128 scales, without which cuBLASLt
  gave silently wrong results, with #166752); scale layouts in ``lowprec.kernels.scaled_mm``.
- ``torchao_triton_blockwise``: torchao's Triton GEMMs (``torchao.prototype.blockwise_fp8_training.kernels``:
  ``triton_fp8_gemm_1x128_128x128`` and ``triton_fp8_gemm_1x128_128x1``). Same semantics as lowprec's: decoding
  (reciprocal) FP32 scales, each 128-wide K step's FP32 partial product multiplied by its two scales and added
  to an FP32 accumulator (DeepSeek-V3's promotion every N_C = 128), one rounding to the output dtype. Layouts:
  ``a`` (M, K) row-major, ``b`` (K, N) column-major, ``a_s`` (M, K/128) column-major, ``b_s`` (K/128, N/128)
  column-major (128x128) or (K/128, N) row-major (128x1). Used where torch's kernel is missing or fails.
- ``emulated``: no blockwise kernel; the GEMM runs as 128-wide K chunks (rowwise ``_scaled_mm`` calls summed in
  FP32, or the same as FP32 arithmetic with ``cpu_kernels=emulated``): ``lowprec.float8.gemm``. CPU only.

A CUDA device with neither kernel is refused before training (``BlockwiseKernelError``): the chunked path runs
one GEMM per 128 elements of K (32 calls at K = 4096), so a run there would report FP8 throughput that no
blockwise kernel delivers and compare it with BF16 as if it did. The lab's rule is that a run does what the
recipe and the effective recipe say or does not run, and ``lowprec.kernels.policy`` says a GPU never emulates.

The probe (``probe_blockwise_gemm``) runs each candidate once on a small problem and holds it to 40 dB SQNR
against the FP32 reference of the same FP8 operands (the bound of ``tests/gpu/test_gpu_fp8_gemm.py``): a kernel
that exists but computes something else is not chosen either.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch

from lowprec.errors import RecipeError
from lowprec.kernels.scaled_mm import HAS_SCALED_MM_V2, ScaledMMCall, column_major, native_scaled_mm

BLOCKWISE_GEMMS = ("torch_scaled_mm_blockwise", "torchao_triton_blockwise", "emulated")
BLOCK = 128
#: The probe's problem (M, K, N): K spans two 128-wide scale groups, N two 128-row weight blocks.
PROBE_SHAPE = (128, 256, 256)
PROBE_MIN_SQNR_DB = 40.0


class BlockwiseKernelError(RecipeError):
    """A blockwise FP8 recipe on a CUDA device without a blockwise GEMM kernel (module doc)."""


def torchao_blockwise_available() -> bool:
    """True where torchao's blockwise Triton GEMMs can be imported: torchao and triton installed (the import
    itself is deferred to the call: torchao prints warnings and takes about a second to import)."""
    return all(importlib.util.find_spec(m) is not None for m in ("torchao", "triton"))


def torchao_blockwise_scaled_mm(call: ScaledMMCall) -> torch.Tensor:
    """Run the blockwise ``call`` on torchao's Triton GEMM. ``call`` holds torchao's layouts (module doc;
    ``lowprec.float8.gemm`` builds them with ``blockwise_gemm="torchao_triton_blockwise"``): ``BlockWise1x128 x
    BlockWise128x128`` -> ``triton_fp8_gemm_1x128_128x128``, ``BlockWise1x128 x BlockWise1x128`` ->
    ``triton_fp8_gemm_1x128_128x1``. Raises ``ValueError`` for another pair and ``ImportError`` without torchao."""
    from torchao.prototype.blockwise_fp8_training import kernels

    pair = (call.recipe_a, call.recipe_b)
    if pair == ("BlockWise1x128", "BlockWise128x128"):
        fn = kernels.triton_fp8_gemm_1x128_128x128
    elif pair == ("BlockWise1x128", "BlockWise1x128"):
        fn = kernels.triton_fp8_gemm_1x128_128x1
    else:
        raise ValueError(f"torchao's blockwise Triton GEMMs take 1x128 x 128x128 or 1x128 x 1x128; got {pair}")
    return fn(call.mat_a, call.mat_b, call.scale_a, call.scale_b, out_dtype=call.out_dtype)


#: blockwise kernel -> the function that runs one blockwise ``ScaledMMCall`` (``emulated`` has no such call).
BLOCKWISE_RUNNERS = {
    "torch_scaled_mm_blockwise": native_scaled_mm,
    "torchao_triton_blockwise": torchao_blockwise_scaled_mm,
}


def blockwise_scale_layout(
    scale: torch.Tensor, granularity: str, rows: int, k: int, role: str, kernel: str
) -> torch.Tensor:
    """The decoding scale of one blockwise operand in ``kernel``'s layout.

    ``scale``: lowprec's compact *encoding* scale of an operand stored (rows, K): ``tile1x128`` (rows, K/128),
    ``block128x128`` (rows/128, K/128). ``role``: ``a`` (first operand) or ``b`` (second). Layouts: both kernels
    take 1x128 scales (rows, K/128) with stride (1, rows) as ``a`` and 128x128 scales as ``b`` transposed to
    (K/128, rows/128), column-major; torch pads that to ``round_up(K/128, 4)`` rows (cuBLASLt's 16-byte stride;
    the padding rows are never read) and takes the same layout for a 128x128 ``a`` (its 128x128 x 1x128 GEMM); a
    1x128 ``b`` is (rows, K/128) stride (1, rows) for torch and its transpose (K/128, rows) row-major for
    torchao's 128x1 kernel. Returns float32. Raises ``ValueError`` for a pair of
    granularity and role no kernel takes."""
    dec = scale.float().reciprocal()
    if granularity == "tile1x128" and role == "a":
        return column_major(dec)
    if granularity == "tile1x128" and role == "b":
        return column_major(dec) if kernel == "torch_scaled_mm_blockwise" else dec.t().contiguous()
    if granularity == "block128x128" and (role == "b" or kernel == "torch_scaled_mm_blockwise"):
        kb = dec.t()  # (K/128, rows/128)
        if kernel != "torch_scaled_mm_blockwise":
            return column_major(kb)
        l4 = 4 * math.ceil((k // BLOCK) / 4)
        padded = torch.ones(l4, kb.shape[1], dtype=kb.dtype, device=kb.device)
        padded[: kb.shape[0]] = kb
        return column_major(padded)
    raise ValueError(f"no blockwise kernel layout for a {granularity} scale as operand {role!r}")


def _probe_operands(gen: torch.Generator):
    m, k, n = PROBE_SHAPE
    kb = k // BLOCK

    def fp8(rows: int) -> torch.Tensor:
        return (torch.randn(rows, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)

    def scales(rows: int) -> torch.Tensor:
        # Encoding scales over 2^-4 .. 2^4, all different where there are at most 9 (the block scales), so that a
        # kernel that drops or misplaces one fails.
        return torch.exp2((torch.randperm(rows * kb, generator=gen) % 9 - 4).float()).reshape(rows, kb)

    return fp8(m), fp8(n), {"tile": (scales(m), scales(n)), "block": (scales(m // BLOCK), scales(n // BLOCK))}


def _reference(a, b, sa_rows, sb_rows) -> torch.Tensor:
    # Dequantize exactly in FP32 (FP8 x power-of-2 scale is exact), FP64 matmul.
    da = a.float() / sa_rows.repeat_interleave(BLOCK, dim=1)
    db = b.float() / sb_rows.repeat_interleave(BLOCK, dim=1)
    return da.double() @ db.double().t()


def _sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    noise = (ref - out.double()).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / noise.clamp_min(1e-300)))


_GRAN = {"tile": ("tile1x128", "BlockWise1x128"), "block": ("block128x128", "BlockWise128x128")}


def probe_blockwise_gemm(kernel: str, device: torch.device) -> str | None:
    """Run ``kernel`` once on ``device`` for each pair lowprec issues on it (1x128 x 128x128, 1x128 x 1x128, and
    on torch's kernel 128x128 x 1x128) and return ``None`` when all hold ``PROBE_MIN_SQNR_DB`` against the FP64
    reference, else one line saying why not (the exception, or the SQNR reached). K/128 = 2 is not a multiple of
    4: the case where unpadded 128x128 scales gave silently wrong results (pytorch/pytorch#166752)."""
    if kernel == "torch_scaled_mm_blockwise" and not HAS_SCALED_MM_V2:
        return f"torch {torch.__version__} has no aten._scaled_mm_v2 (blockwise scaling needs torch>=2.10)"
    if kernel == "torchao_triton_blockwise" and not torchao_blockwise_available():
        return "torchao or triton is not installed"
    m, k, n = PROBE_SHAPE
    a, b, sc = _probe_operands(torch.Generator().manual_seed(0))
    pairs = [("tile", "block"), ("tile", "tile")]
    if kernel == "torch_scaled_mm_blockwise":
        pairs.append(("block", "tile"))
    for pa, pb in pairs:
        name = f"{'1x128' if pa == 'tile' else '128x128'} x {'1x128' if pb == 'tile' else '128x128'}"
        sa, sb = sc[pa][0], sc[pb][1]
        call = ScaledMMCall(
            a.to(device),
            b.to(device).t(),
            blockwise_scale_layout(sa.to(device), _GRAN[pa][0], m, k, "a", kernel),
            _GRAN[pa][1],
            blockwise_scale_layout(sb.to(device), _GRAN[pb][0], n, k, "b", kernel),
            _GRAN[pb][1],
            torch.float32,
        )
        try:
            out = BLOCKWISE_RUNNERS[kernel](call).cpu()  # synchronizes: an asynchronous CUDA error surfaces here
        except Exception as e:  # noqa: BLE001 - any failure means "not this kernel"; its text is the reason
            return f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        rows_a = sa if pa == "tile" else sa.repeat_interleave(BLOCK, dim=0)
        rows_b = sb if pb == "tile" else sb.repeat_interleave(BLOCK, dim=0)
        db = _sqnr_db(_reference(a, b, rows_a, rows_b), out)
        if not db >= PROBE_MIN_SQNR_DB:
            return f"{name}: {db:.1f} dB SQNR against the FP64 reference (< {PROBE_MIN_SQNR_DB:.0f} dB)"
    return None


@functools.cache
def _cuda_choice(index: int) -> tuple[str | None, tuple[str, ...]]:
    device = torch.device("cuda", index)
    reasons = []
    for kernel in BLOCKWISE_GEMMS[:2]:
        why = probe_blockwise_gemm(kernel, device)
        if why is None:
            return kernel, tuple(reasons)
        reasons.append(f"{kernel}: {why}")
    return None, tuple(reasons)


def select_blockwise_gemm(device: torch.device) -> str:
    """The blockwise GEMM kernel for ``device``: ``emulated`` on a CPU; on CUDA the first of
    ``torch_scaled_mm_blockwise``, ``torchao_triton_blockwise`` whose probe passes (probed once per device, a few
    milliseconds for torch's kernel, about a second of Triton autotuning for torchao's). Raises
    ``BlockwiseKernelError`` on CUDA when neither passes, with each one's reason."""
    if device.type != "cuda":
        return "emulated"
    index = device.index if device.index is not None else torch.cuda.current_device()
    kernel, reasons = _cuda_choice(index)
    if kernel is None:
        name = torch.cuda.get_device_name(index)
        cap = ".".join(map(str, torch.cuda.get_device_capability(index)))
        raise BlockwiseKernelError(
            f"no blockwise FP8 GEMM kernel on {name} (sm {cap}, torch {torch.__version__}, CUDA {torch.version.cuda}):"
            f" {'; '.join(reasons)}. Blockwise (1x128/128x128) recipes need torch>=2.10 built with CUDA>=12.9 on a "
            "Hopper GPU, or torchao with triton; lowprec does not emulate them on a GPU"
        )
    return kernel


# Under torch.compile the choice is a constant of the graph: dynamo calls this function instead of tracing it (it
# would otherwise trace through functools.cache into the probe's GEMMs and break the graph). This is what
# ``torch._dynamo.assume_constant_result`` does (torch/_dynamo/decorators.py sets this attribute and nothing else),
# without importing torch._dynamo, which costs about 1 s at the start of every process that imports lowprec (each
# ablation worker, torchrun rank and CLI call). tests/kernels/test_blockwise_kernel_choice.py fails if torch's
# decorator marks anything else; tests/unit/test_quiet.py checks that importing lowprec leaves torch._dynamo unloaded.
select_blockwise_gemm._dynamo_marked_constant = True  # type: ignore[attr-defined]
