"""FP8 weight all-gather for FSDP2: ship each weight shard as e4m3 bytes, hand the linear a dequantized weight.

FSDP2 lets the sharded parameter's tensor subclass decide what is all-gathered (``fsdp_pre_all_gather``) and
how the gathered bytes become the unsharded parameter (``fsdp_post_all_gather``). ``Float8AllGatherWeight``
wraps the high-precision master parameter (fp32 or bf16; every op except the few FSDP needs to keep the
wrapper computes on the plain tensor) and

- before the all-gather quantizes the local shard to e4m3 and returns a ``uint8`` view of it, zero-padded to
  FSDP's padded shard rows, as the *only* all-gather input (one byte per element on the wire, works on gloo
  and NCCL, with uneven shards, ranks holding no rows and world size 1);
- after it returns the full weight dequantized to the mixed-precision ``param_dtype``, so any linear can use
  it (lowprec's ``Float8Linear`` re-quantizes it with its own scaling; torchao's would too).

Wire scaling (constructor ``granularity``):

- ``tensorwise``: one scale; the shard amaxes are all-reduced (MAX) over the FSDP mesh's group inside the
  pre-hook, so every rank quantizes with the scale of the full weight and the gathered weight equals
  ``dequantize(quantize(W, s), s)`` of the full weight.
- ``rowwise``: one scale per row of dim 0 (FSDP's shard dim), computed from the local rows only. The scales
  are all-gathered by the pre-hook itself (fp32, padded to the padded shard rows), 4 bytes per row. They are
  not appended to the payload as extra uint8 columns because FSDP requires every all-gather input of an
  unevenly sharded parameter to have exactly the padded shard *size* (rows and columns; otherwise the padded
  rank asserts and the others hang), and FSDP's world-size-1 path copies only the first input.

Re-quantization: lowprec's tensorwise (rowwise) weight cast of the gathered bf16 weight gives the same e4m3
codes as casting the fp32 master directly (measured: all codes equal), so for those recipes the FP8 wire adds
no error of its own. 128x128-block casts re-quantize per-row wire codes (about 87-89% codes equal).

The collectives issued here (amax all-reduce, scale all-gather) run synchronously, one per parameter, inside
``comm_label("all_gather")`` when ``lowprec.parallel.comm_meter`` is importable.

``enable_fp8_weight_all_gather`` wraps parameters before ``fully_shard`` (works on the meta device and
survives ``to_empty`` + in-place init). ``install_fp8_safe_all_gather`` makes torchao's
``enable_fsdp_float8_all_gather=True`` work on gloo. ``register_safe_globals`` allow-lists the subclass for
``weights_only`` loading (DCP).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch._prims_common import suggest_memory_format
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
from torch.distributed.tensor import DTensor

from lowprec.float8.linear import Float8Linear
from lowprec.numerics.formats import E4M3, amax_to_scale, quantize
from lowprec.parallel.comm_meter import comm_label

WIRE_GRANULARITIES = ("tensorwise", "rowwise")
_WIRE_DTYPE = E4M3.dtype

aten = torch.ops.aten

# Ops whose outputs stay wrapped: FSDP pads / narrows / views / copies the local shard, to_empty builds it
# with empty_like, DCP and the optimizer detach / clone it. Everything else computes on the plain tensor.
_PRESERVE = {
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.slice.Tensor,
    aten.copy_.default,
    aten.view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten._pin_memory.default,
    aten.split.Tensor,
    aten.clone.default,
    aten.alias.default,
}


class Float8AllGatherWeight(torch.Tensor):
    """A high-precision weight whose FSDP2 all-gather moves e4m3 bytes (``granularity``: wire scaling).

    Behaves as the wrapped tensor ``_tensor`` for compute; ``granularity`` is ``tensorwise`` or ``rowwise``.
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, granularity: str = "tensorwise"):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            memory_format=suggest_memory_format(tensor),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            pin_memory=tensor.is_pinned() if tensor.device.type == "cpu" else False,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, granularity: str = "tensorwise"):
        if granularity not in WIRE_GRANULARITIES:
            raise ValueError(f"wire granularity {granularity!r} not in {WIRE_GRANULARITIES}")
        if isinstance(tensor, Float8AllGatherWeight):
            tensor = tensor._tensor
        self._tensor = tensor
        self._granularity = granularity

    def __repr__(self) -> str:
        return f"Float8AllGatherWeight(granularity={self._granularity}, tensor={self._tensor})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.detach.default:
            return cls(args[0]._tensor.detach(), args[0]._granularity)
        granularity = None

        def unwrap(t):
            nonlocal granularity
            granularity = granularity or t._granularity
            return t._tensor

        u_args, u_kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs))
        out = func(*u_args, **u_kwargs)
        if func in _PRESERVE:
            return pytree.tree_map_only(torch.Tensor, lambda x: cls(x, granularity), out)
        # In-place ops (normal_, mul_, add_, ... from init and optimizers) return their wrapped self argument.
        schema = func._schema
        if (
            args
            and isinstance(args[0], cls)
            and schema.arguments
            and schema.arguments[0].alias_info is not None
            and schema.arguments[0].alias_info.is_write
            and len(schema.returns) == 1
            and schema.returns[0].alias_info is not None
        ):
            return args[0]
        return out

    def __tensor_flatten__(self):
        return ["_tensor"], {"granularity": self._granularity}

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        return Float8AllGatherWeight(inner_tensors["_tensor"], flatten_spec["granularity"])

    # -- FSDP2 extension -------------------------------------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        x = self._tensor
        group = mesh.get_group()
        ws = mesh.size()
        rows = x.shape[0]
        padded_rows = math.ceil(outer_size[0] / ws)  # torch.chunk's chunk size: FSDP's padded shard rows
        x2d = x.reshape(rows, math.prod(x.shape[1:]))
        if self._granularity == "tensorwise":
            # ao#3982: the amax of a rank holding 0 rows is 0 (max() of an empty tensor raises).
            amax = x2d.abs().amax().float() if x2d.numel() else torch.zeros((), device=x.device)
            if ws > 1:
                with comm_label("all_gather"):
                    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
            scale = amax_to_scale(amax, E4M3)
            data = quantize(x2d, scale, E4M3)
            meta = (scale, outer_size[0])
        else:
            amax = x2d.abs().amax(dim=1).float() if x2d.numel() else torch.zeros(rows, device=x.device)
            scale = amax_to_scale(amax, E4M3)
            data = quantize(x2d, scale[:, None], E4M3)
            scales = torch.ones(padded_rows, dtype=torch.float32, device=x.device)
            scales[:rows] = scale
            if ws > 1:
                gathered = torch.empty(ws * padded_rows, dtype=torch.float32, device=x.device)
                with comm_label("all_gather"):
                    dist.all_gather_single(gathered, scales, group=group)
                scales = gathered
            meta = (scales, outer_size[0])
        payload = torch.zeros((padded_rows, *x.shape[1:]), dtype=torch.uint8, device=x.device)
        if rows:
            payload[:rows] = data.view(torch.uint8).view(rows, *x.shape[1:])
        return (payload,), meta

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out: torch.Tensor | None = None):
        (payload,) = all_gather_outputs
        scale, rows = metadata
        data = payload.view(_WIRE_DTYPE)[:rows]  # drop the padding rows of the last ranks
        if self._granularity == "rowwise":
            scale = scale[:rows].view(rows, *([1] * (data.dim() - 1)))
        weight = (data.to(torch.float32) / scale).to(param_dtype)
        if out is None:
            # The plain tensor is both the unsharded parameter and the inner tensor FSDP frees on reshard.
            return weight, (weight,)

        if isinstance(out, DTensor):  # FSDP + TP: the subclass sits inside the TP DTensor
            out = out._local_tensor
        # Refill in place (FSDP re-allocated the storage); keep the version counter or backward complains.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
            out.copy_(weight)
        return None


