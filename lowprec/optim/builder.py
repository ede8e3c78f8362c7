"""AdamW from a recipe's ``OptimSpec`` and ``WeightSpec``: one function, whatever the state precision.

- ``state=param, impl=torch``: ``torch.optim.AdamW``; m and v take the parameter dtype.
- ``state=int8, impl=bitsandbytes``: ``bnb.optim.AdamW8bit`` (block-wise dynamic quantization,
  256-element blocks, one fp32 absmax per block, 256-entry fp32 qmap; Dettmers et al. 2022).
- ``state=int8|int4, impl=torchao``: ``torchao.optim.AdamW8bit`` (block 256, works on FSDP2 DTensors) /
  ``AdamW4bit`` (block 128); ``update_rounding=stochastic`` maps to their ``bf16_stochastic_round``.
- ``impl=lowprec``: ``lowprec.optim.LowBitAdamW`` with FP32, BF16 or MS-AMP O2 (FP8/FP16) moments and
  nearest, stochastic or Kahan update rounding.
- ``weights.master_dtype=fp32``: ``lowprec.optim.master.MasterWeightOptimizer`` around any of the above.

Both 8-bit libraries keep tensors with fewer than ``MIN_8BIT_NUMEL`` elements in 32-bit states
(bitsandbytes ``min_8bit_size=4096``; torchao's ``_new_buffer`` rule), which the effective-recipe check
accounts for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowprec.errors import ConfigError
from lowprec.recipe import Recipe

MIN_8BIT_NUMEL = 4096
#: Quantization block of each library's low-bit state (elements).
STATE_BLOCK = {("bitsandbytes", "int8"): 256, ("torchao", "int8"): 256, ("torchao", "int4"): 128}


def is_quantized_state(impl: str, state: str, numel: int) -> bool:
    """Whether ``impl`` keeps a tensor of ``numel`` elements in its low-bit (``state``) form.

    bitsandbytes: ``numel >= min_8bit_size``; torchao (``_new_buffer``): also ``numel % block == 0``.
    Other tensors keep states in the dtype of the stepped tensor."""
    block = STATE_BLOCK.get((impl, state))
    if block is None or numel < MIN_8BIT_NUMEL:
        return False
    return impl == "bitsandbytes" or numel % block == 0


@dataclass(frozen=True)
class OptimHParams:
    """AdamW hyper-parameters (not precision): lr (peak), betas, eps, weight decay (2-D weights only).

    Raises ``ConfigError`` naming the field for lr <= 0, betas outside [0, 1), eps <= 0 or weight_decay < 0.
    """

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1

    def __post_init__(self) -> None:
        checks = {"lr": (self.lr > 0, "> 0"), "beta1": (0 <= self.beta1 < 1, "in [0, 1)"),
                  "beta2": (0 <= self.beta2 < 1, "in [0, 1)"), "eps": (self.eps > 0, "> 0"),
                  "weight_decay": (self.weight_decay >= 0, ">= 0")}
        for name, (ok, rule) in checks.items():
            if not ok or not math.isfinite(getattr(self, name)):
                raise ConfigError(f"optim.{name}={getattr(self, name)} must be finite and {rule}")


def _param_groups(model: torch.nn.Module, wd: float) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def _has_dtensor(groups: list[dict]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for g in groups for p in g["params"])


def _adamw(groups: list[dict], recipe: Recipe, hp: OptimHParams, stepped_dtype: str) -> torch.optim.Optimizer:
    spec, kw = recipe.optim, dict(lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps)
    if spec.impl == "torch":
        return torch.optim.AdamW(groups, **kw)
    if spec.impl == "lowprec":
        from lowprec.optim.lowbit_adamw import LowBitAdamW

        state = stepped_dtype if spec.state == "param" else spec.state
        make = lambda g: LowBitAdamW(g, **kw, state_dtype=state, update_rounding=recipe.weights.update_rounding)  # noqa: E731
        if _has_dtensor(groups):  # FSDP2/TP: its FP8/FP16 moment scales are then per local shard
            from lowprec.optim.local_shards import LocalShardOptimizer

            return LocalShardOptimizer(groups, make)
        return make(groups)
    if spec.impl == "bitsandbytes":
        import bitsandbytes as bnb

        if _has_dtensor(groups):  # FSDP2/TP: bitsandbytes steps the local shards
            from lowprec.optim.local_shards import LocalShardOptimizer

            return LocalShardOptimizer(groups, lambda g: bnb.optim.AdamW8bit(g, min_8bit_size=MIN_8BIT_NUMEL, **kw))
        return bnb.optim.AdamW8bit(groups, min_8bit_size=MIN_8BIT_NUMEL, **kw)
    if spec.impl == "torchao":
        from torchao.optim import AdamW4bit, AdamW8bit, _AdamW

        cls = {"int8": AdamW8bit, "int4": AdamW4bit, "param": _AdamW}[spec.state]
        return cls(groups, **kw, bf16_stochastic_round=recipe.weights.update_rounding == "stochastic")
    raise ValueError(f"recipe.optim.impl={spec.impl!r} has no builder")


def build_optimizer(model: torch.nn.Module, recipe: Recipe, hp: OptimHParams) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters with the recipe's state precision and master policy.

    With ``weights.master_dtype=fp32`` the returned optimizer is a ``MasterWeightOptimizer`` whose inner
    AdamW steps FP32 master copies (``master_params``). Raises ``ImportError`` naming a missing library.
    """
    groups = _param_groups(model, hp.weight_decay)
    if recipe.weights.master_dtype == "fp32":
        from lowprec.optim.master import MasterWeightOptimizer

        return MasterWeightOptimizer(groups, lambda g: _adamw(g, recipe, hp, "fp32"))
    return _adamw(groups, recipe, hp, recipe.weights.param_dtype)


def moment_kind(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> str:
    """How ``p``'s first moment is stored: a dtype name (``float32``, ``bfloat16``) or ``int8_blockwise``.

    Returns ``none`` when the optimizer holds no state for ``p`` yet.
    """
    state = optimizer.state.get(p, {})
    m = state.get("exp_avg", state.get("state1"))
    if m is None:
        return "none"
    from torch.distributed.tensor import DTensor

    if isinstance(m, DTensor):  # torchao keeps quantized states inside DTensors under FSDP2
        m = m._local_tensor
    if type(m).__name__ == "OptimState4bit":
        return "int4_blockwise"
    codes = getattr(m, "codes", None)  # torchao OptimState8bit
    if codes is not None or m.dtype == torch.uint8:
        return "int8_blockwise"
    return str(m.dtype).removeprefix("torch.")
