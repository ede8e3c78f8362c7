"""The SwiGLU operator with its inputs cached in FP8 and its output recomputed in backward.

DeepSeek-V3 (arXiv 2412.19437, section 3.3.3, "Low-Precision Storage and Communication"): "we cache the inputs of
the SwiGLU operator and recompute its output in the backward pass. These activations are also stored in FP8 with
our fine-grained quantization method". Here the inputs ``a = w1 x`` and ``b = w3 x`` are saved as e4m3 with
power-of-2 scales per 1x128 tile along features (the paper's integral scaling factors for these activations), and
the backward recomputes ``silu(a)``, its derivative and the products from the dequantized values. The forward
output is computed from the exact inputs. The following ``w2`` saves its own input as its recipe says (lowprec
does not fuse the recompute into ``w2``'s weight-gradient GEMM, as the paper's kernels may).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.numerics.formats import E4M3
from lowprec.numerics.scaling import QTensor, quantize_operand


def _quantize(t: torch.Tensor) -> QTensor:
    return quantize_operand(t.reshape(-1, t.shape[-1]), E4M3, "tile1x128", power_of_2=True)


class _CachedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        qa, qb = _quantize(a), _quantize(b)
        ctx.shape, ctx.dtype = a.shape, a.dtype
        ctx.save_for_backward(qa.data, qa.scale, qb.data, qb.scale)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        da_, sa, db_, sb = ctx.saved_tensors
        a = QTensor(da_, sa, "tile1x128", E4M3).dequantize().view(ctx.shape)
        b = QTensor(db_, sb, "tile1x128", E4M3).dequantize().view(ctx.shape)
        sig = torch.sigmoid(a)
        silu = a * sig
        dyf = dy.float()
        grad_a = dyf * b * sig * (1 + a * (1 - sig))
        grad_b = dyf * silu
        return grad_a.to(ctx.dtype), grad_b.to(ctx.dtype)


class Float8CachedSwiGLU(nn.Module):
    """``silu(a) * b`` (``a``, ``b``: (..., hidden), same shape and dtype) whose inputs are saved for backward in
    e4m3 with power-of-2 1x128 tile scales (module doc). Replaces ``lowprec.model.llama.SwiGLU`` when
    ``recipe.fp8.saved.swiglu_cache='fp8'``."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not (a.requires_grad or b.requires_grad):
            return F.silu(a) * b
        return _CachedSwiGLU.apply(a, b)
