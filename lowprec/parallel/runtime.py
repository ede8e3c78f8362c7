"""What the training loop needs from the process layout, as one object: batch slicing, metric averaging,
gradient clipping. The loop calls the same methods on one process and on many."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def init_distributed(device: torch.device) -> bool:
    """Join the process group torchrun describes (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the environment):
    NCCL on CUDA, gloo on CPU. Returns False when not launched by torchrun. On CUDA, selects the device
    ``LOCAL_RANK``."""
    if dist.is_initialized():
        return True
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 1:
        return False
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return True


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_rank0() -> bool:
    return rank() == 0


class DistContext:
    """Per-process view of the data-parallel layout.

    ``dp_rank``/``dp_size``: this process's slice of every global batch (ranks of one TP group share a
    slice). ``mean`` averages a scalar over all ranks (TP ranks hold identical values, so this is the
    data-parallel mean). ``clip_grad_norm_`` works on plain and DTensor gradients (the norm is reduced
    over every mesh dimension, as torchtitan's ``clip_grad_norm_``).
    """

    def __init__(self, dp_rank: int = 0, dp_size: int = 1):
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1

    def shard_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[dp_rank * B/dp, (dp_rank+1) * B/dp)`` of a global (B, seq) batch."""
        if self.dp_size == 1:
            return x, y
        n = x.shape[0] // self.dp_size
        sl = slice(self.dp_rank * n, (self.dp_rank + 1) * n)
        return x[sl], y[sl]

    def mean(self, value: torch.Tensor) -> float:
        """Mean of a 0-dim tensor over all ranks, as a Python float (a plain ``.item()`` on one process)."""
        if not self.distributed:
            return value.item()
        t = value.detach().float().reshape(1).clone()
        dist.all_reduce(t)
        return t.item() / dist.get_world_size()

    def clip_grad_norm_(self, params: Iterable[torch.Tensor], max_norm: float) -> float:
        """Clip gradients to total L2 norm ``max_norm``; returns the norm before clipping."""
        params = [p for p in params if p.grad is not None]
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)
