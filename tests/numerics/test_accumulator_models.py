"""The emulated FP8 tensor-core accumulators (``lowprec.float8.accumulator``) against exact rational arithmetic:
every mode (round to nearest, truncation toward zero, toward -inf; per-step rounding or products aligned in
groups) computed with ``fractions.Fraction`` on small K, and the default model bit-identical to lowprec's
original one (round to nearest after every 32-element step)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from lowprec.float8.accumulator import (
    ROUNDINGS,
    AccumulatorModel,
    accumulation_error,
    limited_accumulation,
    round_mantissa,
)
from lowprec.float8.gemm import fp8_gemm
from lowprec.numerics.formats import E4M3
from lowprec.numerics.scaling import QTensor, quantize_operand


def _to_int(x: Fraction, rounding: str) -> int:
    if rounding == "nearest":
        return round(x)  # Fraction.__round__: half to even
    return int(x) if rounding == "truncate" else math.floor(x)


def _exponent(x: Fraction) -> int:
    """e with 2**e <= |x| < 2**(e + 1)."""
    x = abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    return e if Fraction(2) ** e <= x else e - 1


def _round_bits(x: Fraction, bits: int, rounding: str) -> Fraction:
    if x == 0:
        return x
    unit = Fraction(2) ** (_exponent(x) - bits)
    return _to_int(x / unit, rounding) * unit


def _reference(a, b, bits: int, rounding: str, group: int | None) -> list[list[Fraction]]:
    """The accumulator written out in exact arithmetic, output by output."""
    k = len(a[0])
    out = []
    for row in a:
        out.append([])
        for col in b:
            acc = Fraction(0)
            prods = [Fraction(x) * Fraction(y) for x, y in zip(row, col)]
            for s in range(0, k, group or 32):
                step = prods[s : s + (group or 32)]
                if group is None:  # the step's products summed exactly, one rounding of the running sum
                    acc = _round_bits(acc + sum(step), bits, rounding)
                    continue
                terms = [acc, *step]
                top = max(abs(t) for t in terms)
                if top == 0:
                    continue
                unit = Fraction(2) ** (_exponent(top) - bits)
                acc = _round_bits(sum(_to_int(t / unit, rounding) for t in terms) * unit, bits, rounding)
            out[-1].append(acc)
    return out


def _e4m3(shape, seed: int, lo: float | None = None) -> torch.Tensor:
    """Random e4m3 values as float32; with ``lo``, magnitudes in [lo, 8) (so 32 products sum exactly in FP32)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 4
    if lo is not None:
        x = x.sign() * x.abs().clamp(lo, 7.5)
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize(("bits", "group"), [(3, 1), (5, 4), (10, 32), (4, 8)])
def test_aligned_accumulator_matches_exact_arithmetic(rounding, bits, group):
    a, b = _e4m3((3, 64), 1), _e4m3((4, 64), 2)  # the whole e4m3 range, subnormals included
    got = limited_accumulation(a, b, AccumulatorModel(bits, rounding, group))[0]
    ref = _reference(a.tolist(), b.tolist(), bits, rounding, group)
    assert got.tolist() == [[float(x) for x in r] for r in ref]


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("bits", [2, 7, 14])
def test_per_step_accumulator_matches_exact_arithmetic(rounding, bits):
    # magnitudes in [1, 8): a 32-element step of products sums exactly in FP32, as the model assumes
    a, b = _e4m3((3, 96), 3, lo=1.0), _e4m3((4, 96), 4, lo=1.0)
    got = limited_accumulation(a, b, AccumulatorModel(bits, rounding))[0]
    ref = _reference(a.tolist(), b.tolist(), bits, rounding, None)
    assert got.tolist() == [[float(x) for x in r] for r in ref]


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_round_mantissa_float32_matches_exact_arithmetic(rounding):
    x = torch.cat([torch.randn(500, generator=torch.Generator().manual_seed(5)) * 1e3, torch.tensor([0.0, -1.5])])
    got = round_mantissa(x, 6, rounding)
    assert got.tolist() == [float(_round_bits(Fraction(v), 6, rounding)) for v in x.tolist()]


def test_modes_differ_and_truncation_biases_positive_sums():
    # all-positive products: truncation only ever drops value, so the sum ends below the exact one
    a, b = _e4m3((8, 512), 6).abs(), _e4m3((8, 512), 7).abs()
    exact = a.double() @ b.double().t()
    sums = {r: limited_accumulation(a, b, AccumulatorModel(8, r, 32))[0] for r in ROUNDINGS}
    assert bool((sums["truncate"].double() < exact).all())
    err = {r: accumulation_error(c, exact)["rel_err"] for r, c in sums.items()}
    assert err["truncate"] > 3 * err["nearest"]
    assert torch.equal(sums["truncate"], sums["floor"])  # non-negative terms: toward zero is toward -inf


