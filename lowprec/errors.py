"""Exception types for bad input a user can fix.

The command line prints a ``UserError`` as one line (exit 2) and keeps the traceback of every other
exception: a ``ValueError`` or ``KeyError`` raised by a bug is never mistaken for a user's mistake.
Lower layers raise the specific subclass (``RecipeError`` in ``lowprec.recipe``, ``DataError`` in
``lowprec.data``, ``CheckpointError`` in ``lowprec.train.checkpoint``, ``ParallelError`` in
``lowprec.parallel``); this module sits below all of them so none imports upwards.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input the user can fix (a value, a file, a combination); the message names it and the fix."""


class ConfigError(UserError, ValueError):
    """A run setting (``train.*``, ``optim.*``, ``model.*``, ``device``, ablation fields) is invalid."""


class RecipeError(ConfigError):
    """An invalid or unsupported recipe; the message names the conflicting fields (``lowprec.recipe``)."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint folder is missing, corrupt, or does not match this model or recipe; the message says which."""


class DiskError(UserError, OSError):
    """A write to a disk failed for lack of space (``ENOSPC``, ``EDQUOT``) or because it is read-only; the message
    names the folder, the mount point and the free bytes. Unlike other user errors, it is not the run's result:
    freeing space and resuming continues the run."""
