"""E5M6 (DeepSeek-V3 3.3.3) against an independent decoder of every code, written here from the definition:
1 sign, 5 exponent bits (bias 15, field 31 reserved), 6 mantissa bits, IEEE-like subnormals; nearest value with
ties to the even mantissa code, saturating at the largest finite value."""

from __future__ import annotations

import bisect
from fractions import Fraction

import pytest
import torch

from lowprec.numerics import e5m6


def _all_nonnegative_values() -> list[Fraction]:
    """Every finite non-negative E5M6 value in code order (code = exponent_field << 6 | mantissa)."""
    out = []
    for ef in range(31):  # 31 = inf/NaN
        for m in range(64):
            if ef == 0:
                out.append(Fraction(m, 64) * Fraction(2) ** -14)
            else:
                out.append((1 + Fraction(m, 64)) * Fraction(2) ** (ef - 15))
    return out


VALUES = _all_nonnegative_values()


def _reference(x: float) -> float:
    """Nearest E5M6 value by exhaustive search over the codes; ties to the even code; saturating."""
    a = Fraction(abs(x))
    if a >= VALUES[-1]:
        best = VALUES[-1]
    else:
        hi = bisect.bisect_left(VALUES, a)
        if VALUES[hi] == a:
            best = a
        else:
            lo = hi - 1
            dlo, dhi = a - VALUES[lo], VALUES[hi] - a
            best = VALUES[lo] if dlo < dhi or (dlo == dhi and lo % 2 == 0) else VALUES[hi]
    return float(best) if x >= 0 else -float(best)


def test_constants_match_the_code_table():
    assert e5m6.MAX == float(VALUES[-1]) == 65024.0
    assert e5m6.MIN_NORMAL == float(VALUES[64]) == 2.0**-14
    assert e5m6.MIN_SUBNORMAL == float(VALUES[1]) == 2.0**-20


def test_every_code_and_every_midpoint_rounds_as_the_reference():
    vals = [float(v) for v in VALUES]
    mids = [float((a + b) / 2) for a, b in zip(VALUES, VALUES[1:])]  # exact ties: exercise ties-to-even
    quarter = [float(a + (b - a) / 4) for a, b in zip(VALUES, VALUES[1:])]
    xs = vals + mids + quarter + [-v for v in mids[::7]]
    got = e5m6.round_e5m6(torch.tensor(xs, dtype=torch.float64)).tolist()
    want = [_reference(x) for x in xs]
    assert got == want


def test_random_values_across_the_range_and_saturation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-24, 18, (3000,), generator=g))
    x = torch.cat([x, torch.tensor([70000.0, -1e9, 65024.0, 65279.0, 65280.0, 0.0, 2.0**-21, 2.0**-21 * 1.0001])])
    got = e5m6.round_e5m6(x).tolist()
    assert got == [_reference(v) for v in x.tolist()]


def test_nan_stays_nan_and_inf_saturates():
    y = e5m6.round_e5m6(torch.tensor([float("nan"), float("inf"), float("-inf")]))
    assert torch.isnan(y[0]) and y[1].item() == 65024.0 and y[2].item() == -65024.0


def test_tiles_use_power_of_2_scales_that_fill_the_range():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 300, generator=g) * torch.tensor([1e-3, 1.0, 50.0, 0.0])[:, None]
    values, scale = e5m6.e5m6_tiles(x)
    assert scale.shape == (4, 3)
    for r in range(4):
        for t in range(3):
            tile = x[r, t * 128 : (t + 1) * 128].double()
            amax = float(tile.abs().max())
            s = float(scale[r, t])
            assert s == 2.0 ** int(torch.tensor(s).log2())  # a power of 2
            if amax == 0:
                assert s == 1.0
                continue
            assert amax * s <= 65024.0 < amax * s * 2  # the largest power of 2 that keeps the tile in range
            want = [_reference(v * s) / s for v in tile.tolist()]
            assert values[r, t * 128 : (t + 1) * 128].tolist() == want


def test_tiles_refuse_non_2d():
    with pytest.raises(ValueError, match="2-D"):
        e5m6.e5m6_tiles(torch.zeros(2, 3, 4))
