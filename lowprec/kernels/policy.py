"""``cpu_kernels=auto|native|emulated``: which kernels run this process's low-precision GEMMs and attention.

A top-level run setting, not a recipe field: it must not change the numerics (``lowprec.kernels.emulated`` and
``lowprec.kernels.scaled_mm`` compute what the native kernels compute, up to FP32 accumulation order), only the
time they take on this CPU. Two kinds are decided separately: ``bf16`` (BF16/FP16 GEMMs under autocast or
low-precision weights, and attention) and ``fp8`` (scaled FP8 matmuls). ``auto`` takes the faster of native and
emulated per kind, from a short probe (``lowprec.kernels.probe``) cached per CPU model and torch version. A GPU
run never emulates. Blockwise (1x128/128x128) FP8 GEMMs have their own kernel choice (``blockwise``:
``lowprec.kernels.blockwise``), made only for runs that have such GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowprec.errors import ConfigError
from lowprec.kernels.blockwise import select_blockwise_gemm
from lowprec.kernels.cpu import cpu_model, has_bf16_instructions, isa_flags
from lowprec.kernels.scaled_mm import SCALED_MM_OP

CPU_KERNELS = ("auto", "native", "emulated")
KERNELS = ("native", "emulated")


@dataclass(frozen=True)
class KernelPolicy:
    """The kernels a run uses. ``requested``: the ``cpu_kernels`` setting; ``bf16`` / ``fp8``: ``native`` or
    ``emulated`` per kind; ``probe``: the ``auto`` probe's figures (ms per call, see ``lowprec.kernels.probe``),
    empty when no probe decided; ``warning``: a line to print and record (e.g. native BF16 on a CPU without BF16
    instructions), or empty; ``blockwise``: the kernel of blockwise FP8 GEMMs
    (``lowprec.kernels.blockwise.BLOCKWISE_GEMMS``; ``emulated`` on a CPU and where the run has none)."""

    requested: str = "native"
    bf16: str = "native"
    fp8: str = "native"
    device_type: str = "cpu"
    cpu_model: str = ""
    isa: tuple[str, ...] = ()
    probe: dict = field(default_factory=dict)
    warning: str = ""
    blockwise: str = "emulated"

    def summary(self) -> dict:
        """What the effective recipe records: the kernel per kind and the op that runs scaled matmuls."""
        return {"bf16": self.bf16, "fp8": self.fp8, "scaled_mm_op": SCALED_MM_OP, "fp8_blockwise_gemm": self.blockwise}

    def tags(self) -> dict[str, str]:
        """MLflow run tags: the setting, what it resolved to, the CPU and the flags that decided it."""
        out = {
            "cpu_kernels": self.requested,
            "cpu_kernels_bf16": self.bf16,
            "cpu_kernels_fp8": self.fp8,
            "scaled_mm_op": SCALED_MM_OP,
            "fp8_blockwise_gemm": self.blockwise,
        }
        if self.device_type == "cpu":
            out |= {"cpu_model": self.cpu_model, "cpu_isa": " ".join(self.isa) or "none"}
        if self.probe:
            out["cpu_kernels_probe"] = ", ".join(f"{k}={v:.3g}" for k, v in sorted(self.probe.items()))
        if self.warning:
            out["cpu_kernels_warning"] = self.warning
        return out


def check_cpu_kernels(value: str) -> None:
    """Raise ``ConfigError`` (one line) unless ``value`` is one of ``CPU_KERNELS``."""
    if value not in CPU_KERNELS:
        raise ConfigError(f"cpu_kernels={value!r} is not one of {', '.join(CPU_KERNELS)}")


def resolve_kernels(requested: str, device: torch.device, blockwise: bool = False) -> KernelPolicy:
    """The ``KernelPolicy`` for ``cpu_kernels=requested`` on ``device``.

    CUDA: native for every kind, whatever was asked (a GPU never emulates). CPU: ``native`` / ``emulated`` as
    asked (``native`` BF16 on a CPU without BF16 instructions is allowed, with a ``warning``); ``auto`` runs the
    probe (at most a few seconds, once per CPU model and torch version). ``blockwise``: the run has blockwise
    FP8 GEMMs, so choose their kernel (``select_blockwise_gemm``: probed once per GPU; ``emulated`` on a CPU).
    Raises ``ConfigError`` for an unknown value and ``lowprec.kernels.blockwise.BlockwiseKernelError`` (a
    ``RecipeError``) for blockwise GEMMs on a GPU that has no blockwise kernel."""
    check_cpu_kernels(requested)
    if device.type != "cpu":
        kernel = select_blockwise_gemm(device) if blockwise else "emulated"
        return KernelPolicy(requested, "native", "native", device.type, blockwise=kernel)
    base = dict(requested=requested, device_type="cpu", cpu_model=cpu_model(), isa=isa_flags())
    if requested == "auto":
        from lowprec.kernels.probe import probe_kernels

        figures = probe_kernels()
        return KernelPolicy(**base, bf16=figures.choice("bf16"), fp8=figures.choice("fp8"), probe=figures.ms)
    warning = ""
    if requested == "native" and not has_bf16_instructions():
        warning = (
            f"cpu_kernels=native on a CPU without BF16 instructions ({cpu_model()}): BF16 GEMMs run in software "
            "here, up to ~17x slower than FP32; cpu_kernels=auto would emulate them"
        )
    return KernelPolicy(**base, bf16=requested, fp8=requested, warning=warning)
