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

Activation checkpointing (``lowprec.train.ac``): a checkpointed block keeps only what the forward keeps alive
for backward, and rebuilds the rest while backward reaches it. The measurement then counts

- **kept**: what the pack hook sees outside checkpointed regions (the head, the loss, and each checkpointed
  block's inputs, which ``torch.utils.checkpoint`` saves through the active hooks) plus the op outputs the
  selective policy caches, reported with ``note_kept`` (they are held outside autograd's saved tensors);
- **recomputed**: inside a region entered with ``recomputed_region()`` (the checkpoint's forward context),
  every tensor autograd saves is recorded (and handed on to the checkpoint's own hooks). That set is what
  the recompute rebuilds during backward, storage for storage: the recompute saves the same tensors, with
  the block's inputs and the policy's cached outputs being the very storages the forward kept.

and reports the peak, ``kept + max over regions (region's set not already kept)``, all with the counting
rule above: the forward's kept set plus the largest block being recomputed (the estimator's ``full`` /
``selective`` figures are the same sum). A tensor saved inside a region and kept only later in the forward
would be counted twice (none is, in this model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
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
    ``n_saved``: number of pack-hook calls, parameters included. Under activation checkpointing
    ``activations`` and ``weight_copies`` are at the peak (kept + the largest recomputed block, see the module
    doc), ``kept`` is what the forward keeps (both kinds) and ``recomputed`` the largest block's addition;
    without it ``kept`` is the total and ``recomputed`` is 0.
    """

    activations: int
    weight_copies: int
    naive: int
    n_saved: int
    kept: int = 0
    recomputed: int = 0

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


class _Probe:
    """The state of one ``measure_saved_bytes`` call (see the module doc)."""

    def __init__(self, module: nn.Module):
        self.state = {
            _storage_key(leaf) for t in (*module.parameters(), *module.buffers()) for leaf in _leaves(t) if leaf.numel()
        }
        #: (tensor, is a live parameter) for every save outside regions and every kept op output.
        self.saved: list[tuple[torch.Tensor, bool]] = []
        self.n_saved = 0
        #: (activations, weight copies) each region adds to what was kept when it ended.
        self.regions: list[tuple[int, int]] = []
        # Parameters swapped in while the forward runs (FSDP2's unsharded parameters, gathered just before
        # their module runs and freed after it), keyed by storage; checked when a tensor is saved, while they
        # are alive, because a freed all-gather buffer's address is reused by later activations.
        self.live: dict[tuple, torch.Tensor] = {}

    def note_params(self, mod, args) -> None:
        for p in mod.parameters(recurse=False):
            for leaf in _leaves(p):
                if leaf.numel():
                    self.live[_storage_key(leaf)] = leaf

    def is_live_param(self, t: torch.Tensor) -> bool:
        return any(
            (ref := self.live.get(_storage_key(leaf))) is not None and ref.untyped_storage().nbytes() > 0
            for leaf in _leaves(t)
        )

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.n_saved += 1
        self.saved.append((t, self.is_live_param(t)))
        return t

    def _counted(self, entries: list[tuple[torch.Tensor, bool]], exclude: set[tuple]):
        """Distinct storages of ``entries`` that are not state, live parameters or in ``exclude``."""
        for s, param in entries:
            if param:
                continue
            for t in _leaves(s):
                key = _storage_key(t)
                if isinstance(t, nn.Parameter) or key in self.state or key in exclude or t.numel() == 0:
                    continue
                yield key, t

    def kept_keys(self) -> set[tuple]:
        return {key for key, _ in self._counted(self.saved, set())}

    def _tally(self, entries, seen: set[tuple]) -> tuple[int, int, int]:
        """(activations, weight copies, naive) bytes of ``entries``' storages not in ``seen`` (which it extends),
        each distinct storage once."""
        acts = copies = naive = 0
        for key, t in self._counted(entries, set()):
            naive += t.numel() * t.element_size()
            if key in seen:
                continue
            seen.add(key)
            if _is_param_copy(t):
                copies += t.untyped_storage().nbytes()
            else:
                acts += t.untyped_storage().nbytes()
        return acts, copies, naive

    def close_region(self, entries: list[tuple[torch.Tensor, bool]]) -> None:
        acts, copies, _ = self._tally(entries, self.kept_keys())
        self.regions.append((acts, copies))

    def result(self) -> SavedBytes:
        acts, copies, naive = self._tally(self.saved, set())
        kept = acts + copies
        r_acts, r_copies = max(self.regions, key=sum, default=(0, 0))
        return SavedBytes(
            activations=acts + r_acts,
            weight_copies=copies + r_copies,
            naive=naive,
            n_saved=self.n_saved,
            kept=kept,
            recomputed=r_acts + r_copies,
        )


_PROBE: ContextVar[_Probe | None] = ContextVar("lowprec_saved_bytes_probe", default=None)


def note_kept(out: Any) -> None:
    """Report the tensors in ``out`` (a tensor, or a tuple/list of them) as kept alive for backward outside
    autograd's saved tensors (activation checkpointing's cached op outputs). A no-op unless
    ``measure_saved_bytes`` is running."""
    probe = _PROBE.get()
    if probe is None:
        return
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor):
            probe.saved.append((t, probe.is_live_param(t)))


@contextlib.contextmanager
def recomputed_region() -> Iterator[None]:
    """Around the forward of a block whose saved tensors are dropped and recomputed in backward, entered
    inside ``torch.utils.checkpoint``'s hooks (its ``context_fn`` forward context): while
    ``measure_saved_bytes`` runs, what autograd saves here is recorded as the block's recomputed set and
    handed on to the checkpoint's hooks. A no-op otherwise."""
    probe = _PROBE.get()
    if probe is None:
        yield
        return
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        raise RuntimeError("recomputed_region() must be entered inside torch.utils.checkpoint's forward")
    outer_pack, outer_unpack = hooks
    entries: list[tuple[torch.Tensor, bool]] = []

    def pack(t: torch.Tensor):
        entries.append((t, probe.is_live_param(t)))
        return outer_pack(t)

    with torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack):
        yield
    probe.close_region(entries)
    entries.clear()


def measure_saved_bytes(fn: Callable[[], Any], module: nn.Module) -> SavedBytes:
    """Run ``fn()`` (a forward pass, loss included if you want it counted) and measure what autograd saves.

    ``module``: its parameters and buffers are excluded (see the module doc for the counting rule and for
    activation checkpointing). The forward's outputs are returned by ``fn`` and dropped here; nothing is
    backpropagated. Runs on any device; the saved tensors are released when this returns.
    """
    probe = _Probe(module)
    hooks = [m.register_forward_pre_hook(probe.note_params) for m in module.modules()]
    token = _PROBE.set(probe)
    try:
        with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t):
            out = fn()
    finally:
        _PROBE.reset(token)
        for h in hooks:
            h.remove()
        probe.live.clear()
    result = probe.result()
    probe.saved.clear()  # release the saved tensors (and the forward output) before returning
    del out
    return result


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
