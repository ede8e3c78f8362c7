"""What ``train`` and ``ablate`` do after validation and before the first run: join the process group and
prepare the data (rank 0 first)."""

from __future__ import annotations

import torch.distributed as dist

from lowprec.data import DataSpec, TokenData, prepare
from lowprec.parallel import ParallelDims, ParallelError
from lowprec.parallel.runtime import init_distributed
from lowprec.train.build import resolve_device


def prepare_data(spec: DataSpec, progress: bool = False) -> TokenData:
    """``lowprec.data.prepare`` on rank 0 first (it may tokenize and write the cache), then on the others.

    With ``progress`` (``train.progress``), rank 0 shows a cold build's phases on stderr; a warm cache prints
    nothing."""
    if not dist.is_initialized():
        return prepare(spec, progress=progress)
    data = prepare(spec, progress=progress) if dist.get_rank() == 0 else None
    dist.barrier()
    return data if data is not None else prepare(spec)


def start_parallel(dims: ParallelDims, device: str) -> ParallelDims:
    """Under torchrun join the process group of the layout ``dims`` on ``device`` (``auto``, ``cuda`` ...); raises
    ``ParallelError`` for a layout that needs ranks this process does not have. Returns ``dims``."""
    if dims.enabled and not init_distributed(resolve_device(device)):
        raise ParallelError(
            f"parallel layout {dims.short()} needs {dims.world_size} processes: a plain `lowprec train/ablate` "
            f"launches torchrun itself; with Hydra's -m run `torchrun --nproc_per_node={dims.world_size} -m "
            "experiments train -m ...`"
        )
    return dims
