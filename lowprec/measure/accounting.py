"""Exact memory accounting of training state, and the device's peak memory.

State bytes are counted from the live tensors (``numel * element_size``; tensor subclasses such as
torchao's quantized optimizer states are counted through ``__tensor_flatten__``), each storage once,
so quantization constants (block absmax, qmaps) are included and shared tensors are not double-counted.
"""

from __future__ import annotations

import resource
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor


def _leaf_tensors(t: torch.Tensor) -> Iterable[torch.Tensor]:
    if isinstance(t, DTensor):
        yield from _leaf_tensors(t._local_tensor)
        return
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        for n in names:
            yield from _leaf_tensors(getattr(t, n))
    else:
        yield t


def local_numel(t: torch.Tensor) -> int:
    """Elements this rank holds: the local shard of a DTensor (FSDP2/TP), else ``numel()``."""
    return t._local_tensor.numel() if isinstance(t, DTensor) else t.numel()


def unique_tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (subclasses expanded to their inner tensors)."""
    seen: set[tuple] = set()
    total = 0
    for t in tensors:
        for leaf in _leaf_tensors(t):
            key = (leaf.device, leaf.untyped_storage().data_ptr(), leaf.storage_offset(), leaf.numel(), leaf.dtype)
            if leaf.numel() and key not in seen:
                seen.add(key)
                total += leaf.numel() * leaf.element_size()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor held in ``optimizer.state`` (moments, step counters, absmax, qmaps)."""
    out = []
    for state in optimizer.state.values():
        out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


@dataclass(frozen=True)
class StateBytes:
    """Bytes held by the training state, by component (all in bytes; ``per_param`` in bytes/parameter).

    ``master`` counts only an explicit master copy; FP32 parameters under autocast are their own master
    and are counted in ``params``.
    """

    n_params: int
    params: int
    grads: int
    master: int
    optim_states: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optim_states

    @property
    def per_param(self) -> float:
        return self.total / self.n_params

    def as_metrics(self) -> dict[str, float]:
        return {
            "mem_params_bytes": self.params,
            "mem_grads_bytes": self.grads,
            "mem_master_bytes": self.master,
            "mem_optim_states_bytes": self.optim_states,
            "mem_state_bytes": self.total,
            "state_bytes_per_param": self.per_param,
            "n_params": self.n_params,
        }


def measure_state_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, master: Iterable[torch.Tensor] = ()
) -> StateBytes:
    """Measure ``StateBytes`` from live objects; call after an optimizer step, before ``zero_grad``.

    Under FSDP2/TP every figure is this rank's: local shards, and ``n_params`` counts local elements.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return StateBytes(
        n_params=sum(local_numel(p) for p in params),
        params=unique_tensor_bytes(params),
        grads=unique_tensor_bytes(p.grad for p in params if p.grad is not None),
        master=unique_tensor_bytes(master),
        optim_states=unique_tensor_bytes(optimizer_state_tensors(optimizer)),
    )


class PeakMemory:
    """Peak memory of the current run.

    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (kind ``cuda_peak_allocated``).
    CPU: the process's peak resident set (``VmHWM``), reset at ``reset()`` by writing 5 to
    ``/proc/self/clear_refs`` (Linux >= 4.0; kind ``process_peak_rss``). Where that reset is not
    permitted, the kind is ``process_peak_rss_since_start`` and says the figure spans the whole process.
    ``read() - baseline`` is the growth during the run (on a CPU the process's libraries and data are
    already resident at ``reset()`` and dominate the absolute figure).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "cuda_peak_allocated" if device.type == "cuda" else "process_peak_rss"
        self.baseline = 0

    def reset(self) -> None:
        """Start a new measurement; remembers the current usage as ``baseline`` (bytes)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.kind = "process_peak_rss_since_start"
        self.baseline = self._status_bytes("VmRSS:") or 0

    @staticmethod
    def _status_bytes(field: str) -> int | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def read(self) -> int:
        """Peak bytes since ``reset()``."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        peak = self._status_bytes("VmHWM:")
        if peak is None:
            self.kind = "process_peak_rss_since_start"
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak
