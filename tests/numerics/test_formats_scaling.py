"""Quantization: bit-exact with torch's float8 casts, saturating, scale direction and shapes per granularity."""

import math

import pytest
import torch

from lowprec.numerics.formats import E4M3, E4M3FNUZ, E5M2, amax_to_scale, dequantize, quantize, sqnr_db
from lowprec.numerics.scaling import DelayedScaler, compute_amax, expand_scale, quantize_operand


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E4M3FNUZ])
def test_in_range_quantization_is_torchs_cast(fmt):
    x = torch.randn(4096) * fmt.max / 8
    q = quantize(x, torch.tensor(1.0), fmt)
    assert torch.equal(q.view(torch.uint8), x.to(fmt.dtype).view(torch.uint8))


def test_format_facts():
    assert (E4M3.max, E5M2.max, E4M3FNUZ.max) == (448.0, 57344.0, 240.0)
    assert (E4M3.eps, E5M2.eps) == (0.125, 0.25)
    # between 1 and 2: e4m3 holds 8 values, e5m2 holds 4
    grid = torch.linspace(1, 2, 10001)[:-1]
    for fmt, n in ((E4M3, 8), (E5M2, 4)):
        values = grid.to(fmt.dtype).float().unique()
        assert values[values < 2].numel() == n


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_saturation_never_gives_inf(fmt):
    x = torch.tensor([1e9, -1e9, fmt.max * 1.5, float("inf"), -float("inf")])
    q = quantize(x, torch.tensor(1.0), fmt).float()
    assert torch.equal(q, torch.tensor([fmt.max, -fmt.max, fmt.max, fmt.max, -fmt.max]))


def test_scale_direction_multiplies():
    x = torch.tensor([0.001, -0.002, 0.004])
    scale = amax_to_scale(compute_amax(x.view(1, -1), "tensorwise"), E4M3)
    assert scale.item() == pytest.approx(448 / 0.004)
    q = quantize(x, scale, E4M3)
    assert q.float().abs().max().item() == 448.0  # amax maps to the format's max
    torch.testing.assert_close(dequantize(q, scale), x, rtol=0.07, atol=0)
    p2 = amax_to_scale(torch.tensor(0.004), E4M3, power_of_2=True)
    assert math.log2(p2.item()).is_integer() and p2.item() <= 448 / 0.004
    assert amax_to_scale(torch.tensor(0.004), E4M3, margin=2).item() == pytest.approx(448 / 0.004 / 4)


@pytest.mark.parametrize(
    "gran, shape",
    [
        ("tensorwise", ()),
        ("rowwise", (200, 1)),
        ("tile1x128", (200, 3)),
        ("block128x128", (2, 3)),
    ],
)
def test_scale_shapes_and_round_trip(gran, shape):
    x = torch.randn(200, 300)
    q = quantize_operand(x, E4M3, gran)
    assert tuple(q.scale.shape) == shape and q.scale.dtype == torch.float32
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == x.shape
    assert expand_scale(q.scale, gran, x.shape).expand_as(x).shape == x.shape
    assert sqnr_db(x, q.dequantize()) >= 25


@pytest.mark.parametrize("gran", ["tile1x128", "block128x128"])
def test_an_outlier_changes_only_its_own_group(gran):
    x = torch.randn(256, 384)
    base = quantize_operand(x, E4M3, gran).scale
    y = x.clone()
    y[130, 200] = 1e4  # row 130 -> block row 1; column 200 -> K-group 1
    hit = quantize_operand(y, E4M3, gran).scale
    changed = (hit != base).nonzero().tolist()
    assert changed == ([[130, 1]] if gran == "tile1x128" else [[1, 1]])


def test_rowwise_outlier_changes_one_row():
    x = torch.randn(64, 128)
    y = x.clone()
    y[5, 7] = 1e4
    diff = (quantize_operand(y, E4M3, "rowwise").scale != quantize_operand(x, E4M3, "rowwise").scale).nonzero()
    assert diff.tolist() == [[5, 0]]


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1])
def test_delayed_scaling_follows_transformer_engines_rule(algo, margin):
    """A known amax sequence; the scale of step t must come from the history before t."""
    length = 3
    s = DelayedScaler(E4M3, amax_history_len=length, amax_compute_algo=algo, margin=margin)
    s.reset()
    amaxes = [2.0, 8.0, 1.0, 0.5, 0.25, 4.0]
    for t, a in enumerate(amaxes):
        seen = amaxes[:t]
        if not seen:
            expected = 1.0
        else:
            window = seen[-length:]
            ref = max(window) if algo == "max" else seen[-1]
            expected = 448.0 / ref / 2**margin
        assert s.scale.item() == pytest.approx(expected, rel=1e-6), f"step {t}"
        s.record(torch.tensor(a))
        s.update()


def test_delayed_scaler_keeps_scale_on_zero_amax_and_survives_state_dict():
    s = DelayedScaler(E4M3, 4, "max", 0)
    s.reset()
    s.record(torch.tensor(2.0))
    s.update()
    s2 = DelayedScaler(E4M3, 4, "max", 0)
    s2.load_state_dict(s.state_dict())
    assert torch.equal(s2.amax_history, s.amax_history) and s2.scale.item() == 224.0
    for _ in range(5):  # zeros only: history empties, scale stays
        s.update()
    assert s.scale.item() == 224.0


def test_single_casts_reach_25_db_on_gaussian_inputs():
    x = torch.randn(512, 1024)
    for gran in ("tensorwise", "rowwise", "tile1x128", "block128x128"):
        for fmt in (E4M3, E5M2):
            db = sqnr_db(x, quantize_operand(x, fmt, gran).dequantize())
            assert db >= (25 if fmt is E4M3 else 20), (gran, fmt.name, db)


@pytest.mark.parametrize("gran", ["tile1x128", "block128x128", "rowwise", "tensorwise"])
@pytest.mark.parametrize("shape", [(256, 384), (384, 256), (200, 384)])
def test_a_transposed_operand_quantizes_exactly_like_its_contiguous_copy(gran, shape):
    """The backward quantizes ``dy.t()`` and ``x.t()``; the fast path reads them in their transpose's memory
    order and must give the same amax, scale, FP8 bytes and dequantized values as a contiguous copy."""
    x = torch.randn(shape) * torch.logspace(-3, 2, shape[1])  # per-column magnitudes: groups differ
    xt = x.t()
    assert not xt.is_contiguous()
    ref = quantize_operand(xt.contiguous(), E4M3, gran)
    got = quantize_operand(xt, E4M3, gran)
    assert torch.equal(compute_amax(xt, gran), compute_amax(xt.contiguous(), gran))
    assert torch.equal(got.scale, ref.scale)
    assert got.data.shape == ref.data.shape
    assert torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(got.dequantize(), ref.dequantize())


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E4M3FNUZ], ids=lambda f: f.name)
def test_fp8_decoding_by_table_is_torchs_cast_bit_for_bit(fmt):
    from lowprec.numerics.formats import fp8_to_float32

    g = torch.Generator().manual_seed(0)
    codes = torch.cat([torch.arange(256), torch.randint(0, 256, (256 * 5,), generator=g)]).to(torch.uint8)
    codes = codes.view(6, 256).contiguous()  # every code (NaN, -0 and subnormals included), then random ones
    x = codes.view(fmt.dtype)
    assert x.is_contiguous() and x.t().t().is_contiguous() and not x.t().is_contiguous()
    for t in (x, x.t(), x[:, ::2]):  # contiguous, transposed, strided (the cast)
        got, ref = fp8_to_float32(t), t.float()
        assert got.shape == ref.shape and got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
