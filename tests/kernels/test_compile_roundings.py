"""lowprec's compiles keep every BF16 rounding that eager makes (inductor's ``emulate_precision_casts``,
``lowprec.train.compile``): a compiled block and a compiled loss equal eager bit for bit on an expression whose
intermediate BF16 rounding inductor would otherwise skip. The compile-vs-eager training test compares losses
within a reordering yardstick, which a skipped rounding on its debug model stays inside; this one fails when the
setting is off (seen: with ``emulate_precision_casts`` False both compiled results differ from eager)."""

from __future__ import annotations

import torch
from torch import nn

from lowprec.train.compile import apply_compile, compile_loss


def _twice_rounded(x: torch.Tensor) -> torch.Tensor:
    # SwiGLU's shape: silu(a) * b in BF16, each product rounded to BF16 in eager; fused without the emulation,
    # inductor keeps silu(a) in FP32 and rounds once
    a = x.bfloat16()
    return (torch.nn.functional.silu(a * 1.7) * (a * 0.3)).float()


class _Block(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _twice_rounded(x)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"0": _Block()})


def test_compiled_blocks_and_loss_keep_every_bf16_rounding_of_eager():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    eager = _twice_rounded(x)
    model = _Model()
    assert apply_compile(model) == 1
    compiled_block = model.layers["0"](x)
    compiled_fn = compile_loss(_twice_rounded)(x)
    assert torch.equal(compiled_block, eager)
    assert torch.equal(compiled_fn, eager)
