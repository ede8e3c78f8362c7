"""The precision recipe: every precision decision of a training run as one frozen, validated value.

A ``Recipe`` is data. ``lowprec.train.build`` turns it into mechanism (module swaps, an autocast
context, an optimizer) and records what actually ran; nothing else reads it.

Field groups (each a frozen dataclass, overridable from Hydra as ``recipe.<group>.<field>=value``):

- ``weights``: ``param_dtype`` is the storage dtype of the trainable parameters. With FP32 parameters
  under autocast the parameters *are* the FP32 master weights (Accelerate / torch AMP semantics).
- ``compute``: ``autocast_dtype`` (``none`` = compute in the parameter dtype).
- ``fp8``: which linears run their GEMMs in FP8 and how they are scaled.
- ``optim``: the optimizer implementation and the dtype its states are kept in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch


class RecipeError(ValueError):
    """An invalid or unsupported recipe; the message names the conflicting fields."""


DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check_choice(group: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise RecipeError(f"recipe.{group}.{name}={value!r} is not one of {list(choices)}")


@dataclass(frozen=True)
class WeightSpec:
    """Parameter storage. ``param_dtype``: ``fp32`` or ``bf16``."""

    param_dtype: str = "fp32"

    def __post_init__(self) -> None:
        _check_choice("weights", "param_dtype", self.param_dtype, ("fp32", "bf16"))


@dataclass(frozen=True)
class ComputeSpec:
    """Compute dtype of the non-FP8 ops. ``autocast_dtype``: ``none`` or ``bf16``."""

    autocast_dtype: str = "none"

    def __post_init__(self) -> None:
        _check_choice("compute", "autocast_dtype", self.autocast_dtype, ("none", "bf16"))


@dataclass(frozen=True)
class Float8Spec:
    """FP8 GEMMs.

    ``backend``: ``none`` (no FP8) or ``torchao`` (``torchao.float8.Float8Linear``).
    ``scaling``: torchao recipe name: ``tensorwise`` (dynamic, one scale per tensor), ``rowwise``,
    ``rowwise_with_gw_hp`` (grad_weight GEMM in high precision).
    ``keep_hp_fqns``: FQN patterns of linears kept in high precision; a pattern matches a module
    whose FQN equals it or ends with ``.<pattern>`` (``output`` matches only the head).
    """

    backend: str = "none"
    scaling: str = "tensorwise"
    keep_hp_fqns: tuple[str, ...] = ("tok_embeddings", "output")

    def __post_init__(self) -> None:
        _check_choice("fp8", "backend", self.backend, ("none", "torchao"))
        _check_choice("fp8", "scaling", self.scaling, ("tensorwise", "rowwise", "rowwise_with_gw_hp"))
        # Hydra hands lists; freeze them so the recipe stays hashable.
        object.__setattr__(self, "keep_hp_fqns", tuple(self.keep_hp_fqns))

    @property
    def enabled(self) -> bool:
        return self.backend != "none"

    def keeps_high_precision(self, fqn: str) -> bool:
        """True if the linear at ``fqn`` stays out of FP8."""
        return any(fqn == p or fqn.endswith("." + p) for p in self.keep_hp_fqns)


@dataclass(frozen=True)
class OptimSpec:
    """AdamW state precision.

    ``state``: ``param`` (moments in the parameter dtype, ``torch.optim.AdamW``) or ``int8``
    (block-wise dynamic 8-bit m and v, Dettmers et al. 2022).
    ``impl``: ``torch``, ``bitsandbytes`` (``bnb.optim.AdamW8bit``) or ``torchao`` (``torchao.optim.AdamW8bit``).
    """

    state: str = "param"
    impl: str = "torch"

    def __post_init__(self) -> None:
        _check_choice("optim", "state", self.state, ("param", "int8"))
        _check_choice("optim", "impl", self.impl, ("torch", "bitsandbytes", "torchao"))
        if self.state == "int8" and self.impl == "torch":
            raise RecipeError(
                "recipe.optim.state='int8' conflicts with recipe.optim.impl='torch': "
                "torch.optim.AdamW has no 8-bit states; use impl=bitsandbytes or impl=torchao"
            )
        if self.state == "param" and self.impl != "torch":
            raise RecipeError(
                f"recipe.optim.impl={self.impl!r} conflicts with recipe.optim.state='param': "
                f"{self.impl} is used here only for 8-bit states; use state=int8 or impl=torch"
            )


@dataclass(frozen=True)
class Recipe:
    """A complete, validated precision recipe. Raises ``RecipeError`` on an invalid combination."""

    name: str
    description: str = ""
    weights: WeightSpec = field(default_factory=WeightSpec)
    compute: ComputeSpec = field(default_factory=ComputeSpec)
    fp8: Float8Spec = field(default_factory=Float8Spec)
    optim: OptimSpec = field(default_factory=OptimSpec)

    def __post_init__(self) -> None:
        if not self.name:
            raise RecipeError("recipe.name must be a non-empty string")

    # ---- derived facts (what the build must produce) -------------------------------------------
    @property
    def param_dtype(self) -> torch.dtype:
        return DTYPES[self.weights.param_dtype]

    @property
    def compute_dtype(self) -> torch.dtype:
        c = self.compute.autocast_dtype
        return self.param_dtype if c == "none" else DTYPES[c]

    def short_str(self) -> str:
        """One-line summary, e.g. ``w=fp32 ac=bf16 fp8=torchao:tensorwise opt=int8:bitsandbytes``."""
        fp8 = f"{self.fp8.backend}:{self.fp8.scaling}" if self.fp8.enabled else "off"
        opt = "param" if self.optim.state == "param" else f"{self.optim.state}:{self.optim.impl}"
        return f"w={self.weights.param_dtype} ac={self.compute.autocast_dtype} fp8={fp8} opt={opt}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["fp8"]["keep_hp_fqns"] = list(self.fp8.keep_hp_fqns)
        return d

    def hash(self) -> str:
        """Stable 12-hex-digit hash of every field that changes numerics (name and description excluded)."""
        d = self.to_dict()
        d.pop("name"), d.pop("description")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Recipe":
        """Build from a plain (e.g. Hydra) mapping. Unknown keys raise ``RecipeError`` naming them."""
        groups = {"weights": WeightSpec, "compute": ComputeSpec, "fp8": Float8Spec, "optim": OptimSpec}
        top = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - top)
        if unknown:
            raise RecipeError(f"unknown recipe field(s) {unknown}; known: {sorted(top)}")
        kwargs: dict[str, Any] = {}
        for k, v in d.items():
            if k in groups:
                spec = groups[k]
                names = {f.name for f in dataclasses.fields(spec)}
                bad = sorted(set(v) - names)
                if bad:
                    raise RecipeError(f"unknown recipe field(s) {[f'{k}.{b}' for b in bad]}; known: {sorted(names)}")
                kwargs[k] = spec(**dict(v))
            else:
                kwargs[k] = v
        return cls(**kwargs)
