"""Two planted bugs that survived the suite, each pinned by the input that tells it apart.

- ``stochastic_round_bf16`` with ``rand <= low_bits`` instead of ``<``: values already exactly representable in
  BF16 (low 16 bits zero) would move up one ulp with probability 2**-16. SR of such values must be the identity.
- ``mx_scale_exponent(..., "rceil")`` without its exact-power-of-2 case: a block whose amax is exactly the
  element format's maximum times a power of two must keep that power (E8M0 code 127 + k), not round up.
"""

import pytest
import torch

from lowprec.numerics.microscaling import E8M0_BIAS, ELEMENTS, mx_scale_exponent, quantize_mx
from lowprec.optim.rounding import stochastic_round_bf16


def test_stochastic_rounding_of_values_exactly_representable_in_bf16_is_the_identity():
    # 2**20 bf16 values spanning the whole exponent range (random bit patterns, NaN/inf removed): a one-in-65,536
    # upward move, as with `rand <= low_bits`, shows up ~16 times here on average (P(no move) = e**-16).
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(1 << 15), 1 << 15, (1 << 20,), dtype=torch.int16, generator=g)
    x = bits.view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    got = stochastic_round_bf16(x, generator=torch.Generator().manual_seed(1))
    assert torch.equal(got.view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("elem", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("k", [-3, 0, 5])
def test_rceil_keeps_the_exponent_when_amax_is_the_format_max_times_a_power_of_two(elem, k):
    fmt = ELEMENTS[elem]
    amax = torch.tensor([fmt.max * 2.0**k])
    assert mx_scale_exponent(amax, fmt, "rceil").item() == k
    # a hair above needs the next power of two
    assert mx_scale_exponent(torch.nextafter(amax, torch.tensor(float("inf"))), fmt, "rceil").item() == k + 1


def test_mxfp8_block_with_max_exactly_448_under_rceil_gets_e8m0_code_127():
    x = torch.linspace(-1.0, 1.0, 64).reshape(2, 32) * 100.0
    x[0, 5] = 448.0
    x[1, 7] = -448.0 * 4
    q = quantize_mx(x, "e4m3", scale_mode="rceil")
    assert q.scale.flatten().tolist() == [E8M0_BIAS, E8M0_BIAS + 2]
    # the block maximum is stored as the element format's maximum, exactly
    assert q.dequantize().abs().amax(-1).tolist() == [448.0, 1792.0]
