"""A small MLP whose dims divide neither 2 nor 3, shared by the communication tests: FSDP2 pads dim 0, and at
world size 3 the 2-row layer leaves rank 2 with padding only."""

from __future__ import annotations

from torch import nn

DIMS = (13, 50, 7, 2)


def mlp() -> nn.Sequential:
    """Linear(13, 50) -> GELU -> Linear(50, 7) -> GELU -> Linear(7, 2)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(DIMS[:-1], DIMS[1:])):
        layers += [nn.Linear(a, b)] + ([nn.GELU()] if i < len(DIMS) - 2 else [])
    return nn.Sequential(*layers)
