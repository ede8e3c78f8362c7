"""FP8 numerics telemetry, sampled every ``every`` optimizer steps on the training batch.

Per lowprec FP8 linear and operand role (``input``, ``weight``, ``grad_output``), from the first cast of
that role in the sampled step:

- ``amax``: max |x| of the high-precision operand;
- ``scale``: the scale used (the mean over groups for rowwise/tile/block scaling);
- ``overflow``: share of elements with |x * scale| > fmt.max (they saturate);
- ``underflow``: share of non-zero elements that quantize to zero.

Per GEMM (``output``, ``grad_input``): ``sqnr_db`` of the FP8 result against an FP32 shadow GEMM of the
same high-precision operands (the same operands Transformer Engine's precision debug tools compare).
Metric names: ``fp8/<layer fqn>/<role or gemm>/<stat>``. Outside sampled steps the modules carry no
telemetry object, so the cost is one attribute check per cast.
"""

from __future__ import annotations

import torch
from torch import nn

from lowprec.float8.linear import Float8Linear
from lowprec.numerics.formats import sqnr_db
from lowprec.numerics.scaling import QTensor, expand_scale


class FP8Telemetry:
    """Collects the statistics above for every ``Float8Linear`` of ``model``.

    ``before_step(step, built)`` arms sampling on steps divisible by ``every``;
    ``after_step(step, built)`` disarms it and returns the step's metrics (empty on other steps).
    """

    def __init__(self, model: nn.Module, every: int):
        if every < 1:
            raise ValueError(f"telemetry every={every} must be >= 1")
        self.every = every
        self.names = {m: fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
        self._metrics: dict[str, float] = {}

    def _arm(self, on: bool) -> None:
        for m in self.names:
            m.telemetry = self if on else None

    def before_step(self, step: int, built=None) -> None:
        self._metrics = {}
        self._arm(step % self.every == 0)

    def after_step(self, step: int, built=None) -> dict[str, float]:
        self._arm(False)
        out, self._metrics = self._metrics, {}
        return out

    @torch.no_grad()
    def observe_cast(self, mod: nn.Module, role: str, t: torch.Tensor, q: QTensor) -> None:
        prefix = f"fp8/{self.names[mod]}/{role}/"
        if prefix + "amax" in self._metrics:
            return  # the first cast of a role in the step is the one reported
        t32 = t.float()
        scale = expand_scale(q.scale, q.granularity, q.shape)
        nonzero = t32 != 0
        self._metrics.update(
            {
                prefix + "amax": float(t32.abs().max()),
                prefix + "scale": float(q.scale.float().mean()),
                prefix + "overflow": float(((t32 * scale).abs() > q.fmt.max).float().mean()),
                prefix + "underflow": float((nonzero & (q.data.float() == 0)).sum() / nonzero.sum().clamp(min=1)),
            }
        )

    @torch.no_grad()
    def observe_gemm(
        self, mod: nn.Module, gemm: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, transpose_b: bool = True
    ) -> None:
        """``gemm`` = ``output`` (out = a @ b.T) or ``grad_input`` (out = a @ b, ``transpose_b=False``)."""
        key = f"fp8/{self.names[mod]}/{gemm}/sqnr_db"
        if key in self._metrics:
            return
        b32 = b.float().t() if transpose_b else b.float()
        self._metrics[key] = sqnr_db(a.float() @ b32, out)
