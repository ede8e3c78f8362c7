"""A permuted FP32 reduction order: the yardstick for "the same numerics up to accumulation order".

Reversing the contraction of every FP32 matmul keeps the mathematics and changes only the FP32 rounding sequence,
which is what two GEMM kernels (or a compiled and an eager graph) differ by. The kernel parity tests use it as
their tolerance, and ``lowprec selfcheck`` as the negative control of the verdict rule (fp32 against fp32 with this
order must never come out ``inferior``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten
#: matmul op -> index of its first matrix operand (addmm's first argument is the bias)
_MATMULS = {aten.mm.default: 0, aten.bmm.default: 0, aten.addmm.default: 1}


class ReversedReductionOrder(TorchDispatchMode):
    """Every FP32 matmul of the run (``F.linear``, ``@``, torchao's emulated ``torch.mm``, the emulated kernels'
    matmuls, forward and backward, seen below autograd) sums its contraction in reverse order: the same
    mathematics, another FP32 rounding sequence. The yardstick for "same numerics up to accumulation order".

    ``autocast_dtype``: also reverse the matmuls whose two matrix operands are in this dtype (``torch.bfloat16`` or
    ``torch.float16``): under autocast the linears' GEMMs see the autocast dtype, not FP32, so a recipe asking for
    the reversed order under autocast would otherwise reverse almost nothing. Their FP32-accumulated contraction
    runs in reverse: its true effect is still 0, only the roundings move. ``None`` (the default): FP32 matmuls
    only, as the kernel parity yardstick and ``fp32_reordered`` have always measured.
    ``reversed``: how many matmuls it has reversed (the effective-recipe check reads it: the mode did act)."""

    def __init__(self, autocast_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"autocast_dtype must be None, torch.bfloat16 or torch.float16, not {autocast_dtype}")
        self.dtypes = (torch.float32,) if autocast_dtype is None else (torch.float32, autocast_dtype)
        self.reversed = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # FP32 only: the first two arguments (addmm's bias and first matrix), as this mode always checked, so the
        # FP32 behaviour is bit-identical; an autocast dtype: both matrix operands in it (the bias may be another)
        if func in _MATMULS and (
            all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in args[:2])
            or (len(self.dtypes) > 1 and _operands_in(args, _MATMULS[func], self.dtypes[1]))
        ):
            self.reversed += 1
            a, b = args[_MATMULS[func]], args[_MATMULS[func] + 1]
            args = list(args)
            args[_MATMULS[func]], args[_MATMULS[func] + 1] = a.flip(-1), b.flip(-2)
        return func(*args, **kwargs)


def _operands_in(args, first: int, dtype: torch.dtype) -> bool:
    """Both matrix operands of a matmul (``args[first]``, ``args[first + 1]``) are tensors of ``dtype``."""
    return all(isinstance(t, torch.Tensor) and t.dtype == dtype for t in args[first : first + 2])


@contextlib.contextmanager
def reversed_reductions(optimizer: torch.optim.Optimizer):
    """Run the block under ``ReversedReductionOrder`` with ``optimizer.step`` outside it (restored on exit).

    The optimizer step stays in the normal order: torchao's optimizers are compiled, and dynamo does not trace under
    a dispatch mode. Everything else in the block (forward, backward, clipping) sums its FP32 matmuls in reverse.
    """
    step = optimizer.step

    # functools.wraps keeps the attributes of the step an LR scheduler wrapped: without them torch warned on every
    # scheduler step that optimizer.step() "has been overridden" (printed in every `lowprec selfcheck`)
    @functools.wraps(step)
    def step_outside_the_mode(*args, **kwargs):
        with _disable_current_modes():
            return step(*args, **kwargs)

    optimizer.step = step_outside_the_mode
    try:
        with ReversedReductionOrder():
            yield
    finally:
        optimizer.step = step
