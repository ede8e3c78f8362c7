"""FP8 backends and optimizer implementations, one object per name (``lowprec.backends.registry``).

Importing this package registers the built-in ones: FP8 ``none``, ``lowprec``, ``torchao``, ``te``
(Transformer Engine, imported lazily; also its MXFP8/NVFP4 recipes), ``mx`` (lowprec's MXFP8/MXFP4/NVFP4 linear)
and optimizers ``torch``, ``lowprec``, ``bitsandbytes``, ``torchao``. A new backend is a new file plus one import
line.

The recipe checks that need a backend (``check_recipe``; a ``Recipe`` is a pure value) and a recipe's short name
(``short_str``) are here too.
"""

from lowprec.backends import fp8_lowprec, fp8_mx, fp8_none, fp8_te, fp8_torchao, optimizers  # noqa: F401 (registration)
from lowprec.backends.check import check_fp8, check_optim, check_recipe
from lowprec.backends.naming import fp8_short, short_str
from lowprec.backends.registry import (
    Float8Backend,
    OptimizerImpl,
    fp8_backend,
    fp8_backends,
    optim_impl,
    optim_impls,
    register_fp8_backend,
    register_optim_impl,
)

__all__ = [
    "Float8Backend",
    "OptimizerImpl",
    "check_fp8",
    "check_optim",
    "check_recipe",
    "fp8_backend",
    "fp8_backends",
    "fp8_short",
    "optim_impl",
    "optim_impls",
    "register_fp8_backend",
    "register_optim_impl",
    "short_str",
]
