"""Block-scaled GEMMs ``out = a @ bt.T`` for MXFP8 / MXFP4 / NVFP4 operands (``lowprec.numerics.microscaling``).

- ``emulated_block_scaled_mm``: each operand dequantized exactly (element times its block's decode scale; for
  NVFP4 times the FP32 product of block and tensor scale), one FP32 matmul, one rounding to ``out_dtype``. Runs
  anywhere; the reference.
- ``native_block_scaled_mm``: one ``torch.nn.functional.scaled_mm`` call with ``ScalingType.BlockWise1x32``
  (MX: E8M0 scales) or ``[BlockWise1x16, TensorWise]`` (NVFP4: E4M3 block scales plus the FP32 tensor scale), the
  block scales in cuBLAS's swizzled layout (``SwizzleType.SWIZZLE_32_4_4``). The kernels exist on sm100
  (B200/GB200) only; torch checks the contract (``torch/_meta_registrations.py`` ``_check_scaled_mm_sizes_v2``):
  ``mat_a`` (M, K) row-major, ``mat_b`` (K, N) column-major (FP4: K/2 packed bytes), block scales of
  ``round_up(rows, 128) * round_up(K / block, 4)`` elements each.

The swizzle is cuBLAS's "1D block scaling factors layout"
(https://docs.nvidia.com/cuda/cublas/index.html#d-block-scaling-factors-layout): the (rows, K/block) scale matrix,
padded to multiples of (128, 4), is cut into 128x4 tiles and each tile is stored as 32 rows of 16 bytes with
row ``r`` of the tile at ``(r % 32, 4 * (r // 32) + c)``; torchao's ``to_blocked`` computes the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowprec.numerics.microscaling import BlockQTensor

#: True where torch exposes the block-scaled recipes of the public scaled matmul.
HAS_BLOCK_SCALED_OP = (
    hasattr(F, "scaled_mm")
    and hasattr(F, "ScalingType")
    and hasattr(F.ScalingType, "BlockWise1x32")
    and hasattr(F, "SwizzleType")
)


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """(rows, K/block) block scales (1-byte dtype) -> the flat cuBLAS 128x4-tile layout (module doc), padded with
    zeros to ``round_up(rows, 128) * round_up(K/block, 4)`` elements; same dtype."""
    rows, cols = scale.shape
    pr, pc = 128 * math.ceil(rows / 128), 4 * math.ceil(cols / 4)
    raw = scale.view(torch.uint8)
    padded = torch.zeros(pr, pc, dtype=torch.uint8, device=scale.device)
    padded[:rows, :cols] = raw
    tiles = padded.view(pr // 128, 128, pc // 4, 4).permute(0, 2, 1, 3)  # (row tiles, col tiles, 128, 4)
    out = tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1)  # row r of a tile -> (r % 32, r // 32)
    return out.view(scale.dtype)


@dataclass
class BlockScaledMMCall:
    """One native block-scaled matmul, exactly as ``torch.nn.functional.scaled_mm`` receives it: ``mat_a``
    (M, K) and ``mat_b`` (K, N) (FP4: K/2 bytes of ``float4_e2m1fn_x2``), lists of decode scales, recipes and
    swizzles per operand (``ScalingType`` / ``SwizzleType`` member names), result dtype."""

    mat_a: torch.Tensor
    mat_b: torch.Tensor
    scale_a: list[torch.Tensor]
    recipe_a: list[str]
    swizzle_a: list[str]
    scale_b: list[torch.Tensor]
    recipe_b: list[str]
    swizzle_b: list[str]
    out_dtype: torch.dtype


def _operand(q: BlockQTensor) -> tuple[torch.Tensor, list[torch.Tensor], list[str], list[str]]:
    data = q.data.view(torch.float4_e2m1fn_x2) if q.fmt.dtype is None else q.data
    if q.scale.dtype == torch.uint8:  # MX: E8M0 codes
        return (
            data.contiguous(),
            [swizzle_scales(q.scale.view(torch.float8_e8m0fnu))],
            ["BlockWise1x32"],
            ["SWIZZLE_32_4_4"],
        )
    scales = [swizzle_scales(q.scale), q.tensor_scale.reshape(1).float()]
    return data.contiguous(), scales, ["BlockWise1x16", "TensorWise"], ["SWIZZLE_32_4_4", "NO_SWIZZLE"]


def block_scaled_mm_call(a: BlockQTensor, bt: BlockQTensor, out_dtype: torch.dtype) -> BlockScaledMMCall:
    """The native call computing ``a @ bt.T`` for ``a`` (M, K) and ``bt`` (N, K) of one format. Raises
    ``ValueError`` for operands of different formats or block sizes, or mismatched K."""
    if (a.elem, a.block, a.scale.dtype) != (bt.elem, bt.block, bt.scale.dtype) or a.shape[1] != bt.shape[1]:
        raise ValueError(f"operands do not match: {a.elem}/{a.block} {a.shape} vs {bt.elem}/{bt.block} {bt.shape}")
    da, sa, ra, wa = _operand(a)
    db, sb, rb, wb = _operand(bt)
    return BlockScaledMMCall(da, db.t(), sa, ra, wa, sb, rb, wb, out_dtype)


def native_block_scaled_mm(call: BlockScaledMMCall) -> torch.Tensor:
    """Run ``call`` through ``torch.nn.functional.scaled_mm`` (imported lazily by name). Raises ``RuntimeError``
    when the installed torch lacks the block-scaled recipes, and torch's own error where the device has no
    kernel (anything but sm100)."""
    if not HAS_BLOCK_SCALED_OP:
        raise RuntimeError("this torch has no torch.nn.functional.scaled_mm with BlockWise1x32/1x16 (torch>=2.10)")
    unwrap = (lambda xs: xs[0]) if len(call.scale_a) == 1 else (lambda xs: xs)
    return F.scaled_mm(
        call.mat_a,
        call.mat_b,
        unwrap(call.scale_a),
        unwrap([getattr(F.ScalingType, r) for r in call.recipe_a]),
        unwrap(call.scale_b),
        unwrap([getattr(F.ScalingType, r) for r in call.recipe_b]),
        swizzle_a=unwrap([getattr(F.SwizzleType, s) for s in call.swizzle_a]),
        swizzle_b=unwrap([getattr(F.SwizzleType, s) for s in call.swizzle_b]),
        output_dtype=call.out_dtype,
    )


def emulated_block_scaled_mm(a: BlockQTensor, bt: BlockQTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ bt.T`` -> (M, N) in ``out_dtype``: exact dequantization, FP32 accumulation over all of K, one
    rounding. Raises ``ValueError`` for mismatched K."""
    if a.shape[1] != bt.shape[1]:
        raise ValueError(f"contraction dims differ: a is {a.shape}, bt is {bt.shape}")
    return (a.dequantize() @ bt.dequantize().t()).to(out_dtype)


def block_scaled_mm(a: BlockQTensor, bt: BlockQTensor, out_dtype: torch.dtype, kernel: str) -> torch.Tensor:
    """``a @ bt.T`` on the ``native`` kernel (CUDA sm100) or ``emulated`` (module doc). Raises ``ValueError`` for
    an unknown kernel."""
    if kernel == "emulated":
        return emulated_block_scaled_mm(a, bt, out_dtype)
    if kernel == "native":
        return native_block_scaled_mm(block_scaled_mm_call(a, bt, out_dtype))
    raise ValueError(f"unknown block-scaled GEMM kernel {kernel!r}; known: ['native', 'emulated']")
