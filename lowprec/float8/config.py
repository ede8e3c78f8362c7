"""Per-role FP8 configuration of lowprec's own FP8 linear, expanded from a recipe's ``Float8Spec``."""

from __future__ import annotations

from dataclasses import dataclass

from lowprec.numerics.formats import Format, get_format

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


@dataclass(frozen=True)
class RoleConfig:
    """How one operand role is cast: format, granularity, strategy (and the strategy's knobs)."""

    fmt: Format
    granularity: str
    strategy: str = "current"
    static_scale: float = 1.0


@dataclass(frozen=True)
class LinearFP8Config:
    """Everything one FP8 linear needs. Built by ``from_spec`` from a recipe's ``Float8Spec``."""

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
    amax_floor: float = 1e-12
    promotion: bool = True
    #: ``fp8`` (or the input itself, as ``cache_fp8_activations`` says) | ``e5m6``: how the input is saved for
    #: backward (per linear: ``Float8Spec.e5m6_inputs`` names the linears).
    saved_input: str = "fp8"

    @classmethod
    def from_spec(cls, spec) -> LinearFP8Config:
        grans = list(SCALING_PRESETS[spec.scaling])
        if spec.grad_output_granularity is not None:
            grans[2] = spec.grad_output_granularity
        fmts = FORMAT_PRESETS[spec.fp8_format]
        roles = [
            RoleConfig(get_format(f), g, spec.strategy, float(s)) for f, g, s in zip(fmts, grans, spec.static_scales)
        ]
        return cls(
            *roles,
            power_of_2=spec.power_of_2_scales,
            amax_history_len=spec.amax_history_len,
            amax_compute_algo=spec.amax_compute_algo,
            margin=spec.margin,
            gemm_backend=spec.gemm_backend,
            promotion_interval=spec.promotion_interval,
            accum_mantissa_bits=spec.accum_mantissa_bits,
            accum_rounding=spec.accum_rounding,
            accum_group=spec.accum_group,
            cache_fp8_activations=spec.cache_fp8_activations,
            amax_floor=spec.amax_floor,
            promotion=spec.promotion,
        )

    @property
    def runs_blockwise_gemm(self) -> bool:
        """True when some GEMM runs a blockwise kernel (``lowprec.kernels.blockwise``): an operand cast in 1x128
        tiles or 128x128 blocks, the ``scaled_mm`` backend, and no emulated limited-precision accumulator (which
        computes the GEMM itself, on every device)."""
        blockwise = any(self.role(r).granularity in ("tile1x128", "block128x128") for r in ROLES)
        return blockwise and self.gemm_backend == "scaled_mm" and self.accum_mantissa_bits is None

    def role(self, name: str) -> RoleConfig:
        return getattr(self, name)
