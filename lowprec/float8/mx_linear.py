"""lowprec's block-scaled linear: the three GEMMs of a linear in MXFP8, MXFP4 or NVFP4, with NVIDIA's stabilisers.

``output = input @ weight.T`` (forward), ``grad_input = grad_output @ weight`` (dgrad), ``grad_weight =
grad_output.T @ input`` (wgrad). Every operand is quantized in blocks along its GEMM's contraction dimension
(``lowprec.numerics.microscaling``): features for the forward GEMM, output features for dgrad, tokens for wgrad,
so activations and gradients are re-quantized for the transposed GEMMs (as torchao's MXFP8 training and
Transformer Engine do).

Stabilisers (arXiv 2509.25149, "Pretraining Large Language Models with NVFP4", section 4), each a recipe field:

- ``rht_size`` (section 4.2): the wgrad GEMM's two operands are multiplied, along tokens, by one random Hadamard
  transform ``diag(signs) @ H_n`` (orthogonal, so the product is unchanged in exact arithmetic) to spread outliers
  across each block. ``signs`` is a fixed random +-1 vector per linear, drawn at build from the run's seed and
  kept in the state dict (``rht_signs``).
- ``weight_scaling_2d`` (section 4.3): NVFP4 weights take one scale per 16x16 tile, so the dgrad GEMM uses
  exactly the quantized weight of the forward GEMM (its transpose), which 1x16 scaling along the other
  dimension would not.
- ``grad_rounding='stochastic'`` (section 4.4): gradient operands (dgrad's and wgrad's ``grad_output``) are
  rounded stochastically; weights and activations round to nearest even. The random numbers come from torch's
  global generator, which the build seeds with the run's seed (so the run's seed reproduces them).
- ``hp_last_blocks`` (section 4.1) and ``precision_switch_at`` (the 12B run's switch to BF16 for its last
  tokens): the first is linear selection (``Float8Spec.selects_linear``); the second switches every
  block-scaled linear to a plain high-precision ``F.linear`` (the compute dtype) once ``steps_done`` reaches
  ``hp_after_step`` (set by the ``mx`` backend from ``train.steps``; both are buffers, so a resumed run switches
  at the same step).

Casts: with ``fused_casts`` (set at build from ``train.fused_casts``) every round-to-nearest cast runs as one
compiled kernel (``lowprec.kernels.fused_mx_casts``, the eager casts' bits); stochastically rounded operands stay
eager (a compiled SR cast would draw other random numbers).

Kernels: ``fp8_kernel='native'`` runs one ``torch.nn.functional.scaled_mm`` block-scaled call on CUDA (sm100);
on CPU there is no block-scaled kernel, so both settings run the exact emulation
(``lowprec.kernels.block_scaled_mm``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.kernels.block_scaled_mm import block_scaled_mm
from lowprec.kernels.fused_mx_casts import fused_quantize_mx, fused_quantize_nvfp4
from lowprec.numerics.microscaling import (
    MX_BLOCK,
    NVFP4_BLOCK,
    BlockQTensor,
    apply_rht,
    quantize_mx,
    quantize_nvfp4,
    random_hadamard,
)
from lowprec.recipe import BlockSpec

if TYPE_CHECKING:
    from lowprec.recipe import Float8Spec

MX_SCALINGS = ("mxfp8", "mxfp4", "nvfp4")


@dataclass(frozen=True)
class MXConfig:
    """One block-scaled linear's numerics. ``scaling``: ``mxfp8``/``mxfp4``/``nvfp4``; ``elements``: element
    format of (input, weight, grad_output); ``block``: the recipe's ``recipe.fp8.block`` group as it is
    (``lowprec.recipe.BlockSpec``: ``mx_scale_mode``, the stabilisers ``rht_size``, ``weight_scaling_2d``,
    ``grad_rounding``; module doc), read where each is used. ``mx_config`` builds it from a recipe."""

    scaling: str
    elements: tuple[str, str, str]
    block: BlockSpec = field(default_factory=BlockSpec)

    @property
    def block_size(self) -> int:
        """Elements per scale block: 16 for NVFP4, 32 for MX."""
        return NVFP4_BLOCK if self.scaling == "nvfp4" else MX_BLOCK


def mx_config(spec: Float8Spec) -> MXConfig:
    """The block-scaled linears' config under a recipe's ``spec`` (already validated by the ``mx`` backend):
    elements from ``scaling`` (MXFP8: e4m3, gradients e5m2 under ``cast.fp8_format=hybrid``; else E2M1) and
    ``spec.block`` itself."""
    if spec.scaling == "mxfp8":
        elements = ("e4m3", "e4m3", "e5m2" if spec.cast.fp8_format == "hybrid" else "e4m3")
    else:
        elements = ("e2m1",) * 3
    return MXConfig(spec.scaling, elements, spec.block)


class MXLinear(nn.Linear):
    """``nn.Linear`` whose three GEMMs run block-scaled as ``config`` says (module doc).

    Shapes: input (..., in_features) -> (..., out_features); in_features and out_features must be multiples of the
    block size (32 for MX, 16 for NVFP4) and of ``rht_size`` (the ``mx`` backend refuses others before training);
    any number of tokens: the weight-gradient GEMM zero-pads them to the block. Buffers:
    ``rht_signs`` (rht_size,) float32, ``steps_done`` and ``hp_after_step`` (int64, -1 = never).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, config: MXConfig, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.mx_config = config
        self.register_buffer("rht_signs", torch.ones(config.block.rht_size, device=device))
        self.register_buffer("steps_done", torch.zeros((), dtype=torch.int64, device=device))
        self.register_buffer("hp_after_step", torch.full((), -1, dtype=torch.int64, device=device))
        self.fp8_kernel = "native"
        #: ``high_precision`` as a Python bool, for ``torch.compile`` (``sync_precision_switch``).
        self.switched = False
        self.register_load_state_dict_post_hook(_sync_after_load)
        #: Round-to-nearest casts run as one compiled kernel each (``lowprec.kernels.fused_mx_casts``; set at build
        #: from ``train.fused_casts``; the same bits as the eager casts). Stochastic rounding stays eager.
        self.fused_casts = False
        #: ``None`` or an object with ``observe_block_cast`` / ``observe_block_gemm`` (``lowprec.measure``).
        self.telemetry = None

    @classmethod
    def from_linear(cls, mod: nn.Linear, config: MXConfig) -> MXLinear:
        """Swap for ``mod`` sharing its parameters (works on the meta device)."""
        new = cls(mod.in_features, mod.out_features, mod.bias is not None, config, mod.weight.device, mod.weight.dtype)
        new.weight = mod.weight
        if mod.bias is not None:
            new.bias = mod.bias
        return new

    def init_buffers(self, generator: torch.Generator | None = None) -> None:
        """Draw the RHT sign vector from ``generator`` (the build's seeded one) and reset the step counter."""
        n = self.mx_config.block.rht_size
        if n:
            u = torch.rand(n, generator=generator, device=self.rht_signs.device)
            self.rht_signs.copy_(torch.where(u < 0.5, -1.0, 1.0))
        self.steps_done.zero_()
        self.sync_precision_switch()

    @property
    def high_precision(self) -> bool:
        """True once ``precision_switch_at`` has switched this linear to ``F.linear``. Eager code reads the
        buffers; code that ``torch.compile`` traces reads ``switched``, their value as a Python bool, because reading a
        tensor's value is a graph break (dynamo guards on the bool, so a switch recompiles the block once)."""
        if torch.compiler.is_compiling():
            return self.switched
        return 0 <= int(self.hp_after_step) <= int(self.steps_done)

    def sync_precision_switch(self) -> None:
        """Set ``switched`` from the buffers: called wherever they change (``init_buffers``, the ``mx`` backend's
        step counter and schedule, a state-dict load)."""
        self.switched = 0 <= int(self.hp_after_step) <= int(self.steps_done)

    def quantize(self, role: str, t: torch.Tensor, rounding: str = "nearest") -> BlockQTensor:
        """Quantize the 2-D operand ``t`` (rows, K) as ``role`` (``input``, ``weight``, ``grad_output``)."""
        cfg = self.mx_config
        # inside a compiled block the casts are traced with the block; SR stays eager (module doc)
        fused = self.fused_casts and rounding == "nearest" and not torch.compiler.is_compiling()
        two_d = role == "weight" and cfg.block.weight_scaling_2d
        if cfg.scaling == "nvfp4":
            return fused_quantize_nvfp4(t, two_d=two_d) if fused else quantize_nvfp4(t, rounding, two_d=two_d)
        elem = cfg.elements[("input", "weight", "grad_output").index(role)]
        if fused:
            return fused_quantize_mx(t, elem, MX_BLOCK, cfg.block.mx_scale_mode)
        return quantize_mx(t, elem, MX_BLOCK, cfg.block.mx_scale_mode, rounding)

    def rht(self) -> torch.Tensor:
        return random_hadamard(self.rht_signs)

    def gemm(self, a: BlockQTensor, bt: BlockQTensor, out_dtype: torch.dtype) -> torch.Tensor:
        kernel = self.fp8_kernel if a.data.device.type == "cuda" else "emulated"
        return block_scaled_mm(a, bt, out_dtype, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            x = x.to(torch.get_autocast_dtype(dev))
        if self.high_precision:
            out = F.linear(x, self.weight.to(x.dtype))
        else:
            shape = x.shape
            out = _MXMatmul.apply(x.reshape(-1, shape[-1]), self.weight, self)
            out = out.reshape(*shape[:-1], out.shape[-1])
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        c, b = self.mx_config, self.mx_config.block
        return (
            f"{super().extra_repr()}, {c.scaling}, elements={'/'.join(c.elements)}, scale_mode={b.mx_scale_mode}, "
            f"rht={b.rht_size}, weight_2d={b.weight_scaling_2d}, grad_rounding={b.grad_rounding}, "
            f"kernel={self.fp8_kernel}, fused_casts={self.fused_casts}"
        )


def _sync_after_load(module: MXLinear, incompatible_keys) -> None:
    # a resumed run's step counter arrives through load_state_dict (DCP's set_state_dict calls it too)
    module.sync_precision_switch()


def _pad_tokens(t: torch.Tensor, cfg: MXConfig) -> torch.Tensor:
    """``t`` (features, tokens) with zero token columns appended up to a multiple of the block and ``rht_size``."""
    need = max(cfg.block_size, cfg.block.rht_size)
    short = -t.shape[1] % need
    return F.pad(t, (0, short)) if short else t


class _MXMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, mod: MXLinear) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            qx, qw = mod.quantize("input", x), mod.quantize("weight", weight)
            out = mod.gemm(qx, qw, x.dtype)
            if mod.telemetry is not None:
                mod.telemetry.observe_block_cast(mod, "input", x, qx)
                mod.telemetry.observe_block_cast(mod, "weight", weight, qw)
                mod.telemetry.observe_block_gemm(mod, "output", x, weight.t(), out)
        ctx.mod, ctx.x_dtype = mod, x.dtype
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        mod: MXLinear = ctx.mod
        cfg = mod.mx_config
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        with torch.autocast(dy.device.type, enabled=False):
            # dgrad: contraction over out_features.
            qdy = mod.quantize("grad_output", dy, cfg.block.grad_rounding)
            two_d = cfg.block.weight_scaling_2d
            qwt = mod.quantize("weight", weight).t() if two_d else mod.quantize("weight", weight.t())
            grad_input = mod.gemm(qdy, qwt, ctx.x_dtype)
            # wgrad: contraction over tokens, optionally through the random Hadamard transform. Tokens are
            # zero-padded to the block (and RHT) size: a MoE expert receives any number of tokens, and zero tokens
            # add nothing to grad_output.T @ input (grouped MoE kernels pad each expert's tokens the same way).
            dyt, xt = _pad_tokens(dy.t(), cfg), _pad_tokens(x.t(), cfg)
            if cfg.block.rht_size:
                r = mod.rht()
                dyt_r, xt_r = apply_rht(dyt, r), apply_rht(xt, r)
                if mod.telemetry is not None:
                    mod.telemetry.observe_rht(mod, dyt, xt, dyt_r, xt_r)
                dyt, xt = dyt_r, xt_r
            qdyt = mod.quantize("grad_output", dyt, cfg.block.grad_rounding)
            qxt = mod.quantize("input", xt)
            grad_weight = mod.gemm(qdyt, qxt, torch.float32).to(weight.dtype)
            if mod.telemetry is not None:
                mod.telemetry.observe_block_cast(mod, "grad_output", dy, qdy)
                mod.telemetry.observe_block_gemm(mod, "grad_input", dy, weight, grad_input)
        return grad_input, grad_weight, None
