"""Per-role FP8 configuration of lowprec's own FP8 linear, built from a recipe's ``Float8Spec`` by ``linear_config``.

The recipe's ``cast`` and ``gemm`` groups (``lowprec.recipe.CastSpec`` / ``GemmSpec``) travel into the linear as they
are and are read where they are used (``Float8Linear.quantize`` / ``gemm``): a new field of either reaches the linear
without a copy here. What this module derives is only what the recipe states as presets: each operand role's format
and granularity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lowprec.numerics.formats import Format, get_format
from lowprec.recipe import CastSpec, GemmSpec

if TYPE_CHECKING:
    from lowprec.recipe import Float8Spec

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

#: How a linear saves its input for backward: as it is, cast to FP8 with its scales (the forward GEMM's operand,
#: ``recipe.fp8.saved.cache_fp8_activations``), or in E5M6 (``recipe.fp8.saved.e5m6_inputs``).
SAVED_INPUTS = ("input", "fp8", "e5m6")


@dataclass(frozen=True)
class RoleConfig:
    """How one operand role is cast: format, granularity, strategy (and the strategy's knobs)."""

    fmt: Format
    granularity: str
    strategy: str = "current"
    static_scale: float = 1.0


@dataclass(frozen=True)
class LinearFP8Config:
    """Everything one FP8 linear needs: its three operand roles (``linear_config`` builds them from the recipe's
    presets), the recipe's ``cast`` and ``gemm`` groups as they are (the scale options and delayed-scaling
    settings, the GEMM kernel and accumulator), and ``saved_input`` (one of ``SAVED_INPUTS``)."""

    input: RoleConfig
    weight: RoleConfig
    grad_output: RoleConfig
    cast: CastSpec = field(default_factory=CastSpec)
    gemm: GemmSpec = field(default_factory=GemmSpec)
    saved_input: str = "input"

    def __post_init__(self) -> None:
        if self.saved_input not in SAVED_INPUTS:
            raise ValueError(f"saved_input={self.saved_input!r} is not one of {list(SAVED_INPUTS)}")

    @property
    def runs_blockwise_gemm(self) -> bool:
        """True when some GEMM runs a blockwise kernel (``lowprec.kernels.blockwise``): an operand cast in 1x128
        tiles or 128x128 blocks, the ``scaled_mm`` backend, and no emulated limited-precision accumulator (which
        computes the GEMM itself, on every device)."""
        blockwise = any(self.role(r).granularity in ("tile1x128", "block128x128") for r in ROLES)
        return blockwise and self.gemm.gemm_backend == "scaled_mm" and self.gemm.accum_mantissa_bits is None

    def role(self, name: str) -> RoleConfig:
        return getattr(self, name)


def linear_config(spec: Float8Spec, fqn: str | None = None) -> LinearFP8Config:
    """The config of the FP8 linear at ``fqn`` under the recipe's ``spec`` (any ``fqn`` when None): the roles'
    granularities from ``SCALING_PRESETS[spec.scaling]`` (``cast.grad_output_granularity`` overriding the gradients'),
    formats from ``FORMAT_PRESETS[cast.fp8_format]``, strategy and static scale from ``cast``; ``spec.cast`` and
    ``spec.gemm`` themselves; ``saved_input`` from ``spec.saved`` (``e5m6`` where ``saved.e5m6_inputs`` matches
    ``fqn``, else ``fp8`` with ``saved.cache_fp8_activations``). Raises ``KeyError`` for a scaling or format
    without a preset."""
    cast = spec.cast
    grans = list(SCALING_PRESETS[spec.scaling])
    if cast.grad_output_granularity is not None:
        grans[2] = cast.grad_output_granularity
    fmts = FORMAT_PRESETS[cast.fp8_format]
    roles = [RoleConfig(get_format(f), g, cast.strategy, float(s)) for f, g, s in zip(fmts, grans, cast.static_scales)]
    if fqn is not None and spec.saves_e5m6_input(fqn):
        saved = "e5m6"
    else:
        saved = "fp8" if spec.saved.cache_fp8_activations else "input"
    return LinearFP8Config(*roles, cast=cast, gemm=spec.gemm, saved_input=saved)
