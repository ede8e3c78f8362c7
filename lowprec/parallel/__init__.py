"""Parallel layouts (FSDP2, TP, HSDP) and FP8 communication, knowing nothing of recipes.

``lowprec.build_parallel.parallelize`` (build layer) applies them to a recipe's model.
"""

from lowprec.parallel.dims import ParallelDims, ParallelError

__all__ = ["ParallelDims", "ParallelError"]
