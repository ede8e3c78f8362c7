"""Scaling: granularity (which elements share a scale) x strategy (where the scale comes from).

Operands are handled as 2-D ``(rows, K)`` tensors whose K is the GEMM's contraction dimension, so
"rowwise" means one scale per row of the operand along K (torchao's axiswise scaling), ``tile1x128``
one scale per row per 128 elements of K (DeepSeek-V3 activations and gradients), ``block128x128`` one
scale per 128 x 128 block (DeepSeek-V3 weights; arXiv 2412.19437 section 3.3.2). Ragged edges form
partial tiles/blocks with their own scale.

Compact scale shapes for an operand of shape (R, K), with ``b = 128``:
``tensorwise`` ``()``, ``rowwise`` ``(R, 1)``, ``tile1x128`` ``(R, ceil(K/b))``,
``block128x128`` ``(ceil(R/b), ceil(K/b))``. ``expand_scale`` turns any of them into a tensor that
broadcasts against (R, K). All scales are float32 and multiply (``fp8 = hp * scale``).

Strategies: ``current`` (scale from this tensor's amax), ``delayed`` (Transformer Engine's
``DelayedScaling``: see ``DelayedScaler``), ``static`` (a fixed scale, as modded-nanogpt's FP8 head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.numerics.formats import AMAX_EPS, Format, amax_to_scale, dequantize, quantize

GRANULARITIES = ("tensorwise", "rowwise", "tile1x128", "block128x128")
STRATEGIES = ("current", "delayed", "static")
BLOCK = 128


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    r, c = x.shape
    return x if (r, c) == (rows, cols) else F.pad(x, (0, cols - c, 0, rows - r))


@torch.no_grad()
def compute_amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """max(|x|) over each scaling group of the 2-D operand ``x`` (R, K), in float32, compact shape."""
    if x.dim() != 2:
        raise ValueError(f"operands are 2-D (rows, K); got shape {tuple(x.shape)}")
    if granularity in ("tile1x128", "block128x128") and _is_transposed(x) and x.shape[1] % BLOCK == 0:
        return _transposed_amax(x, granularity)
    a = x.abs()
    if granularity == "tensorwise":
        return a.max().float()
    if granularity == "rowwise":
        return a.amax(dim=1, keepdim=True).float()
    r, k = x.shape
    nk = math.ceil(k / BLOCK)
    if granularity == "tile1x128":
        return _pad_to(a, r, nk * BLOCK).reshape(r, nk, BLOCK).amax(dim=2).float()
    if granularity == "block128x128":
        nr = math.ceil(r / BLOCK)
        return _pad_to(a, nr * BLOCK, nk * BLOCK).reshape(nr, BLOCK, nk, BLOCK).amax(dim=(1, 3)).float()
    raise ValueError(f"unknown granularity {granularity!r}; known: {GRANULARITIES}")


def _is_transposed(x: torch.Tensor) -> bool:
    """``x`` is the transpose of a contiguous tensor (a backward operand such as ``dy.t()``). Always False under
    ``torch.compile``: see ``_layout_queries_allowed``."""
    return _layout_queries_allowed() and not x.is_contiguous() and x.t().is_contiguous()


def _layout_queries_allowed() -> bool:
    """Whether quantization may choose its code path from an operand's strides. Not while dynamo traces: a stride
    query (``is_contiguous``, ``stride``) on a tensor inside an autograd Function's backward made dynamo (torch
    2.11 CUDA and 2.13 CPU) trace the *next* FP8 linear of the graph with autocast off, so its output left in
    FP32 (SDPA then refused query bf16 with key/value fp32; ``benchmarks/compile_probe.py``). The layout-free
    paths compute the same products; inductor picks the memory order itself."""
    return not torch.compiler.is_compiling()


def _transposed_amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    # Reduce in the memory order of x.t(): the same groups, read contiguously. A strided reduction over a
    # transposed operand cost ~15x (2048x768 tiles along tokens: 3.7 ms vs 0.25 ms on a 2-core AVX2 EPYC).
    xt = x.t()
    if granularity == "block128x128":
        return compute_amax(xt, granularity).t().contiguous()
    k, r = xt.shape
    return xt.abs().view(k // BLOCK, BLOCK, r).amax(dim=1).t().contiguous().float()


def expand_scale(scale: torch.Tensor, granularity: str, shape: tuple[int, int]) -> torch.Tensor:
    """A view/copy of the compact ``scale`` that broadcasts against an operand of ``shape`` (R, K)."""
    r, k = shape
    if granularity in ("tensorwise", "rowwise"):
        return scale
    if granularity == "tile1x128":
        return scale.repeat_interleave(BLOCK, dim=1)[:, :k]
    if granularity == "block128x128":
        return scale.repeat_interleave(BLOCK, dim=0)[:r].repeat_interleave(BLOCK, dim=1)[:, :k]
    raise ValueError(f"unknown granularity {granularity!r}; known: {GRANULARITIES}")


@dataclass
class QTensor:
    """A quantized 2-D operand: ``data`` (R, K) in an FP8 dtype, compact float32 ``scale`` (see module doc).

    ``data / expand_scale(scale) ~ original``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    granularity: str
    fmt: Format

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        blocked = _blocked_views(self.data, self.scale, self.granularity)
        if blocked is not None:
            data, scale, transposed = blocked
            return _unview(dequantize(data, scale, dtype), self.shape, transposed)
        return dequantize(self.data, expand_scale(self.scale, self.granularity, self.shape), dtype)

    def t(self) -> QTensor:
        """Transpose; only scalings symmetric under transposition (tensorwise, 128x128 blocks) allow it."""
        if self.granularity not in ("tensorwise", "block128x128"):
            raise ValueError(f"a {self.granularity} operand cannot be transposed without requantizing")
        scale = self.scale if self.granularity == "tensorwise" else self.scale.t()
        return QTensor(self.data.t(), scale, self.granularity, self.fmt)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


