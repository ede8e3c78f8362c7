"""AdamW from a recipe's ``OptimSpec`` and ``WeightSpec``: one function, whatever the state precision.

The implementation named by ``optim.impl`` builds the optimizer (``lowprec.backends.optimizers``: torch,
lowprec's ``LowBitAdamW``, bitsandbytes, torchao); ``weights.master_dtype=fp32`` wraps it in
``lowprec.optim.master.MasterWeightOptimizer``. ``moment_kind`` reads back how each moment is stored.

Build layer (beside ``lowprec.convert`` and ``lowprec.build_parallel``): it reads the recipe and asks the backend
registry, so it lives above both, not in ``lowprec.optim``, whose components know nothing of recipes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from lowprec.backends import optim_impl
from lowprec.errors import ConfigError
from lowprec.optim.master import MasterWeightOptimizer
from lowprec.recipe import Recipe


@dataclass(frozen=True)
class OptimHParams:
    """AdamW hyper-parameters (not precision): lr (peak), betas, eps, weight decay (2-D weights only).

    Raises ``ConfigError`` naming the field for lr <= 0, betas outside [0, 1), eps <= 0 or weight_decay < 0.
    """

    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1

    def __post_init__(self) -> None:
        checks = {
            "lr": (self.lr > 0, "> 0"),
            "beta1": (0 <= self.beta1 < 1, "in [0, 1)"),
            "beta2": (0 <= self.beta2 < 1, "in [0, 1)"),
            "eps": (self.eps > 0, "> 0"),
            "weight_decay": (self.weight_decay >= 0, ">= 0"),
        }
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
    return any(isinstance(p, DTensor) for g in groups for p in g["params"])


def _adamw(groups: list[dict], recipe: Recipe, hp: OptimHParams, stepped_dtype: str) -> torch.optim.Optimizer:
    return optim_impl(recipe.optim.impl).build(
        groups,
        state=recipe.optim.state,
        stepped_dtype=stepped_dtype,
        update_rounding=recipe.weights.update_rounding,
        hparams=dict(lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps),
        sharded=_has_dtensor(groups),
    )


def build_optimizer(model: torch.nn.Module, recipe: Recipe, hp: OptimHParams) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters with the recipe's state precision and master policy.

    With ``weights.master_dtype=fp32`` the returned optimizer is a ``MasterWeightOptimizer`` whose inner
    AdamW steps FP32 master copies (``master_params``). Raises ``ImportError`` naming a missing library.
    """
    groups = _param_groups(model, hp.weight_decay)
    if recipe.weights.master_dtype == "fp32":
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
    if isinstance(m, DTensor):  # torchao keeps quantized states inside DTensors under FSDP2
        m = m._local_tensor
    if type(m).__name__ == "OptimState4bit":
        return "int4_blockwise"
    codes = getattr(m, "codes", None)  # torchao OptimState8bit
    if codes is not None or m.dtype == torch.uint8:
        return "int8_blockwise"
    return str(m.dtype).removeprefix("torch.")
