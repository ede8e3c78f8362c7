"""The memory layout of a 2-D GEMM operand, a key of the compiled casts' caches (``lowprec.kernels.fused_casts``,
``lowprec.kernels.fused_mx_casts``): inductor compiles one kernel per layout."""

from __future__ import annotations

import torch


def operand_layout(x: torch.Tensor) -> str:
    """``contiguous``, ``transposed`` (a 2-D tensor whose transpose is contiguous, as ``weight.t()`` in the backward
    GEMMs) or ``strided`` (anything else)."""
    if x.is_contiguous():
        return "contiguous"
    return "transposed" if x.dim() == 2 and x.t().is_contiguous() else "strided"
