"""Shared by the kernel parity tests: train a recipe a few steps in-process on the real corpus and return its
per-step losses, optionally under a permuted FP32 reduction order (``lowprec.numerics.reorder``), the yardstick
for "same numerics"."""

from __future__ import annotations

import torch

from lowprec.build_optim import OptimHParams
from lowprec.data import TokenBatches
from lowprec.model import model_args
from lowprec.numerics.reorder import reversed_reductions
from lowprec.train.build import build
from lowprec.train.spec import TrainSpec
from lowprec.train.step import train_step
from recipes import CATALOG

STEPS, BATCH, SEQ = 20, 4, 64


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
    with reversed_reductions(b.optimizer):
        return [train_step(b, [batches.train_batch(s)], spec.grad_clip, s).loss for s in range(steps)]


def max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
