"""Build step: turn (recipe, model shape, hyper-parameters) into the objects the loop runs.

Named builders in a fixed order (DESIGN.md): 1 model on meta, 2 converters, 3 parallelize
(single device here), 4 ``to_empty`` + ``init_weights``, 5 optimizer, 6 post-optimizer hooks,
7 effective recipe (inspected after the first step by ``lowprec.train.effective``).
The precision mechanism on one device is ``torch.autocast``; this is the only place that picks it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch

from lowprec.convert import convert_fp8
from lowprec.model import ModelArgs, Transformer
from lowprec.optim import OptimHParams, build_optimizer
from lowprec.recipe import DTYPES, Recipe
from lowprec.train.schedule import build_scheduler
from lowprec.train.spec import TrainSpec


@dataclass
class Built:
    """Everything a run needs; the loop reads only these objects, never the recipe's fields."""

    recipe: Recipe
    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Callable[[], ContextManager]
    device: torch.device
    fp8_fqns: list[str] = field(default_factory=list)
    master_params: list[torch.Tensor] = field(default_factory=list)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; raises ``ValueError`` for an unavailable cuda."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} requested but CUDA is not available")
    return dev


def build_model_meta(args: ModelArgs) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def materialize(model: Transformer, device: torch.device, seed: int) -> None:
    """Allocate on ``device`` and initialise with a generator seeded by ``seed`` (same seed, same weights)."""
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        model.init_weights(generator=gen)


def cast_weights(model: Transformer, recipe: Recipe) -> None:
    """Store parameters in ``recipe.weights.param_dtype`` (initialised in FP32 first, then rounded)."""
    if recipe.param_dtype != torch.float32:
        model.to(dtype=recipe.param_dtype)


def build_precision_context(recipe: Recipe, device: torch.device) -> Callable[[], ContextManager]:
    """A factory of the forward-pass context: ``torch.autocast`` in the recipe's dtype, or a no-op."""
    if recipe.compute.autocast_dtype == "none":
        return contextlib.nullcontext
    dtype = DTYPES[recipe.compute.autocast_dtype]
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def build(
    recipe: Recipe, args: ModelArgs, train: TrainSpec, hp: OptimHParams, seed: int, device: torch.device
) -> Built:
    """Run the build steps in order. Raises ``ValueError``/``ImportError`` before training if the
    recipe cannot run as asked (no silent fallback)."""
    model = build_model_meta(args)  # 1
    fp8_fqns = convert_fp8(model, recipe.fp8)  # 2
    # 3: parallelize (TP, activation checkpointing, compile, FSDP2) joins here with lowprec.parallel.
    materialize(model, device, seed)  # 4
    cast_weights(model, recipe)
    optimizer = build_optimizer(model, recipe.optim, hp)  # 5
    scheduler = build_scheduler(optimizer, train.warmup_steps, train.steps, train.min_lr_ratio)
    # 6: no post-optimizer hooks are needed by the recipes of this catalog (dynamic scaling only).
    return Built(
        recipe=recipe,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        precision=build_precision_context(recipe, device),
        device=device,
        fp8_fqns=fp8_fqns,
    )
