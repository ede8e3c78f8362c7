"""Per-role FP8 configuration of lowprec's own FP8 linear, expanded from a recipe's ``Float8Spec``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lowprec.numerics.formats import AMAX_EPS, Format, get_format

ROLES = ("input", "weight", "grad_output")

#: ``scaling`` preset -> granularity of (input, weight, grad_output).
SCALING_PRESETS: dict[str, tuple[str, str, str]] = {
    "tensorwise": ("tensorwise", "tensorwise", "tensorwise"),
    "rowwise": ("rowwise", "rowwise", "rowwise"),
    # DeepSeek-V3: 1x128 tiles for activations and activation gradients, 128x128 blocks for weights.
    "blockwise": ("tile1x128", "block128x128", "tile1x128"),
}

#: ``fp8_format`` -> format of (input, weight, grad_output). HYBRID is Transformer Engine's ``Format.HYBRID``.
FORMAT_PRESETS: dict[str, tuple[str, str, str]] = {
    "hybrid": ("e4m3", "e4m3", "e5m2"),
    "e4m3": ("e4m3", "e4m3", "e4m3"),
}


#: LinearFP8Config field -> the Float8Spec field it is copied from, where the names differ.
_SPEC_NAMES = {"power_of_2": "power_of_2_scales"}


@dataclass(frozen=True)
class RoleConfig:
    """How one operand role is cast: format, granularity, strategy (and the strategy's knobs)."""

    fmt: Format
    granularity: str
    strategy: str = "current"
    static_scale: float = 1.0


@dataclass(frozen=True)
class LinearFP8Config:
    """Everything one FP8 linear needs. Built by ``from_spec`` from a recipe's ``Float8Spec``: the three roles from
    the presets, every other field copied from the spec field of the same name (``_SPEC_NAMES`` for the one that is
    named otherwise), so a new spec field reaches the linear by a field here alone."""

    input: RoleConfig
    weight: RoleConfig
    grad_output: RoleConfig
    power_of_2: bool = False
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    margin: int = 0
    gemm_backend: str = "scaled_mm"
    promotion_interval: int | None = None
    accum_mantissa_bits: int | None = None
    #: the emulated accumulator's rounding and alignment group (``lowprec.float8.accumulator.AccumulatorModel``)
    accum_rounding: str = "nearest"
    accum_group: int | None = None
    cache_fp8_activations: bool = False
    amax_floor: float = AMAX_EPS
    promotion: bool = True
    #: ``fp8`` (or the input itself, as ``cache_fp8_activations`` says) | ``e5m6``: how the input is saved for
    #: backward (per linear: ``Float8Spec.e5m6_inputs`` names the linears).
    saved_input: str = "fp8"

    @classmethod
    def from_spec(cls, spec) -> LinearFP8Config:
        """From a recipe's ``Float8Spec`` (any object with its fields): roles from ``scaling`` /
        ``grad_output_granularity``, ``fp8_format``, ``strategy`` and ``static_scales``; the other fields of this
        config that the spec has, by name. Raises ``KeyError`` for a scaling or format without a preset."""
        grans = list(SCALING_PRESETS[spec.scaling])
        if spec.grad_output_granularity is not None:
            grans[2] = spec.grad_output_granularity
        fmts = FORMAT_PRESETS[spec.fp8_format]
        roles = [
            RoleConfig(get_format(f), g, spec.strategy, float(s)) for f, g, s in zip(fmts, grans, spec.static_scales)
        ]
        copied = {}
        for f in dataclasses.fields(cls):
            name = _SPEC_NAMES.get(f.name, f.name)
            if f.name not in ROLES and hasattr(spec, name):
                copied[f.name] = getattr(spec, name)
        return cls(*roles, **copied)

    @property
    def runs_blockwise_gemm(self) -> bool:
        """True when some GEMM runs a blockwise kernel (``lowprec.kernels.blockwise``): an operand cast in 1x128
        tiles or 128x128 blocks, the ``scaled_mm`` backend, and no emulated limited-precision accumulator (which
        computes the GEMM itself, on every device)."""
        blockwise = any(self.role(r).granularity in ("tile1x128", "block128x128") for r in ROLES)
        return blockwise and self.gemm_backend == "scaled_mm" and self.accum_mantissa_bits is None

    def role(self, name: str) -> RoleConfig:
        return getattr(self, name)
