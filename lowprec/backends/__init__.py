"""FP8 backends and optimizer implementations, one object per name (``lowprec.backends.registry``).

Importing this package registers the built-in ones: FP8 ``none``, ``lowprec``, ``torchao``, ``te``
(Transformer Engine, imported lazily; also its MXFP8/NVFP4 recipes), ``mx`` (lowprec's MXFP8/MXFP4/NVFP4 linear)
and optimizers ``torch``, ``lowprec``, ``bitsandbytes``, ``torchao``. A new backend is a new file plus one import
line.
"""

from lowprec.backends import fp8_lowprec, fp8_mx, fp8_none, fp8_te, fp8_torchao, optimizers  # noqa: F401 (registration)
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
    "fp8_backend",
    "fp8_backends",
    "optim_impl",
    "optim_impls",
    "register_fp8_backend",
    "register_optim_impl",
]
