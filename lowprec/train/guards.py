"""Measurement without side effects: forwards that are not training steps must leave training state alone."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def preserve_buffers(model: nn.Module) -> Iterator[None]:
    """Restore every buffer of ``model`` to its value on entry when the block exits (also on error).

    Buffers hold training state that a forward pass updates: delayed-scaling amax histories and scales
    (``lowprec.numerics.scaling.DelayedScaler.record``). A forward that only measures (the saved-activation probe)
    or validates must not feed its amaxes into the next training step's scales, or a run's trajectory
    would depend on how often it is validated. Cost: one copy of the buffers (FP8 scaling state is a few
    KiB per linear).
    """
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)