# -- wrapping parameters ----------------------------------------------------------------------------------------


def enable_fp8_weight_all_gather(
    model: nn.Module, granularity_for: Callable[[str, nn.Module], str | None]
) -> list[str]:
    """Wrap the ``weight`` of every module for which ``granularity_for(fqn, module)`` returns ``tensorwise`` or
    ``rowwise`` in a ``Float8AllGatherWeight``; returns the wrapped parameters' FQNs (``<module fqn>.weight``).

    Call it before ``fully_shard`` (the parameter must still be a plain tensor, not a DTensor). Works on the
    meta device: ``model.to_empty(device=...)`` keeps the wrapper (``nn.Module._apply`` swaps wrapper-subclass
    parameters with ``torch.utils.swap_tensors``, whatever ``torch.__future__`` says), and in-place init
    (``nn.init.normal_(w, generator=g)``, ``trunc_normal_``) writes through to the wrapped tensor. A parameter
    shared by several modules (tied weights) is wrapped once and stays shared. Already wrapped weights, weights
    of fewer than 2 dimensions and ``None`` are skipped.
    """
    done: dict[int, nn.Parameter] = {}
    wrapped: list[str] = []
    for fqn, mod in model.named_modules(remove_duplicate=False):
        p = mod._parameters.get("weight")
        if p is None or isinstance(p, Float8AllGatherWeight):
            continue
        if id(p) in done:
            mod._parameters["weight"] = done[id(p)]
            continue
        g = granularity_for(fqn, mod)
        if g is None:
            continue
        if g not in WIRE_GRANULARITIES:
            raise ValueError(f"{fqn}: wire granularity {g!r} not in {WIRE_GRANULARITIES}")
        if isinstance(p, DTensor):
            raise ValueError(f"{fqn}.weight is already a DTensor: call enable_fp8_weight_all_gather before fully_shard")
        if p.dim() < 2:
            continue
        new = nn.Parameter(Float8AllGatherWeight(p.detach(), g), requires_grad=p.requires_grad)
        done[id(p)] = new
        mod._parameters["weight"] = new
        wrapped.append(f"{fqn}.weight" if fqn else "weight")
    return wrapped


