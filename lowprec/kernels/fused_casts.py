"""Fused FP8 casts for eager runs (``train.fused_casts``): each current-scaling cast is one compiled kernel.

A cast is amax over the scaling groups, the scale (``amax_to_scale``: float64 division, power-of-2 rounding), the
product, saturation and the conversion to FP8 (``lowprec.numerics.scaling.quantize_operand``). Run op by op in eager
mode that is 5-8 passes over the operand; ``torch.compile`` of the same plain functions (the layout-free code path of
``quantize_operand``) gives inductor one reduction and one elementwise pass to fuse, as torchao's casts are fused
when its users compile. Bit for bit the eager casts (``tests/numerics/test_fused_casts.py``): the same ops, the
scale computed in float64 as torchao does so that eager and compiled agree.

The compiled functions are cached per format, granularity, power-of-2 rounding, amax floor, input dtype, device
type and layout (contiguous, transposed), each with its own dynamo cache (a fresh code object), and compiled with
dynamic shapes, so every linear of a model shares a handful of kernels. A cache that would exceed dynamo's
recompile limit raises instead of running in eager (``fail_on_recompile_limit_hit``): no silent fallback.
``fused_casts_unavailable`` says why a device cannot compile them (checked once per device type at build).
"""

from __future__ import annotations

import functools
import types

import torch

from lowprec.kernels.operand_layout import operand_layout as _layout
from lowprec.numerics.formats import AMAX_EPS, Format, amax_to_scale, quantize
from lowprec.numerics.scaling import QTensor, compute_amax, expand_scale

FUSED_CASTS = ("auto", "on", "off")


def _cast(x: torch.Tensor, fmt: Format, granularity: str, power_of_2: bool, amax_floor: float):
    # quantize_operand with scale=None, through its layout-free path (under compile it takes that path too)
    scale = amax_to_scale(compute_amax(x, granularity), fmt, power_of_2=power_of_2, amax_floor=amax_floor)
    return quantize(x, expand_scale(scale, granularity, tuple(x.shape)), fmt), scale


@functools.cache
def _compiled(key: tuple):
    # A fresh code object per key: dynamo keeps its cache (and counts recompiles) per code object, so each key's
    # kernels neither evict nor count against another's.
    fn = types.FunctionType(_cast.__code__.replace(), _cast.__globals__, "fused_cast_" + "_".join(map(str, key[:2])))
    return torch.compile(fn, fullgraph=True, dynamic=True)


@torch.no_grad()
def fused_quantize_operand(
    x: torch.Tensor, fmt: Format, granularity: str, power_of_2: bool = False, amax_floor: float = AMAX_EPS
) -> QTensor:
    """``quantize_operand(x, fmt, granularity, power_of_2=..., amax_floor=...)`` (current scaling) as one compiled
    kernel: the same data and compact scale, bit for bit; ``data`` may be laid out differently (inductor picks the
    memory order). ``x``: 2-D (R, K), float32/bfloat16/float16. Raises what ``torch.compile`` raises when it cannot
    compile (the build checked ``fused_casts_unavailable`` first), and ``RuntimeError`` when a key's kernels would
    exceed dynamo's recompile limit."""
    if x.dim() != 2:
        raise ValueError(f"operands are 2-D (rows, K); got shape {tuple(x.shape)}")
    key = (fmt.name, granularity, power_of_2, float(amax_floor), x.dtype, x.device.type, _layout(x))
    fn = _compiled(key)
    # Set and restored by hand: ``torch._dynamo.config.patch`` cost 15 us per call (2-core EPYC), half the host
    # time of the compiled cast itself, paid by every cast of every FP8 linear in an eager step.
    cfg = torch._dynamo.config
    before = cfg.fail_on_recompile_limit_hit
    cfg.fail_on_recompile_limit_hit = True
    try:
        data, scale = fn(x, fmt, granularity, power_of_2, amax_floor)
    finally:
        cfg.fail_on_recompile_limit_hit = before
    return QTensor(data, scale, granularity, fmt)


@functools.cache
def fused_casts_unavailable(device_type: str) -> str | None:
    """Why the fused casts cannot run on ``device_type`` (``cpu``, ``cuda``), or ``None``: one small cast is
    compiled and checked against the eager cast (once per process and device type; a CPU compile takes seconds)."""
    from lowprec.numerics.formats import E4M3
    from lowprec.numerics.scaling import quantize_operand

    try:
        x = torch.linspace(-3.0, 3.0, 256 * 128, device=device_type).reshape(256, 128)
        fused = fused_quantize_operand(x, E4M3, "tile1x128")
        eager = quantize_operand(x, E4M3, "tile1x128")
    except Exception as e:  # the reason is recorded in the run (effective recipe, tags), not swallowed
        return f"torch.compile of the casts failed on {device_type}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if not torch.equal(fused.data.view(torch.uint8), eager.data.view(torch.uint8)):
        return f"the compiled cast differs from the eager cast on {device_type}"
    return None


def resolve_fused_casts(setting: str, device: torch.device, compiled_model: bool, block_scaled: bool = False) -> str:
    """``train.fused_casts`` (``auto`` | ``on`` | ``off``) for a run on ``device`` -> ``on`` or ``off: <why>``.
    ``block_scaled``: the run's casts are MXFP8/MXFP4/NVFP4 ones (``lowprec.kernels.fused_mx_casts``), whose probe
    decides instead of the FP8 casts' one.

    ``auto``: on for CUDA; off on a CPU, where the compile time of the casts (seconds per kernel on a 2-core CPU)
    outweighed what they save in the lab's short CPU runs (docs/measurements.md). ``on`` where the casts cannot
    compile raises ``ConfigError`` (no silent fallback); under ``train.compile`` the casts are compiled with their
    blocks, so the setting does not apply. Raises ``ConfigError`` for an unknown setting."""
    from lowprec.errors import ConfigError

    if setting not in FUSED_CASTS:
        raise ConfigError(f"train.fused_casts={setting!r} is not one of {', '.join(FUSED_CASTS)}")
    if compiled_model:
        return "off: train.compile compiles the casts with their blocks"
    if setting == "off":
        return "off: train.fused_casts=off"
    if setting == "auto" and device.type != "cuda":
        return f"off: train.fused_casts=auto on {device.type} (compile time outweighs the gain on short CPU runs)"
    if block_scaled:
        from lowprec.kernels.fused_mx_casts import fused_mx_casts_unavailable

        why = fused_mx_casts_unavailable(device.type)
    else:
        why = fused_casts_unavailable(device.type)
    if why is None:
        return "on"
    if setting == "on":
        raise ConfigError(f"train.fused_casts=on cannot run: {why}; use train.fused_casts=off")
    return f"off: {why}"
