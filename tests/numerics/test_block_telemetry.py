"""Block-scale telemetry on a real MXLinear: the statistics against computations written here, RHT's effect on
the weight-gradient SQNR, and a sampled step that trains exactly as an unsampled one."""

from __future__ import annotations

import torch
from torch import nn

from lowprec.float8.mx_linear import MXLinear, mx_config
from lowprec.measure.block_telemetry import BlockScaleTelemetry
from lowprec.numerics.microscaling import apply_rht, quantize_nvfp4, random_hadamard
from lowprec.recipes import CATALOG


class Net(nn.Module):
    def __init__(self, recipe: str, **block):
        super().__init__()
        fields = block  # ``recipe.fp8.block`` fields
        spec = CATALOG[recipe].with_fields("fp8.block", **fields).fp8 if fields else CATALOG[recipe].fp8
        torch.manual_seed(0)
        self.proj = MXLinear(64, 96, False, mx_config(spec))
        self.proj.init_buffers(torch.Generator().manual_seed(1))


def _step(net, tel, x, dy, step=0):
    if tel:
        tel.before_step(step)
    net.proj.weight.grad = None
    net.proj(x).backward(dy)
    return tel.after_step(step) if tel else {}, net.proj.weight.grad.clone()


def _data(outlier: bool = False):
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(64, 64, generator=g), torch.randn(64, 96, generator=g)
    if outlier:  # a few tokens with huge gradients: each 16-token block holding one is crushed without RHT
        dy[::16] *= 200.0
    return x, dy


def test_block_statistics_match_independent_computations():
    net = Net("mxfp8", mx_scale_mode="floor")
    tel = BlockScaleTelemetry(net, every=1)
    x, dy = _data()
    x[0, :32] = 1e-3 * x[0, :32]  # one block of tiny values
    m, _ = _step(net, tel, x, dy)
    p = "mx/proj/input/"
    # E8M0 exponents of FLOOR scaling: floor(log2(block amax)) - 8 (e4m3's emax)
    amax = x.reshape(64, 2, 32).abs().amax(-1).double()
    want = torch.floor(torch.log2(amax)) - 8
    assert m[p + "scale_exp_min"] == float(want.min()) and m[p + "scale_exp_max"] == float(want.max())
    # FLOOR lets the block's largest elements exceed 448 * scale: they saturate
    y = x.reshape(64, 2, 32).double() / torch.pow(2.0, want)[..., None]
    assert m[p + "elem_saturated"] == float((y.abs() > 448).double().mean()) > 0
    assert m[p + "scale_saturated"] == 0.0 and m[p + "scale_underflow"] == 0.0
    hist = {k: v for k, v in m.items() if k.startswith("mx/all/input/scale_exp/")}
    assert abs(sum(hist.values()) - 1) < 1e-9
    assert m["mx/proj/output/sqnr_db"] > 20  # e4m3 with saturating FLOOR scales: about 25 dB


def test_weight_gradient_sqnr_with_and_without_rht():
    net = Net("nvfp4")
    tel = BlockScaleTelemetry(net, every=1)
    x, dy = _data(outlier=True)
    m, _ = _step(net, tel, x, dy)
    r = random_hadamard(net.proj.rht_signs)
    ref = dy.t().double() @ x.double()

    def sqnr(a, b):  # FP64, from the definition; operands quantized round-to-nearest as the telemetry states
        got = quantize_nvfp4(a).dequantize().double() @ quantize_nvfp4(b).dequantize().double().t()
        return float(20 * torch.log10(ref.norm() / (ref - got).norm()))

    assert abs(m["mx/proj/wgrad_sqnr_db_plain"] - sqnr(dy.t(), x.t())) < 1e-6
    assert abs(m["mx/proj/wgrad_sqnr_db_rht"] - sqnr(apply_rht(dy.t(), r), apply_rht(x.t(), r))) < 1e-6
    assert m["mx/proj/wgrad_sqnr_db_rht"] != m["mx/proj/wgrad_sqnr_db_plain"]
    assert m["mx/proj/grad_output/elem_underflow"] > 0  # the small gradients beside the outlier tokens


def test_sampling_does_not_change_training():
    x, dy = _data()
    grads = []
    for sample in (True, False):
        net = Net("nvfp4")  # stochastic rounding of gradients: the global generator must not be touched
        torch.manual_seed(3)
        grads.append(_step(net, BlockScaleTelemetry(net, 1) if sample else None, x, dy)[1])
    assert torch.equal(grads[0], grads[1])
