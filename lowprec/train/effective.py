"""The effective recipe: what actually ran, read from the built objects after the first optimizer step.

``inspect_effective`` looks at live tensors and modules only; ``expected_effective`` derives the same
summary from the requested recipe; ``check_effective`` raises when they differ, so a comparison is never
logged for a recipe that silently ran as something else.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from lowprec.optim import moment_kind
from lowprec.optim.builder import is_quantized_state
from lowprec.train.build import Built


class EffectiveRecipeError(RuntimeError):
    """The run's effective recipe differs from the requested one."""


def _dt(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


#: recipe.fp8.backend -> the module class its FP8 linears must have.
FP8_MODULE_CLASS = {
    "torchao": "torchao.float8.float8_linear.Float8Linear",
    "lowprec": "lowprec.float8.linear.Float8Linear",
    "te": "transformer_engine.pytorch.module.linear.Linear",
}


def _qualname(m: nn.Module) -> str:
    return f"{type(m).__module__}.{type(m).__name__}"


def _fp8_modules(model: nn.Module) -> dict[str, int]:
    kinds = Counter(_qualname(m) for m in model.modules() if _qualname(m) in FP8_MODULE_CLASS.values())
    return dict(kinds)


@torch.no_grad()
def _linear_output_dtypes(built: Built, tokens: torch.Tensor) -> Counter:
    seen: Counter = Counter()
    hooks = [
        m.register_forward_hook(lambda mod, inp, out: seen.update([_dt(out.dtype)]))
        for m in built.model.modules()
        if isinstance(m, nn.Linear) or _qualname(m) in FP8_MODULE_CLASS.values()
    ]
    try:
        with built.precision():
            built.model(tokens)
    finally:
        for h in hooks:
            h.remove()
        _reshard(built.model)
    return seen


def _reshard(model: nn.Module) -> None:
    # FSDP2 keeps modules with reshard_after_forward=False unsharded after a forward without backward;
    # shard them again so later inspection and accounting see the sharded parameters and their gradients.
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def inspect_effective(built: Built, tokens: torch.Tensor) -> dict:
    """Summary of what ran: dtypes weighted by element counts, FP8 linear count, optimizer class.

    ``tokens``: (batch, seq) int64, used for one no-grad forward that records each linear's output dtype.
    Call after an optimizer step and before ``zero_grad`` (gradients must exist).
    """
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt = built.optimizer
    return {
        "param_dtype": dict(_count(params, lambda p: _dt(p.dtype))),
        "grad_dtype": dict(_count([p for p in params if p.grad is not None], lambda p: _dt(p.grad.dtype))),
        "linear_output_dtype": dict(_linear_output_dtypes(built, tokens[:1])),
        "fp8_linears": _fp8_modules(built.model),
        "linears": _n_linears(built.model),
        "optimizer": f"{type(opt).__module__}.{type(opt).__name__}",
        "moment_dtype": dict(_count(params, lambda p: moment_kind(opt, p))),
        "master": "explicit" if built.master_params else "params_are_master" if _all_fp32(params) else "none",
        **({"comm": _observed_comm(built)} if built.parallel is not None else {}),
    }


def _observed_comm(built: Built) -> dict:
    from lowprec.parallel.comm_metrics import observed_comm_dtypes

    # The first step of a run is always metered, and its counts stay in the meter until the next sampled step.
    seen = observed_comm_dtypes(built.comm_metrics.meter.bytes_by_kind_dtype())
    out = {}
    if built.parallel.dims.fsdp and built.parallel.dims.tp == 1:
        # Under TP the all-gathers and reduce-scatters mix FSDP's and sequence parallelism's; only pure FSDP
        # layouts attribute them to weights and gradients unambiguously.
        out = {"weight_all_gather": seen.get("all_gather"), "grad_reduce": seen.get("reduce_scatter")}
    elif built.parallel.dims.tp > 1 and not built.parallel.dims.fsdp:
        # TP alone all-gathers only activations (sequence parallelism): FP8 there is the FP8 SP all-gather.
        out = {"activation_all_gather": "fp8" if seen.get("all_gather") == "fp8" else "compute"}
    return out


def _expected_comm(built: Built) -> dict:
    r = built.recipe
    dims = built.parallel.dims
    if dims.tp > 1 and not dims.fsdp:
        return {"activation_all_gather": r.comm.activation_all_gather}
    if not (dims.fsdp and dims.tp == 1):
        return {}
    mp = built.parallel.mp_policy
    gather = _dt(mp.param_dtype) if mp is not None and mp.param_dtype is not None else _dt(r.param_dtype)
    return {
        "weight_all_gather": "fp8" if r.comm.weight_all_gather == "fp8" else gather,
        "grad_reduce": {"fp32": "float32", "bf16": "bfloat16", "fp8": "fp8"}[r.comm.grad_reduce],
    }


def _n_linears(model: nn.Module) -> int:
    # te.Linear is not an nn.Linear subclass; count it too.
    return sum(1 for m in model.modules() if isinstance(m, nn.Linear) or _qualname(m) in FP8_MODULE_CLASS.values())


def _count(params, key) -> Counter:
    c: Counter = Counter()
    for p in params:
        c[key(p)] += p.numel()
    return c


def _all_fp32(params) -> bool:
    return all(p.dtype == torch.float32 for p in params)


def expected_effective(built: Built) -> dict:
    """The summary ``inspect_effective`` must return if the recipe ran exactly as requested."""
    r = built.recipe
    params = [p for p in built.model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    n_linears = _n_linears(built.model)
    stepped = "float32" if r.weights.master_dtype == "fp32" else _dt(r.param_dtype)
    state = r.optim.state
    if state in ("int8", "int4"):
        impl = r.optim.impl
        moments = _count(params, lambda p: f"{state}_blockwise" if is_quantized_state(impl, state, p.numel()) else stepped)
    else:
        kind = {"param": stepped, "fp32": "float32", "bf16": "bfloat16", "fp8_fp16": "float8_e4m3fn"}[state]
        moments = Counter({kind: n})
    return {
        "param_dtype": {_dt(r.param_dtype): n},
        "grad_dtype": {_dt(r.param_dtype): n},
        "linear_output_dtype": {_dt(r.compute_dtype): n_linears},
        "fp8_linears": {FP8_MODULE_CLASS[r.fp8.backend]: len(built.fp8_fqns)} if built.fp8_fqns else {},
        "linears": n_linears,
        "moment_dtype": dict(moments),
        "master": "explicit" if r.weights.master_dtype != "none"
        else "params_are_master" if r.param_dtype == torch.float32 else "none",
        **({"comm": _expected_comm(built)} if built.parallel is not None else {}),
    }


def check_effective(effective: dict, expected: dict) -> None:
    """Raise ``EffectiveRecipeError`` naming every field where ``effective`` differs from ``expected``."""
    diffs = [f"{k}: requested {v}, ran {effective.get(k)}" for k, v in expected.items() if effective.get(k) != v]
    if diffs:
        raise EffectiveRecipeError("effective recipe differs from the requested one: " + "; ".join(diffs))
