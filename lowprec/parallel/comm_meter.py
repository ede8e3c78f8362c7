"""Count the bytes that collectives carry, per kind and dtype, for FSDP2, DTensor/TP and custom comms.

``CommMeter`` is a ``TorchDispatchMode`` that watches the two op namespaces collectives go through:

- ``c10d``: the eager process-group ops behind ``dist.all_gather_into_tensor``, ``dist.reduce_scatter_tensor``,
  ``dist.all_reduce``, ``dist.all_to_all_single``, ``dist.broadcast`` ... (FSDP2's parameter all-gather and
  gradient reduce-scatter, and any custom comm built on ``torch.distributed``);
- ``_c10d_functional``: the functional collectives DTensor issues when it redistributes (tensor parallel).

Patching ``torch.distributed.*`` instead would miss DTensor, which calls the functional ops directly
(docs/architecture.md, "Platform facts"); ``torch.distributed.tensor.debug.CommDebugMode`` sees both but only
counts calls.

Byte convention: the size in bytes of the full buffer the collective operates on, seen from the calling rank
(``numel * element_size``), independent of the algorithm a backend uses to move it:

================  ==========================================================================
all_gather        the gathered output (world_size x the local input)
reduce_scatter    the full, unreduced input (world_size x the local output)
all_reduce        the tensor(s) being reduced
all_to_all        the input this rank sends (all destinations together)
broadcast         the tensor(s) broadcast
other             the buffer this rank sends or receives (reduce, gather, scatter, send/recv)
================  ==========================================================================

So an fp32 FSDP2 model's all-gather per forward equals its (dim-0 padded) parameter bytes, and its
reduce-scatter per backward its padded gradient bytes. Gloo implements reduce-scatter as an all-reduce of the
whole buffer internally; the meter deliberately counts the logical collective, not the wire.
Barriers, ``wait_tensor`` and other non-payload ops are not counted.

``comm_label(kind)`` re-labels every collective issued inside it (thread-local), so a composite comm, e.g. an
FP8 reduce-scatter built from ``all_to_all_single``, is counted as the kind it implements.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["KINDS", "CommMeter", "comm_label", "current_comm_label"]

#: Collective kinds the meter reports, in this order.
KINDS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "other")


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _arg(i: int, name: str) -> Callable[[tuple, dict], list[torch.Tensor]]:
    """Tensors of the argument at position ``i`` (or keyword ``name``)."""

    def get(args: tuple, kwargs: dict) -> list[torch.Tensor]:
        return _tensors(args[i] if len(args) > i else kwargs.get(name))

    return get


def _gathered(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    # Functional all-gather returns a new tensor; its input is 1/group_size of what is gathered.
    group_size = args[1] if len(args) > 1 else kwargs["group_size"]
    return [t for t in _tensors(args[0] if args else kwargs["input"]) for _ in range(int(group_size))]


# op name -> (kind, tensors whose bytes follow the convention in the module docstring)
_C10D: dict[str, tuple[str, Callable]] = {
    "allgather_": ("all_gather", _arg(0, "output_tensors")),
    "_allgather_base_": ("all_gather", _arg(0, "output_tensor")),
    "allgather_coalesced_": ("all_gather", _arg(0, "output_lists")),
    "allgather_into_tensor_coalesced_": ("all_gather", _arg(0, "outputs")),
    "reduce_scatter_": ("reduce_scatter", _arg(1, "input_tensors")),
    "_reduce_scatter_base_": ("reduce_scatter", _arg(1, "input_tensor")),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", _arg(1, "inputs")),
    "allreduce_": ("all_reduce", _arg(0, "tensors")),
    "allreduce_coalesced_": ("all_reduce", _arg(0, "tensors")),
    "alltoall_base_": ("all_to_all", _arg(1, "input")),
    "alltoall_": ("all_to_all", _arg(1, "input_tensors")),
    "broadcast_": ("broadcast", _arg(0, "tensors")),
    "reduce_": ("other", _arg(0, "tensors")),
    "gather_": ("other", _arg(1, "input_tensors")),
    "scatter_": ("other", _arg(0, "output_tensors")),
    "send": ("other", _arg(0, "tensors")),
    "recv_": ("other", _arg(0, "tensors")),
    "recv_any_source_": ("other", _arg(0, "tensors")),
}
_FUNCTIONAL: dict[str, tuple[str, Callable]] = {
    "all_gather_into_tensor": ("all_gather", _gathered),
    "all_gather_into_tensor_coalesced": ("all_gather", _gathered),
    "all_gather_into_tensor_out": ("all_gather", lambda a, k: _tensors(k["out"])),
    "reduce_scatter_tensor": ("reduce_scatter", _arg(0, "input")),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", _arg(0, "inputs")),
    "reduce_scatter_tensor_out": ("reduce_scatter", _arg(0, "input")),
    "all_reduce": ("all_reduce", _arg(0, "input")),
    "all_reduce_": ("all_reduce", _arg(0, "input")),
    "all_reduce_coalesced": ("all_reduce", _arg(0, "inputs")),
    "all_reduce_coalesced_": ("all_reduce", _arg(0, "inputs")),
    "all_to_all_single": ("all_to_all", _arg(0, "input")),
    "broadcast": ("broadcast", _arg(0, "input")),
    "broadcast_": ("broadcast", _arg(0, "input")),
    "isend": ("other", _arg(0, "tensor")),
    "irecv": ("other", _arg(0, "tensor")),
    "batch_p2p_ops": ("other", _arg(3, "tensors")),
}
# ``_c10d_functional_autograd.*`` is deliberately absent: its autograd kernel re-issues the plain
# ``_c10d_functional`` op, which is what reaches a dispatch mode; listing both would count twice.
_TABLES = {"c10d": _C10D, "_c10d_functional": _FUNCTIONAL}

_label = threading.local()


@contextmanager
def comm_label(kind: str) -> Iterator[None]:
    """Attribute every collective issued in this block (this thread only) to ``kind``.

    ``kind`` must be one of ``KINDS``; raises ``ValueError`` otherwise. Nested labels: the innermost wins.
    Labels are honoured by every active ``CommMeter``; outside a meter they cost nothing.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")
    stack = _label.__dict__.setdefault("stack", [])
    stack.append(kind)
    try:
        yield
    finally:
        stack.pop()


