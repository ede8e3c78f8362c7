"""Which worker trains where: the slots of an ablation, each with the GPU indices its runs may see.

A run whose parallel layout needs ``k`` GPUs (``dp_replicate * dp_shard * tp``; 1 without a layout) takes ``k``
GPUs of its own: on a node of ``G`` visible GPUs at most ``floor(G / k)`` runs train at once, never two on one GPU.
``workers=auto`` is that bound on CUDA; ``workers=N`` is allowed up to it. Each slot's worker process is started
with ``CUDA_VISIBLE_DEVICES`` naming only its GPUs (``lowprec_lab.runner.scheduler``), so a run alone on its
device(s) measures its own throughput (the report compares throughput only between such runs).

On a CPU the slots share the cores (``workers``: 2 runs at a time measured 1.15x one run on the 2-core EPYC,
``lowprec_lab.runner.scheduler``); they carry no GPU. Pure (no torch, no environment read), but for
``visible_gpus``, the one device query, which ``lowprec_lab.plan.preflight`` makes to build the ``Plan``'s placement.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from lowprec.errors import ConfigError


@dataclass(frozen=True)
class Slot:
    """One worker: ``index`` (0-based) and the logical GPU indices (``0 .. G-1`` of the visible ones) its runs see;
    empty on a CPU."""

    index: int
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class Placement:
    """The slots of an ablation on ``device_type`` with ``visible`` GPUs (0 on a CPU), ``gpus_per_run`` each."""

    device_type: str
    visible: int
    gpus_per_run: int
    slots: tuple[Slot, ...]

    @property
    def workers(self) -> int:
        """Runs trained at once."""
        return len(self.slots)

    @property
    def alone_on_device(self) -> bool:
        """Every run had its device(s) to itself: one slot, or GPU slots (which never share a GPU)."""
        return self.workers == 1 or (self.device_type == "cuda" and all(s.gpus for s in self.slots))

    def describe(self) -> str:
        """One line: ``"8 workers, 1 GPU per run: worker 0 -> GPU 0, ..."``."""
        if self.device_type != "cuda" or not any(s.gpus for s in self.slots):
            return f"{self.workers} run(s) at a time on {self.device_type}" + (
                "" if self.alone_on_device else " (sharing its cores)"
            )
        each = ", ".join(f"worker {s.index} -> GPU {','.join(map(str, s.gpus))}" for s in self.slots)
        return (
            f"{self.workers} worker(s) on {self.visible} GPU(s), {self.gpus_per_run} GPU(s) per run, "
            f"none shared: {each}"
        )

    def to_json(self) -> str:
        """``{"device_type", "visible", "gpus_per_run", "workers": {index: [gpus]}}`` (the parent run's tag)."""
        return json.dumps(
            {
                "device_type": self.device_type,
                "visible": self.visible,
                "gpus_per_run": self.gpus_per_run,
                "workers": {str(s.index): list(s.gpus) for s in self.slots},
            }
        )


def visible_gpus() -> int:
    """CUDA devices this process sees (``torch.cuda.device_count()``: honours ``CUDA_VISIBLE_DEVICES``); 0 without
    CUDA. Queried in the ablation process only: its workers are pinned before they touch CUDA."""
    import torch  # here only: the rest of this module is pure

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def physical_ids(gpus: tuple[int, ...], parent_visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a slot: its logical indices mapped through the parent's own
    ``CUDA_VISIBLE_DEVICES`` (``"2,3,5"``: logical 1 is physical 3), or the indices themselves when unset."""
    if parent_visible is None or not parent_visible.strip():
        return ",".join(map(str, gpus))
    ids = [x.strip() for x in parent_visible.split(",") if x.strip()]
    return ",".join(ids[g] for g in gpus)


def _requested(workers) -> int | None:
    """``None`` for ``auto``, else the int; ``ConfigError`` for anything else or below 1."""
    if workers == "auto":
        return None
    if isinstance(workers, bool) or not isinstance(workers, int):
        raise ConfigError(f"workers={workers} must be an integer >= 1 or auto")
    if workers < 1:
        raise ConfigError(f"workers={workers} must be >= 1")
    return workers


def plan_placement(
    visible_gpus: int, gpus_per_run: int, workers, device_type: str, cpu_cores: int = 1, multi_gpu_slots: bool = True
) -> Placement:
    """The slots for ``workers`` (``auto`` or an int >= 1) on ``device_type`` (``cpu``, ``cuda``, other).

    CUDA: ``visible_gpus`` G (``gpus=`` or ``torch.cuda.device_count()``), ``gpus_per_run`` k (the layout's ranks);
    ``auto`` -> ``floor(G / k)`` slots, slot i holding GPUs ``i*k .. i*k+k-1``. ``multi_gpu_slots=False`` (the local
    runner today: a layout with k > 1 runs the whole ablation under one torchrun) caps that at 1 slot when k > 1.
    CPU: ``auto`` -> ``min(cpu_cores, 2)`` slots without a layout, 1 with one; N > 1 only without a layout.
    Other devices: one slot.

    Raises ``ConfigError`` (one line) for ``gpus=0`` on CUDA, k > G, ``workers`` above the bound, a bad ``workers``.
    """
    n = _requested(workers)
    if gpus_per_run < 1:
        raise ConfigError(f"a run needs {gpus_per_run} GPUs: the layout's ranks must be >= 1")
    if device_type == "cuda":
        if visible_gpus < 1:
            raise ConfigError(f"gpus={visible_gpus}: a CUDA ablation needs at least one GPU; use device=cpu")
        if gpus_per_run > visible_gpus:
            raise ConfigError(
                f"the layout needs {gpus_per_run} GPUs per run but the node has {visible_gpus} (gpus=); "
                "lower parallel.* or use more GPUs"
            )
        bound = visible_gpus // gpus_per_run
        if gpus_per_run > 1 and not multi_gpu_slots:
            bound = 1
        if n is not None and n > bound:
            raise ConfigError(
                f"workers={n} exceeds {bound}: {visible_gpus} GPU(s) / {gpus_per_run} per run"
                + ("" if multi_gpu_slots or gpus_per_run == 1 else " (a parallel layout trains one run at a time)")
                + "; use workers=auto or fewer"
            )
        count = bound if n is None else n
        slots = tuple(Slot(i, tuple(range(i * gpus_per_run, (i + 1) * gpus_per_run))) for i in range(count))
        return Placement("cuda", visible_gpus, gpus_per_run, slots)
    parallel = gpus_per_run > 1
    if device_type == "cpu":
        if n is None:
            count = 1 if parallel else min(max(cpu_cores, 1), 2)
        elif n > 1 and parallel:
            raise ConfigError(f"workers={n} cannot combine with a parallel layout (parallel.*); use workers=1")
        else:
            count = n
        return Placement("cpu", 0, gpus_per_run, tuple(Slot(i) for i in range(count)))
    if n is not None and n > 1:
        raise ConfigError(f"workers={n} trains runs side by side on a CPU or one per GPU; on {device_type} use 1")
    return Placement(device_type, 0, gpus_per_run, (Slot(0),))
