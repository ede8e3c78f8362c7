"""The scaled FP8 matmul under lowprec's FP8 GEMMs: one call, described as data, run natively or emulated.

``SCALED_MM_OP`` is chosen once, at import: torch's public ``torch.nn.functional.scaled_mm`` (with
``ScalingType``) where the installed torch has it, the private ``torch._scaled_mm`` otherwise (tensorwise and
rowwise only). It names what blockwise calls need; tensorwise and rowwise calls always run ``torch._scaled_mm``
and blockwise ones the aten op under the public function (``native_scaled_mm`` says why). Both compute
``out = (mat_a * scale_a) @ (mat_b * scale_b)`` with *decoding* scales (the
reciprocal of lowprec's ``fp8 = hp * scale``), FP32 accumulation and one rounding to ``out_dtype``.

The contract a call must meet on CUDA (torch's own checks: ``torch/_meta_registrations.py``
``_check_scaled_mm_sizes_v2``, which mirrors ``aten/src/ATen/native/cuda/ScaledBlas.cpp``): ``mat_a`` (M, K)
row-major and ``mat_b`` (K, N) column-major, both FP8, K and N multiples of 16; FP32 scales shaped

- ``TensorWise``: one element each;
- ``RowWise``: ``scale_a`` (M, 1) and ``scale_b`` (1, N), contiguous;
- ``BlockWise1x128`` x ``BlockWise128x128`` (DeepSeek-V3 activations x weights): ``scale_a`` (M, K/128) with
  stride (1, M); ``scale_b`` (L4, N/128) with stride (1, L4), ``L4 = round_up(K/128, 4)`` (rows past K/128 are
  padding);
- ``BlockWise1x128`` x ``BlockWise1x128`` (the weight-gradient GEMM): ``scale_a`` (M, K/128) stride (1, M),
  ``scale_b`` (N, K/128) stride (1, N).

The native blockwise kernel exists on sm90 with CUDA 12.9+ (``native_blockwise_supported``); which blockwise kernel
a run uses (torch's, torchao's Triton GEMM, or 128-wide K chunks on a CPU) is ``lowprec.kernels.blockwise``'s choice.

``emulated_scaled_mm`` is the same computation as FP32 arithmetic, for CPUs whose FP8 kernel is missing or slow
(on a 2-core AMX Xeon CPU ``_scaled_mm`` fell to oneDNN's reference matmul, ~700x FP32): FP8 values and their
pairwise products are exact in FP32, the products are accumulated in FP32 by one FP32 matmul, the combined
decoding scale ``scale_a * scale_b`` multiplies the accumulator, and the result is rounded once to ``out_dtype``.
What differs from a CUDA kernel: the order of the FP32 accumulation (cuBLASLt/CUTLASS tile order vs the CPU
BLAS's), and for rowwise scales the order of the two scale multiplications in the epilogue (at most one FP32
rounding before the output rounding).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowprec.numerics.formats import fp8_to_float32

#: Which op runs a native scaled matmul in this process (chosen once, at import).
SCALED_MM_OP = (
    "torch.nn.functional.scaled_mm"
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType") and hasattr(F.ScalingType, "BlockWise1x128")
    else "torch._scaled_mm"
)
RECIPES = ("TensorWise", "RowWise", "BlockWise1x128", "BlockWise128x128")
#: Whether this torch has the aten op under ``F.scaled_mm`` (added in torch 2.10, pytorch/pytorch#164141); the
#: blockwise calls use it even where ``F.ScalingType`` is not exposed under that name.
HAS_SCALED_MM_V2 = hasattr(torch.ops.aten, "_scaled_mm_v2")
#: ``ScalingType`` values the aten op takes (``torch.nn.functional.ScalingType`` on torch 2.13; torchao's
#: blockwise kernels fall back to the same ids, 4 and 5, where the enum is not exposed).
_RECIPE_IDS = {"TensorWise": 0, "RowWise": 1, "BlockWise1x16": 2, "BlockWise1x32": 3, "BlockWise1x128": 4}
_RECIPE_IDS["BlockWise128x128"] = 5


def _recipe_id(name: str) -> int:
    enum = getattr(getattr(F, "ScalingType", None), name, None)
    return int(enum.value) if enum is not None else _RECIPE_IDS[name]


BLOCK = 128


@dataclass
class ScaledMMCall:
    """One scaled matmul: ``mat_a`` (M, K) and ``mat_b`` (K, N) FP8, decoding scales ``scale_a``/``scale_b``
    (float32, shapes and strides per ``recipe_a``/``recipe_b`` as in the module doc), result (M, N) in
    ``out_dtype``."""

    mat_a: torch.Tensor
    mat_b: torch.Tensor
    scale_a: torch.Tensor
    recipe_a: str
    scale_b: torch.Tensor
    recipe_b: str
    out_dtype: torch.dtype


def native_scaled_mm(call: ScaledMMCall) -> torch.Tensor:
    """Run ``call`` on the device's own kernel. Tensorwise and rowwise calls go to ``torch._scaled_mm`` on every
    torch (the op torchao's FP8 linears use: dynamo traces it); blockwise calls, where ``SCALED_MM_OP`` is the
    public op, to the aten op under ``torch.nn.functional.scaled_mm`` (``torch.ops.aten._scaled_mm_v2``) with the
    arguments that function builds. Why not the public function itself: on torch 2.11 + CUDA 13.0 (an H100,
    2026-11-25) dynamo refused to trace it (``_VariableFunctionsClass._scaled_mm_v2`` "marked as skipped"), so
    every lowprec FP8 recipe failed under ``train.compile``; the OpOverload is traceable. Raises ``RuntimeError``
    (torch's) when the device has no kernel for the scaling, and ``ValueError`` for blockwise scaling without the
    public op."""
    blockwise = call.recipe_a.startswith("BlockWise") or call.recipe_b.startswith("BlockWise")
    if not blockwise:
        return torch._scaled_mm(
            call.mat_a, call.mat_b, scale_a=call.scale_a, scale_b=call.scale_b, out_dtype=call.out_dtype
        )
    if not HAS_SCALED_MM_V2:
        raise ValueError(f"torch._scaled_mm has no {call.recipe_a} x {call.recipe_b} scaling; it needs torch>=2.10")
    return torch.ops.aten._scaled_mm_v2.default(
        call.mat_a,
        call.mat_b,
        [call.scale_a],
        [_recipe_id(call.recipe_a)],
        [],
        [call.scale_b],
        [_recipe_id(call.recipe_b)],
        [],
        None,
        call.out_dtype,
        [],
        False,
    )


def emulated_scaled_mm(call: ScaledMMCall) -> torch.Tensor:
    """``call`` computed exactly as FP32 arithmetic (module doc). Tensorwise and rowwise scales only (blockwise
    operands reach it as 128-wide K chunks). Raises ``ValueError`` for blockwise scales."""
    if call.recipe_a not in ("TensorWise", "RowWise") or call.recipe_b not in ("TensorWise", "RowWise"):
        raise ValueError(f"emulated_scaled_mm runs tensorwise/rowwise calls; got {call.recipe_a} x {call.recipe_b}")
    # The table decode: torch's CPU FP8 -> FP32 cast is scalar code, a fifth of an emulated FP8 step.
    acc = fp8_to_float32(call.mat_a) @ fp8_to_float32(call.mat_b)
    return (acc * (call.scale_a.float() * call.scale_b.float())).to(call.out_dtype)


#: kernel name -> the function that runs a ``ScaledMMCall``.
SCALED_MM_KERNELS = {"native": native_scaled_mm, "emulated": emulated_scaled_mm}


@functools.cache
def native_blockwise_supported(device: torch.device) -> bool:
    """True where torch's own ``BlockWise1x128``/``BlockWise128x128`` kernel can exist: the aten op, a CUDA
    device of compute capability 9.x (H100/H200; ``_check_deepseek_support`` in torch's ``ScaledBlas.cpp``) and a
    CUDA 12.9+ build of torch. A precondition only: ``lowprec.kernels.blockwise`` runs the kernel to choose it."""
    if not HAS_SCALED_MM_V2 or device.type != "cuda" or not torch.version.cuda:
        return False
    major, minor = (int(x) for x in torch.version.cuda.split(".")[:2])
    return torch.cuda.get_device_capability(device)[0] == 9 and (major, minor) >= (12, 9)


def column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (R, C) with strides (1, R) (a no-op when it already has them)."""
    return t.t().contiguous().t()
