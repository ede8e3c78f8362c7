"""Block-scaled formats (lowprec.numerics.microscaling) against independent computations: every code decoded by
the OCP MX v1.0 / IEEE-style formulas in FP64, quantize-dequantize against an FP64 implementation of the
spec's conversion written here, torchao's MXTensor / nvfp4_quantize bit for bit, and stochastic rounding's
bias measured over 10**6 samples."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lowprec.numerics import microscaling as mx


# ---- the formats, from their definitions (FP64) ---------------------------------------------------------------
def spec_value(code: int, ebits: int, mbits: int, bias: int, kind: str) -> float:
    """Value of a minifloat code: sign, ``ebits`` exponent bits, ``mbits`` mantissa bits, subnormals at e=0.
    ``kind``: ``fn`` (E4M3: only S.1111.111 is NaN), ``ieee`` (E5M2: e all ones is inf/NaN), ``plain`` (E2M1)."""
    s = code >> (ebits + mbits)
    e = (code >> mbits) & ((1 << ebits) - 1)
    m = code & ((1 << mbits) - 1)
    emask = (1 << ebits) - 1
    if kind == "fn" and e == emask and m == (1 << mbits) - 1:
        return math.nan
    if kind == "ieee" and e == emask:
        return math.nan if m else (-math.inf if s else math.inf)
    mag = (m / 2**mbits) * 2.0 ** (1 - bias) if e == 0 else (1 + m / 2**mbits) * 2.0 ** (e - bias)
    return -mag if s else mag


FORMATS = {"e4m3": (4, 3, 7, "fn", 8), "e5m2": (5, 2, 15, "ieee", 8), "e2m1": (2, 1, 1, "plain", 4)}


def all_codes(name: str) -> list[tuple[int, float]]:
    ebits, mbits, bias, kind, bits = FORMATS[name]
    return [(c, spec_value(c, ebits, mbits, bias, kind)) for c in range(2**bits)]


def finite_grid(name: str) -> np.ndarray:
    return np.array(sorted({v for _, v in all_codes(name) if math.isfinite(v)}), dtype=np.float64)


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1"])
def test_every_element_code_decodes_as_the_spec_and_round_trips(name):
    fmt = mx.ELEMENTS[name]
    codes = torch.arange(2**fmt.bits, dtype=torch.uint8)
    decoded = mx.codes_to_float32(codes, fmt).double()
    finite = []
    for c, v in all_codes(name):
        got = float(decoded[c])
        if math.isnan(v):
            assert math.isnan(got), (name, c)
            continue
        assert got == v and math.copysign(1, got) == math.copysign(1, v), (name, c, got, v)
        if math.isfinite(v):
            finite.append(c)
    vals = decoded[finite].float()
    for rounding in ("nearest", "stochastic"):
        back = mx.round_to_codes(vals, fmt, rounding, torch.Generator().manual_seed(0))
        assert back.tolist() == finite, (name, rounding)
    # exact midpoints between neighbouring values: nearest-even picks the even code
    grid = finite_grid(name)
    mids = torch.tensor((grid[1:] + grid[:-1]) / 2, dtype=torch.float32)
    want = rne_to_grid(np.clip(mids.double().numpy(), -fmt.max, fmt.max), grid[grid >= 0])
    got = mx.codes_to_float32(mx.round_to_codes(mids, fmt, "nearest"), fmt).double().numpy()
    np.testing.assert_array_equal(got, want)
    if fmt.dtype is None:  # packed storage round-trips too
        assert torch.equal(mx.unpack_e2m1(mx.pack_e2m1(codes)), codes)


def test_every_e8m0_code_round_trips():
    codes = torch.arange(256, dtype=torch.uint8)
    vals = mx.e8m0_to_float32(codes)
    for c in range(255):
        assert float(vals[c]) == 2.0 ** (c - 127), c
    assert math.isnan(float(vals[255]))
    assert torch.equal(mx.float32_to_e8m0(vals), codes)
    with pytest.raises(ValueError, match="powers of two"):
        mx.float32_to_e8m0(torch.tensor([3.0]))


# ---- quantize-dequantize against an FP64 implementation of the conversion ---------------------------------------
def rne_to_grid(v: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Round |v| (already clamped to the grid's max) to the nearest grid value, ties to the even code."""
    mag = np.abs(v)
    d = np.abs(mag[..., None] - grid)
    best = d.min(-1, keepdims=True)
    cand = d == best
    idx = np.where(cand.sum(-1) > 1, np.argmax(cand & (np.arange(len(grid)) % 2 == 0), -1), np.argmax(cand, -1))
    return np.copysign(grid[idx], v)


