"""Block-scale telemetry for lowprec's block-scaled linears (``MXLinear``), sampled every ``every`` optimizer steps.

Per linear and operand role (``input``, ``weight``, ``grad_output``), from the role's first cast in the sampled
step (metric ``mx/<layer fqn>/<role>/<stat>``):

- ``scale_exp_min`` / ``scale_exp_median`` / ``scale_exp_max``: the block decode scales' base-2 exponents (E8M0:
  the code minus 127; NVFP4: ``floor(log2(e4m3_scale * tensor_scale))``), and per role over all linears their
  histogram as shares ``mx/all/<role>/scale_exp/<e>``;
- ``scale_saturated`` / ``scale_underflow``: share of blocks whose scale hit the top / bottom of its format (E8M0
  exponent 127 / -127 with a non-zero block; NVFP4: block scale beyond 448 / below E4M3's smallest normal before
  the clamp);
- ``elem_saturated``: share of elements beyond the element format's max after scaling (only FLOOR scaling can
  saturate); ``elem_underflow``: share of non-zero elements that quantize to zero.

Per GEMM (``output``, ``grad_input``): ``sqnr_db`` against an FP32 shadow GEMM of the high-precision operands. With
RHT (``rht_size``), per linear ``wgrad_sqnr_db_rht`` and ``wgrad_sqnr_db_plain``: the weight-gradient GEMM's SQNR
against FP32 with and without the transform (both operands quantized round-to-nearest, so sampling never draws
from the generator that stochastic rounding uses and a sampled step trains exactly as an unsampled one).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from lowprec.float8.mx_linear import MXLinear
from lowprec.numerics.formats import sqnr_db
from lowprec.numerics.microscaling import BlockQTensor

_E4M3_TINY = float(torch.finfo(torch.float8_e4m3fn).tiny)


class BlockScaleTelemetry:
    """Collects the statistics above for every ``MXLinear`` of ``model``; ``before_step`` / ``after_step`` as
    ``lowprec.measure.telemetry.FP8Telemetry``."""

    def __init__(self, model: nn.Module, every: int):
        if every < 1:
            raise ValueError(f"telemetry every={every} must be >= 1")
        self.every = every
        self.names = {m: fqn for fqn, m in model.named_modules() if isinstance(m, MXLinear)}
        self._metrics: dict[str, float] = {}
        self._hist: dict[str, Counter] = {}

    def _arm(self, on: bool) -> None:
        for m in self.names:
            m.telemetry = self if on else None

    def before_step(self, step: int, built=None) -> None:
        self._metrics, self._hist = {}, {}
        self._arm(step % self.every == 0)

    def after_step(self, step: int, built=None) -> dict[str, float]:
        self._arm(False)
        for role, counts in self._hist.items():
            total = sum(counts.values())
            for e, n in counts.items():
                self._metrics[f"mx/all/{role}/scale_exp/{e}"] = n / total
        out, self._metrics, self._hist = self._metrics, {}, {}
        return out

    @torch.no_grad()
    def observe_block_cast(self, mod: nn.Module, role: str, t: torch.Tensor, q: BlockQTensor) -> None:
        prefix = f"mx/{self.names[mod]}/{role}/"
        if prefix + "elem_underflow" in self._metrics:
            return  # the first cast of a role in the step is the one reported
        t32 = t.detach().float()
        r, k = q.shape
        amax = t32.reshape(r, k // q.block, q.block).abs().amax(-1)
        if q.scale.dtype == torch.uint8:  # E8M0
            exp = q.scale.to(torch.int32) - 127
            sat = exp >= 127
            under = (exp <= -127) & (amax > 0)
        else:  # NVFP4: the block scale before its clamp to E4M3
            pre = amax / 6.0 / q.tensor_scale
            exp = torch.floor(torch.log2(q.block_decode_scale())).to(torch.int32)
            sat = pre > 448.0
            under = (pre < _E4M3_TINY) & (amax > 0)
        el = q.elements()
        nonzero = t32 != 0
        dec = q.block_decode_scale().repeat_interleave(q.block, dim=1)
        e = exp.flatten().float()
        self._metrics.update(
            {
                prefix + "scale_exp_min": float(e.min()),
                prefix + "scale_exp_median": float(e.median()),
                prefix + "scale_exp_max": float(e.max()),
                prefix + "scale_saturated": float(sat.float().mean()),
                prefix + "scale_underflow": float(under.float().mean()),
                prefix + "elem_saturated": float(((t32 / dec).abs() > q.fmt.max).float().mean()),
                prefix + "elem_underflow": float((nonzero & (el == 0)).sum() / nonzero.sum().clamp(min=1)),
            }
        )
        self._hist.setdefault(role, Counter()).update(exp.flatten().tolist())

    @torch.no_grad()
    def observe_block_gemm(self, mod: nn.Module, gemm: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor):
        """``gemm`` = ``output`` or ``grad_input``: ``out`` ~ ``a @ b`` (both high precision)."""
        key = f"mx/{self.names[mod]}/{gemm}/sqnr_db"
        if key not in self._metrics:
            self._metrics[key] = sqnr_db(a.float() @ b.float(), out)

    @torch.no_grad()
    def observe_rht(self, mod: MXLinear, dyt, xt, dyt_r, xt_r) -> None:
        """The weight-gradient GEMM (``dyt @ xt.T``) against FP32, quantized with and without the transform."""
        prefix = f"mx/{self.names[mod]}/wgrad_sqnr_db_"
        if prefix + "rht" in self._metrics:
            return
        ref = dyt.float() @ xt.float().t()

        def quantized(a, b):
            return mod.quantize("grad_output", a).dequantize() @ mod.quantize("input", b).dequantize().t()

        self._metrics[prefix + "rht"] = sqnr_db(ref, quantized(dyt_r, xt_r))
        self._metrics[prefix + "plain"] = sqnr_db(ref, quantized(dyt, xt))
