"""lowprec's FP8 linear against torchao's Float8Linear, across GEMM backends, and its SQNR."""

import copy
from dataclasses import replace

import pytest
import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from lowprec.float8 import Float8Linear, fp8_gemm, linear_config
from lowprec.float8.gemm import round_mantissa
from lowprec.numerics.formats import E4M3, sqnr_db
from lowprec.numerics.scaling import quantize_operand
from lowprec.recipe import CastSpec, Float8Spec, SavedSpec

SPECS = {
    "tensorwise": Float8Spec(backend="lowprec", scaling="tensorwise", cast=CastSpec(fp8_format="hybrid")),
    "rowwise": Float8Spec(
        backend="lowprec", scaling="rowwise", cast=CastSpec(fp8_format="e4m3", power_of_2_scales=True)
    ),
    "blockwise": Float8Spec(backend="lowprec", scaling="blockwise", cast=CastSpec(fp8_format="e4m3")),
    "delayed": Float8Spec(
        backend="lowprec", scaling="tensorwise", cast=CastSpec(strategy="delayed", fp8_format="hybrid")
    ),
}


def _run(mod, x, g):
    x = x.clone().requires_grad_()
    y = mod(x)
    y.backward(g)
    return y.detach(), x.grad, mod.weight.grad


def _pair(name, dtype=torch.float32, n=512, k=256, m=64, **spec_overrides):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False).to(dtype)
    ref = torch.nn.Sequential(copy.deepcopy(lin))
    spec = replace(SPECS[name], **spec_overrides)
    mine = Float8Linear.from_linear(copy.deepcopy(lin), linear_config(spec))
    x, g = torch.randn(m, k, dtype=dtype), torch.randn(m, n, dtype=dtype)
    return lin, ref, mine, x, g


def test_tensorwise_matches_torchao_bit_for_bit():
    _, ref, mine, x, g = _pair("tensorwise")
    convert_to_float8_training(ref, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    for a, b in zip(_run(ref[0], x, g), _run(mine, x, g)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_rowwise_matches_torchao_to_its_bf16_rounding():
    """torchao's rowwise GEMMs produce BF16 and rescale afterwards (``addmm_float8_unwrapped``), so the
    two agree to BF16 rounding of the result, not bit for bit."""
    _, ref, mine, x, g = _pair("rowwise")
    convert_to_float8_training(ref, config=Float8LinearConfig.from_recipe_name("rowwise"))
    for a, b in zip(_run(ref[0], x, g), _run(mine, x, g)):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-7 * a.abs().max().item())


@pytest.mark.parametrize("name", list(SPECS))
def test_scaled_mm_and_emulated_backends_agree(name):
    _, _, mine, x, g = _pair(name)
    emu = copy.deepcopy(mine)
    spec = SPECS[name]
    emu.fp8_config = linear_config(replace(spec, gemm=replace(spec.gemm, gemm_backend="emulated")))
    for a, b in zip(_run(mine, x, g), _run(emu, x, g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * a.abs().max().item())


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise"])
def test_output_and_gradients_reach_18_db(name):
    lin, _, mine, x, g = _pair(name)
    y_ref, gx_ref, gw_ref = _run(lin, x, g)
    for ref, got in zip((y_ref, gx_ref, gw_ref), _run(mine, x, g)):
        assert sqnr_db(ref, got) >= 18


def test_bf16_inputs_under_autocast_give_bf16_outputs_and_fp32_weight_grads():
    _, _, mine, x, g = _pair("blockwise")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mine(x.requires_grad_())
    assert y.dtype == torch.bfloat16
    y.backward(g.bfloat16())
    assert mine.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


def test_fp8_activation_cache_saves_a_quarter_of_the_bytes_and_the_same_grads():
    _, _, plain, x, g = _pair("blockwise")
    cached = copy.deepcopy(plain)
    cached.fp8_config = linear_config(replace(SPECS["blockwise"], saved=SavedSpec(cache_fp8_activations=True)))
    saved = {}
    for name, mod in (("plain", plain), ("cached", cached)):
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size() if t.data_ptr() != mod.weight.data_ptr() else 0)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            xin = x.clone().requires_grad_()
            y = mod(xin)
        y.backward(g)
        saved[name] = sum(sizes)
    # fp32 input (4 B/elem) -> e4m3 input (1 B/elem) + one fp32 scale per 128 elements
    assert saved["cached"] == x.numel() + 4 * x.shape[0] * 2
    assert saved["plain"] == 4 * x.numel()


def test_delayed_linear_uses_the_previous_steps_amax():
    _, _, mine, x, g = _pair("delayed")
    mine.init_buffers()
    assert mine.scalers["input"].scale.item() == 1.0
    _run(mine, x, g)
    mine.update_scales()
    assert mine.scalers["input"].scale.item() == pytest.approx(448 / x.abs().max().item(), rel=1e-6)
    assert mine.scalers["grad_output"].scale.item() == pytest.approx(57344 / g.abs().max().item(), rel=1e-6)
    state = mine.state_dict()
    assert "scalers.input.amax_history" in state and "scalers.weight.scale" in state


def test_promotion_interval_and_limited_accumulation():
    """DeepSeek-V3 section 3.3.2: a ~14-bit accumulator loses accuracy at large K unless partial sums are
    promoted to FP32 every N_C = 128 elements."""
    torch.manual_seed(0)
    k = 4096
    a = quantize_operand(torch.randn(64, k), E4M3, "tile1x128")
    b = quantize_operand(torch.randn(64, k), E4M3, "block128x128")
    exact = a.dequantize().double() @ b.dequantize().double().t()
    promoted = fp8_gemm(a, b, torch.float32, promotion_interval=128, accum_mantissa_bits=14)
    ta = quantize_operand(torch.randn(64, k), E4M3, "tensorwise")
    tb = quantize_operand(torch.randn(64, k), E4M3, "tensorwise")
    exact_t = ta.dequantize().double() @ tb.dequantize().double().t()
    no_promotion = fp8_gemm(ta, tb, torch.float32, accum_mantissa_bits=14)
    with_promotion = fp8_gemm(ta, tb, torch.float32, promotion_interval=128, accum_mantissa_bits=14)
    assert sqnr_db(exact_t, with_promotion) > sqnr_db(exact_t, no_promotion) + 6
    assert sqnr_db(exact, promoted) > 60
    assert torch.equal(round_mantissa(torch.tensor([1.0 + 2**-10]), 8), torch.tensor([1.0]))