def ref_mx(x: np.ndarray, name: str, block: int, mode: str) -> np.ndarray:
    emax, fmax = {"e4m3": (8, 448.0), "e5m2": (15, 57344.0), "e2m1": (2, 6.0)}[name]
    grid = finite_grid(name)
    grid = grid[grid >= 0]
    r, k = x.shape
    xb = x.astype(np.float64).reshape(r, k // block, block)
    amax = np.abs(xb).max(-1)
    if mode == "floor":  # OCP MX v1.0 section 6.3: X = 2**(floor(log2(amax)) - emax)
        e = np.array([[math.frexp(a)[1] - 1 - emax if a > 0 else -127 for a in row] for row in amax])
    else:  # torchao RCEIL: X = 2**ceil(log2(fp32(amax / max)))
        desc = (amax.astype(np.float32) / np.float32(fmax)).astype(np.float64)
        e = np.array([[math.ceil(math.log2(d)) if d > 0 else -127 for d in row] for row in desc])
    e = np.clip(e, -127, 127)
    scale = np.ldexp(1.0, e)[..., None]
    q = rne_to_grid(np.clip(xb / scale, -fmax, fmax), grid)
    return (q * scale).reshape(r, k)


def sample(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g) * torch.logspace(-4, 4, k)[torch.randperm(k, generator=g)]


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1"])
def test_mx_quantize_dequantize_matches_fp64_reference(name, mode):
    x = sample(8, 128, 1)
    got = mx.quantize_mx(x, name, 32, mode).dequantize().double().numpy()
    np.testing.assert_array_equal(got, ref_mx(x.numpy(), name, 32, mode))


def test_nvfp4_quantize_dequantize_matches_reference():
    x = sample(32, 64, 2)
    xn = x.numpy()
    f32 = np.float32
    ts = f32(np.abs(xn).max()) / f32(448.0 * 6.0)
    xb = xn.reshape(32, 4, 16)
    bs = (np.abs(xb).max(-1) / f32(6.0) / ts).astype(f32)
    e4m3 = finite_grid("e4m3")
    e4m3 = e4m3[e4m3 > 0]
    bs = rne_to_grid(np.clip(bs.astype(np.float64), e4m3.min(), 448.0), e4m3).astype(f32)  # E4M3, RNE
    recip = (f32(1.0) / ts) / bs
    y = np.clip((xb * recip[..., None]).astype(f32), -6, 6).astype(np.float64)
    grid = finite_grid("e2m1")
    q = rne_to_grid(y, grid[grid >= 0])
    # the element times the FP32 product of the two scales, rounded once to FP32
    want = (q * (bs * ts).astype(f32)[..., None].astype(np.float64)).astype(f32).reshape(32, 64)
    got = mx.quantize_nvfp4(x).dequantize().double().numpy()
    np.testing.assert_array_equal(got, want)


def test_two_d_weight_scaling_transposes_exactly():
    w = sample(32, 48, 3)
    q = mx.quantize_nvfp4(w, two_d=True)
    assert torch.equal(q.t().dequantize(), q.dequantize().t())
    assert torch.equal(q.t().t().data, q.data)
    with pytest.raises(ValueError, match="only 2-D"):
        mx.quantize_nvfp4(w).t()


def test_k_not_a_block_multiple_is_refused():
    with pytest.raises(ValueError, match="not a multiple of the block size 32; lowprec refuses"):
        mx.quantize_mx(torch.randn(4, 48), "e4m3")
    with pytest.raises(ValueError, match="block size 16"):
        mx.quantize_nvfp4(torch.randn(4, 40))


# ---- torchao, bit for bit --------------------------------------------------------------------------------------
def test_bit_for_bit_with_torchao():
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    x = sample(16, 256, 4)
    dts = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.float4_e2m1fn_x2}
    modes = {"floor": mx_tensor.ScaleCalculationMode.FLOOR, "rceil": mx_tensor.ScaleCalculationMode.RCEIL}
    for name, dt in dts.items():
        for mode, tmode in modes.items():
            scale, data = mx_tensor.to_mx(x, dt, 32, tmode)
            q = mx.quantize_mx(x, name, 32, mode)
            assert torch.equal(scale.view(torch.uint8), q.scale), (name, mode)
            assert torch.equal(data.view(torch.uint8), q.data.view(torch.uint8)), (name, mode)
    ts = nv.per_tensor_amax_to_scale(x.abs().amax())
    scale, data = nv.nvfp4_quantize(x, 16, ts)
    q = mx.quantize_nvfp4(x)
    assert torch.equal(ts, q.tensor_scale)
    assert torch.equal(scale.view(torch.uint8), q.scale.view(torch.uint8))
    assert torch.equal(data.view(torch.uint8), q.data)