def quantize_operand(
    x: torch.Tensor,
    fmt: Format,
    granularity: str,
    scale: torch.Tensor | None = None,
    power_of_2: bool = False,
    amax_floor: float = AMAX_EPS,
) -> QTensor:
    """Quantize the 2-D operand ``x`` (R, K). With ``scale=None`` the scale is current (from ``x``'s amax, each
    group's amax floored at ``amax_floor``: ``amax_to_scale``); otherwise the given compact scale is used
    (delayed or static strategies)."""
    if scale is None:
        scale = amax_to_scale(compute_amax(x, granularity), fmt, power_of_2=power_of_2, amax_floor=amax_floor)
    blocked = _blocked_views(x, scale, granularity)
    if blocked is not None:  # the same products, without materialising an (R, K) scale
        xb, sb, transposed = blocked
        data = _unview(quantize(xb, sb, fmt), tuple(x.shape), transposed)
    else:
        data = quantize(x, expand_scale(scale, granularity, tuple(x.shape)), fmt)
    return QTensor(data, scale, granularity, fmt)


def _blocked_views(x: torch.Tensor, scale: torch.Tensor, granularity: str):
    """``(x, scale, transposed)``: views of ``x`` and its compact ``scale`` that broadcast block by block, for
    tile/block scaling of an operand whose dims are multiples of 128, and whether ``x`` was viewed through its
    transpose (``_unview`` turns a result of the blocked shape back into ``x``'s (R, K)); ``None`` otherwise (the
    caller expands the scale). A transposed operand (``dy.t()`` in the backward) is viewed in the memory order of
    its transpose, so it is read contiguously and the result is the transpose of a contiguous tensor, like ``x``.
    No closures: a function returned from here would be a free variable to ``torch.compile``'s tracer."""
    r, k = x.shape
    if granularity not in ("tile1x128", "block128x128") or k % BLOCK:
        return None
    if granularity == "block128x128" and r % BLOCK:
        return None
    if not _layout_queries_allowed() or x.is_contiguous():
        # Under torch.compile, reshape whatever the layout (inductor turns it into indexing): a block index
        # j * 128 + l instead of the expanded scale's column // 128, whose loop split inductor's CPU backend
        # could not compile for two differently shaped operands in one fused kernel (torch 2.13; see
        # lowprec.backends.fp8_lowprec.compile_device_blocker's history).
        if granularity == "tile1x128":
            return x.reshape(r, k // BLOCK, BLOCK), scale[:, :, None], False
        return x.reshape(r // BLOCK, BLOCK, k // BLOCK, BLOCK), scale[:, None, :, None], False
    if _is_transposed(x):
        xt, st = x.t(), scale.t()
        if granularity == "tile1x128":  # groups run down the columns of xt (K, R)
            return xt.view(k // BLOCK, BLOCK, r), st[:, None, :], True
        return xt.view(k // BLOCK, BLOCK, r // BLOCK, BLOCK), st[:, None, :, None], True
    return None


def _unview(y: torch.Tensor, shape: tuple[int, int], transposed: bool) -> torch.Tensor:
    """A result of ``_blocked_views``' blocked shape back in the operand's (R, K) ``shape``."""
    r, k = shape
    return y.view(k, r).t() if transposed else y.reshape(r, k)


class DelayedScaler(nn.Module):
    """Per-tensor delayed scaling with Transformer Engine's semantics (``transformer_engine/common/recipe``
    ``DelayedScaling``; update rule of ``_default_sf_compute`` / amax-history roll in TE's PyTorch code).

    Buffers (checkpointed with the module): ``amax_history`` (amax_history_len,) float32, slot 0 is the
    step being recorded; ``scale`` () float32, initially 1.0.

    - ``scale`` is used for every cast of the current step (it was computed from steps before it);
    - ``record(amax)`` folds this step's amax into slot 0 (running max over micro-batches);
    - ``update()`` (after the optimizer step): ``amax = max(history)`` (``max``) or ``history[0]``
      (``most_recent``); ``scale = fmt.max / amax / 2**margin``, kept unchanged where amax is 0 or not
      finite; then the history rolls by one and slot 0 is zeroed.
    """

    def __init__(
        self, fmt: Format, amax_history_len: int, amax_compute_algo: str, margin: int, power_of_2: bool = False
    ):
        super().__init__()
        if amax_history_len < 1:
            raise ValueError(f"amax_history_len={amax_history_len} must be >= 1")
        if amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo={amax_compute_algo!r} is not 'max' or 'most_recent'")
        self.fmt, self.algo, self.margin, self.power_of_2 = fmt, amax_compute_algo, margin, power_of_2
        self.register_buffer("amax_history", torch.zeros(amax_history_len))
        self.register_buffer("scale", torch.ones(()))

    @torch.no_grad()
    def reset(self) -> None:
        self.amax_history.zero_()
        self.scale.fill_(1.0)

    @torch.no_grad()
    def record(self, amax: torch.Tensor) -> None:
        self.amax_history[0] = torch.maximum(self.amax_history[0], amax.float().reshape(()))

    @torch.no_grad()
    def update(self) -> None:
        amax = self.amax_history.max() if self.algo == "max" else self.amax_history[0]
        new = amax_to_scale(amax, self.fmt, power_of_2=self.power_of_2, margin=self.margin)
        ok = (amax > 0) & torch.isfinite(amax)
        self.scale.copy_(torch.where(ok, new, self.scale))
        self.amax_history.copy_(torch.roll(self.amax_history, -1))
        self.amax_history[0] = 0.0

    def extra_repr(self) -> str:
        return f"{self.fmt.name}, len={self.amax_history.numel()}, algo={self.algo}, margin={self.margin}"
