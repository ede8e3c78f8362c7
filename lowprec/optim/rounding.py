"""How a low-precision parameter takes an FP32 update: round to nearest, stochastic rounding, or Kahan.

A BF16 weight of magnitude ~1 has a spacing of 2**-7 = 7.8e-3 just above 1 (2**-8 below). An AdamW update
of ``lr ~ 1e-4`` is far below half that spacing, so round-to-nearest writes the old weight back and the
update is lost ("stagnation"). Two remedies that keep no FP32 master copy (Zamirai, Zhang, Aberger,
De Sa, "Revisiting BFloat16 Training", arXiv 2010.06192, 2020):

- stochastic rounding: round up with probability equal to the distance to the lower neighbour, so the
  stored weight is unbiased, ``E[sr(x)] = x`` (torchao ``_fp32_to_bf16_sr`` does the same bit trick);
- Kahan-compensated summation: a per-parameter compensation buffer (same dtype as the parameter)
  keeps the part of each update that rounding dropped and adds it back on the next step.

All functions work on plain tensors of any shape and device.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Values of ``update_rounding`` (``lowprec.optim.lowbit_adamw.LowBitAdamW``, recipe ``weights.update_rounding``).
UPDATE_ROUNDINGS = ("nearest", "stochastic", "kahan")


def stochastic_round_bf16(x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Round ``x`` (any float dtype, read as float32) to bfloat16 stochastically; returns a new bf16 tensor.

    An FP32 bit pattern ``[a31..a16 | a15..a0]`` becomes ``[a31..a16]`` (toward zero) or that plus one ulp
    (away from zero) with probability ``[a15..a0] / 2**16``, so ``E[result] = x`` exactly for finite ``x``
    inside the bf16 range. ``inf`` stays ``inf``; NaN stays NaN; values within one bf16 ulp of the largest
    finite value may round to ``inf``. ``generator`` (on ``x``'s device) makes the draw reproducible.
    """
    x32 = x.detach().to(torch.float32).contiguous()
    bits = x32.view(torch.int32)
    rand = torch.randint(0, 1 << 16, x32.shape, dtype=torch.int32, device=x32.device, generator=generator)
    toward_zero = bits & -65536  # -65536 == 0xFFFF0000 as int32: keep sign, exponent, top 7 mantissa bits
    rounded = torch.where(rand < (bits & 0xFFFF), toward_zero + 0x10000, toward_zero)
    return rounded.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


@torch.no_grad()
def kahan_update_(param: Tensor, comp: Tensor, new_value: Tensor) -> None:
    """Move the low-precision ``param`` to ``new_value`` (float32) with Kahan-compensated summation, in place.

    ``delta = new_value - param`` is the FP32 update. With ``y = delta + comp``: ``param <- round(param + y)``
    and ``comp <- y - (param_new - param_old)`` (what rounding dropped), computed in FP32 and stored in
    ``comp``'s dtype (bf16 in Zamirai et al. 2020, 2 bytes per parameter). ``param``, ``comp``,
    ``new_value``: same shape. Over many steps ``param + comp`` tracks the FP32 trajectory.
    """
    old = param.float()
    y = new_value.float() - old
    y.add_(comp.float())
    new = (old + y).to(param.dtype)
    comp.copy_(y.sub_(new.float() - old))
    param.copy_(new)


def write_update_(
    param: Tensor,
    new_value: Tensor,
    rounding: str,
    comp: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> None:
    """Store the FP32 ``new_value`` into ``param`` with ``rounding`` (one of ``UPDATE_ROUNDINGS``), in place.

    FP32 parameters (``new_value is param``) need nothing. ``stochastic`` needs a bf16 ``param``; ``kahan``
    needs ``comp`` (the compensation buffer, same shape as ``param``). Raises ``ValueError`` otherwise.
    """
    if new_value is param:
        return
    if rounding == "nearest" or param.dtype == torch.float32:
        param.copy_(new_value)  # round to nearest even
    elif rounding == "stochastic":
        if param.dtype != torch.bfloat16:
            raise ValueError(f"stochastic rounding is implemented for bfloat16 parameters, not {param.dtype}")
        param.copy_(stochastic_round_bf16(new_value, generator))
    elif rounding == "kahan":
        if comp is None:
            raise ValueError("kahan rounding needs a compensation buffer")
        kahan_update_(param, comp, new_value)
    else:
        raise ValueError(f"update_rounding={rounding!r} is not one of {list(UPDATE_ROUNDINGS)}")