def lowprec_wire_granularity(fqn: str, module: nn.Module) -> str | None:
    """``granularity_for`` for lowprec's ``Float8Linear``: ``tensorwise`` wire scaling for tensorwise (and
    delayed / static, which are tensorwise) weight casts, ``rowwise`` for rowwise and 128x128 blockwise ones;
    ``None`` (not wrapped) for any other module, torchao's ``Float8Linear`` included (it has its own)."""
    if not isinstance(module, Float8Linear):
        return None
    rc = module.fp8_config.weight
    if rc.strategy != "current" or rc.granularity == "tensorwise":
        return "tensorwise"
    return "rowwise"


# -- torchao's float8 all-gather on gloo --------------------------------------------------------------------------


def _byte_view_all_gather_cls():
    class ByteViewAllGather(DefaultAllGather):
        """FSDP2's default all-gather, moving 1-byte float buffers (float8) as ``uint8`` views (gloo cannot
        move float8 dtypes; the bytes are identical)."""

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            async_op: bool = False,
        ):
            if output_tensor.dtype.is_floating_point and output_tensor.element_size() == 1:
                output_tensor = output_tensor.view(torch.uint8)
                input_tensor = input_tensor.view(torch.uint8)
            return super().__call__(
                output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op
            )

    return ByteViewAllGather


def install_fp8_safe_all_gather(model: nn.Module) -> int:
    """Install on every ``FSDPModule`` in ``model`` an all-gather that views float8 buffers as ``uint8``, so
    torchao's ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` works on gloo (FSDP all-gathers a
    group's buffer in float8 when every input of the group is float8). Call after ``fully_shard``. Harmless
    on NCCL. Returns the number of FSDP modules changed."""
    comm = _byte_view_all_gather_cls()()
    n = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(comm)
            n += 1
    return n


#: The name the task brief used for ``install_fp8_safe_all_gather``.
torchao_fsdp_fp8_all_gather_gloo = install_fp8_safe_all_gather


# -- checkpoints -----------------------------------------------------------------------------------------------------


def register_safe_globals() -> None:
    """Allow-list ``Float8AllGatherWeight`` for ``torch.load(weights_only=True)`` (DCP loads and
    ``torch.load`` of a state dict holding wrapped weights). Idempotent; also run at import."""
    torch.serialization.add_safe_globals([Float8AllGatherWeight])


register_safe_globals()
