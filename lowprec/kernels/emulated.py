"""Emulated low-precision GEMMs and attention: the CUDA kernels' rounding points computed with FP32 arithmetic.

For CPUs whose native BF16/FP16 kernels are slow (an AVX2-only CPU converts BF16 in software inside oneDNN's
GEMM: 17x FP32 measured), ``cpu_kernels=emulated`` computes every BF16/FP16 GEMM and attention of a run on FP32
operands that hold exactly the low-precision values, and rounds where the CUDA kernel rounds. Tensors keep their
storage dtype (what autograd saves is the BF16 tensor, as natively), so memory figures do not change.

Rounding points, per op (``c`` = the compute dtype: autocast's, or the input's when autocast is off):

- linear forward, ``y = x @ W.T``: ``x`` and ``W`` cast to ``c`` (autocast's casts), products and sums in FP32,
  one rounding of ``y`` to ``c``. As cuBLAS with FP32 accumulation (``CUBLAS_COMPUTE_32F``).
- linear backward: ``grad_x = grad_y @ W`` and ``grad_W = grad_y.T @ x`` from the ``c`` operands, FP32
  accumulation, one rounding each to ``c`` (autograd then casts ``grad_W`` to the parameter's dtype, as under
  autocast). The bias is added in ``c`` as ``F.linear`` does.
- attention (``F.scaled_dot_product_attention``, causal): q, k, v in ``c``; scores, softmax and ``P @ V`` in
  FP32 (the CPU flash kernel run in FP32), one rounding of the output to ``c``; the logsumexp stays FP32. The
  backward recomputes in FP32 from the saved ``c`` tensors and rounds ``dq``, ``dk``, ``dv`` to ``c`` once.

What differs from CUDA: the FP32 accumulation order (tile and split-K order of cuBLAS/CUTLASS vs the CPU BLAS);
for attention, FlashAttention-2 on CUDA rounds the probabilities ``P`` to ``c`` before ``P @ V`` and accumulates
the output block by block with online-softmax rescaling, where this keeps ``P`` in FP32; cuBLAS may also use
reduced-precision reductions for FP16 (``allow_fp16_reduced_precision_reduction``), which this does not.
FP32 GEMMs are not touched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.kernels import recompute

LOW_PRECISION = (torch.bfloat16, torch.float16)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` computes in: autocast's when autocast is on for its device, else ``x``'s."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class _EmulatedMatmul(torch.autograd.Function):
    """``x @ w.T`` for ``x`` (..., K) and ``w`` (N, K) in the same low-precision dtype, FP32 accumulation."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        # One matmul whose output is the rounded one, for activation checkpointing (lowprec.kernels.recompute).
        with recompute.matmul_unit() as unit:
            return unit.output(lambda: F.linear(x.float(), w.float()).to(x.dtype))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        dy32 = dy.float()
        grad_x = (dy32 @ w.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (dy32.reshape(-1, dy.shape[-1]).t() @ x.float().reshape(-1, x.shape[-1])).to(w.dtype)
        return grad_x, grad_w


def emulated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with BF16/FP16 GEMMs emulated (module doc); an FP32 computation runs ``F.linear`` itself.

    ``x`` (..., in_features), ``weight`` (out_features, in_features) -> (..., out_features) in the compute dtype.
    The casts happen outside the autograd function, so autocast's saved BF16 weight copy is a cast of the
    parameter (``lowprec.measure.saved_tensors`` counts it as a weight copy, as natively)."""
    dt = compute_dtype(x)
    if dt not in LOW_PRECISION:
        return F.linear(x, weight, bias)
    with torch.autocast(x.device.type, enabled=False):
        out = _EmulatedMatmul.apply(x.to(dt), weight.to(dt))
        return out if bias is None else out + bias.to(dt)


class EmulatedLinear(nn.Linear):
    """``nn.Linear`` whose BF16/FP16 GEMMs are emulated (``emulated_linear``); same parameters and FQNs."""

    @classmethod
    def from_linear(cls, mod: nn.Linear) -> EmulatedLinear:
        """Swap for ``mod`` sharing its parameters (works on the meta device)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = mod.in_features, mod.out_features
        new.weight = mod.weight
        new.bias = mod.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return emulated_linear(x, self.weight, self.bias)


class _EmulatedFlashAttention(torch.autograd.Function):
    """Causal or full attention over (batch, heads, seq, head_dim) q/k/v of one low-precision dtype: the CPU
    flash kernel run in FP32, output rounded once; saves what the native kernel saves (q, k, v, out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal: bool, scale):
        def attention():
            out32, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.float(), k.float(), v.float(), 0.0, is_causal, scale=scale
            )
            return out32.to(q.dtype), lse

        # One attention whose outputs are the rounded ones, for activation checkpointing (lowprec.kernels.recompute).
        with recompute.attention_unit() as unit:
            out, lse = unit.output(attention)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.float(), q.float(), k.float(), v.float(), out.float(), lse, 0.0, ctx.is_causal, scale=ctx.scale
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def emulated_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (no mask, no dropout) with BF16/FP16 attention emulated on CPU (module
    doc); FP32 attention and non-CPU tensors run ``F.scaled_dot_product_attention`` itself.

    q (batch, heads, seq, head_dim), k/v (batch, heads, seq_kv, head_dim) -> (batch, heads, seq, head_dim)."""
    dt = compute_dtype(q)
    if dt not in LOW_PRECISION or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    with torch.autocast(q.device.type, enabled=False):
        return _EmulatedFlashAttention.apply(q.to(dt), k.to(dt), v.to(dt), is_causal, scale)
