"""FP8 gradient reduce-scatter for FSDP2: blockwise-scaled FP8 payload over ``all_to_all``, FP32 accumulation.

FSDP2 lets a module replace its gradient reduce-scatter (``FSDPModule.set_custom_reduce_scatter``, torch >= 2.8).
What torch 2.13 passes to it (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, ``foreach_reduce``):

- ``input_tensor``: one flat 1-D buffer of ``reduce_dtype`` (the gradient dtype unless
  ``MixedPrecisionPolicy.reduce_dtype`` is set; so fp32, or bf16 under ``param_dtype=bf16``) holding every
  gradient of the param group, each padded on dim 0 to a multiple of the world size and laid out by
  ``chunk_cat`` so that ``input.view(ws, -1)[r]`` is exactly rank ``r``'s shard: the buffer always splits into
  ``ws`` equal chunks; ``output_tensor`` is one such chunk. FSDP keeps the input alive after the call (it
  records it for stream sync), so it must not be resized; this comm only reads it.
- ``op`` (from ``_get_gradient_divide_factors``): ``ReduceOp.AVG`` for fp32/bf16 by default; ``ReduceOp.SUM``
  after ``set_force_sum_reduction_for_comms(True)`` (FSDP then divides the output itself) and for fp16 or
  other reduce dtypes (FSDP pre/post-divides to avoid overflow); ``PREMUL_SUM(1/f)`` after
  ``set_gradient_divide_factor(f)`` with ``f != ws``, which gloo rejects and this comm rejects too.
  So no FSDP setting is needed for this comm; with a custom divide factor also call
  ``set_force_sum_reduction_for_comms(True)``.
- It is called synchronously (``async_op`` is never passed) and not at all at world size 1 (FSDP copies).
- ``set_custom_reduce_scatter`` raises ``ValueError`` on a module with several param groups
  (per-parameter meshes through ``shard_placement_fn``).

The method, as in DeepSeek-V3's FP8 training (one scale per 128-element block) applied to communication
rather than GEMMs: each destination chunk is quantized with one fp32 scale per ``block`` contiguous elements
(``scale = fmt.max / amax``, ``lowprec.numerics.formats``), the FP8 bytes and the scales are packed into one uint8
buffer per destination (gloo cannot move float8 dtypes) and exchanged with a single
``all_to_all_single``; each rank dequantizes the ``ws`` chunks it receives and sums them in FP32. The sum
therefore sees each contribution rounded once to FP8 but never accumulates in FP8. Payload: ``1 + 4/block``
bytes per element against 4 for an fp32 reduce-scatter (0.258x at block 128, plus ragged last blocks).
Quantization SQNR per 128-block on Gaussian data: 31.8 dB e4m3, 25.8 dB e5m2; FSDP2 gradients of the test MLP
vs the fp32 reduce-scatter: 43-46 dB e4m3, 37-41 dB e5m2 at world sizes 2-3 (tests/distributed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from lowprec.numerics.formats import Format, amax_to_scale, dequantize, get_format, quantize
from lowprec.parallel.comm_meter import comm_label

__all__ = ["Float8ReduceScatter", "apply_fp8_reduce_scatter", "quantize_blocks", "dequantize_blocks"]

_SCALE_BYTES = 4  # fp32


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``(rows, n)`` -> ``(rows, ceil(n/block), block)`` in fp32, the ragged tail zero-padded (zeros leave amax
    unchanged and are dropped again after dequantization)."""
    rows, n = x.shape
    nb = -(-n // block)
    out = x.new_zeros((rows, nb * block), dtype=torch.float32)
    out[:, :n] = x
    return out.view(rows, nb, block)


def quantize_blocks(x: torch.Tensor, fmt: Format, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` with one scale per ``block`` contiguous elements.

    Args: ``x`` of shape ``(rows, n)``, any float dtype. Returns ``(data, scales)``: ``data`` of shape
    ``(rows, n)`` in ``fmt.dtype`` and ``scales`` of shape ``(rows, ceil(n / block))`` fp32, with
    ``data ~ x * scale`` (``lowprec.numerics.formats`` convention, saturating). A block of zeros gets a finite scale.
    A non-finite value makes its whole block non-finite after dequantization (amax is inf/NaN), so overflow
    checks downstream still see it.
    """
    n = x.shape[1]
    xb = _blocks(x, block)
    scales = amax_to_scale(xb.abs().amax(dim=-1), fmt)
    data = quantize(xb, scales.unsqueeze(-1), fmt).flatten(1)[:, :n]
    return data, scales


def dequantize_blocks(data: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of ``quantize_blocks``: ``(rows, n)`` FP8 and ``(rows, ceil(n/block))`` fp32 -> ``(rows, n)`` fp32."""
    n = data.shape[1]
    return dequantize(_blocks(data, block), scales.unsqueeze(-1)).flatten(1)[:, :n]


class Float8ReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter comm that ships gradients as blockwise-scaled FP8 and reduces in FP32.

    Args:
        fmt: FP8 format name for ``lowprec.numerics.formats.get_format`` (``"e4m3"`` default, ``"e5m2"``); raises
            ``ValueError`` for an unknown name.
        block: elements per fp32 scale (default 128), ``>= 1``; raises ``ValueError`` otherwise.

    Install with ``module.set_custom_reduce_scatter(Float8ReduceScatter())`` or ``apply_fp8_reduce_scatter``.
    Stateless: one instance can serve every FSDP module. See the module docstring for what FSDP passes.
    """

    def __init__(self, fmt: str = "e4m3", block: int = 128) -> None:
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int, got {block!r}")
        self.fmt = get_format(fmt)
        self.block = block

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Uninitialised buffer of ``size`` (FSDP's own default allocation)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> None:
        """Reduce-scatter ``input_tensor`` into ``output_tensor`` through FP8.

        Args:
            output_tensor: ``numel == input_tensor.numel() // ws``, any float dtype; overwritten with this rank's
                reduced chunk (computed in fp32, cast on write).
            input_tensor: any shape with ``numel`` divisible by ``ws`` (FSDP: flat, ``reduce_dtype``); chunk
                ``r`` of its flattened view goes to rank ``r``. Not modified.
            group: the process group (FSDP's shard group); ``ws = group.size()``.
            op: ``ReduceOp.AVG`` (sum / ws) or ``ReduceOp.SUM``.
            async_op: accepted for the interface; the exchange always completes before returning and ``None`` is
                returned (FSDP2 calls this synchronously).

        Raises:
            ValueError: any other ``op`` (e.g. ``PREMUL_SUM`` from ``set_gradient_divide_factor``: use
                ``set_force_sum_reduction_for_comms(True)``), or sizes that do not split into ``ws`` chunks.
        """
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(
                f"Float8ReduceScatter supports ReduceOp.SUM and ReduceOp.AVG, got {op!r}; for a custom gradient "
                "divide factor call module.set_force_sum_reduction_for_comms(True) so FSDP passes SUM"
            )
        ws = group.size() if group is not None else dist.get_world_size()
        total = input_tensor.numel()
        if total % ws or output_tensor.numel() != total // ws:
            raise ValueError(
                f"reduce-scatter sizes do not split into {ws} chunks: input numel {total}, "
                f"output numel {output_tensor.numel()} (expected input = ws * output)"
            )
        chunk = total // ws
        data, scales = quantize_blocks(input_tensor.reshape(ws, chunk), self.fmt, self.block)
        # One exchange instead of two: per destination, [fp8 bytes | fp32 scale bytes]. uint8 because gloo
        # rejects float8 dtypes; the view is bit-exact.
        send = torch.cat([data.view(torch.uint8), scales.view(torch.uint8)], dim=1)
        recv = torch.empty_like(send)
        with comm_label("reduce_scatter"):
            dist.all_to_all_single(recv, send, group=group)
        r_data = recv[:, :chunk].contiguous().view(self.fmt.dtype)
        r_scales = recv[:, chunk:].contiguous().view(torch.float32)
        # Row i of the received buffer is rank i's contribution to this rank's chunk; summing in fp32 keeps
        # the accumulation error out of the fp8 budget.
        reduced = dequantize_blocks(r_data, r_scales, self.block).sum(dim=0)
        if op == dist.ReduceOp.AVG:
            reduced /= ws
        output_tensor.copy_(reduced.view_as(output_tensor))
        return None

    def __repr__(self) -> str:
        return f"Float8ReduceScatter(fmt={self.fmt.name!r}, block={self.block})"


def apply_fp8_reduce_scatter(module: torch.nn.Module, fmt: str = "e4m3", block: int = 128) -> int:
    """Install one ``Float8ReduceScatter(fmt, block)`` on every ``FSDPModule`` in ``module.modules()``.

    Call after ``fully_shard``. Returns the number of FSDP modules changed. Raises ``ValueError`` if
    ``module`` contains no FSDP module, for a bad ``fmt``/``block``, or (from FSDP) for a module with several
    param groups. No other FSDP setting is required (module docstring).
    """
    comm = Float8ReduceScatter(fmt, block)
    n = 0
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_reduce_scatter(comm)
            n += 1
    if n == 0:
        raise ValueError(f"{type(module).__name__} contains no FSDPModule; call fully_shard before this")
    return n
