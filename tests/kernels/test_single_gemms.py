"""Single emulated GEMMs and attention: bit for bit what the CUDA kernel's rounding points give."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowprec.float8.gemm import fp8_gemm
from lowprec.kernels import EmulatedLinear, emulated_sdpa
from lowprec.kernels.scaled_mm import ScaledMMCall, emulated_scaled_mm, native_scaled_mm
from lowprec.numerics.formats import E4M3, E5M2
from lowprec.numerics.scaling import quantize_operand

LOW = [torch.bfloat16, torch.float16]


def _rounded_mm(a: torch.Tensor, b: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """``dt(fp32_mm(dt(a), dt(b)))``: low-precision operands, FP32 accumulation, one rounding."""
    return (a.to(dt).float() @ b.to(dt).float()).to(dt)


@pytest.mark.parametrize("dt", LOW)
@pytest.mark.parametrize("autocast", [True, False])
def test_linear_forward_and_backward_round_once(dt, autocast):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 96, generator=gen)
    lin = torch.nn.Linear(96, 80, bias=False)
    lin.weight.data = torch.randn(80, 96, generator=gen)
    if not autocast:
        x, lin = x.to(dt), lin.to(dt)
    x.requires_grad_(True)
    emu = EmulatedLinear.from_linear(lin)
    with torch.autocast("cpu", dtype=dt, enabled=autocast):
        y = emu(x)
    assert y.dtype == dt
    assert torch.equal(y, _rounded_mm(x.detach(), lin.weight.detach().t(), dt))
    g = torch.randn(y.shape, generator=gen).to(dt)
    y.backward(g)
    x2, w2 = x.detach().reshape(-1, 96), lin.weight.detach()
    assert torch.equal(x.grad, _rounded_mm(g, w2, dt).to(x.dtype))
    gw = _rounded_mm(g.reshape(-1, 80).t(), x2, dt)
    assert torch.equal(lin.weight.grad, gw.to(lin.weight.dtype))


def test_linear_fp32_is_the_native_op():
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    assert torch.equal(EmulatedLinear.from_linear(lin)(x), lin(x))


@pytest.mark.parametrize("dt", LOW)
def test_attention_output_and_grads_round_once(dt):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 48, 16, generator=gen).to(dt).requires_grad_(True) for _ in range(3))
    out = emulated_sdpa(q, k, v, is_causal=True)
    ref_in = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    assert out.dtype == dt
    torch.testing.assert_close(out.float(), ref.to(dt).float(), rtol=0, atol=2**-7)
    g = torch.randn(out.shape, generator=gen).to(dt)
    out.backward(g)
    ref.backward(g.float())
    # The backward reads the output as saved, rounded to dt (D = rowsum(dO * O), as FlashAttention does on
    # CUDA); the FP32 reference uses its FP32 output, so elements where terms cancel may differ by more than one
    # rounding: compare to the gradient's own scale.
    for got, want in zip((q, k, v), ref_in, strict=True):
        assert got.grad.dtype == dt
        scale = want.grad.abs().max().item()
        torch.testing.assert_close(got.grad.float(), want.grad.to(dt).float(), rtol=2**-6, atol=2**-6 * scale)


def _fp8_call(scale_a: float, scale_b: float, k: int, out_dtype) -> ScaledMMCall:
    gen = torch.Generator().manual_seed(k)
    a = (torch.randn(64, k, generator=gen) * 3).to(torch.float8_e4m3fn)
    b = (torch.randn(48, k, generator=gen) * 3).to(torch.float8_e4m3fn).t()
    return ScaledMMCall(a, b, torch.tensor(scale_a), "TensorWise", torch.tensor(scale_b), "TensorWise", out_dtype)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_emulated_scaled_mm_scales_the_fp32_accumulator(out_dtype):
    # CUDA's contract: exact FP8 products, FP32 accumulation, then alpha = scale_a * scale_b, one rounding.
    # With K = 32 the FP32 accumulation of e4m3 products is exact (as the float64 one is), so one rounding of
    # alpha * sum is the answer; a kernel that scaled the operands first would round each of them.
    call = _fp8_call(0.37, 1.9, 32, out_dtype)
    acc64 = call.mat_a.double() @ call.mat_b.double()
    assert torch.equal(acc64.float().double(), acc64), "the test needs an exactly representable sum"
    alpha = (call.scale_a * call.scale_b).double()  # alpha itself is formed in FP32, as cuBLASLt does
    want = (acc64.float() * alpha.float()).to(out_dtype)
    assert torch.equal(emulated_scaled_mm(call), want)


def test_emulated_scaled_mm_equals_native_with_power_of_two_scales():
    # With exact scales there is one right answer, and both paths must give it.
    call = _fp8_call(0.5, 2.0, 256, torch.bfloat16)
    assert torch.equal(emulated_scaled_mm(call), native_scaled_mm(call))


def test_native_scaled_mm_traces_fullgraph_under_dynamo():
    # train.compile compiles blocks with fullgraph=True, so the native op must be traceable (on torch 2.11 + CUDA
    # the public F.scaled_mm was not; lowprec.kernels.scaled_mm.native_scaled_mm).
    call = _fp8_call(0.5, 2.0, 256, torch.bfloat16)

    def run(a, b):
        return native_scaled_mm(
            ScaledMMCall(a, b, call.scale_a, "TensorWise", call.scale_b, "TensorWise", call.out_dtype)
        )

    out = torch.compile(run, fullgraph=True, backend="aot_eager")(call.mat_a, call.mat_b)
    assert torch.equal(out, native_scaled_mm(call))


@pytest.mark.parametrize(
    "ga,gb,chunks",
    [
        ("tensorwise", "tensorwise", None),
        # tensorwise operands cut into 128-wide promotion chunks: deepseek_v3_tensorwise's weight-gradient GEMM
        # (test_parity leaves that recipe out and relies on this case)
        ("tensorwise", "tensorwise", 128),
        ("rowwise", "rowwise", None),
        ("tile1x128", "block128x128", 128),
        ("tile1x128", "tile1x128", 128),
    ],
    ids=["tensorwise", "tensorwise-chunked", "rowwise", "tile-block", "tile-tile"],
)
def test_fp8_gemm_kernels_agree(ga, gb, chunks):
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(96, 256, generator=gen), torch.randn(128, 256, generator=gen) * 0.05
    a, bt = quantize_operand(x, E4M3, ga), quantize_operand(w, E5M2 if ga == "tensorwise" else E4M3, gb)
    native = fp8_gemm(a, bt, torch.float32, promotion_interval=chunks, kernel="native")
    emulated = fp8_gemm(a, bt, torch.float32, promotion_interval=chunks, kernel="emulated")
    # CPU native scales the operands before its FP32 matmul, emulated (like CUDA) the accumulator: same sums,
    # a few FP32 ulps apart.
    torch.testing.assert_close(emulated, native, rtol=1e-5, atol=1e-5)


def test_unknown_kernel_is_refused():
    q = quantize_operand(torch.randn(4, 32), E4M3, "tensorwise")
    with pytest.raises(ValueError, match="unknown FP8 GEMM kernel"):
        fp8_gemm(q, q, torch.float32, kernel="fast")
