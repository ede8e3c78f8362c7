"""DeepSeek-V3's recipe pieces against computations written here from their definitions: the
tiny-tile amax floor of DeepSeek's reference kernels, the E5M6-saved attention.wo input, the FP8-cached SwiGLU
inputs, the limited accumulator without promotion, 128x128 activation-gradient blocks, and the build's refusals."""

from __future__ import annotations

import bisect
import math
from dataclasses import replace
from fractions import Fraction

import pytest
import torch
from torch import nn

from lowprec.convert import convert_fp8
from lowprec.errors import RecipeError
from lowprec.float8 import Float8Linear, linear_config
from lowprec.float8.gemm import fp8_gemm
from lowprec.float8.swiglu import Float8CachedSwiGLU
from lowprec.model import LLAMA_CONFIGS, Transformer
from lowprec.numerics.formats import E4M3
from lowprec.numerics.scaling import quantize_operand
from lowprec.recipes import get_recipe


def _codes(exp_bits: int, man_bits: int, bias: int, fn: bool) -> list[Fraction]:
    """Finite non-negative values of a binary float format, ascending. ``fn``: e4m3fn-style (only the all-ones
    code is NaN); otherwise IEEE-like (the top exponent field is inf/NaN)."""
    out = []
    top = 2**exp_bits - (0 if fn else 1)
    for ef in range(top):
        for m in range(2**man_bits):
            if fn and ef == 2**exp_bits - 1 and m == 2**man_bits - 1:
                continue
            frac = Fraction(m, 2**man_bits)
            out.append(frac * Fraction(2) ** (1 - bias) if ef == 0 else (1 + frac) * Fraction(2) ** (ef - bias))
    return out


E4M3_VALUES = _codes(4, 3, 7, fn=True)
E5M6_VALUES = _codes(5, 6, 15, fn=False)


def _round(x: float, values: list[Fraction]) -> float:
    """Nearest value, ties to the even code, saturating."""
    a = Fraction(abs(x))
    if a >= values[-1]:
        best = values[-1]
    else:
        hi = bisect.bisect_left(values, a)
        if values[hi] == a:
            best = a
        else:
            dlo, dhi = a - values[hi - 1], values[hi] - a
            best = values[hi - 1] if dlo < dhi or (dlo == dhi and (hi - 1) % 2 == 0) else values[hi]
    return float(best) if x >= 0 else -float(best)


