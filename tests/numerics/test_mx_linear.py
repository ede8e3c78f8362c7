"""lowprec's block-scaled linear (MXLinear): each GEMM takes its operands quantized along its own contraction
dimension, the stabilisers do what the NVFP4 paper describes, and each is one recipe override away."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowprec.float8.mx_linear import MXLinear, mx_config
from lowprec.numerics.microscaling import apply_rht, quantize_mx, quantize_nvfp4, random_hadamard
from lowprec.recipes import CATALOG


def _linear(recipe: str, fin=64, fout=48, **block) -> MXLinear:
    """``recipe``'s block-scaled linear with ``recipe.fp8.block`` fields ``block`` replaced."""
    fields = block
    spec = CATALOG[recipe].with_fields("fp8.block", **fields).fp8 if fields else CATALOG[recipe].fp8
    torch.manual_seed(0)
    lin = MXLinear(fin, fout, False, mx_config(spec))
    lin.init_buffers(torch.Generator().manual_seed(1))
    return lin


def _fwd_bwd(lin, x, dy):
    x = x.clone().requires_grad_(True)
    lin.weight.grad = None
    out = lin(x)
    out.backward(dy)
    return out, x.grad, lin.weight.grad


def test_mxfp8_gemms_use_operands_quantized_along_their_contraction_dims():
    lin = _linear("mxfp8", fout=96)
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(32, 64, generator=g), torch.randn(32, 96, generator=g)
    with torch.no_grad():  # rows of very different magnitude: blocks along rows and along columns then differ
        lin.weight.mul_(torch.logspace(-2, 2, 96)[:, None])
    out, gx, gw = _fwd_bwd(lin, x, dy)
    w = lin.weight.detach()

    def q(t, elem="e4m3"):
        return quantize_mx(t, elem, 32, "rceil").dequantize()

    torch.testing.assert_close(out, q(x) @ q(w).t(), rtol=0, atol=1e-5)
    torch.testing.assert_close(gx, q(dy) @ q(w.t()).t(), rtol=0, atol=1e-5)
    torch.testing.assert_close(gw, q(dy.t()) @ q(x.t()).t(), rtol=0, atol=1e-5)
    assert not torch.equal(q(w.t()).t(), q(w)), "dgrad re-quantizes the weight along out_features"


def test_nvfp4_stabilisers():
    lin = _linear("nvfp4", grad_rounding="nearest")  # SR off here so the expectation is deterministic
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(32, 64, generator=g), torch.randn(32, 48, generator=g)
    out, gx, gw = _fwd_bwd(lin, x, dy)
    w = lin.weight.detach()
    qw = quantize_nvfp4(w, two_d=True)
    torch.testing.assert_close(out, quantize_nvfp4(x).dequantize() @ qw.dequantize().t(), rtol=0, atol=1e-5)
    # 2-D weight scaling: dgrad multiplies by exactly the weight the forward used
    torch.testing.assert_close(gx, quantize_nvfp4(dy).dequantize() @ qw.dequantize(), rtol=0, atol=1e-5)
    # RHT on the wgrad inputs along tokens, with the linear's fixed sign vector
    assert set(lin.rht_signs.tolist()) == {-1.0, 1.0}
    r = random_hadamard(lin.rht_signs)
    want = quantize_nvfp4(apply_rht(dy.t(), r)).dequantize() @ quantize_nvfp4(apply_rht(x.t(), r)).dequantize().t()
    torch.testing.assert_close(gw, want, rtol=0, atol=1e-5)
    # without RHT the wgrad differs (the transform is not a no-op on the quantization)
    _, _, gw_plain = _fwd_bwd(_linear("nvfp4", grad_rounding="nearest", rht_size=0), x, dy)
    assert not torch.equal(gw_plain, gw)


def test_stochastic_rounding_of_gradients_follows_the_global_seed():
    lin = _linear("nvfp4")
    g = torch.Generator().manual_seed(4)
    x, dy = torch.randn(32, 64, generator=g), torch.randn(32, 48, generator=g)
    grads = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        grads.append(_fwd_bwd(lin, x, dy)[2])
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])


