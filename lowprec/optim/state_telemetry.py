"""How far a low-precision optimizer's moments drift from FP32 moments fed the same gradients.

For a few sampled parameter tensors, ``OptimStateTelemetry`` keeps an FP32 "shadow" AdamW first and
second moment updated every step from the gradients the optimizer saw, and every ``every`` steps reports
``optim/<name>/m_rel_err = ||m_q - m_fp32|| / ||m_fp32||`` (and ``v_rel_err``), where ``m_q`` is the
optimizer's actual moment, dequantized. Cost: two FP32 buffers per sampled tensor and a few elementwise
ops per step.

Understood state layouts (``dequantized_moments``):
- ``torch.optim.AdamW`` and ``lowprec.optim.lowbit_adamw.LowBitAdamW``: ``exp_avg`` / ``exp_avg_sq`` plain
  tensors (fp32 / bf16 / fp16, fp8 with an ``<key>_scale`` FP32 scalar that multiplies: ``x = q / scale``);
- bitsandbytes ``AdamW8bit``: ``state1`` / ``state2`` uint8 codes, ``absmax1`` / ``absmax2`` per 256-element
  block, ``qmap1`` / ``qmap2`` code books, dequantized with ``bitsandbytes.functional.dequantize_blockwise``
  (tensors below ``min_8bit_size`` keep FP32 ``state1`` / ``state2``);
- torchao ``AdamW8bit`` / ``AdamW4bit`` / ``AdamWFp8``: ``exp_avg`` / ``exp_avg_sq`` tensor subclasses
  (``OptimState8bit`` etc.) with ``.dequantize()``;
- ``lowprec.optim.master.MasterWeightOptimizer``: its ``state`` is keyed by model parameters already.

The shadow follows the optimizer's step counter (``state["step"]``): a step the optimizer skipped (loss
scaler overflow) is skipped by the shadow too. Parameters whose gradients are clipped by the loop are seen
after clipping, as the optimizer sees them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor


def _local(t: Tensor) -> Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor: compare the local shards
    return to_local() if to_local is not None else t


def _bnb_dequantize(codes: Tensor, absmax: Tensor, qmap: Tensor) -> Tensor:
    import bitsandbytes.functional as bnbF  # lazy: only bitsandbytes states need it, and it costs ~1 s of import

    n, blocks = codes.numel(), absmax.numel()
    blocksize = next(b for b in (64, 128, 256, 512, 1024, 2048, 4096) if -(-n // b) == blocks)
    return bnbF.dequantize_blockwise(codes, absmax=absmax, code=qmap, blocksize=blocksize).float().reshape(codes.shape)


def _dequant(state: dict, key: str, shape: torch.Size) -> Tensor:
    t = _local(state[key])
    if type(t) is not Tensor and hasattr(type(t), "__tensor_flatten__"):  # torchao OptimState8bit / 4bit / Fp8
        return t.dequantize().float().reshape(shape)
    scale = state.get(key + "_scale")
    x = t.float()
    return (x / _local(scale)).reshape(shape) if scale is not None else x.reshape(shape)


def dequantized_moments(optimizer: torch.optim.Optimizer, p: Tensor) -> tuple[Tensor, Tensor] | None:
    """FP32 (m, v) of ``p`` as the optimizer holds them (shape of ``p``'s local tensor), or None without state.

    Raises ``KeyError`` for a state layout this module does not know (the message lists the keys).
    """
    state = optimizer.state.get(p)
    if not state:
        return None
    shape = _local(p).shape
    if "exp_avg" in state:
        return _dequant(state, "exp_avg", shape), _dequant(state, "exp_avg_sq", shape)
    if "state1" in state:  # bitsandbytes
        s1, s2 = state["state1"], state["state2"]
        if s1.dtype == torch.uint8:
            return (
                _bnb_dequantize(s1, state["absmax1"], state["qmap1"]).reshape(shape),
                _bnb_dequantize(s2, state["absmax2"], state["qmap2"]).reshape(shape),
            )
        return s1.float().reshape(shape), s2.float().reshape(shape)
    raise KeyError(f"unknown optimizer state layout with keys {sorted(state)}")


def _step_count(state: dict) -> float:
    s = state.get("step", 0)
    return float(s.item()) if isinstance(s, Tensor) else float(s)


def _betas(optimizer: torch.optim.Optimizer, p: Tensor) -> tuple[float, float]:
    for g in optimizer.param_groups:
        if any(q is p for q in g["params"]):
            b1, b2 = g["betas"]
            return float(b1), float(b2)
    raise KeyError("parameter is not in the optimizer's param_groups")


def _rel_err(q: Tensor, ref: Tensor) -> float:
    den = float(ref.double().norm())
    if den == 0.0:
        return 0.0 if float(q.double().norm()) == 0.0 else math.inf
    return float((q.double() - ref.double()).norm()) / den


class OptimStateTelemetry:
    """FP32 shadow AdamW moments for sampled parameters and their relative error against the optimizer's.

    ``optimizer``: the run's optimizer (any layout in the module doc). ``params_sample``: a mapping
    name -> parameter (e.g. FQNs from ``model.named_parameters()``) or an iterable of parameters (named
    ``p0``, ``p1``, ...). ``every``: report every ``every`` steps (>= 1). Metrics (dimensionless):
    ``optim/<name>/m_rel_err``, ``optim/<name>/v_rel_err``.

    Use ``after_step(step, built)`` as a ``Built.after_step`` hook (it runs after the optimizer step,
    before the next ``zero_grad``, so ``p.grad`` is the gradient the step used). If the optimizer already
    holds state when the first update is seen (a resumed run), the shadow starts from the optimizer's own
    dequantized moments, so the error measures drift since then.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, params_sample: Mapping[str, Tensor] | Iterable[Tensor], every: int
    ) -> None:
        if every < 1:
            raise ValueError(f"every={every} must be >= 1")
        items = (
            params_sample.items()
            if isinstance(params_sample, Mapping)
            else ((f"p{i}", p) for i, p in enumerate(params_sample))
        )
        self.optimizer = optimizer
        self.every = every
        self.params: dict[str, Tensor] = dict(items)
        self._shadow: dict[str, tuple[Tensor, Tensor]] = {}
        self._seen_step: dict[str, float] = {}

    @torch.no_grad()
    def update(self) -> None:
        """Advance each shadow by one AdamW moment update if the optimizer advanced that parameter's step."""
        for name, p in self.params.items():
            state = self.optimizer.state.get(p)
            if not state or p.grad is None:
                continue
            step = _step_count(state)
            seen = self._seen_step.get(name, 0.0)
            if step == seen:
                continue  # the optimizer skipped this step
            if name not in self._shadow:
                if step == 1:
                    z = torch.zeros_like(_local(p), dtype=torch.float32)
                    self._shadow[name] = (z, z.clone())
                else:  # resumed: start from the optimizer's current (post-step) moments
                    m, v = dequantized_moments(self.optimizer, p)
                    self._shadow[name] = (m.clone(), v.clone())
                    self._seen_step[name] = step
                    continue
            b1, b2 = _betas(self.optimizer, p)
            g = _local(p.grad).float()
            m, v = self._shadow[name]
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            self._seen_step[name] = step

    @torch.no_grad()
    def metrics(self) -> dict[str, float]:
        """``optim/<name>/m_rel_err`` and ``v_rel_err`` for every sampled parameter with a shadow."""
        out: dict[str, float] = {}
        for name, p in self.params.items():
            if name not in self._shadow:
                continue
            mv = dequantized_moments(self.optimizer, p)
            if mv is None:
                continue
            (mq, vq), (m, v) = mv, self._shadow[name]
            out[f"optim/{name}/m_rel_err"] = _rel_err(mq, m)
            out[f"optim/{name}/v_rel_err"] = _rel_err(vq, v)
        return out

    def after_step(self, step: int, built=None) -> dict[str, float]:
        """Update the shadows; every ``every`` steps (``step % every == 0``) return ``metrics()``, else ``{}``."""
        self.update()
        return self.metrics() if step % self.every == 0 else {}


def default_sample(model: torch.nn.Module, k: int = 3, min_numel: int = 4096) -> dict[str, Tensor]:
    """Up to ``k`` evenly spaced 2-D trainable parameters with at least ``min_numel`` elements (large enough
    for the 8-bit optimizers to quantize them), keyed by FQN."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2 and p.numel() >= min_numel]
    if not named or k <= 0:
        return {}
    idx = sorted({round(i * (len(named) - 1) / max(k - 1, 1)) for i in range(min(k, len(named)))})
    return {named[i][0]: named[i][1] for i in idx}
