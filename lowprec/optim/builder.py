"""AdamW from a recipe's ``OptimSpec``: one function, whatever the state precision.

- ``state=param, impl=torch``: ``torch.optim.AdamW``; m and v take the parameter dtype.
- ``state=int8, impl=bitsandbytes``: ``bnb.optim.AdamW8bit`` (block-wise dynamic quantization,
  256-element blocks, one fp32 absmax per block, 256-entry fp32 qmap; Dettmers et al. 2022).
- ``state=int8, impl=torchao``: ``torchao.optim.AdamW8bit`` (block 256, works on FSDP2 DTensors).

Both 8-bit libraries keep tensors with fewer than ``MIN_8BIT_NUMEL`` elements in 32-bit states
(bitsandbytes ``min_8bit_size=4096``; torchao's ``_new_buffer`` rule), which the effective-recipe check
accounts for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowprec.recipe import OptimSpec

MIN_8BIT_NUMEL = 4096


@dataclass(frozen=True)
class OptimHParams:
    """AdamW hyper-parameters (not precision): lr (peak), betas, eps, weight decay (2-D weights only)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1


def _param_groups(model: torch.nn.Module, wd: float) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, spec: OptimSpec, hp: OptimHParams) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters with the state precision of ``spec``.

    Raises ``ImportError`` with the package name if the chosen library is not installed.
    """
    groups = _param_groups(model, hp.weight_decay)
    kw = dict(lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps)
    if spec.impl == "torch":
        return torch.optim.AdamW(groups, **kw)
    if spec.impl == "bitsandbytes":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, min_8bit_size=MIN_8BIT_NUMEL, **kw)
    if spec.impl == "torchao":
        from torchao.optim import AdamW8bit

        return AdamW8bit(groups, **kw)
    raise ValueError(f"recipe.optim.impl={spec.impl!r} has no builder")


def moment_kind(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> str:
    """How ``p``'s first moment is stored: a dtype name (``float32``, ``bfloat16``) or ``int8_blockwise``.

    Returns ``none`` when the optimizer holds no state for ``p`` yet.
    """
    state = optimizer.state.get(p, {})
    m = state.get("exp_avg", state.get("state1"))
    if m is None:
        return "none"
    codes = getattr(m, "codes", None)  # torchao OptimState8bit
    if codes is not None or m.dtype == torch.uint8:
        return "int8_blockwise"
    return str(m.dtype).removeprefix("torch.")