def test_prefix_states_are_the_shorter_gemms():
    a, b = _e4m3((5, 256), 8), _e4m3((6, 256), 9)
    for model in (AccumulatorModel(9, "truncate", 16), AccumulatorModel(9, "floor")):
        states = limited_accumulation(a, b, model, ks=[64, 256, 128])
        for k, s in zip([64, 128, 256], states):
            assert torch.equal(s, limited_accumulation(a[:, :k], b[:, :k], model)[0])
    with pytest.raises(ValueError, match="multiples of the step"):
        limited_accumulation(a, b, AccumulatorModel(9, "nearest", 16), ks=[40])


def _old_limited_accumulation(a: QTensor, bt: QTensor, bits: int, tiled_scales) -> torch.Tensor:
    """lowprec's accumulator before the new modes, written out: 32-element steps, the running sum rounded to
    nearest (``frexp``), scales applied at the end (or per step: ``tiled_scales``)."""

    def rnd(v):
        f, e = torch.frexp(v.double())
        return torch.ldexp(torch.round(f * 2.0 ** (bits + 1)), e - (bits + 1)).float()

    ar, br = a.data.float(), bt.data.float()
    acc = torch.zeros(a.shape[0], bt.shape[0])
    for s in range(0, a.shape[1], 32):
        p = ar[:, s : s + 32] @ br[:, s : s + 32].t()
        acc = rnd(acc + (p / tiled_scales(s) if tiled_scales else p))
    return acc if tiled_scales else acc / a.scale / bt.scale.reshape(1, -1)


def test_default_accumulator_is_lowprecs_original_one():
    g = torch.Generator().manual_seed(10)
    x, w = torch.randn(16, 512, generator=g), torch.randn(32, 512, generator=g)
    qa, qb = quantize_operand(x, E4M3, "rowwise"), quantize_operand(w, E4M3, "rowwise")
    got = fp8_gemm(qa, qb, torch.float32, accum_mantissa_bits=11, promotion=False)
    assert torch.equal(got, _old_limited_accumulation(qa, qb, 11, None))
    assert torch.equal(got, fp8_gemm(qa, qb, torch.float32, accum_mantissa_bits=11, promotion=False, accum_group=None))
    ta, tb = quantize_operand(x, E4M3, "tile1x128"), quantize_operand(w, E4M3, "tile1x128")

    def tile_scales(s):
        return ta.scale[:, s // 128 : s // 128 + 1] * tb.scale[:, s // 128].reshape(1, -1)

    got = fp8_gemm(ta, tb, torch.float32, accum_mantissa_bits=11, promotion=False)
    assert torch.equal(got, _old_limited_accumulation(ta, tb, 11, tile_scales))


def test_fp8_gemm_runs_the_chosen_accumulator():
    g = torch.Generator().manual_seed(11)
    qa = quantize_operand(torch.randn(8, 256, generator=g), E4M3, "rowwise")
    qb = quantize_operand(torch.randn(12, 256, generator=g), E4M3, "rowwise")
    model = AccumulatorModel(7, "truncate", 4)
    raw = limited_accumulation(qa.data.float(), qb.data.float(), model)[0]
    got = fp8_gemm(
        qa, qb, torch.float32, accum_mantissa_bits=7, promotion=False, accum_rounding="truncate", accum_group=4
    )
    assert torch.equal(got, raw / qa.scale / qb.scale.reshape(1, -1))
    promoted = fp8_gemm(
        qa, qb, torch.float32, promotion_interval=128, accum_mantissa_bits=7, accum_rounding="truncate", accum_group=4
    )
    halves = [
        limited_accumulation(qa.data.float()[:, s : s + 128], qb.data.float()[:, s : s + 128], model)[0]
        for s in (0, 128)
    ]
    assert torch.equal(promoted, sum(h / qa.scale / qb.scale.reshape(1, -1) for h in halves))
    ta = quantize_operand(torch.randn(8, 256, generator=g), E4M3, "tile1x128")
    with pytest.raises(ValueError, match="must divide 128"):
        fp8_gemm(ta, ta, torch.float32, accum_mantissa_bits=7, promotion=False, accum_group=48)
    with pytest.raises(ValueError, match="unknown accumulator rounding"):
        fp8_gemm(qa, qb, torch.float32, accum_mantissa_bits=7, accum_rounding="up")
    with pytest.raises(ValueError, match="need accum_mantissa_bits"):
        fp8_gemm(qa, qb, torch.float32, accum_rounding="truncate")
