"""The effective recipe: what actually ran, read from the built objects after the first optimizer step.

``inspect_effective`` looks at live tensors and modules only; ``expected_effective`` derives the same
summary from the requested recipe; ``check_effective`` raises when they differ, so a comparison is never
logged for a recipe that silently ran as something else.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch import nn

from lowprec.backends import fp8_backend, fp8_backends, optim_impl
from lowprec.build_optim import moment_kind
from lowprec.kernels import EmulatedLinear, emulated_sdpa
from lowprec.model.moe import RouterGate
from lowprec.parallel.comm_metrics import observed_comm_dtypes
from lowprec.train.ac import is_checkpointed
from lowprec.train.build import Built
from lowprec.train.compile import is_compiled


class EffectiveRecipeError(RuntimeError):
    """The run's effective recipe differs from the requested one."""


def _dt(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _fp8_module_classes() -> set[str]:
    """Qualified class names of every registered backend's FP8 linear."""
    return {b.module_class for b in fp8_backends().values() if b.module_class}


def _qualname(m: nn.Module) -> str:
    return f"{type(m).__module__}.{type(m).__name__}"


def _fp8_modules(model: nn.Module) -> dict[str, int]:
    classes = _fp8_module_classes()
    kinds = Counter(_qualname(m) for m in model.modules() if _qualname(m) in classes)
    return dict(kinds)


def _observed_kernels(model: nn.Module) -> dict[str, str]:
    """Which kernels the built model runs: ``bf16`` from its high-precision linears and attention slots
    (``emulated``, ``native`` or ``mixed``), ``fp8`` from its FP8 linears (absent when there are none),
    ``fp8_blockwise_gemm`` from those with blockwise GEMMs (``lowprec.kernels.blockwise``; absent without)."""
    backends = {b.module_class: b for b in fp8_backends().values() if b.module_class}
    hp, fp8, blockwise, casts = set(), set(), set(), set()
    for m in model.modules():
        if _qualname(m) in backends:
            fp8.add(backends[_qualname(m)].kernel_of(m))
            blockwise.add(backends[_qualname(m)].blockwise_gemm_of(m))
            if hasattr(m, "fused_casts"):  # lowprec's Float8Linear (train.fused_casts)
                casts.add("fused" if m.fused_casts else "eager")
        elif isinstance(m, nn.Linear):
            hp.add("emulated" if isinstance(m, EmulatedLinear) else "native")
        if hasattr(m, "sdpa"):
            hp.add("emulated" if m.sdpa is emulated_sdpa else "native")
    out = {"bf16": hp.pop() if len(hp) == 1 else "mixed"}
    if fp8:
        out["fp8"] = fp8.pop() if len(fp8) == 1 else "mixed"
    blockwise.discard(None)
    if blockwise:
        out["fp8_blockwise_gemm"] = blockwise.pop() if len(blockwise) == 1 else "mixed"
    if casts:
        out["fp8_casts"] = casts.pop() if len(casts) == 1 else "mixed"
    return out


def _observed_blocks(model: nn.Module) -> dict[str, int]:
    """How many transformer blocks there are, and how many are checkpointed (``train.ac``) and compiled."""
    blocks = list(model.layers.values())
    return {
        "n": len(blocks),
        "checkpointed": sum(is_checkpointed(b) for b in blocks),
        "compiled": sum(is_compiled(b) for b in blocks),
    }


def _is_linear(m: nn.Module) -> bool:
    # te.Linear is not an nn.Linear subclass; count it too.
    return isinstance(m, nn.Linear) or _qualname(m) in _fp8_module_classes()


@contextlib.contextmanager
def record_linear_output_dtypes(model: nn.Module) -> Iterator[dict[str, str]]:
    """Record the output dtype of every linear and MoE router gate (``fqn -> dtype name``) during the forward
    passes run inside.

    The loop wraps the first real training step in it, so the inspection needs no forward of its own: an
    extra forward would record amaxes into delayed-scaling histories and change the next step's scales.
    """
    seen: dict[str, str] = {}

    def hook(fqn):
        return lambda mod, inp, out: seen.__setitem__(fqn, _dt(out.dtype))

    handles = [
        m.register_forward_hook(hook(fqn))
        for fqn, m in model.named_modules()
        if _is_linear(m) or isinstance(m, RouterGate)
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def inspect_effective(built: Built, linear_output_dtypes: dict[str, str]) -> dict:
    """Summary of what ran: dtypes weighted by element counts, FP8 linear count, optimizer class.

    ``linear_output_dtypes``: ``fqn -> dtype`` of each linear's output, recorded during the step that was
    just taken (``record_linear_output_dtypes``). Reads the built objects only: it runs no forward and
    changes no buffer. Call after an optimizer step and before ``zero_grad`` (gradients must exist).
    """
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt = built.optimizer
    routers = _router_fqns(built.model)
    router_out = Counter(v for k, v in linear_output_dtypes.items() if k in routers)
    idle = idle_expert_linears(built.model, linear_output_dtypes) if routers else []
    linear_output_dtypes = {k: v for k, v in linear_output_dtypes.items() if k not in routers}
    return {
        "param_dtype": dict(_count(params, lambda p: _dt(p.dtype))),
        "grad_dtype": dict(_count([p for p in params if p.grad is not None], lambda p: _dt(p.grad.dtype))),
        "linear_output_dtype": dict(Counter(linear_output_dtypes.values())),
        "fp8_linears": _fp8_modules(built.model),
        "linears": _n_linears(built.model),
        "optimizer": f"{type(opt).__module__}.{type(opt).__name__}",
        "moment_dtype": dict(_count(params, lambda p: moment_kind(opt, p))),
        "master": "explicit" if built.master_params else "params_are_master" if _all_fp32(params) else "none",
        "kernels": _observed_kernels(built.model),
        "blocks": _observed_blocks(built.model),
        **({"comm": _observed_comm(built)} if built.parallel is not None else {}),
        **({"router_dtype": dict(router_out), "moe_idle_expert_linears": len(idle)} if routers else {}),
        # the mode's own count: it reversed matmuls in the step just taken (absent for the natural order)
        **({"reduction_order": "reversed"} if built.reduction_order and built.reduction_order.reversed else {}),
    }


def idle_expert_linears(model: nn.Module, linear_output_dtypes: dict[str, str]) -> list[str]:
    """FQNs of the routed experts' linears (``*.moe.experts.E.*``) that did not run in the recorded step: no token
    was routed to their expert. Their output dtype cannot be observed; the effective recipe reports their number
    (``moe_idle_expert_linears``) and the linear-output check covers the linears that ran."""
    return [
        fqn
        for fqn, m in model.named_modules()
        if _is_linear(m) and ".moe.experts." in fqn and fqn not in linear_output_dtypes
    ]


def _router_fqns(model: nn.Module) -> set[str]:
    """FQNs of the MoE router gates (``lowprec.model.moe.RouterGate``), which stay out of FP8 and compute in FP32
    (DeepSeek-V3 3.3.1): the effective recipe records their output dtype apart from the linears'."""
    return {fqn for fqn, m in model.named_modules() if isinstance(m, RouterGate)}


def _observed_comm(built: Built) -> dict:
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
    return sum(1 for m in model.modules() if _is_linear(m))


def expected_fp8_fqns(model: nn.Module, spec) -> list[str]:
    """The linears ``spec`` puts in FP8, from the recipe's filters applied to the built model's linears
    (whatever class they have now), independently of what the converter reported doing."""
    n_blocks = len(getattr(model, "layers", []))
    return [
        fqn
        for fqn, m in model.named_modules()
        if _is_linear(m) and spec.selects_linear(fqn, m.in_features, m.out_features, n_blocks)
    ]


def _count(params, key) -> Counter:
    c: Counter = Counter()
    for p in params:
        c[key(p)] += p.numel()
    return c


def _all_fp32(params) -> bool:
    return all(p.dtype == torch.float32 for p in params)


def expected_effective(built: Built, idle_linears: int = 0) -> dict:
    """The summary ``inspect_effective`` must return if the recipe ran exactly as requested. ``idle_linears``: the
    MoE expert linears that received no token in the inspected step (``idle_expert_linears``), left out of the
    expected linear-output count."""
    r = built.recipe
    params = [p for p in built.model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    n_linears = _n_linears(built.model)
    fp8 = expected_fp8_fqns(built.model, r.fp8)
    stepped = "float32" if r.weights.master_dtype == "fp32" else _dt(r.param_dtype)
    state = r.optim.state
    if state in ("int8", "int4"):
        impl = optim_impl(r.optim.impl)
        moments = _count(params, lambda p: f"{state}_blockwise" if impl.is_quantized(state, p.numel()) else stepped)
    else:
        kind = {"param": stepped, "fp32": "float32", "bf16": "bfloat16", "fp8_fp16": "float8_e4m3fn"}[state]
        moments = Counter({kind: n})
    return {
        "param_dtype": {_dt(r.param_dtype): n},
        "grad_dtype": {_dt(r.param_dtype): n},
        "linear_output_dtype": {_dt(r.compute_dtype): n_linears - idle_linears},
        "fp8_linears": {fp8_backend(r.fp8.backend).module_class: len(fp8)} if fp8 else {},
        "linears": n_linears,
        "moment_dtype": dict(moments),
        "master": "explicit"
        if r.weights.master_dtype != "none"
        else "params_are_master"
        if r.param_dtype == torch.float32
        else "none",
        "kernels": {
            "bf16": built.kernels.bf16,
            **({"fp8": built.kernels.fp8} if fp8 else {}),
            **(
                {"fp8_blockwise_gemm": built.kernels.blockwise}
                if fp8 and fp8_backend(r.fp8.backend).needs_blockwise_gemm(r.fp8)
                else {}
            ),
            **({"fp8_casts": "fused" if built.kernels.fused_casts == "on" else "eager"} if _casts(built) else {}),
        },
        "blocks": {
            "n": len(built.model.layers),
            "checkpointed": 0 if built.ac == "none" else len(built.model.layers),
            "compiled": len(built.model.layers) if built.compiled else 0,
        },
        **({"comm": _expected_comm(built)} if built.parallel is not None else {}),
        **({"router_dtype": {"float32": len(routers)}} if (routers := _router_fqns(built.model)) else {}),
        **({"reduction_order": "reversed"} if r.compute.reduction_order == "reversed" else {}),
    }


def _casts(built) -> bool:
    """The run has lowprec FP8 linears whose casts ``train.fused_casts`` decides."""
    return any(hasattr(m, "fused_casts") for m in built.model.modules())


def check_effective(effective: dict, expected: dict) -> None:
    """Raise ``EffectiveRecipeError`` naming every field where ``effective`` differs from ``expected``."""
    diffs = [f"{k}: requested {v}, ran {effective.get(k)}" for k, v in expected.items() if effective.get(k) != v]
    if diffs:
        raise EffectiveRecipeError("effective recipe differs from the requested one: " + "; ".join(diffs))
