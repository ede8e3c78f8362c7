"""AdamW whose moments are stored in a configurable low-precision format; the math runs in FP32.

Same algorithm and operation order as ``torch.optim.AdamW`` (single-tensor path: decoupled weight decay
``p *= 1 - lr*wd``, ``m.lerp_(g, 1-beta1)``, ``v = beta2*v + (1-beta2)*g*g``, bias corrections from the
step count, ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``), so with FP32 states and FP32 parameters it
reproduces ``torch.optim.AdamW(foreach=False)`` bit for bit. Every step loads each stored moment, widens it
to FP32, updates, and stores it back rounded:

- ``state_dtype="fp32"``: FP32 m and v (8 B/param).
- ``state_dtype="bf16"``: BF16 m and v, round to nearest (4 B/param); DeepSeek-V3 (arXiv 2412.19437,
  section 3.3) keeps its AdamW moments in BF16.
- ``state_dtype="fp8_fp16"``: MS-AMP optimization level O2 (FP8-LM, Peng et al., arXiv 2310.18313): first
  moment FP8 e4m3, second moment FP16, each with one FP32 per-tensor scaling factor recomputed from the
  new moment's amax every step (``scale = fmt_max / amax``, ``stored = saturate(x * scale)``,
  ``x ~ stored / scale``; 448 for e4m3, 65504 for fp16). MS-AMP's ``LBAdamW`` scales both moments per
  tensor (``tensor_scale=True``) and rounds its scales to powers of two (``power_of_2_scales=True`` here).
  Without a scale, FP16 would flush ``v`` below 6e-8 (gradients below ~2.4e-4) to zero and turn the
  update into ``m / eps``. 3 B/param + 8 B per tensor.

State per parameter tensor, all plain tensors in ``optimizer.state[p]`` (``lowprec.measure.accounting`` counts
them): ``step`` (FP32 scalar on the CPU, as torch keeps it), ``exp_avg``, ``exp_avg_sq``, for
``fp8_fp16`` ``exp_avg_scale`` and ``exp_avg_sq_scale`` (FP32 scalars, the multiplying direction), and
with ``update_rounding="kahan"`` on a low-precision parameter ``kahan_comp`` (parameter dtype).

Low-precision (BF16) parameters without a master copy are updated in FP32 and written back once, by
``update_rounding`` (``lowprec.optim.rounding``): ``nearest``, ``stochastic`` (bf16 only) or ``kahan``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from lowprec.numerics.formats import E4M3, Format, amax_to_scale, quantize
from lowprec.optim.rounding import UPDATE_ROUNDINGS, write_update_

#: FP16 as a scaled storage format (max 65504, eps 2**-10, smallest normal 2**-14, smallest subnormal 2**-24).
FP16 = Format("fp16", torch.float16, 65504.0, 2.0**-10, 2.0**-14, 2.0**-24)

#: state_dtype -> (exp_avg format, exp_avg_sq format); a ``torch.dtype`` is stored unscaled, a ``Format`` with a scale.
STATE_FORMATS: dict[str, tuple[torch.dtype | Format, torch.dtype | Format]] = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp8_fp16": (E4M3, FP16),
}
STATE_DTYPES = tuple(STATE_FORMATS)


def _scalar(x) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


class LowBitAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with moments stored as ``state_dtype``.

    Args: ``params`` (tensors or param-group dicts), ``lr``, ``betas``, ``eps``, ``weight_decay`` as in
    ``torch.optim.AdamW`` (``lr`` may be a float or an FP32 scalar tensor). ``state_dtype``: one of
    ``STATE_DTYPES`` (module doc). ``update_rounding``: one of ``nearest | stochastic | kahan``; only matters
    for non-FP32 parameters. ``min_lowbit_numel``: tensors with fewer elements keep FP32 moments (the
    bitsandbytes / torchao rule uses 4096; default 0 = every tensor). ``power_of_2_scales``: round the
    ``fp8_fp16`` scales down to powers of two (exact dequantization, as MS-AMP). ``generator``: random
    source of stochastic rounding (on the parameters' device).

    Raises ``ValueError`` for an unknown ``state_dtype``/``update_rounding``, bad hyper-parameters, or
    stochastic rounding on a non-bf16 low-precision parameter; ``RuntimeError`` for sparse gradients.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_dtype: str = "fp32",
        update_rounding: str = "nearest",
        min_lowbit_numel: int = 0,
        power_of_2_scales: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        if state_dtype not in STATE_FORMATS:
            raise ValueError(f"state_dtype={state_dtype!r} is not one of {list(STATE_DTYPES)}")
        if update_rounding not in UPDATE_ROUNDINGS:
            raise ValueError(f"update_rounding={update_rounding!r} is not one of {list(UPDATE_ROUNDINGS)}")
        if _scalar(lr) < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(
                f"invalid AdamW hyper-parameters lr={lr} betas={betas} eps={eps} weight_decay={weight_decay}"
            )
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.state_dtype = state_dtype
        self.update_rounding = update_rounding
        self.min_lowbit_numel = min_lowbit_numel
        self.power_of_2_scales = power_of_2_scales
        self.generator = generator
        if update_rounding == "stochastic":
            bad = {
                p.dtype
                for g in self.param_groups
                for p in g["params"]
                if p.dtype not in (torch.float32, torch.bfloat16)
            }
            if bad:
                raise ValueError(
                    f"update_rounding='stochastic' is implemented for bfloat16 parameters; got {sorted(map(str, bad))}"
                )

    # ---- state layout ----------------------------------------------------------------------------
    def formats_for(self, p: Tensor) -> tuple[torch.dtype | Format, torch.dtype | Format]:
        """The (exp_avg, exp_avg_sq) storage of ``p``: a dtype (unscaled) or a ``Format`` (with a scale)."""
        if p.numel() < self.min_lowbit_numel:
            return STATE_FORMATS["fp32"]
        return STATE_FORMATS[self.state_dtype]

    def _init_state(self, p: Tensor, state: dict) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key, fmt in zip(("exp_avg", "exp_avg_sq"), self.formats_for(p)):
            if isinstance(fmt, Format):
                state[key] = torch.zeros_like(p, dtype=fmt.dtype, memory_format=torch.preserve_format)
                state[key + "_scale"] = torch.ones((), dtype=torch.float32, device=p.device)
            else:
                state[key] = torch.zeros_like(p, dtype=fmt, memory_format=torch.preserve_format)
        if self.update_rounding == "kahan" and p.dtype != torch.float32:
            state["kahan_comp"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @staticmethod
    def load_moment(state: dict, key: str) -> Tensor:
        """FP32 value of the stored moment ``key`` (``exp_avg`` / ``exp_avg_sq``); the stored tensor itself
        when it is already FP32 and unscaled (then updates write through), else a new tensor."""
        t = state[key]
        scale = state.get(key + "_scale")
        if scale is None:
            return t if t.dtype == torch.float32 else t.float()
        return t.float().div_(scale)

    def _store_moment(self, state: dict, key: str, x32: Tensor, fmt) -> None:
        t = state[key]
        if t is x32:
            return
        if not isinstance(fmt, Format):
            t.copy_(x32)  # round to nearest even
            return
        scale = amax_to_scale(x32.abs().amax(), fmt, power_of_2=self.power_of_2_scales)
        t.copy_(quantize(x32, scale, fmt))
        state[key + "_scale"].copy_(scale)

    # ---- the update ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step for every parameter with a gradient; returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = _scalar(group["lr"])
            beta1, beta2 = (_scalar(b) for b in group["betas"])
            wd, eps = group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LowBitAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                step = _scalar(state["step"])
                grad = p.grad if p.grad.dtype == torch.float32 else p.grad.float()
                fm, fv = self.formats_for(p)
                m = self.load_moment(state, "exp_avg")
                v = self.load_moment(state, "exp_avg_sq")
                p32 = p if p.dtype == torch.float32 else p.float()
                if wd != 0:
                    p32.mul_(1 - lr * wd)
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                step_size = lr / bias_correction1
                denom = (v.sqrt() / bias_correction2**0.5).add_(eps)
                p32.addcdiv_(m, denom, value=-step_size)
                self._store_moment(state, "exp_avg", m, fm)
                self._store_moment(state, "exp_avg_sq", v, fv)
                write_update_(p, p32, self.update_rounding, state.get("kahan_comp"), self.generator)
        return loss

    # ---- checkpoints -----------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict``, then restore every state tensor's saved dtype.

        torch casts floating-point state to the parameter's dtype on load (which would turn BF16/FP8
        moments into the parameter dtype, or round FP32 moments of a BF16 parameter); here each state tensor
        is copied back exactly as saved (dtype kept, moved to the parameter's device).
        """
        saved_state = state_dict["state"]
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            for key, value in saved_state.get(pid, {}).items():
                if isinstance(value, Tensor):
                    device = value.device if key == "step" else p.device
                    self.state[p][key] = value.detach().to(device=device, copy=True)
