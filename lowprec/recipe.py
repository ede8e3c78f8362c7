"""The precision recipe: every precision decision of a training run as one frozen value.

A ``Recipe`` is data. ``lowprec.train.build`` turns it into mechanism (module swaps, an autocast
context, an optimizer) and records what actually ran; nothing else reads it.

A pure value, like torchao's ``Float8LinearConfig`` and Transformer Engine's recipe classes: this module imports
the standard library, torch (dtypes) and ``lowprec.errors`` only. Constructing a spec checks what the value alone
decides (choices, ranges, fields that would be inert, conflicts between its own fields). What depends on a backend
(``fp8.backend`` / ``optim.impl`` names, each backend's scalings and fields, which implementation provides which
optimizer states and roundings) is asked of the backend registry where the recipe is built or planned:
``lowprec.backends.check_recipe``, called by the catalog (``recipes``), ``lowprec.train.build.check_runtime``
(preflight and ``build``) and ``lowprec.convert.convert_fp8``. A recipe's short name, which also needs a backend
fact, is ``lowprec.backends.short_str``.

Field groups (each a frozen dataclass, overridable from Hydra as ``recipe.<group>.<field>=value``):

- ``weights``: ``param_dtype`` is the storage dtype of the trainable parameters. With FP32 parameters
  under autocast the parameters *are* the FP32 master weights (Accelerate / torch AMP semantics).
- ``compute``: ``autocast_dtype`` (``none`` = compute in the parameter dtype).
- ``fp8``: which linears run their GEMMs in FP8 and how they are scaled.
- ``optim``: the optimizer implementation and the dtype its states are kept in.
- ``comm``: the dtype of FSDP2's weight all-gather and gradient reduce-scatter, and of tensor-parallel
  activation all-gathers (inert on one process).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lowprec.errors import RecipeError

_BLOCK_RE = re.compile(r"^layers\.(\d+)\.")

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: How the emulated accumulator drops bits (``lowprec.float8.accumulator.ROUNDINGS``; a pure value cannot import it,
#: tests/unit/test_recipe_accumulator.py holds the two equal).
ACCUM_ROUNDINGS = ("nearest", "truncate", "floor")
#: ``lowprec.numerics.formats.AMAX_EPS`` (torchao's ``EPS``), the default ``amax_floor``: a pure value cannot import
#: it; tests/unit/test_recipe_fields.py holds the two equal.
AMAX_EPS = 1e-12

#: The FP8 backends of lowprec's own per-tensor linear, and of it and the block-scaled one (``spec_field(backends=)``).
_LOWPREC = ("lowprec",)
_LOWPREC_MX = ("lowprec", "mx")

#: Spec classes with nested field groups (``Float8Spec`` -> ``FP8_GROUPS``) and the order of their leaves
#: (``_leaves``); filled in below the classes.
_NESTED: dict[type, dict[str, type]] = {}
_FLAT_ORDER: dict[type, tuple[str, ...]] = {}


def spec_field(
    default: Any,
    *,
    backends: tuple[str, ...] | None = None,
    short: str | Callable[[Any, Any], str] | None = None,
    hash_omit_at_default: bool = False,
    choices: tuple | None = None,
    block: bool = False,
) -> Any:
    """A recipe dataclass field declared once, with the facts the lab derives from it (``dataclasses.field``
    metadata; the pattern of torchao's ``Float8LinearConfig`` and Transformer Engine's recipe classes, where the
    config is the one place an option is named).

    ``default``: the value meaning "not asked for" (immutable: a tuple for a sequence).
    ``backends``: the FP8 backends (``recipe.fp8.backend`` names) that implement any other value; ``None``: every
    backend. The others refuse a recipe that sets it (``unimplemented_fields``, asked by ``lowprec.backends``)
    instead of training without it.
    ``short``: the field's token in the recipe's short name (``lowprec.backends.fp8_short``), in declaration order:
    a format string given the value, emitted when the value differs from ``default``; or a callable
    ``(spec, backend) -> str`` (``backend`` the registered ``Float8Backend``) for a token that reads other fields;
    ``None``: no token.
    ``hash_omit_at_default``: the field came after recipes were first hashed: ``Recipe.hash`` leaves it out at its
    default, so those recipes (and their checkpoints) keep their hash. Every new field needs it.
    ``choices``: the values construction accepts (``check_choices`` refuses others with ``RecipeError``).
    ``block``: a block-scaling (microscaling) field (``BLOCK_FIELDS``): ``backends`` lists the backends whose
    ``block_fields`` implement it.
    Raises ``ValueError`` for a block field without ``backends`` or a default outside ``choices``.
    """
    if block and backends is None:
        raise ValueError("a block-scaling field names the backends that implement it")
    if choices is not None and default not in choices:
        raise ValueError(f"default {default!r} is not one of the choices {list(choices)}")
    meta = {
        "backends": None if backends is None else tuple(backends),
        "short": short,
        "hash_omit_at_default": hash_omit_at_default,
        "choices": None if choices is None else tuple(choices),
        "block": block,
    }
    return field(default=default, metadata=meta)


def _meta(f: dataclasses.Field, key: str) -> Any:
    return f.metadata.get(key)


def _leaves(spec_cls: type) -> list[tuple[str, dataclasses.Field]]:
    """``(path, field)`` of every leaf field of the dataclass ``spec_cls``: its own fields and, for a spec with
    nested groups (``Float8Spec``: ``FP8_GROUPS``), each group's as ``group.field``. Order: declaration order, or
    for ``Float8Spec`` its flat order (``Float8Spec.flat``: the fields as they were declared before they were
    grouped, then any added since), which is the order of the short name's tokens."""
    groups = _NESTED.get(spec_cls, {})
    out: list[tuple[str, dataclasses.Field]] = []
    for f in dataclasses.fields(spec_cls):
        if f.name in groups:
            out += [(f"{f.name}.{p}", g) for p, g in _leaves(groups[f.name])]
        else:
            out.append((f.name, f))
    order = _FLAT_ORDER.get(spec_cls)
    if order:
        out.sort(key=lambda pf: order.index(pf[0]) if pf[0] in order else len(order))  # stable: the rest in place
    return out


