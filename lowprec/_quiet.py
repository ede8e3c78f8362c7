"""Silence exactly three known, harmless third-party warnings that an import of lowprec's dependencies would print.

- torchao logs ``Failed to load .../torchao/_C_mxfp8...so`` / ``_C_cutlass_90a...so`` when its CUDA kernels
  cannot load (every CPU machine): the Python paths lowprec uses do not need them.
- torch's pytree logs that registering an Enum (torchao's ``KernelPreference``) as a constant is deprecated.
- bitsandbytes, on a CPU with AVX-512-BF16, logs ``Failed to load CPU gemm_4bit_forward from kernels-community`` when
  the optional ``kernels`` package (a download from the Hugging Face hub) is missing: that kernel is the 4-bit
  inference GEMV, which lowprec never calls (it uses bitsandbytes' 8-bit AdamW). Seen on a 2-core AMD EPYC with
  AVX-512-BF16, where it broke the "a run prints no third-party noise" test.

Only records matching these messages are dropped; every other message of those loggers still shows. Installed
from ``lowprec/__init__.py`` so that it is in place before torchao is first imported.
"""

from __future__ import annotations

import logging


class _DropKnownNoise(logging.Filter):
    def __init__(self, match) -> None:
        super().__init__()
        self._match = match

    def filter(self, record: logging.LogRecord) -> bool:
        return not self._match(record.getMessage())


def install() -> None:
    """Attach the filters to the ``torchao``, ``torch.utils._pytree`` and bitsandbytes CPU-ops loggers
    (idempotent)."""
    rules = {
        "torchao": lambda m: m.startswith("Failed to load ") and "torchao/_C" in m,
        "torch.utils._pytree": lambda m: "is an Enum subclass and is now natively supported" in m,
        "bitsandbytes.backends.cpu.ops": lambda m: m.startswith(
            "Failed to load CPU gemm_4bit_forward from kernels-community"
        ),
    }
    for name, match in rules.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownNoise) for f in logger.filters):
            logger.addFilter(_DropKnownNoise(match))