# ---- stochastic rounding ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["e2m1", "e4m3"])
def test_stochastic_rounding_is_unbiased_and_seeded(name):
    fmt = mx.ELEMENTS[name]
    n = 10**6
    g = torch.Generator().manual_seed(123)
    # values inside the gaps just above 2 (E2M1: [2, 3); E4M3: [2, 2.25)), both signs: nearest is biased here
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    x = (2.0 + torch.rand(n, generator=g) * 0.2) * sign
    codes = mx.round_to_codes(x, fmt, "stochastic", torch.Generator().manual_seed(7))
    # error of the magnitude (a bias away from or towards zero would cancel between the signs otherwise)
    err = (mx.codes_to_float32(codes, fmt).double() - x.double()) * sign
    mean, se = float(err.mean()), float(err.std() / math.sqrt(n))
    assert abs(mean) < 3 * se, (mean, se)
    # the same inputs rounded to nearest are biased towards zero by far more than 3 s.e. (the test can fail)
    near = mx.codes_to_float32(mx.round_to_codes(x.abs(), fmt, "nearest"), fmt).double() - x.abs().double()
    assert abs(float(near.mean())) > 30 * se
    again = mx.round_to_codes(x, fmt, "stochastic", torch.Generator().manual_seed(7))
    other = mx.round_to_codes(x, fmt, "stochastic", torch.Generator().manual_seed(8))
    assert torch.equal(codes, again) and not torch.equal(codes, other)


# ---- random Hadamard transform ---------------------------------------------------------------------------------
def test_random_hadamard_is_orthogonal_and_keeps_the_product():
    h = mx.hadamard(16, torch.float64)
    np.testing.assert_allclose((h @ h.t()).numpy(), np.eye(16), atol=1e-15)
    assert torch.equal(h.abs(), torch.full((16, 16), 0.25, dtype=torch.float64))
    signs = torch.where(torch.rand(16, generator=torch.Generator().manual_seed(0)) < 0.5, -1.0, 1.0)
    r = mx.random_hadamard(signs)
    a, b = torch.randn(8, 64, dtype=torch.float64), torch.randn(12, 64, dtype=torch.float64)
    got = mx.apply_rht(a, r).double() @ mx.apply_rht(b, r).double().t()
    np.testing.assert_allclose(got.numpy(), (a @ b.t()).numpy(), rtol=1e-5, atol=1e-5)
    for bad in (12, 0):
        with pytest.raises(ValueError, match="power-of-2"):
            mx.hadamard(bad)
