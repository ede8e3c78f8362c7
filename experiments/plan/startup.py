"""What ``train`` and ``ablate`` do after validation and before the first run: join the process group,
prepare the data (rank 0 first) and say when a run would repeat it."""

from __future__ import annotations

import sys

import torch.distributed as dist
from omegaconf import DictConfig

from experiments.plan.config import data_from_cfg, parallel_from_cfg, train_from_cfg
from lowprec.data import DataUsage, TokenData, data_usage, prepare
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


def usage_of(cfg: DictConfig, data: TokenData) -> DataUsage:
    """How much of ``data``'s training split one run of ``cfg`` reads (``lowprec.data.data_usage``)."""
    spec = train_from_cfg(cfg)
    return data_usage(data, spec.steps, spec.batch_size * spec.grad_accum * spec.seq_len)


def corpus_tags(cfg: DictConfig, data: TokenData) -> dict[str, str]:
    """The run's data, as MLflow tags beside ``corpus_fingerprint``: the corpus's train and val token counts and
    the epochs of it the run reads (``corpus_epochs``, tokens seen / train tokens)."""
    u = usage_of(cfg, data)
    return {
        "corpus_train_tokens": str(u.train_tokens),
        "corpus_val_tokens": str(data.n_val_tokens),
        "corpus_epochs": f"{u.epochs:.4g}",
    }


def warn_repeated_data(cfg: DictConfig, data: TokenData, command: str) -> None:
    """Before training: one line on stderr when each run would read its training tokens more than once, unless
    ``data.allow_epochs``."""
    warning = None if cfg.data.get("allow_epochs", False) else usage_of(cfg, data).warning()
    if warning:
        print(f"lowprec {command}: warning: {warning}", file=sys.stderr, flush=True)
