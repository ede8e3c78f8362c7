"""The parallel layout: data-parallel replicate x data-parallel shard x tensor parallel, as a DeviceMesh.

Follows torchtitan's ``ParallelDims`` (``torchtitan/distributed/parallel_dims.py``): mesh dimensions are
named ``dp_replicate``, ``dp_shard`` and ``tp`` (outermost to innermost, so TP ranks are neighbours, as on
a node's NVLink), and the data-parallel dimensions are flattened into ``dp`` for data loading and loss
averaging. HSDP is ``dp_replicate > 1`` with ``dp_shard > 1``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lowprec.errors import ConfigError


class ParallelError(ConfigError):
    """A parallel layout that cannot run (wrong world size, indivisible batch or heads)."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel dimension; their product is the world size. TP always runs with sequence
    parallelism (norms and the residual stream sharded along the sequence, Korthikanti et al. 2022), as
    torchtitan does by default."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp"):
            if getattr(self, name) < 1:
                raise ParallelError(f"parallel.{name}={getattr(self, name)} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def fsdp(self) -> bool:
        return self.dp_shard > 1

    def short(self) -> str:
        parts = [
            f"{n}{getattr(self, k)}"
            for k, n in (("dp_replicate", "rep"), ("dp_shard", "fsdp"), ("tp", "tp"))
            if getattr(self, k) > 1
        ]
        return "x".join(parts) or "single"

    def check(self, *, batch_size: int, n_heads: int, n_kv_heads: int) -> None:
        """Raise ``ParallelError`` if the global batch does not split over ``dp`` or heads over ``tp``."""
        if batch_size % self.dp:
            raise ParallelError(
                f"train.batch_size={batch_size} is not divisible by the data-parallel degree {self.dp} "
                "(dp_replicate x dp_shard): every rank takes an equal slice of the global batch"
            )
        if n_kv_heads % self.tp or n_heads % self.tp:
            raise ParallelError(
                f"parallel.tp={self.tp} must divide model.n_heads={n_heads} and model.n_kv_heads={n_kv_heads}"
            )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world's DeviceMesh with dims ``(dp_replicate, dp_shard, tp)`` and the flattened ``dp`` dim.

        Raises ``ParallelError`` when the process group's world size differs from ``world_size``.
        """
        ws = dist.get_world_size() if dist.is_initialized() else 1
        if ws != self.world_size:
            raise ParallelError(
                f"dp_replicate x dp_shard x tp = {self.world_size} but the process group has {ws} ranks"
            )
        mesh = init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
        )
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The flattened ``dp`` sub-mesh of a mesh made by ``ParallelDims.build_mesh``.

    torch (2.9 on) warns at each such slice that slicing a flattened dim from the root mesh "will be deprecated",
    which printed twice on every rank of every sharded run; the slice is what torch supports today, so that one
    message is ignored here, for this slice only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
        return mesh["dp"]


def dp_coordinate(mesh: DeviceMesh | None) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` of this process; ``(0, 1)`` without a mesh."""
    if mesh is None:
        return 0, 1
    dp = dp_mesh(mesh)
    return dp.get_local_rank(), dp.size()
