"""Parallel layouts (FSDP2, TP, HSDP) and FP8 communication. See ``apply.parallelize``."""

from lowprec.parallel.dims import ParallelDims, ParallelError

__all__ = ["ParallelDims", "ParallelError"]
