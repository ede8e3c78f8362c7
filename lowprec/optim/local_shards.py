"""Run an optimizer that cannot take DTensors (bitsandbytes) on each rank's local shards under FSDP2/TP.

bitsandbytes' 8-bit kernels receive the DTensor parameter and a plain state tensor and fail ("mixed
torch.Tensor and DTensor"; bitsandbytes#1633). The fix verified on the lab's machines (docs/architecture.md,
"Platform facts"): give the optimizer plain leaf tensors that alias each DTensor's local shard (same storage,
so the update lands in the parameter with no copy), and hand it the local shard of each gradient before every
step. Block-wise 8-bit states are then per local shard, which is what bitsandbytes does on one device for a
tensor of that size.

``LocalShardOptimizer`` reuses ``MasterWeightOptimizer``'s machinery (groups, LR sync, state view keyed by
the model parameters) with aliasing views in place of FP32 copies: it adds no memory.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from lowprec.errors import CheckpointError
from lowprec.optim.master import MasterWeightOptimizer, MasterWeights


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class LocalShardViews(MasterWeights):
    """``masters[i]``: a leaf alias of ``params[i]``'s local shard (``params[i]`` itself when it is a plain
    tensor). ``before_step`` attaches the local shard of each gradient; ``after_step`` only drops it."""

    def __init__(self, params) -> None:
        self.params = list(params)
        self.master_dtype = None
        self.keep_master_grads = False
        self.masters = []
        for p in self.params:
            if isinstance(p, DTensor):
                v = p._local_tensor.detach()  # shares storage with the shard
                v.requires_grad_(p.requires_grad)
                self.masters.append(v)
            else:
                self.masters.append(p)

    @property
    def master_params(self) -> list[Tensor]:
        return []  # aliases: no bytes of their own

    @torch.no_grad()
    def before_step(self) -> None:
        for p, m in self.pairs():
            m.grad = None if p.grad is None else _local(p.grad).detach()

    @torch.no_grad()
    def after_step(self) -> None:
        for _, m in self.pairs():
            m.grad = None


class LocalShardOptimizer(MasterWeightOptimizer):
    """``inner_factory(groups)`` builds the real optimizer over local-shard aliases of the DTensor
    parameters in ``params``; everything else behaves as ``MasterWeightOptimizer`` (see there).

    Its ``state_dict`` turns the local states into DTensors (see there): states shaped like the shard reshard
    on load, per-rank constants (bitsandbytes block absmax) load only into the same layout, and
    ``lowprec.train.checkpoint`` turns any other attempt into a one-line ``CheckpointError``.
    """

    def _make_copies(self, flat, master_dtype, keep_master_grads) -> MasterWeights:
        return LocalShardViews(flat)

    def state_dict(self) -> dict:
        """Per-parameter states as DTensors so ``torch.distributed.checkpoint`` saves every rank's part:
        tensors shaped like the local shard take the parameter's placements (they reshard on load);
        other tensors (block absmax, per-shard scales, counters) become per-rank rows, which load only into
        the same layout. Raises ``CheckpointError`` on unevenly sharded parameters (not representable)."""
        sd = super().state_dict()
        for pid, st in sd["state"].items():
            st.pop("master", None)  # aliases of the parameters, which the model checkpoint holds
            for k in [k for k, v in st.items() if isinstance(v, dict)]:
                # bitsandbytes nests its quantization tensors (absmax, qmap, codes) under one key for FSDP1;
                # its load_state_dict also takes them flat, and flat they can become DTensors.
                st.update(st.pop(k))
            p = self.master.params[pid]
            for k, v in list(st.items()):
                if isinstance(v, Tensor) and k != "step":  # the step counter is the same on every rank
                    st[k] = _as_dtensor(v, p)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        cur = self.inner.state
        # Keys are integer ids or, from torch.distributed.checkpoint.state_dict, FQNs; either way the
        # param_groups list them in this optimizer's parameter order.
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        view_of = dict(zip(saved_ids, self.master.masters))
        state = {}
        for pid, st in state_dict["state"].items():
            state[pid] = {k: _from_dtensor(v, cur.get(view_of.get(pid), {}).get(k)) for k, v in st.items()}
        self.inner.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
        self._load_group_hparams(state_dict["param_groups"])


def _as_dtensor(v: Tensor, p: Tensor) -> Tensor:
    if not isinstance(p, DTensor):
        return v
    mesh = p.device_mesh
    if any(isinstance(pl, Shard) and p.shape[pl.dim] % mesh.size(i) for i, pl in enumerate(p.placements)):
        raise CheckpointError(
            f"a parameter of shape {tuple(p.shape)} is unevenly sharded over {tuple(mesh.shape)}: the local-shard "
            "optimizer states (bitsandbytes, lowprec) cannot be checkpointed for it; use a layout that divides "
            "every dim 0, or optim.impl=torchao / torch"
        )
    if v.dim() and v.shape == p._local_tensor.shape:
        return DTensor.from_local(v, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    rows = v.reshape((1,) * mesh.ndim + (-1,))
    return DTensor.from_local(rows, mesh, [Shard(i) for i in range(mesh.ndim)], run_check=False)


def _from_dtensor(v, like: Tensor | None):
    if not isinstance(v, DTensor):
        return v
    local = v.to_local()
    return local.reshape(like.shape) if like is not None and local.numel() == like.numel() else local