def _pow2_tiles(x: torch.Tensor, fmax: float, values: list[Fraction]) -> torch.Tensor:
    """Dequantized 1x128 tiles with scale 2**floor(log2(fmax / amax)), in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for r in range(x.shape[0]):
        for t0 in range(0, x.shape[1], 128):
            tile = x[r, t0 : t0 + 128].double()
            amax = float(tile.abs().max())
            s = 1.0 if amax == 0 else 2.0 ** math.floor(math.log2(fmax / amax))
            out[r, t0 : t0 + 128] = torch.tensor([_round(v * s, values) / s for v in tile.tolist()])
    return out


# ---- tiny tiles: DeepSeek's reference kernels floor the amax at 1e-4 ---------------------------------------------


def _tiles_with_a_tiny_one() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 256, generator=g)
    x[0, :128] *= 1e-20  # a 1x128 tile whose amax is ~3e-20
    x[1, 128:] *= 1e-6
    return x


@pytest.mark.parametrize("floor", [1e-4, 1e-12, 1e-30])
def test_tile_quantization_matches_an_fp64_computation_at_each_amax_floor(floor):
    x = _tiles_with_a_tiny_one()
    q = quantize_operand(x, E4M3, "tile1x128", amax_floor=floor)
    deq = q.dequantize().double()
    for r in range(2):
        for t in range(2):
            tile = x[r, t * 128 : (t + 1) * 128].double()
            # DeepGEMM per_token_cast_to_fp8 / DeepSeek-V3 act_quant: sf = max(amax, floor) / 448, fp8 = x / sf
            scale = float(torch.tensor(448.0 / max(float(tile.abs().max()), floor), dtype=torch.float32))
            f32 = [float(torch.tensor(v * scale, dtype=torch.float32)) for v in tile.tolist()]  # the FP32 product
            want = [_round(v, E4M3_VALUES) / scale for v in f32]
            assert deq[r, t * 128 : (t + 1) * 128].tolist() == pytest.approx(want, rel=1e-6, abs=0)


def test_reference_floor_flushes_a_tile_of_1e_20_and_a_small_floor_keeps_it():
    x = _tiles_with_a_tiny_one()
    tiny = x[0, :128]
    ref = quantize_operand(x, E4M3, "tile1x128", amax_floor=1e-4).dequantize()[0, :128]
    kept = quantize_operand(x, E4M3, "tile1x128", amax_floor=1e-30).dequantize()[0, :128]
    assert torch.count_nonzero(ref) == 0  # as DeepSeek's act_quant: 3e-20 / (1e-4 / 448) is far below e4m3's 2**-9
    assert torch.allclose(kept.double(), tiny.double(), rtol=2**-4, atol=0)
    assert get_recipe("deepseek_v3").fp8.cast.amax_floor == 1e-4


# ---- activation storage (3.3.3) -------------------------------------------------------------------------------


def _linear(saved_input: str) -> Float8Linear:
    torch.manual_seed(0)
    cfg = replace(linear_config(get_recipe("deepseek_v3").fp8), saved_input=saved_input)
    return Float8Linear.from_linear(nn.Linear(256, 128, bias=False), cfg)


def test_e5m6_saved_input_feeds_the_weight_gradient_as_an_fp64_e5m6_rounding_of_it():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(128, 256, generator=g) * torch.logspace(-3, 2, 256)
    dy = torch.randn(128, 128, generator=g)
    lin = _linear("e5m6")
    x1 = x.clone().requires_grad_()
    lin(x1).backward(dy)
    # the same linear fed the test's own E5M6 rounding and saving its input as is: same weight gradient
    plain = _linear("input")
    plain.weight = lin.weight
    lin.weight.grad, gw = None, lin.weight.grad.clone()
    plain(torch.tensor(_pow2_tiles(x, 65024.0, E5M6_VALUES), dtype=torch.float32)).backward(dy)
    assert torch.equal(gw, plain.weight.grad)
    cached = _linear("fp8")  # and it differs from the FP8-cached input's
    cached.weight = nn.Parameter(lin.weight.detach().clone())
    cached(x.clone().requires_grad_()).backward(dy)
    assert not torch.equal(gw, cached.weight.grad)


def test_swiglu_backward_uses_e4m3_power_of_2_tiles_of_its_inputs():
    g = torch.Generator().manual_seed(4)
    a = (torch.randn(4, 256, generator=g) * 3).requires_grad_()
    b = torch.randn(4, 256, generator=g).requires_grad_()
    dy = torch.randn(4, 256, generator=g)
    out = Float8CachedSwiGLU()(a, b)
    assert torch.equal(out, torch.nn.functional.silu(a) * b)  # the forward is exact
    out.backward(dy)
    aq, bq = _pow2_tiles(a.detach(), 448.0, E4M3_VALUES), _pow2_tiles(b.detach(), 448.0, E4M3_VALUES)
    sig = torch.sigmoid(aq)
    want_a = dy.double() * bq * (sig + aq * sig * (1 - sig))
    want_b = dy.double() * aq * sig
    assert torch.allclose(a.grad.double(), want_a, rtol=1e-5, atol=1e-6)
    assert torch.allclose(b.grad.double(), want_b, rtol=1e-5, atol=1e-6)


def _llama() -> Transformer:
    torch.manual_seed(0)
    return Transformer(LLAMA_CONFIGS["debug"])


def test_deepseek_v3_build_swaps_swiglu_and_keeps_wo_inputs_in_e5m6():
    model = _llama()
    convert_fp8(model, get_recipe("deepseek_v3").fp8)
    wo = [m for n, m in model.named_modules() if n.endswith("attention.wo")]
    others = [m for n, m in model.named_modules() if isinstance(m, Float8Linear) and not n.endswith("attention.wo")]
    assert wo and all(m.fp8_config.saved_input == "e5m6" for m in wo)
    assert others and all(m.fp8_config.saved_input == "fp8" for m in others)
    assert all(isinstance(ff.swiglu, Float8CachedSwiGLU) for ff in (b.feed_forward for b in model.layers.values()))


def test_e5m6_of_a_layer_without_such_activation_and_swiglu_cache_without_swiglu_are_refused():
    spec = get_recipe("deepseek_v3").fp8
    with pytest.raises(RecipeError, match=r"\['attention.wk9'\] match no FP8 linear"):
        convert_fp8(_llama(), replace(spec, saved=replace(spec.saved, e5m6_inputs=("attention.wo", "attention.wk9"))))
    toy = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))
    with pytest.raises(RecipeError, match="has no SwiGLU"):
        convert_fp8(toy, replace(spec, saved=replace(spec.saved, e5m6_inputs=())))


# ---- accumulation and gradient granularity (3.3.2, B.2) -------------------------------------------------------------


def test_without_promotion_a_14_bit_accumulator_loses_what_promotion_keeps():
    g = torch.Generator().manual_seed(5)
    k = 4096
    a, b = torch.randn(8, k, generator=g), torch.randn(8, k, generator=g)
    exact = a.double() @ b.double().t()
    qa, qb = quantize_operand(a, E4M3, "tile1x128"), quantize_operand(b, E4M3, "tile1x128")
    deq = qa.dequantize().double() @ qb.dequantize().double().t()  # the quantized operands' exact product

    def err(**kw):
        out = fp8_gemm(qa, qb, torch.float32, accum_mantissa_bits=14, **kw).double()
        return float(((out - deq).abs() / exact.abs().mean()).max())

    promoted, unpromoted = err(promotion_interval=128), err(promotion=False)
    assert unpromoted > 8 * promoted
    with pytest.raises(ValueError, match="needs accum_mantissa_bits"):
        fp8_gemm(qa, qb, torch.float32, promotion=False)


def test_grad_blocks_variant_quantizes_activation_gradients_in_128x128_blocks():
    cfg = linear_config(get_recipe("deepseek_v3_grad_blocks").fp8)
    assert (cfg.input.granularity, cfg.weight.granularity, cfg.grad_output.granularity) == (
        "tile1x128",
        "block128x128",
        "block128x128",
    )
    lin = Float8Linear.from_linear(nn.Linear(256, 128, bias=False), cfg)
    x = torch.randn(128, 256, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad is not None and torch.isfinite(lin.weight.grad).all()