def test_rht_signs_come_from_the_build_generator():
    a, b = _linear("nvfp4"), _linear("nvfp4")
    assert torch.equal(a.rht_signs, b.rht_signs)
    b.init_buffers(torch.Generator().manual_seed(99))
    assert not torch.equal(a.rht_signs, b.rht_signs)
    assert "rht_signs" in a.state_dict() and _linear("nvfp4_no_rht").rht_signs.numel() == 0


def test_precision_switch_runs_the_high_precision_linear():
    lin = _linear("nvfp4")
    x = torch.randn(16, 64)
    assert not lin.high_precision and not torch.equal(lin(x), F.linear(x, lin.weight))
    lin.hp_after_step.fill_(3)
    lin.steps_done.fill_(3)
    assert lin.high_precision and torch.equal(lin(x), F.linear(x, lin.weight))


@pytest.mark.parametrize(
    "variant, field, value",
    [
        ("nvfp4_no_rht", "block.rht_size", 0),
        ("nvfp4_no_2d", "block.weight_scaling_2d", False),
        ("nvfp4_no_sr", "block.grad_rounding", "nearest"),
        ("nvfp4_no_hp", "layers.hp_last_blocks", 0),
    ],
)
def test_each_ablation_variant_is_nvfp4_with_one_override(variant, field, value):
    group, _, name = field.partition(".")
    assert CATALOG["nvfp4"].with_fields(f"fp8.{group}", **{name: value}).hash() == CATALOG[variant].hash()


def test_precision_switch_at_a_fraction_of_the_run(token_data):
    from lowprec.build_optim import OptimHParams
    from lowprec.data import TokenBatches
    from lowprec.model import model_args
    from lowprec.train.build import build
    from lowprec.train.loop import run_training
    from lowprec.train.spec import TrainSpec

    recipe = CATALOG["nvfp4"].with_fields("fp8.block", precision_switch_at=0.5)
    spec = TrainSpec(steps=4, batch_size=2, seq_len=64, warmup_steps=1, val_every=0, val_batches=1,
                     timing_warmup_steps=1, telemetry_every=0, progress=False)  # fmt: skip
    b = build(recipe, model_args("debug"), spec, OptimHParams(), 0, torch.device("cpu"))
    mx = [m for m in b.model.modules() if isinstance(m, MXLinear)]
    assert mx and all(int(m.hp_after_step) == 2 and not m.high_precision and not m.switched for m in mx)

    class Sink:
        def log_metrics(self, m, step):
            pass

    run_training(b, TokenBatches(token_data.train, token_data.val, 64, 2, 0), spec, Sink())
    # ``switched`` is what torch.compile'd code reads (a tensor's value would be a graph break): it follows the buffers
    assert all(int(m.steps_done) == 4 and m.high_precision and m.switched for m in mx)
    fresh = build(recipe, model_args("debug"), spec, OptimHParams(), 0, torch.device("cpu"))
    fresh.model.load_state_dict(b.model.state_dict())  # a resume: the counters arrive by a state-dict load
    assert all(m.switched for m in fresh.model.modules() if isinstance(m, MXLinear))


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_a_token_count_off_the_block_equals_training_on_explicit_zero_tokens(recipe):
    # A MoE expert gets any number of tokens; the wgrad GEMM pads them with zeros. That must be exactly the
    # gradient of the same tokens plus appended all-zero tokens (input and grad_output rows of zeros).
    fields = {"grad_rounding": "nearest"} if recipe == "nvfp4" else {}
    g = torch.Generator().manual_seed(4)
    x, dy = torch.randn(13, 64, generator=g), torch.randn(13, 64, generator=g)
    pad = 32 - 13
    _, gx, gw = _fwd_bwd(_linear(recipe, fout=64, **fields), x, dy)
    _, gx_z, gw_z = _fwd_bwd(_linear(recipe, fout=64, **fields), F.pad(x, (0, 0, 0, pad)), F.pad(dy, (0, 0, 0, pad)))
    assert torch.equal(gw, gw_z)
    assert torch.equal(gx, gx_z[:13])
    exact = dy.double().t() @ x.double()  # and it is the product of the 13 real tokens, to the format's error
    assert (gw.double() - exact).norm() / exact.norm() < (0.05 if recipe == "mxfp8" else 0.3)
