"""Optimizers built from a recipe's state policy."""
from lowprec.optim.builder import OptimHParams, build_optimizer, moment_kind

__all__ = ["OptimHParams", "build_optimizer", "moment_kind"]
