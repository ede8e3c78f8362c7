"""Shared by the kernel parity tests: train a recipe a few steps in-process on the real corpus and return its
per-step losses; and a permuted FP32 reduction order, the yardstick for "same numerics"."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from lowprec.data import TokenBatches
from lowprec.model import model_args
from lowprec.optim.builder import OptimHParams
from lowprec.train.build import build
from lowprec.train.spec import TrainSpec
from lowprec.train.step import train_step
from recipes import CATALOG

STEPS, BATCH, SEQ = 20, 4, 64
aten = torch.ops.aten
#: matmul op -> index of its first matrix operand (addmm's first argument is the bias)
_MATMULS = {aten.mm.default: 0, aten.bmm.default: 0, aten.addmm.default: 1}


def train_losses(
    token_data, recipe: str, cpu_kernels: str, reorder: bool = False, steps: int = STEPS, **train
) -> list[float]:
    """Per-step training losses of ``recipe`` on ``debug`` (seed 0, the real corpus), with ``cpu_kernels``;
    ``reorder``: every FP32 matmul of the forward and backward under ``ReversedReductionOrder`` (the optimizer
    step runs outside it: torchao's optimizers are compiled, and dynamo does not trace under a dispatch mode)."""
    spec = TrainSpec(steps=steps, batch_size=BATCH, seq_len=SEQ, warmup_steps=2, timing_warmup_steps=1, **train)
    b = build(CATALOG[recipe], model_args("debug"), spec, OptimHParams(), 0, torch.device("cpu"), None, cpu_kernels)
    batches = TokenBatches(token_data.train, token_data.val, SEQ, BATCH, 0)
    if not reorder:
        return [train_step(b, [batches.train_batch(s)], spec.grad_clip, s).loss for s in range(steps)]
    step = b.optimizer.step

    def step_outside_the_mode(*args, **kwargs):
        with _disable_current_modes():
            return step(*args, **kwargs)

    b.optimizer.step = step_outside_the_mode
    with ReversedReductionOrder():
        return [train_step(b, [batches.train_batch(s)], spec.grad_clip, s).loss for s in range(steps)]


class ReversedReductionOrder(TorchDispatchMode):
    """Every FP32 matmul of the run (``F.linear``, ``@``, torchao's emulated ``torch.mm``, the emulated kernels'
    matmuls, forward and backward, seen below autograd) sums its contraction in reverse order: the same
    mathematics, another FP32 rounding sequence. The yardstick for "same numerics up to accumulation order"."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in args[:2]):
            a, b = args[_MATMULS[func]], args[_MATMULS[func] + 1]
            args = list(args)
            args[_MATMULS[func]], args[_MATMULS[func] + 1] = a.flip(-1), b.flip(-2)
        return func(*args, **kwargs)


def max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
