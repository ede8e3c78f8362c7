"""Measure what a forward pass keeps alive for backward, and the FP8 scaling buffers.

Counting rule (the estimator in ``lowprec.estimate.activations`` counts the same way):

- every tensor autograd saves is seen through ``torch.autograd.graph.saved_tensors_hooks``; the pack
  hook returns the tensor itself, so every saved storage stays alive until the measurement ends and
  no two distinct saved storages can share an address;
- a saved tensor whose storage is a parameter's or a buffer's storage (an ``nn.Parameter``, or a view of
  one such as the ``weight.t()`` that ``F.linear`` saves) is not counted: that memory is state;
- each distinct storage is counted **once, at its full size** (``untyped_storage().nbytes()``), however
  many times it or views of it are saved (the norm's input is saved by ``pow`` and by ``mul``; one
  normalised input feeds ``wq``, ``wk`` and ``wv``). This is the memory the saves hold, not the
  sum of the saves;
- a saved tensor derived from a parameter only through casts and views (autocast's BF16 copy of an
  FP32 weight, ``RMSNorm``'s ``weight.float()`` of a BF16 weight) is reported as ``weight_copies``;
  everything else is ``activations``.

``naive`` is also given: the plain sum of ``numel * element_size`` over every save except parameters and
buffers (views and repeats counted each time), for comparison with tools that count that way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from lowprec.measure.accounting import _leaf_tensors

#: Autograd nodes that only cast or re-view their single input: walked through when deciding whether a
#: saved tensor is a copy of a parameter.
_CAST_OR_VIEW = {
    "ToCopyBackward0",
    "TBackward0",
    "ViewBackward0",
    "TransposeBackward0",
    "UnsafeViewBackward0",
    "ExpandBackward0",
    "PermuteBackward0",
    "AliasBackward0",
    "ReshapeAliasBackward0",
    "CloneBackward0",
}


@dataclass(frozen=True)
class SavedBytes:
    """Bytes held for backward by one forward pass (all in bytes).

    ``activations``: distinct saved storages not derived from parameters. ``weight_copies``: distinct
    saved storages derived from parameters by casts/views. ``naive``: sum over saves (see module doc).
    ``n_saved``: number of pack-hook calls, parameters included.
    """

    activations: int
    weight_copies: int
    naive: int
    n_saved: int

    @property
    def total(self) -> int:
        return self.activations + self.weight_copies

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def _is_param_copy(t: torch.Tensor) -> bool:
    node = t.grad_fn
    for _ in range(16):
        if node is None:
            return False
        name = type(node).__name__
        if name == "AccumulateGrad":
            return isinstance(node.variable, nn.Parameter)
        if name not in _CAST_OR_VIEW or not node.next_functions:
            return False
        node = node.next_functions[0][0]
    return False


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    # DTensors (TP/FSDP2) and other wrapper subclasses (funcol's AsyncCollectiveTensor) own no storage:
    # count the plain tensors inside them, which is what occupies this rank's memory.

    return list(_leaf_tensors(t)) if type(t) not in (torch.Tensor, nn.Parameter) else [t]


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr())


def measure_saved_bytes(fn: Callable[[], Any], module: nn.Module) -> SavedBytes:
    """Run ``fn()`` (a forward pass, loss included if you want it counted) and measure what autograd saves.

    ``module``: its parameters and buffers are excluded (see the module doc for the counting rule).
    The forward's outputs are returned by ``fn`` and dropped here; nothing is backpropagated. Runs on
    any device; the saved tensors are released when this returns.
    """
    state = {
        _storage_key(leaf) for t in (*module.parameters(), *module.buffers()) for leaf in _leaves(t) if leaf.numel()
    }
    saved: list[tuple[torch.Tensor, bool]] = []
    # Parameters swapped in while the forward runs (FSDP2's unsharded parameters, gathered just before their
    # module runs and freed after it), keyed by storage; checked when a tensor is saved, while they are alive,
    # because a freed all-gather buffer's address is reused by later activations.
    live: dict[tuple, torch.Tensor] = {}

    def note_params(mod, args):
        for p in mod.parameters(recurse=False):
            for leaf in _leaves(p):
                if leaf.numel():
                    live[_storage_key(leaf)] = leaf

    def is_live_param(t: torch.Tensor) -> bool:
        ref = live.get(_storage_key(t))
        return ref is not None and ref.untyped_storage().nbytes() > 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t, any(is_live_param(leaf) for leaf in _leaves(t))))
        return t

    hooks = [m.register_forward_pre_hook(note_params) for m in module.modules()]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
    finally:
        for h in hooks:
            h.remove()
        live.clear()
    seen: set[tuple] = set()
    acts = copies = naive = 0
    for t in (leaf for s, param in saved if not param for leaf in _leaves(s)):
        key = _storage_key(t)
        if isinstance(t, nn.Parameter) or key in state or t.numel() == 0:
            continue
        naive += t.numel() * t.element_size()
        if key in seen:
            continue
        seen.add(key)
        if _is_param_copy(t):
            copies += t.untyped_storage().nbytes()
        else:
            acts += t.untyped_storage().nbytes()
    n = len(saved)
    saved.clear()  # release the saved tensors (and the forward output) before returning
    del out
    return SavedBytes(activations=acts, weight_copies=copies, naive=naive, n_saved=n)


def measure_fp8_scaling_bytes(model: nn.Module) -> int:
    """Bytes of FP8 delayed-scaling state: the buffers whose name contains ``scalers.`` (lowprec
    ``Float8Linear``'s ``scalers.<role>.amax_history`` (amax_history_len,) fp32 and ``.scale`` () fp32),
    each storage once. Not counted by ``lowprec.measure.accounting.measure_state_bytes``."""
    seen: set[tuple] = set()
    total = 0
    for name, b in model.named_buffers():
        if "scalers." not in name or not b.numel():
            continue
        key = _storage_key(b)
        if key not in seen:
            seen.add(key)
            total += b.numel() * b.element_size()
    return total
