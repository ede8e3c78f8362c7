"""Fused block-scaled casts (MXFP8, MXFP4, NVFP4) for eager runs (``train.fused_casts``): one compiled kernel each.

The eager casts of ``lowprec.numerics.microscaling`` (``quantize_mx``, ``quantize_nvfp4``) run op by op: block amax,
the E8M0 exponent from ``frexp``, ``ldexp``, clamping, E2M1's segment rounding and nibble packing, 10-30 passes over
the operand. Here the same helpers (``mx_scale_exponent``, ``nvfp4_scaled``, ``_e2m1_index``, ``pack_e2m1``)
are traced by ``torch.compile`` with dynamic shapes, as ``lowprec.kernels.fused_casts`` does for the FP8 casts, and
give the eager casts' bits (``tests/numerics/test_fused_mx_casts.py``): data, block scales and NVFP4's tensor scale.

What stays eager, and why:

- Stochastic rounding: the random numbers come from a ``torch.Generator`` through ``torch.rand``, and inductor
  draws its own (Philox) stream, so a compiled SR cast could not give the eager cast's bits for a seed. The fused
  functions take round-to-nearest only; ``MXLinear`` casts SR operands (``grad_rounding='stochastic'``) eagerly.
- The random Hadamard transform (a GEMM, ``apply_rht``): it runs before the cast; its output's cast is fused.

NaN in an E2M1 cast (MXFP4 or NVFP4; for NVFP4 an infinite input makes the block scale NaN too) raises the eager
cast's ``ValueError``: the compiled kernel returns a NaN flag, read once after it ran, instead of the eager cast's
check before packing. Kernels are cached per key (element format, scale mode, block, 2-D tiles, input dtype, device
type, layout) with a dynamo cache each and ``fail_on_recompile_limit_hit`` set while they run: no silent fallback to
eager. ``fused_mx_casts_unavailable`` says why a device cannot compile them (checked once per device type at build).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.fx.experimental._config

from lowprec.kernels.operand_layout import operand_layout as _layout
from lowprec.numerics.microscaling import (
    E8M0_BIAS,
    ELEMENTS,
    MX_BLOCK,
    NVFP4_BLOCK,
    BlockQTensor,
    _blocks,
    _e2m1_index,
    mx_scale_exponent,
    nvfp4_scaled,
    pack_e2m1,
)

_NAN_MSG = "E2M1 has no NaN; the block holds NaN"


def _encode_nearest(y: torch.Tensor, elem: str):
    # microscaling._encode / round_to_codes for rounding="nearest", with the NaN check returned as a flag
    fmt = ELEMENTS[elem]
    if fmt.dtype is not None:
        return y.clamp(-fmt.max, fmt.max).to(fmt.dtype), None
    nan = torch.isnan(y)
    mag = y.abs().clamp(max=fmt.max)
    mag = torch.where(nan, torch.zeros_like(mag), mag)
    idx = _e2m1_index(mag, "nearest", None).to(torch.uint8)
    codes = idx | (torch.signbit(y).to(torch.uint8) << (fmt.bits - 1))
    return pack_e2m1(codes), nan.any()


def _mx_cast(x: torch.Tensor, elem: str, scale_mode: str, block: int = MX_BLOCK):
    # microscaling.quantize_mx with rounding="nearest". Blocks as rows of a (rows * K / block, block) view: the
    # block index is then one static division, which inductor vectorizes (a (rows, K / block, block) view with
    # symbolic sizes left it scalar). ``x * 2**-exp`` is ``torch.ldexp``'s own definition (one correctly rounded
    # product by an exact power of two, 2**-127 a float32 subnormal), so the bits are the same.
    fmt = ELEMENTS[elem]
    xb = x.float().reshape(-1, block)
    exp = mx_scale_exponent(xb.abs().amax(-1), fmt, scale_mode)
    y = (xb * torch.pow(2.0, (-exp).float())[:, None]).reshape(x.shape)
    data, nan = _encode_nearest(y, elem)
    return data, (exp + E8M0_BIAS).to(torch.uint8).reshape(x.shape[0], -1), nan


def _nvfp4_cast(x: torch.Tensor, two_d: bool, tensor_amax: torch.Tensor | None):
    # microscaling.quantize_nvfp4 with rounding="nearest": its own scaling, then the compiled rounding
    y, scale, ts = nvfp4_scaled(x, two_d, tensor_amax)
    data, nan = _encode_nearest(y, "e2m1")
    return data, scale, ts.reshape(()), nan


@functools.cache
def _compiled(kind: str, key: tuple):
    # A fresh code object per key: dynamo keeps its cache (and counts recompiles) per code object.
    src = _mx_cast if kind == "mx" else _nvfp4_cast
    name = f"fused_{kind}_cast_" + "_".join(map(str, key[:3]))
    # ``block`` is the function's default, not an argument: under ``dynamic=True`` an int argument is symbolic,
    # and a symbolic block size left the kernel's indexing unvectorized.
    fn = types.FunctionType(src.__code__.replace(), src.__globals__, name, (key[2],) if kind == "mx" else None)
    return torch.compile(fn, fullgraph=True, dynamic=True)


def _run(fn, x: torch.Tensor, *args):
    # ``x.detach()``: a tensor that is neither a view nor requires grad, so dynamo guards on neither (a weight
    # parameter and an activation, or a view and a fresh tensor, would otherwise compile a kernel each).
    # The config is set and restored by hand, as in fused_casts (dynamo's config.patch costs more host time).
    # No duck sizing: a first operand with rows == K (the probe's, a square weight) would otherwise compile a kernel
    # for square operands only, and every other shape would compile another.
    cfg, fx_cfg = torch._dynamo.config, torch.fx.experimental._config
    before = cfg.fail_on_recompile_limit_hit, fx_cfg.use_duck_shape
    cfg.fail_on_recompile_limit_hit, fx_cfg.use_duck_shape = True, False
    try:
        return fn(x.detach(), *args)
    finally:
        cfg.fail_on_recompile_limit_hit, fx_cfg.use_duck_shape = before


def _check_nan(nan: torch.Tensor | None) -> None:
    if nan is not None and bool(nan):
        raise ValueError(_NAN_MSG)


@torch.no_grad()
def fused_quantize_mx(x: torch.Tensor, elem: str, block: int = MX_BLOCK, scale_mode: str = "floor") -> BlockQTensor:
    """``quantize_mx(x, elem, block, scale_mode, rounding="nearest")`` as one compiled kernel: the same data and
    E8M0 scale codes, bit for bit (an FP8 NaN's payload may differ). ``x``: 2-D (rows, K), any float dtype.

    Raises ``ValueError`` as the eager cast does (K not a multiple of ``block``, unknown mode, NaN in an E2M1 cast),
    what ``torch.compile`` raises when it cannot compile (the build checked ``fused_mx_casts_unavailable`` first),
    and ``RuntimeError`` when a key's kernels would exceed dynamo's recompile limit."""
    fmt = ELEMENTS[elem]
    _blocks(x, block)  # the eager cast's shape errors, before compiling
    mx_scale_exponent(torch.zeros(()), fmt, scale_mode)  # and its mode error
    key = (elem, scale_mode, block, x.dtype, x.device.type, _layout(x))
    data, scale, nan = _run(_compiled("mx", key), x, elem, scale_mode)
    _check_nan(nan)
    return BlockQTensor(data.contiguous(), scale.contiguous(), None, elem, block, tuple(x.shape))


@torch.no_grad()
def fused_quantize_nvfp4(x: torch.Tensor, two_d: bool = False, tensor_amax: torch.Tensor | None = None) -> BlockQTensor:
    """``quantize_nvfp4(x, rounding="nearest", two_d=..., tensor_amax=...)`` as one compiled kernel: the same
    packed E2M1 data, E4M3 block scales and FP32 tensor scale, bit for bit. ``x``: 2-D (rows, K), any float dtype.

    Raises ``ValueError`` as the eager cast does (K, or rows with ``two_d``, not a multiple of 16; NaN in the
    scaled elements), what ``torch.compile`` raises when it cannot compile, and ``RuntimeError`` past dynamo's
    recompile limit."""
    _blocks(x, NVFP4_BLOCK)  # the eager cast's shape errors, before compiling
    if two_d and x.shape[0] % NVFP4_BLOCK:
        raise ValueError(f"2-D 16x16 scaling needs rows divisible by 16, got shape {tuple(x.shape)}")
    key = ("nvfp4", two_d, tensor_amax is None, x.dtype, x.device.type, _layout(x))
    data, scale, ts, nan = _run(_compiled("nvfp4", key), x, two_d, tensor_amax)
    _check_nan(nan)
    return BlockQTensor(data.contiguous(), scale.contiguous(), ts, "e2m1", NVFP4_BLOCK, tuple(x.shape), two_d)


@functools.cache
def fused_mx_casts_unavailable(device_type: str) -> str | None:
    """Why the fused block-scaled casts cannot run on ``device_type`` (``cpu``, ``cuda``), or ``None``: one small
    MXFP4 cast is compiled and checked against the eager cast (once per process and device type)."""
    from lowprec.numerics.microscaling import quantize_mx

    try:
        x = torch.linspace(-3.0, 3.0, 64 * 64, device=device_type).reshape(64, 64)
        fused = fused_quantize_mx(x, "e2m1", MX_BLOCK, "rceil")
        eager = quantize_mx(x, "e2m1", MX_BLOCK, "rceil")
    except Exception as e:  # the reason is recorded in the run (effective recipe, tags), not swallowed
        return (
            f"torch.compile of the block-scaled casts failed on {device_type}: "
            f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        )
    if not (torch.equal(fused.data, eager.data) and torch.equal(fused.scale, eager.scale)):
        return f"the compiled block-scaled cast differs from the eager cast on {device_type}"
    return None
