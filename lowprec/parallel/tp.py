"""Tensor parallelism for the Llama model: torchtitan's plan, with an optional FP8 sequence-parallel all-gather.

Plan (``torchtitan/models/llama3/infra/parallelize.py``, ``apply_tp``): ``tok_embeddings`` row-wise
(vocab-sharded), ``attention.wq/wk/wv`` and ``feed_forward.w1/w3`` column-wise, ``attention.wo`` and
``feed_forward.w2`` row-wise, ``output`` column-wise with a replicated output. With sequence parallelism
the norms (``attention_norm``, ``ffn_norm``, ``norm``) and the residual stream are sharded along the
sequence (dim 1), and the inputs of ``attention`` / ``feed_forward`` are all-gathered along it.

``activation_all_gather="fp8"`` replaces that all-gather: each rank quantizes its sequence shard to e4m3
with one scale per token (per row along the features, which is exactly the rowwise scaling of the
column-wise linears' input, so no cross-rank amax is needed), the uint8 payload and the FP32 scales are
all-gathered, and every rank dequantizes to the compute dtype. The backward is the usual reduce-scatter
of the input gradient in the compute dtype.

lowprec's ``Float8Linear`` runs under this plan on the local shards (``Float8Linear.forward`` handles
DTensor weights); its scales are then per TP shard, a finer granularity than one process uses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from lowprec.float8 import Float8Linear
from lowprec.numerics.formats import amax_to_scale, dequantize, get_format, quantize
from lowprec.parallel.comm_meter import comm_label

_E4M3 = get_format("e4m3")


def _label(kind: str):
    return comm_label(kind)


class _Fp8SequenceAllGather(torch.autograd.Function):
    """``Shard(1)`` -> ``Replicate`` along the sequence, moving e4m3 + one FP32 scale per token.

    Input: DTensor (batch, seq/tp, dim) sharded on dim 1; output: DTensor (batch, seq, dim), replicated, in
    the input dtype. Backward: a ``Partial`` gradient is reduce-scattered (sum) in its dtype; a
    ``Replicate`` one is sliced.
    """

    @staticmethod
    def forward(ctx, x: DTensor) -> DTensor:
        mesh = x.device_mesh
        group = mesh.get_group()
        ws = mesh.size()
        local = x.to_local().contiguous()
        rows = local.reshape(-1, local.shape[-1])
        scale = amax_to_scale(rows.abs().amax(dim=1, keepdim=True).float(), _E4M3)
        payload = quantize(rows, scale, _E4M3).view(torch.uint8)
        with _label("all_gather"):
            g_payload = payload.new_empty((ws * payload.shape[0], payload.shape[1]))
            g_scale = scale.new_empty((ws * scale.shape[0], 1))
            dist.all_gather_into_tensor(g_payload, payload, group=group)
            dist.all_gather_into_tensor(g_scale, scale, group=group)
        full = dequantize(g_payload.view(_E4M3.dtype), g_scale, local.dtype)  # (ws * b*s_local, dim), rank-major
        b, s_local, d = local.shape
        full = full.view(ws, b, s_local, d).permute(1, 0, 2, 3).reshape(b, ws * s_local, d)
        ctx.mesh, ctx.s_local = mesh, s_local
        return DTensor.from_local(full, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad: DTensor):
        mesh, s_local = ctx.mesh, ctx.s_local
        rank = mesh.get_local_rank()
        if isinstance(grad, DTensor):
            partial = isinstance(grad.placements[0], Partial)
            g = grad.to_local()
        else:
            partial, g = False, grad
        if partial:
            chunks = g.contiguous().chunk(mesh.size(), dim=1)
            out = torch.empty_like(chunks[rank])
            with _label("reduce_scatter"):
                dist.reduce_scatter(out, [c.contiguous() for c in chunks], group=mesh.get_group())
        else:
            out = g[:, rank * s_local : (rank + 1) * s_local].contiguous()
        return DTensor.from_local(out, mesh, [Shard(1)], run_check=False)


class Float8SequenceAllGather(ParallelStyle):
    """Like ``PrepareModuleInput(input_layouts=(Shard(1), ...), desired_input_layouts=(Replicate(), ...))``
    for a module's first positional input, with the all-gather in FP8 (see the module docstring)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre_hook(mod, args):
            x, *rest = args
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False)
            return (_Fp8SequenceAllGather.apply(x), *rest)

        module.register_forward_pre_hook(pre_hook)
        return module


class _TopLevelOnly:
    """torch's Colwise/RowwiseParallel partition every submodule of the linear; lowprec's ``Float8Linear``
    has submodules (``scalers``, delayed-scaling buffers, which stay replicated), so only the linear itself
    is partitioned."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name == "":
            super()._partition_linear_fn(name, module, device_mesh)


class _Colwise(_TopLevelOnly, ColwiseParallel):
    pass


class _Rowwise(_TopLevelOnly, RowwiseParallel):
    pass


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, activation_all_gather: str = "compute") -> None:
    """Tensor-parallelize a ``lowprec.model.Transformer`` in place over ``tp_mesh`` (1-D), with sequence
    parallelism (torchtitan's default; it also makes every parameter a DTensor on the mesh).

    Call before FSDP2 and before ``to_empty`` (works on the meta device). ``activation_all_gather``:
    ``compute`` or ``fp8`` (see the module docstring). Raises ``ValueError`` for a lowprec FP8 linear with a
    bias (its TP path adds none: a row-wise output is a partial sum).
    """
    biased = [n for n, m in model.named_modules() if isinstance(m, Float8Linear) and m.bias is not None]
    if biased:
        raise ValueError(f"tensor parallelism supports lowprec FP8 linears without bias; {biased[0]} has one")
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    fp8 = activation_all_gather == "fp8"
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {**_qk_norm_plan(block), **_block_plan(fp8)})
    _plain_scaling_buffers(model)


def _qk_norm_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    """The QK-norms (``ModelArgs.qk_norm``), when the block has them: replicated weights, each rank normalising the
    heads its column-wise ``wq``/``wk`` produced (a local ``(batch, seq, heads/tp, head_dim)`` tensor, read as
    ``Shard(2)``; torchtitan's Qwen3 plan). Left out of the plan, their weights would stay plain tensors whose
    gradients cover only the local heads, and the ranks' copies would drift apart."""
    if getattr(block.attention, "q_norm", None) is None:
        return {}
    return {
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }


def _block_plan(fp8: bool) -> dict[str, ParallelStyle]:
    """torchtitan's plan of one transformer block (module docstring); ``fp8``: the FP8 sequence all-gather."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": Float8SequenceAllGather()
        if fp8
        else PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": _Colwise(),
        "attention.wk": _Colwise(),
        "attention.wv": _Colwise(),
        "attention.wo": _Rowwise(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": Float8SequenceAllGather()
        if fp8
        else PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": _Colwise(),
        "feed_forward.w2": _Rowwise(output_layouts=Shard(1)),
        "feed_forward.w3": _Colwise(),
    }


def _plain_scaling_buffers(model: nn.Module) -> None:
    """``parallelize_module`` replicates every buffer as a DTensor; FP8 delayed-scaling state (amax
    histories, scales) is per rank and per local GEMM, so it goes back to plain tensors."""
    for mod in model.modules():
        for name, buf in list(mod.named_buffers(recurse=False)):
            if isinstance(buf, DTensor):
                mod.register_buffer(name, buf.to_local(), persistent=name not in mod._non_persistent_buffers_set)
