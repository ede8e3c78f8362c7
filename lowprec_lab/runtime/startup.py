"""What ``train`` and ``ablate`` do after validation and before the first run: join the process group,
prepare the data (rank 0 first) and say when a run would repeat it."""

from __future__ import annotations

import sys

import torch.distributed as dist

from lowprec.data import DataSpec, DataUsage, TokenData, data_usage, prepare
from lowprec.parallel import ParallelDims, ParallelError
from lowprec.parallel.runtime import init_distributed
from lowprec.train.build import resolve_device
from lowprec.train.spec import TrainSpec


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
            "lowprec_lab train -m ...`"
        )
    return dims


def usage_of(train: TrainSpec, data: TokenData) -> DataUsage:
    """How much of ``data``'s training split one run of ``train`` reads (``lowprec.data.data_usage``)."""
    return data_usage(data, train.steps, train.batch_size * train.grad_accum * train.seq_len)


def corpus_tags(train: TrainSpec, data: TokenData) -> dict[str, str]:
    """The run's data, as MLflow tags beside ``corpus_fingerprint``: the corpus's train and val token counts and
    the epochs of it the run reads (``corpus_epochs``, tokens seen / train tokens)."""
    u = usage_of(train, data)
    return {
        "corpus_train_tokens": str(u.train_tokens),
        "corpus_val_tokens": str(data.n_val_tokens),
        "corpus_epochs": f"{u.epochs:.4g}",
    }


def warn_repeated_data(spec: DataSpec, train: TrainSpec, data: TokenData, command: str) -> None:
    """Before training: one line on stderr when each run of ``train`` would read its training tokens more than
    once, unless ``spec.allow_epochs`` (``data.allow_epochs``)."""
    warning = None if spec.allow_epochs else usage_of(train, data).warning()
    if warning:
        print(f"lowprec {command}: warning: {warning}", file=sys.stderr, flush=True)
