"""What ``train`` and ``ablate`` do after validation and before the first run: join the process group and
prepare the data (rank 0 first)."""

from __future__ import annotations

import torch.distributed as dist
from omegaconf import DictConfig

from experiments.plan.config import data_from_cfg, parallel_from_cfg
from lowprec.data import prepare
from lowprec.parallel import ParallelError
from lowprec.parallel.runtime import init_distributed
from lowprec.train.build import resolve_device


def prepare_data(cfg: DictConfig):
    """``lowprec.data.prepare`` on rank 0 first (it may tokenize and write the cache), then on the others.

    With ``train.progress``, rank 0 shows a cold build's phases on stderr; a warm cache prints nothing."""
    spec = data_from_cfg(cfg)
    progress = bool(cfg.train.progress)
    if not dist.is_initialized():
        return prepare(spec, progress=progress)
    data = prepare(spec, progress=progress) if dist.get_rank() == 0 else None
    dist.barrier()
    return data if data is not None else prepare(spec)


def start_parallel(cfg: DictConfig):
    """Validate ``cfg.parallel``; under torchrun join the process group. Returns the ``ParallelDims``."""
    dims = parallel_from_cfg(cfg)
    if dims.enabled and not init_distributed(resolve_device(cfg.device)):
        raise ParallelError(
            f"parallel layout {dims.short()} needs {dims.world_size} processes: a plain `lowprec train/ablate` "
            f"launches torchrun itself; with Hydra's -m run `torchrun --nproc_per_node={dims.world_size} -m "
            "experiments train -m ...`"
        )
    return dims