def field_paths(spec_cls: type) -> tuple[str, ...]:
    """The paths of every leaf field of the dataclass ``spec_cls`` (``_leaves`` order), e.g. ``Float8Spec``'s
    ``backend``, ``scaling``, ``cast.strategy``, ...: what follows ``recipe.fp8.`` in an override."""
    return tuple(p for p, _ in _leaves(spec_cls))


def field_value(spec: Any, path: str) -> Any:
    """The value of the (dotted) field ``path`` of ``spec``, e.g. ``field_value(fp8, "cast.strategy")``."""
    return functools.reduce(getattr, path.split("."), spec)


def field_backends(spec_cls: type, name: str) -> tuple[str, ...] | None:
    """The backends that implement a non-default value of ``spec_cls``'s field ``name`` (a path such as
    ``gemm.gemm_backend`` for a grouped field; ``None``: every backend)."""
    return next(_meta(f, "backends") for p, f in _leaves(spec_cls) if p == name)


def unimplemented_fields(spec_cls: type, backend: str, *, block: bool = False) -> dict[str, Any]:
    """``{path: default}`` of the fields of the dataclass ``spec_cls`` (block-scaling ones if ``block``, the others
    if not) that ``backend`` does not implement (``spec_field(backends=...)`` without it), in ``_leaves`` order: the
    table a backend refuses a recipe by. Paths name grouped fields as the user types them after ``recipe.fp8.``."""
    return {
        p: f.default
        for p, f in _leaves(spec_cls)
        if bool(_meta(f, "block")) == block and _meta(f, "backends") is not None and backend not in _meta(f, "backends")
    }


def block_fields_of(spec_cls: type, backend: str) -> tuple[str, ...]:
    """The paths of the block-scaling fields of ``spec_cls`` that ``backend`` implements (its
    ``Float8Backend.block_fields``)."""
    return tuple(p for p, f in _leaves(spec_cls) if _meta(f, "block") and backend in _meta(f, "backends"))


def hash_omits(spec_cls: type) -> dict[str, Any]:
    """``{path: default}`` of the fields ``Recipe.hash`` leaves out at their default (``hash_omit_at_default``)."""
    return {p: f.default for p, f in _leaves(spec_cls) if _meta(f, "hash_omit_at_default")}


def short_tokens(spec: Any, backend: Any) -> str:
    """The short-name tokens of the dataclass ``spec``'s fields (``spec_field(short=...)``), concatenated in
    ``_leaves`` order; callable tokens are given ``spec`` itself (the whole ``Float8Spec`` for a grouped field) and
    ``backend``."""
    out = []
    for path, f in _leaves(type(spec)):
        short, value = _meta(f, "short"), field_value(spec, path)
        if callable(short):
            out.append(short(spec, backend))
        elif short is not None and value != f.default:
            out.append(short.format(value))
    return "".join(out)


def check_choices(spec: Any, group: str) -> None:
    """Refuse (``RecipeError``) the first field of the dataclass ``spec`` whose value is not one of its
    ``spec_field(choices=...)``; ``group`` names it (``recipe.<group>.<field>``, e.g. ``fp8.cast``)."""
    for path, f in _leaves(type(spec)):
        if _meta(f, "choices") is not None:
            _check_choice(group, path, field_value(spec, path), _meta(f, "choices"))


def _strategy_token(spec: Any, backend: Any) -> str:
    c = spec.cast
    if c.strategy == "delayed":
        return f"/delayed{c.amax_history_len}-{c.amax_compute_algo}-m{c.margin}"
    return "/static" if c.strategy == "static" else ""


def _format_token(spec: Any, backend: Any) -> str:
    # a backend fact: whether fp8_format is a free choice (torchao's scalings imply it); E2M1 scalings have none
    return f"/{spec.cast.fp8_format}" if backend.format_in_name and spec.scaling not in ("mxfp4", "nvfp4") else ""


def refuse_inert(spec: Any, group: str, names: tuple[str, ...], because: str) -> None:
    """Refuse fields of the dataclass ``spec`` that differ from their defaults but would have no effect: they
    would change the recipe's hash without changing what runs. ``names``: field paths of ``spec``
    (``block.rht_size`` for a grouped one); ``group``: where ``spec`` sits (``recipe.<group>.<name>``);
    ``because``: the setting that makes them inert, after ``recipe.`` (``fp8.backend='none'``). Raises
    ``RecipeError`` naming the first one."""
    defaults = {p: f.default for p, f in _leaves(type(spec))}
    for name in names:
        default = defaults[name]
        default = tuple(default) if isinstance(default, (list, tuple)) else default
        value = field_value(spec, name)
        if value != default:
            raise RecipeError(
                f"recipe.{group}.{name}={value!r} has no effect with recipe.{because}; "
                "remove the override (or enable the feature it belongs to)"
            )


