"""What a low-precision linear needs to know about activation checkpointing (``lowprec.train.ac``).

Activation checkpointing runs a transformer block's forward twice: once in the forward pass, and again
during backward to rebuild what autograd needs (the *recompute*). Two things must then hold for a linear
that keeps state or computes its GEMM inside a ``torch.autograd.Function``:

- **Side effects happen once.** A delayed-scaling amax is recorded (and max-reduced over the TP group), and
  FP8 telemetry is observed, in the forward only; ``in_recompute()`` is true while a block is being
  recomputed, and ``Float8Linear.quantize`` / ``_Float8Matmul.forward`` skip those side effects then.
  The scales used are unchanged between the two passes (they change only after the optimizer step), so the
  recomputed values equal the forward's bit for bit.
- **One linear is one matmul.** torchtitan's selective (op-level) policy saves the output of every other
  matmul in call order, and every attention kernel's outputs. The ops a GEMM inside an autograd Function
  dispatches depend on the kernel (one ``_scaled_mm``; one FP32 ``mm`` then a cast to BF16; 128-wide K
  chunks of ``_scaled_mm`` summed in FP32), so the Function wraps its forward in ``matmul_unit()`` (or
  ``attention_unit()``): the ops inside are hidden from the op-level policy, the unit counts as one matmul
  (attention: is always saved), and ``unit.output(compute)`` is the op's output, what a native kernel
  would return, that the policy may save (returned from the cache instead of recomputed). ``compute``
  returns a tensor or a tuple of tensors; ``unit.output`` is called exactly once per unit, and the unit's
  other ops must not depend on whether it is saved.

Outside a checkpointed block (and with ``train.ac=none``) a unit costs one ``ContextVar`` read and
``output(compute)`` is ``compute()``. The state is a ``ContextVar``: the recompute runs in whatever thread
runs the backward, and it sets and reads the variable in that thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Protocol

import torch

Output = torch.Tensor | tuple[torch.Tensor, ...]
#: What a unit stands for: ``matmul`` (counted by the every-second-matmul rule) or ``attention``.
UNIT_KINDS = ("matmul", "attention")


class Unit(Protocol):
    def output(self, compute: Callable[[], Output]) -> Output:
        """``compute()``, or the output the forward saved for this unit (during a recompute)."""
        ...


class Region(Protocol):
    """One checkpointed call of one block, as seen by the ops inside it (``lowprec.train.ac`` makes it)."""

    #: True while the block is being recomputed during backward.
    recomputing: bool

    def unit(self, kind: str) -> contextlib.AbstractContextManager[Unit]: ...


class _Plain:
    @staticmethod
    def output(compute: Callable[[], Output]) -> Output:
        return compute()


_PLAIN = _Plain()
_REGION: ContextVar[Region | None] = ContextVar("lowprec_checkpoint_region", default=None)


def in_recompute() -> bool:
    """True while a checkpointed block is being recomputed during backward. Always False while dynamo traces
    (``train.compile``): the compiled backward's recompute is AOTAutograd's, which replays the traced ops; a
    replayed ``DelayedScaler.record`` takes the max with the same amax, so it changes nothing."""
    if torch.compiler.is_compiling():
        return False
    region = _REGION.get()
    return region is not None and region.recomputing


@contextlib.contextmanager
def _unit(kind: str) -> Iterator[Unit]:
    region = None if torch.compiler.is_compiling() else _REGION.get()
    if region is None:
        yield _PLAIN
        return
    with region.unit(kind) as unit:
        yield unit


def matmul_unit() -> contextlib.AbstractContextManager[Unit]:
    """Around one linear's forward (inside its autograd Function): one matmul for the selective policy."""
    return _unit("matmul")


def attention_unit() -> contextlib.AbstractContextManager[Unit]:
    """Around one attention's forward (inside its autograd Function): saved whole by the selective policy."""
    return _unit("attention")


@contextlib.contextmanager
def entered(region: Region | None) -> Iterator[None]:
    """Make ``region`` the current one (``None``: none) for the duration of the block."""
    token = _REGION.set(region)
    try:
        yield
    finally:
        _REGION.reset(token)
