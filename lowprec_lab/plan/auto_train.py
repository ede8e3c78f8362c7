"""``train.compile=auto`` and ``train.ac=auto``: what they mean on this device.

CUDA: compile on (Inductor fuses the FP8 casts and elementwise kernels: compiled FP8 tensorwise on Llama-3-8B
layer shapes ran 1.17x BF16 on an H200, eager it was slower than BF16) and selective activation
checkpointing for dense models, the configuration H100 users run and the cost model (``lowprec estimate``) assumes.
A DeepSeekMoE model stays eager (``lowprec.train.moe_balance`` refuses compile for its per-expert loop) without AC.
CPU (and any other device): today's defaults, compile off and no AC: on the 2-core EPYC compile costs more in
compile time than a short run saves, and the CPU measurements of the docs were taken eager.

A recipe that cannot compile on the device (``Float8Backend.compile_blocker``: e.g. Transformer Engine's linears,
or lowprec's FP8 telemetry on) runs eager under ``auto`` with a warning recorded on its run; an explicit
``train.compile=true`` is still refused for it before training (``lowprec.train.build.check_compile``).

``lowprec estimate`` and ``lowprec recommend`` predict a run on a named part (``hardware=``), not on the machine they
run on: they resolve ``auto`` for that part's device type (``hardware_device_type``), as the dry run does for its
target device.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowprec.errors import ConfigError

AUTO = "auto"


@dataclass(frozen=True)
class Resolved:
    """``compile`` / ``ac`` after ``auto``; ``requested``: the values asked for (``"auto"`` or the value itself);
    ``fallback``: why this recipe runs eager although ``auto`` chose compile (``None`` otherwise)."""

    compile: bool
    ac: str
    requested_compile: object
    requested_ac: str
    fallback: str | None = None

    def tags(self) -> dict[str, str]:
        """The run's tags: what ``auto`` resolved to, and the eager fallback's warning when there is one."""
        out = {}
        if self.requested_compile == AUTO or self.requested_ac == AUTO:
            out["train_auto"] = f"compile={self.requested_compile}->{self.compile}, ac={self.requested_ac}->{self.ac}"
        if self.fallback:
            out["compile_fallback"] = self.fallback
        return out


#: torch's device type on each vendor of ``lowprec.estimate.hardware``: ROCm builds of torch call AMD GPUs ``cuda`` too
VENDOR_DEVICE_TYPE = {"nvidia": "cuda", "amd": "cuda"}


def hardware_device_type(hw) -> str:
    """The torch device type (``"cuda"``) a run on the part ``hw`` (a ``lowprec.estimate.hardware.Hardware``) would
    use: what ``auto`` is resolved for when predicting that run. Raises ``ConfigError`` for a vendor not listed."""
    try:
        return VENDOR_DEVICE_TYPE[hw.vendor]
    except KeyError:
        raise ConfigError(f"hardware={hw.name}: vendor {hw.vendor!r} has no known torch device type") from None


def resolve_compile_ac(compile_, ac: str, device_type: str, moe: bool, blocker: str | None = None) -> Resolved:
    """Resolve ``train.compile`` (bool or ``auto``) and ``train.ac`` (a mode or ``auto``) for ``device_type``.

    ``blocker``: why the recipe cannot compile on this device (``compile_blocker``), consulted only when compile is
    ``auto`` and resolves on. Raises ``ConfigError`` for a compile value that is neither a bool nor ``auto``.
    """
    if not (isinstance(compile_, bool) or compile_ == AUTO):
        raise ConfigError(f"train.compile={compile_!r} must be true, false or auto")
    gpu = device_type == "cuda"
    c = (gpu and not moe) if compile_ == AUTO else compile_
    a = ("selective" if gpu and not moe else "none") if ac == AUTO else ac
    fallback = None
    if compile_ == AUTO and c and blocker:
        c, fallback = False, f"train.compile=auto ran this recipe eager: {blocker}"
    return Resolved(c, a, compile_, ac, fallback)