def _check_choice(group: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise RecipeError(f"recipe.{group}.{name}={value!r} is not one of {list(choices)}")


@dataclass(frozen=True)
class WeightSpec:
    """Parameter storage and how updates are written into it.

    ``param_dtype``: ``fp32`` or ``bf16``. ``master_dtype``: ``none`` or ``fp32`` (an explicit FP32 master
    copy that the optimizer updates and copies back, Megatron/DeepSpeed style; only for BF16 parameters,
    FP32 parameters are their own master). ``update_rounding``: ``nearest``, ``stochastic`` (unbiased
    rounding of the update into BF16) or ``kahan`` (compensated summation); the last two only for BF16
    parameters without a master.
    """

    param_dtype: str = spec_field("fp32", choices=("fp32", "bf16"))
    master_dtype: str = spec_field("none", choices=("none", "fp32"))
    update_rounding: str = spec_field("nearest", choices=("nearest", "stochastic", "kahan"))

    def __post_init__(self) -> None:
        check_choices(self, "weights")
        if self.master_dtype == "fp32" and self.param_dtype == "fp32":
            raise RecipeError(
                "recipe.weights.master_dtype='fp32' conflicts with recipe.weights.param_dtype='fp32': "
                "FP32 parameters are their own master"
            )
        if self.update_rounding != "nearest" and (self.param_dtype != "bf16" or self.master_dtype != "none"):
            raise RecipeError(
                f"recipe.weights.update_rounding={self.update_rounding!r} conflicts with recipe.weights.param_dtype="
                f"{self.param_dtype!r} / master_dtype={self.master_dtype!r}: it rounds updates into BF16 weights "
                "that have no master"
            )


@dataclass(frozen=True)
class ComputeSpec:
    """Compute dtype of the non-FP8 ops, loss scaling and the matmuls' summation order.

    ``autocast_dtype``: ``none``, ``bf16`` or ``fp16``. ``loss_scaling``: ``none`` or ``dynamic``
    (GradScaler semantics: ``init_scale``, doubled after ``growth_interval`` clean steps, halved and the
    step skipped on inf/NaN gradients); dynamic scaling needs FP16 compute.
    ``reduction_order``: ``natural`` or ``reversed``: every FP32 matmul of a training step (forward, backward,
    clipping; not the optimizer step nor validation) sums its contraction in reverse order, and so does every
    matmul whose two matrix operands are in the recipe's ``autocast_dtype`` (under autocast the linears' GEMMs see
    that dtype, not FP32, so the mode would otherwise reverse almost none of them):
    ``lowprec.numerics.reorder.ReversedReductionOrder`` with ``autocast_dtype``. The same mathematics with another
    rounding sequence, the negative control of the noise study (``experiment=noise``). Eager only (a dispatch mode
    is not traced).
    """

    autocast_dtype: str = spec_field("none", choices=("none", "bf16", "fp16"))
    loss_scaling: str = spec_field("none", choices=("none", "dynamic"))
    init_scale: float = 65536.0
    growth_interval: int = 2000
    reduction_order: str = spec_field("natural", choices=("natural", "reversed"), hash_omit_at_default=True)

    def __post_init__(self) -> None:
        check_choices(self, "compute")
        if not (0 < self.init_scale < float("inf")) or self.growth_interval < 1:
            raise RecipeError(
                f"recipe.compute.init_scale={self.init_scale} must be finite and > 0 and "
                f"recipe.compute.growth_interval={self.growth_interval} >= 1"
            )
        if self.loss_scaling == "none":
            refuse_inert(self, "compute", ("init_scale", "growth_interval"), "compute.loss_scaling='none'")
        if self.loss_scaling == "dynamic" and self.autocast_dtype != "fp16":
            raise RecipeError(
                f"recipe.compute.loss_scaling='dynamic' conflicts with recipe.compute.autocast_dtype="
                f"{self.autocast_dtype!r}: loss scaling exists for FP16's narrow exponent range"
            )


@dataclass(frozen=True)
class CastSpec:
    """How the FP8 GEMMs' operands are cast and scaled (torchao's ``CastConfig``; ``recipe.fp8.cast.<field>``).

    ``strategy``: ``current`` (scale from the tensor's own amax), ``delayed`` (Transformer Engine's amax
    history: ``amax_history_len``, ``amax_compute_algo`` max | most_recent, ``margin``), ``static``
    (``static_scales`` for input, weight, grad_output). Delayed and static need tensorwise scaling.
    ``fp8_format``: ``hybrid`` (e4m3 forward, e5m2 gradients) or ``e4m3`` (all e4m3).
    ``power_of_2_scales``: round every scale down to a power of 2.
    ``amax_floor``: current scaling computes ``scale = fmt.max / max(amax, amax_floor)``; ``AMAX_EPS`` (1e-12) is
    torchao's ``EPS``, 1e-4 the clamp of DeepSeek's reference kernels (DeepSeek-V3 ``inference/kernel.py``
    ``act_quant``, DeepGEMM ``per_token_cast_to_fp8``), which flushes tiles whose amax is below about 1e-10 to zero.
    ``grad_output_granularity``: overrides the scaling preset's granularity of the activation gradients
    (``block128x128``: DeepSeek-V3 appendix B.2's diverging variant; blockwise scaling only).
    """

    strategy: str = spec_field("current", choices=("current", "delayed", "static"), short=_strategy_token)
    fp8_format: str = spec_field("hybrid", choices=("hybrid", "e4m3"), short=_format_token)
    amax_history_len: int = 16
    amax_compute_algo: str = spec_field("max", choices=("max", "most_recent"))
    margin: int = 0
    static_scales: tuple[float, float, float] = (1.0, 1.0, 1.0)
    power_of_2_scales: bool = spec_field(False, backends=_LOWPREC)
    amax_floor: float = spec_field(AMAX_EPS, backends=_LOWPREC_MX, short="/floor{:g}", hash_omit_at_default=True)
    grad_output_granularity: str | None = spec_field(
        None,
        backends=_LOWPREC_MX,
        choices=(None, "tile1x128", "block128x128"),
        short="/dy:{}",
        hash_omit_at_default=True,
    )

    def __post_init__(self) -> None:
        # Hydra hands lists; freeze them so the recipe stays hashable.
        object.__setattr__(self, "static_scales", tuple(float(x) for x in self.static_scales))
        check_choices(self, "fp8.cast")
        if not 1e-30 <= self.amax_floor <= 1.0:
            raise RecipeError(
                f"recipe.fp8.cast.amax_floor={self.amax_floor} must be in [1e-30, 1] (scales stay finite)"
            )
        if len(self.static_scales) != 3:
            raise RecipeError(
                f"recipe.fp8.cast.static_scales needs 3 values (input, weight, grad_output), got {self.static_scales}"
            )
        if self.amax_history_len < 1 or self.margin < 0:
            raise RecipeError(
                f"recipe.fp8.cast.amax_history_len={self.amax_history_len} must be >= 1 and "
                f"recipe.fp8.cast.margin={self.margin} >= 0"
            )
        if not all(0 < s < float("inf") for s in self.static_scales):
            raise RecipeError(
                f"recipe.fp8.cast.static_scales={list(self.static_scales)} must be finite and > 0 (fp8 = hp * scale)"
            )


@dataclass(frozen=True)
class GemmSpec:
    """The FP8 GEMMs' kernel and accumulator (torchao's ``Float8GemmConfig``; ``recipe.fp8.gemm.<field>``).

    ``gemm_backend``: ``scaled_mm`` (``torch._scaled_mm``) or ``emulated`` (dequantize + FP32 matmul).
    ``promotion_interval``: N_C, elements of K accumulated before promotion to FP32 (null: 128 for
    blockwise, all of K otherwise); ``accum_mantissa_bits`` emulates a limited-precision accumulator.
    ``accum_rounding`` (``nearest`` | ``truncate`` | ``floor``) and ``accum_group`` (null, or the number of products
    aligned with the running sum to the largest exponent before they are cut and added): the rest of the emulated
    accumulator's model (``lowprec.float8.accumulator.AccumulatorModel``; only with ``accum_mantissa_bits``). The
    defaults are lowprec's original model (round to nearest after every 32-element WGMMA step); the Hopper fit
    (``HOPPER_ACCUMULATOR``: 13 bits, ``truncate``, group 32) is the catalog's ``deepseek_v3_no_promotion_hopper``.
    ``promotion``: False accumulates all of K in the emulated limited-precision accumulator (the tile/block
    scales applied per WGMMA step), i.e. Hopper without DeepSeek-V3's promotion; needs ``accum_mantissa_bits``.
    Without promotion under blockwise scaling the group must divide 128 (a group never straddles two scale tiles).
    ``pad_inner_dim``: zero-pad each GEMM's contraction dim to a multiple of 16 before ``torch._scaled_mm``
    (torchao's ``Float8LinearConfig.pad_inner_dim``: e.g. a step's token count, the weight-gradient GEMM's inner
    dim, need not be a multiple of 16); ``backend=torchao`` only.
    """

    gemm_backend: str = spec_field("scaled_mm", backends=_LOWPREC, choices=("scaled_mm", "emulated"))
    promotion_interval: int | None = spec_field(None, backends=_LOWPREC)
    # the emulated accumulator's token: /acc<bits>[-<rounding>][-g<group>][-nopromo]
    accum_mantissa_bits: int | None = spec_field(None, backends=_LOWPREC, short="/acc{}")
    accum_rounding: str = spec_field(
        "nearest", backends=_LOWPREC, choices=ACCUM_ROUNDINGS, short="-{}", hash_omit_at_default=True
    )
    accum_group: int | None = spec_field(None, backends=_LOWPREC, short="-g{}", hash_omit_at_default=True)
    promotion: bool = spec_field(True, backends=_LOWPREC_MX, short="-nopromo", hash_omit_at_default=True)
    pad_inner_dim: bool = spec_field(False, backends=("torchao",), short="+pad", hash_omit_at_default=True)

    def __post_init__(self) -> None:
        check_choices(self, "fp8.gemm")
        if not self.promotion and self.accum_mantissa_bits is None:
            raise RecipeError(
                "recipe.fp8.gemm.promotion=false needs recipe.fp8.gemm.accum_mantissa_bits: with an FP32 accumulator "
                "there is nothing to promote"
            )
        if self.accum_mantissa_bits is not None and not 0 < self.accum_mantissa_bits < 23:
            raise RecipeError(f"recipe.fp8.gemm.accum_mantissa_bits={self.accum_mantissa_bits} must be in 1..22")
        if self.accum_group is not None and self.accum_group < 1:
            raise RecipeError(f"recipe.fp8.gemm.accum_group={self.accum_group} must be >= 1 products (or null)")
        if self.accum_mantissa_bits is None:
            refuse_inert(
                self,
                "fp8.gemm",
                ("accum_rounding", "accum_group"),
                "fp8.gemm.accum_mantissa_bits=null (FP32 accumulation)",
            )
        if self.promotion_interval is not None and self.promotion_interval < 1:
            raise RecipeError(f"recipe.fp8.gemm.promotion_interval={self.promotion_interval} must be >= 1 (or null)")


@dataclass(frozen=True)
class SavedSpec:
    """What the FP8 linears save for backward (``recipe.fp8.saved.<field>``).

    ``cache_fp8_activations``: save the FP8 input and its scales for backward instead of the input.
    ``e5m6_inputs``: FQN patterns (``keep_hp_fqns`` rule) of FP8 linears whose input is saved for backward in
    E5M6 with power-of-2 1x128 tile scales (``lowprec.numerics.e5m6``; DeepSeek-V3 3.3.3: ``attention.wo``).
    ``swiglu_cache``: ``none`` or ``fp8``: the SwiGLU's inputs (``feed_forward.w1`` / ``w3`` outputs) are saved
    in e4m3 with power-of-2 1x128 tile scales and its output recomputed in backward (DeepSeek-V3 3.3.3).
    """

    cache_fp8_activations: bool = spec_field(False, backends=_LOWPREC, short="+fp8cache")
    e5m6_inputs: tuple[str, ...] = spec_field((), backends=_LOWPREC_MX, short="+e5m6", hash_omit_at_default=True)
    swiglu_cache: str = spec_field(
        "none", backends=_LOWPREC_MX, choices=("none", "fp8"), short="+swiglu:{}", hash_omit_at_default=True
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "e5m6_inputs", tuple(self.e5m6_inputs))
        check_choices(self, "fp8.saved")


@dataclass(frozen=True)
class LayersSpec:
    """Which linears run in FP8 (``recipe.fp8.layers.<field>``): all ``nn.Linear`` except those matching
    ``keep_hp_fqns`` (a pattern matches an FQN equal to it or ending with ``.<pattern>``), the first
    ``hp_first_blocks`` and last ``hp_last_blocks`` transformer blocks, and linears with
    ``min(in, out) < min_features``."""

    keep_hp_fqns: tuple[str, ...] = ("tok_embeddings", "output")
    hp_first_blocks: int = 0
    hp_last_blocks: int = spec_field(0, short="+hplast{}")
    min_features: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_hp_fqns", tuple(self.keep_hp_fqns))
        for name in ("hp_first_blocks", "hp_last_blocks", "min_features"):
            if getattr(self, name) < 0:
                raise RecipeError(f"recipe.fp8.layers.{name}={getattr(self, name)} must be >= 0")


@dataclass(frozen=True)
class BlockSpec:
    """Block-scaled (microscaling) settings (``recipe.fp8.block.<field>``; ``BLOCK_FIELDS``), refused by backends
    that do not implement them: ``mx_scale_mode`` (``rceil``: torchao's default, no element saturates; ``floor``:
    OCP MX v1.0 section 6.3), and NVIDIA's NVFP4 stabilisers (arXiv 2509.25149 section 4): ``rht_size`` (random
    Hadamard transform of that power-of-2 size on the weight-gradient GEMM's inputs; 0 = off),
    ``weight_scaling_2d`` (16x16 weight scale tiles), ``grad_rounding`` (``stochastic`` rounding of gradient
    operands) and ``precision_switch_at`` (fraction of ``train.steps`` after which the block-scaled linears run in
    the compute dtype; null = never), with ``recipe.fp8.layers.hp_last_blocks`` for the BF16 tail blocks."""

    mx_scale_mode: str = spec_field("rceil", backends=("mx",), block=True, choices=("rceil", "floor"), short="/{}")
    rht_size: int = spec_field(0, backends=("mx", "te"), block=True, short="+rht{}")
    weight_scaling_2d: bool = spec_field(False, backends=("mx", "te"), block=True, short="+w2d")
    grad_rounding: str = spec_field(
        "nearest", backends=("mx", "te"), block=True, choices=("nearest", "stochastic"), short="+sr"
    )
    precision_switch_at: float | None = spec_field(None, backends=("mx",), block=True, short="+hp@{:g}")

    def __post_init__(self) -> None:
        check_choices(self, "fp8.block")
        if self.rht_size < 0 or self.rht_size & (self.rht_size - 1) or self.rht_size == 1:
            raise RecipeError(
                f"recipe.fp8.block.rht_size={self.rht_size} must be 0 (off) or a power of 2 >= 2: the random "
                "Hadamard transform uses a Sylvester Hadamard matrix, which exists for powers of 2 only"
            )
        if self.precision_switch_at is not None and not 0 < self.precision_switch_at < 1:
            raise RecipeError(
                f"recipe.fp8.block.precision_switch_at={self.precision_switch_at} must be a fraction of train.steps "
                "in (0, 1), or null"
            )


#: The fields of ``Float8Spec`` before they were grouped by role, in their declaration order then: a legacy flat
#: name -> its group. ``Recipe.from_dict`` reads a record written then (a flat ``fp8`` mapping) through it,
#: ``Float8Spec.flat`` (the hash) writes them under these names and in this order (the short name's token
#: order). A field added since needs no entry (no record names it flat).
FP8_LEGACY: dict[str, str] = {
    "strategy": "cast",
    "fp8_format": "cast",
    "amax_history_len": "cast",
    "amax_compute_algo": "cast",
    "margin": "cast",
    "static_scales": "cast",
    "power_of_2_scales": "cast",
    "gemm_backend": "gemm",
    "promotion_interval": "gemm",
    "accum_mantissa_bits": "gemm",
    "accum_rounding": "gemm",
    "accum_group": "gemm",
    "promotion": "gemm",
    "grad_output_granularity": "cast",
    "amax_floor": "cast",
    "cache_fp8_activations": "saved",
    "e5m6_inputs": "saved",
    "swiglu_cache": "saved",
    "pad_inner_dim": "gemm",
    "mx_scale_mode": "block",
    "rht_size": "block",
    "weight_scaling_2d": "block",
    "grad_rounding": "block",
    "precision_switch_at": "block",
    "keep_hp_fqns": "layers",
    "hp_first_blocks": "layers",
    "hp_last_blocks": "layers",
    "min_features": "layers",
}


@dataclass(frozen=True)
class Float8Spec:
    """FP8 GEMMs: which linears, which kernels, how they are scaled (``recipe.fp8``).

    ``backend``: a name registered in ``lowprec.backends``: ``none``; ``torchao`` (``torchao.float8.Float8Linear``);
    ``lowprec`` (``lowprec.float8.Float8Linear``, runs on CPU and CUDA); ``te`` (Transformer Engine ``te.Linear``;
    CUDA only); ``mx`` (``lowprec.float8.mx_linear.MXLinear``).
    ``scaling``: ``tensorwise`` (one scale per tensor), ``rowwise`` (one per row of each GEMM operand),
    ``blockwise`` (DeepSeek-V3: 1x128 tiles for activations and gradients, 128x128 blocks for weights),
    and torchao's ``rowwise_with_gw_hp``. Block-scaled (microscaling) backends (``mx``: lowprec's own, ``te``'s
    ``mxfp8``/``nvfp4``) take ``mxfp8`` (E4M3 elements, 32-element blocks, E8M0 scales; ``cast.fp8_format=hybrid``
    puts gradients in E5M2), ``mxfp4`` (E2M1, 32-element blocks, E8M0) or ``nvfp4`` (E2M1, 16-element blocks, E4M3
    block scales and an FP32 tensor scale).

    The other fields, grouped by role as torchao's ``Float8LinearConfig`` nests its ``CastConfig`` and
    ``Float8GemmConfig`` (``recipe.fp8.<group>.<field>``): ``cast`` (``CastSpec``), ``gemm`` (``GemmSpec``),
    ``saved`` (``SavedSpec``), ``layers`` (``LayersSpec``), ``block`` (``BlockSpec``). Each group checks its own
    fields; the checks across groups (and with ``backend`` / ``scaling``) are here. Each field is declared once
    (``spec_field``): which backends implement a non-default value, its short-name token, whether the hash omits it
    at its default, its choices. ``flat`` is the view the hash is taken of.
    """

    backend: str = "none"
    scaling: str = "tensorwise"
    cast: CastSpec = field(default_factory=CastSpec)
    gemm: GemmSpec = field(default_factory=GemmSpec)
    saved: SavedSpec = field(default_factory=SavedSpec)
    layers: LayersSpec = field(default_factory=LayersSpec)
    block: BlockSpec = field(default_factory=BlockSpec)

    def __post_init__(self) -> None:
        for name, cls in FP8_GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise RecipeError(f"recipe.fp8.{name} must be a {cls.__name__}, got {getattr(self, name)!r}")
        c, g = self.cast, self.gemm
        group = g.accum_group
        if not g.promotion and self.scaling == "blockwise" and group is not None and 128 % group:
            raise RecipeError(
                f"recipe.fp8.gemm.accum_group={group} conflicts with recipe.fp8.gemm.promotion=false and "
                f"recipe.fp8.scaling={self.scaling!r}: a group must divide the 128-element scale tiles"
            )
        if not self.enabled:
            return  # the ``none`` backend refuses every FP8 field that would be inert (``check_fp8``)
        if c.strategy != "delayed":
            refuse_inert(
                c,
                "fp8.cast",
                ("amax_history_len", "amax_compute_algo", "margin"),
                f"fp8.cast.strategy={c.strategy!r} (they are delayed-scaling settings)",
            )
        if c.strategy != "static":
            refuse_inert(c, "fp8.cast", ("static_scales",), f"fp8.cast.strategy={c.strategy!r}")
        if c.strategy != "current":
            refuse_inert(c, "fp8.cast", ("amax_floor",), f"fp8.cast.strategy={c.strategy!r} (it bounds current scales)")
        if c.grad_output_granularity is not None and self.scaling != "blockwise":
            raise RecipeError(
                f"recipe.fp8.cast.grad_output_granularity={c.grad_output_granularity!r} conflicts with "
                f"recipe.fp8.scaling={self.scaling!r}: it chooses between blockwise scaling's tile and block"
            )
        if c.strategy != "current" and self.scaling != "tensorwise":
            raise RecipeError(
                f"recipe.fp8.cast.strategy={c.strategy!r} conflicts with recipe.fp8.scaling={self.scaling!r}: "
                "delayed and static scaling keep one scale per tensor; use scaling=tensorwise"
            )

    @property
    def enabled(self) -> bool:
        """False only for ``backend='none'``, the recipe's own "no FP8" value (the registry refuses any other
        backend that would be disabled)."""
        return self.backend != "none"

    def flat(self) -> dict[str, Any]:
        """``{name: value}`` with every grouped field under its own name (``FP8_LEGACY``'s order, then fields added
        since), ``backend`` and ``scaling`` first, sequences as lists: the form records had before the fields were
        grouped, and the one ``Recipe.hash`` is taken of (so a recipe keeps its hash)."""
        out: dict[str, Any] = {}
        for path, _ in _leaves(Float8Spec):
            value = field_value(self, path)
            out[path.rpartition(".")[2]] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Float8Spec:
        """From a plain mapping: nested (``{"backend", "scaling", "cast": {...}, ...}``, what ``Recipe.to_dict``
        writes) or flat (``{"strategy": ..., ...}``, what it wrote before the fields were grouped; translated by
        ``FP8_LEGACY``). Raises ``RecipeError`` naming unknown keys, or the flat keys of a mapping that mixes
        both forms."""
        d = dict(d)
        legacy = sorted(k for k in d if k in FP8_LEGACY)
        nested = sorted(k for k in d if k in FP8_GROUPS)
        if legacy and nested:
            moved = ", ".join(f"recipe.fp8.{k} -> recipe.fp8.{FP8_LEGACY[k]}.{k}" for k in legacy)
            raise RecipeError(
                f"recipe.fp8 mixes the flat keys {legacy} (written before the FP8 fields were grouped) with the "
                f"groups {nested}; put each under its group: {moved}"
            )
        top = {"backend", "scaling", *FP8_GROUPS}
        unknown = sorted(set(d) - top - set(FP8_LEGACY))
        if unknown:
            raise RecipeError(f"unknown recipe field(s) {[f'fp8.{k}' for k in unknown]}; known: {sorted(top)}")
        for k in legacy:
            d.setdefault(FP8_LEGACY[k], {})[k] = d.pop(k)
        kwargs: dict[str, Any] = {k: v for k, v in d.items() if k not in FP8_GROUPS}
        for name, group_cls in FP8_GROUPS.items():
            if name in d:
                kwargs[name] = _build_group(group_cls, d[name], f"fp8.{name}")
        return cls(**kwargs)

    def keeps_high_precision(self, fqn: str) -> bool:
        """True if the linear at ``fqn`` stays out of FP8 by name (``layers.keep_hp_fqns``)."""
        return any(fqn == p or fqn.endswith("." + p) for p in self.layers.keep_hp_fqns)

    def saves_e5m6_input(self, fqn: str) -> bool:
        """True if the FP8 linear at ``fqn`` saves its input for backward in E5M6 (``saved.e5m6_inputs`` matches
        it)."""
        return any(fqn == p or fqn.endswith("." + p) for p in self.saved.e5m6_inputs)

    def selects_linear(self, fqn: str, in_features: int, out_features: int, n_blocks: int) -> bool:
        """True if the linear at ``fqn`` (``in_features`` -> ``out_features``) of a model with ``n_blocks``
        transformer blocks (``layers.N.*``) runs in FP8 under this spec.

        Excluded: everything when FP8 is off, ``layers.keep_hp_fqns`` matches, linears of the first
        ``layers.hp_first_blocks`` / last ``layers.hp_last_blocks`` blocks, and linears with
        ``min(in, out) < layers.min_features``. The converter and the effective-recipe check both apply this rule
        to the model's linears.
        """
        if not self.enabled or self.keeps_high_precision(fqn):
            return False
        sel = self.layers
        block = _BLOCK_RE.match(fqn)
        if block:
            i = int(block.group(1))
            if i < sel.hp_first_blocks or i >= n_blocks - sel.hp_last_blocks:
                return False
        return min(in_features, out_features) >= sel.min_features


#: ``Float8Spec``'s field groups (``recipe.fp8.<group>.<field>``) and their dataclasses.
FP8_GROUPS: dict[str, type] = {
    "cast": CastSpec,
    "gemm": GemmSpec,
    "saved": SavedSpec,
    "layers": LayersSpec,
    "block": BlockSpec,
}
_NESTED[Float8Spec] = FP8_GROUPS
_FLAT_ORDER[Float8Spec] = ("backend", "scaling", *(f"{g}.{k}" for k, g in FP8_LEGACY.items()))
_PATHS = [p for p, _ in _leaves(Float8Spec)]
_NAMES = [p.rpartition(".")[2] for p in _PATHS]
if len(set(_NAMES)) != len(_NAMES) or any(f"{g}.{k}" not in _PATHS for k, g in FP8_LEGACY.items()):
    # ``flat`` names every field by its own name: a field added to a group must not take another group's name
    raise ValueError("Float8Spec's groups repeat a field name, or FP8_LEGACY names a field they do not have")

#: Paths of the block-scaling (microscaling) fields of ``Float8Spec`` (``block.<field>``); backends without them
#: refuse them when set (``spec_field(block=True)``).
BLOCK_FIELDS = tuple(p for p, f in _leaves(Float8Spec) if f.metadata.get("block"))


def moved_fp8_key(key: str) -> str | None:
    """For an override key that names an FP8 field by its flat path from before the fields were grouped
    (``recipe.fp8.strategy``), the path it has now (``recipe.fp8.cast.strategy``); None for any other key."""
    head, _, name = key.rpartition(".")
    if head in ("recipe.fp8", "fp8") and name in FP8_LEGACY:
        return f"{head}.{FP8_LEGACY[name]}.{name}"
    return None


def _build_group(cls: type, v: Any, group: str) -> Any:
    """``cls(**v)`` for the mapping ``v`` of ``recipe.<group>``; ``RecipeError`` naming unknown keys."""
    if isinstance(v, cls):
        return v
    if not isinstance(v, Mapping):
        raise RecipeError(f"recipe.{group} must be a mapping of its fields, got {v!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(v) - names)
    if bad:
        raise RecipeError(f"unknown recipe field(s) {[f'{group}.{b}' for b in bad]}; known: {sorted(names)}")
    return cls(**dict(v))


@dataclass(frozen=True)
class OptimSpec:
    """AdamW state precision.

    ``state``: ``param`` (moments in the dtype of the stepped tensors), ``fp32``, ``bf16`` (DeepSeek-V3
    BF16 moments), ``fp8_fp16`` (MS-AMP O2: e4m3 first moment, FP16 second moment, per-tensor scales),
    ``int8`` (block-wise dynamic 8-bit m and v, Dettmers et al. 2022), ``int4`` (torchao AdamW4bit).
    ``impl``: ``torch`` (``torch.optim.AdamW``), ``lowprec`` (``lowprec.optim.LowBitAdamW``),
    ``bitsandbytes`` (``bnb.optim.AdamW8bit``) or ``torchao`` (``torchao.optim.AdamW8bit`` / ``AdamW4bit``,
    and ``_AdamW`` for ``state=param``, whose ``bf16_stochastic_round`` serves ``update_rounding=stochastic``).
    """

    state: str = "param"
    impl: str = "torch"


@dataclass(frozen=True)
class CommSpec:
    """Communication dtypes under FSDP2 / tensor parallelism (no effect on one process).

    ``weight_all_gather``: ``compute`` (FSDP2 gathers parameters in the compute dtype, i.e.
    ``MixedPrecisionPolicy.param_dtype``) or ``fp8`` (each rank quantizes its shard and the FP8 payload
    plus its scales move; torchao's float8 all-gather for ``backend=torchao`` tensorwise, lowprec's
    ``fsdp_pre_all_gather`` extension for ``backend=lowprec``). ``grad_reduce``: dtype of the gradient
    reduce-scatter: ``fp32``, ``bf16``, or ``fp8`` (MS-AMP style: per-block scaled e4m3 chunks are exchanged
    and summed in FP32 by the receiver; ``grad_reduce_block`` elements share a scale).
    ``activation_all_gather``: ``compute`` or ``fp8``: the sequence-parallel all-gather of the inputs of
    tensor-parallel linears moves e4m3 with one scale per token.
    """

    weight_all_gather: str = spec_field("compute", choices=("compute", "fp8"))
    grad_reduce: str = spec_field("fp32", choices=("fp32", "bf16", "fp8"))
    grad_reduce_block: int = 128
    activation_all_gather: str = spec_field("compute", choices=("compute", "fp8"))

    def __post_init__(self) -> None:
        check_choices(self, "comm")
        if self.grad_reduce_block < 1:
            raise RecipeError(f"recipe.comm.grad_reduce_block={self.grad_reduce_block} must be >= 1")

    def short(self) -> str:
        parts = []
        if self.weight_all_gather != "compute":
            parts.append(f"ag:{self.weight_all_gather}")
        if self.grad_reduce != "fp32":
            parts.append(f"rs:{self.grad_reduce}")
        if self.activation_all_gather != "compute":
            parts.append(f"sp:{self.activation_all_gather}")
        return ",".join(parts)


@dataclass(frozen=True)
class Recipe:
    """A complete precision recipe. Raises ``RecipeError`` on a combination its own fields rule out; the checks
    that need a backend are ``lowprec.backends.check_recipe`` (the module docstring says where they run)."""

    name: str
    description: str = ""
    weights: WeightSpec = field(default_factory=WeightSpec)
    compute: ComputeSpec = field(default_factory=ComputeSpec)
    fp8: Float8Spec = field(default_factory=Float8Spec)
    optim: OptimSpec = field(default_factory=OptimSpec)
    comm: CommSpec = field(default_factory=CommSpec)

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

    def to_dict(self) -> dict[str, Any]:
        """Plain nested mapping of every field (``recipe.fp8.cast.strategy`` is ``d["fp8"]["cast"]["strategy"]``;
        sequences as lists): what Hydra sees and what runs record (``recipe_json``)."""
        return _lists(dataclasses.asdict(self))

    def hash(self) -> str:
        """Stable 12-hex-digit hash of every field that changes numerics (name and description excluded), taken of
        the FP8 fields' flat form (``Float8Spec.flat``) so a recipe keeps the hash it had before they were
        grouped."""
        d = self.to_dict()
        d.pop("name"), d.pop("description")
        d["fp8"] = self.fp8.flat()
        for group in _GROUPS:
            for path, default in hash_omits(_GROUPS[group]).items():
                # fields added later hash only when set, so recipes (and checkpoints) from before keep their hash
                name = path.rpartition(".")[2]
                if d[group][name] == (list(default) if isinstance(default, tuple) else default):
                    del d[group][name]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    def with_fields(self, group: str, **fields: Any) -> Recipe:
        """A copy with ``recipe.<group>.<field>`` replaced (its own checks run again; the backend's are
        ``lowprec.backends.check_recipe``), e.g. ``r.with_fields("comm", grad_reduce="fp8")`` or
        ``r.with_fields("fp8.cast", strategy="delayed")``. Raises ``RecipeError`` as ``from_dict`` does."""
        d = self.to_dict()
        node = d
        for part in group.split("."):
            if not isinstance(node.get(part), dict):
                raise RecipeError(f"recipe.{group} is not a group of recipe fields")
            node = node[part]
        node.update(fields)
        return Recipe.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        """Build from a plain (e.g. Hydra) mapping; ``fp8`` nested or, as records written before its fields were
        grouped have it, flat (``Float8Spec.from_dict``). Unknown keys raise ``RecipeError`` naming them."""
        groups = _GROUPS
        top = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - top)
        if unknown:
            raise RecipeError(f"unknown recipe field(s) {unknown}; known: {sorted(top)}")
        kwargs: dict[str, Any] = {}
        for k, v in d.items():
            if k == "fp8":
                kwargs[k] = v if isinstance(v, Float8Spec) else Float8Spec.from_dict(v)
            elif k in groups:
                kwargs[k] = _build_group(groups[k], v, k)
            else:
                kwargs[k] = v
        return cls(**kwargs)


def _lists(x: Any) -> Any:
    """``x`` with every tuple (recursively, through dicts) made a list: the plain form of a recipe."""
    if isinstance(x, dict):
        return {k: _lists(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_lists(v) for v in x]
    return x


#: The recipe's field groups (``recipe.<group>.<field>``) and their dataclasses.
_GROUPS: dict[str, type] = {
    "weights": WeightSpec,
    "compute": ComputeSpec,
    "fp8": Float8Spec,
    "optim": OptimSpec,
    "comm": CommSpec,
}