def current_comm_label() -> str | None:
    """The innermost active ``comm_label`` kind of this thread, or ``None``."""
    stack = _label.__dict__.get("stack")
    return stack[-1] if stack else None


def _infra_types() -> tuple[type, ...]:
    # Fake and functional tensors belong to tracing machinery whose own mode sits below this one; deferring to
    # them (NotImplemented) makes FakeTensor.__torch_dispatch__ return NotImplemented too, and dispatch fails
    # with "all handlers returned NotImplemented" (measured on gloo with torchao's float8 TP).

    return (FakeTensor, FunctionalTensor)


def _is_real(t: torch.Tensor) -> bool:
    # Collectives traced on fake or meta tensors (torch.compile, DTensor's sharding propagation) move no data.
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type != "meta"


class CommMeter(TorchDispatchMode):
    """Dispatch mode that accumulates collective payload bytes and call counts per kind and dtype.

    Use ``with meter: step()``; it can be entered and exited any number of times and accumulates across
    entries until ``reset()``. It composes with other dispatch modes (CommDebugMode, FakeTensorMode, ...): ops
    are always forwarded unchanged, and when an argument is a tensor subclass such as DTensor or an
    AsyncCollectiveTensor the meter returns ``NotImplemented`` so the subclass runs first and the collectives it
    lowers to (on plain local tensors) come back through the meter, the approach of torch's ``CommDebugMode``.
    Only collectives on real (non-fake, non-meta) tensors are counted. Bytes follow the module docstring's
    convention: the full buffer from this rank's view. Counts are per process (per rank); nothing is exchanged.
    Like every dispatch mode it is thread-local state (autograd carries it into backward); several meters may
    be stacked and each counts everything, but do not nest one instance inside itself.
    """

    def __init__(self) -> None:
        super().__init__()
        self._infra = _infra_types()
        self.reset()

    def reset(self) -> None:
        """Forget all counts."""
        self._bytes: dict[str, dict[str, int]] = {k: defaultdict(int) for k in KINDS}
        self._calls: dict[str, int] = {k: 0 for k in KINDS}

    def bytes_by_kind(self) -> dict[str, int]:
        """Payload bytes per kind (every kind in ``KINDS`` present, 0 when unseen)."""
        return {k: sum(d.values()) for k, d in self._bytes.items()}

    def bytes_by_kind_dtype(self) -> dict[str, dict[str, int]]:
        """Payload bytes per kind, then per dtype name (``"float32"``, ``"bfloat16"``, ``"uint8"`` ...)."""
        return {k: dict(d) for k, d in self._bytes.items()}

    def calls_by_kind(self) -> dict[str, int]:
        """Number of collectives per kind (a coalesced collective counts once)."""
        return dict(self._calls)

    def total_bytes(self) -> int:
        """Payload bytes over all kinds."""
        return sum(self.bytes_by_kind().values())

    def _record(self, func: Any, args: tuple, kwargs: dict) -> None:
        schema_name = getattr(func, "name", lambda: "")()  # "c10d::allreduce_"; absent on higher-order ops
        ns, _, op = schema_name.partition("::")
        entry = _TABLES.get(ns, {}).get(op)
        if entry is None:
            return
        kind, payload = entry
        tensors = payload(args, kwargs)
        if not all(_is_real(t) for t in tensors):
            return
        kind = current_comm_label() or kind
        self._calls[kind] += 1
        for t in tensors:
            self._bytes[kind][str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, torch.Tensor) and t is not torch.Tensor and not issubclass(t, self._infra) for t in types):
            return NotImplemented
        # Record before running: an in-place collective (allreduce_) may be resized or freed by later ops,
        # and the buffer sizes are known up front.
        self._record(func, args, kwargs)
        return func(*args, **kwargs)
