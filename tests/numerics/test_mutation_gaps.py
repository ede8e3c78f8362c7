"""Behaviours that surviving mutants of ``scripts/mutation.py`` showed to be untested.

Each test checks lowprec against an independent computation (plain torch / arithmetic written out here), at
inputs chosen so that the mutant's behaviour differs: e.g. ``margin=3`` (the suite used 1 and 2, where
``2**m == 2*m``), a delayed-scaling history longer than 3 (where rolling by -2 is rolling by +1), a
bf16 input with a 0-dim scale (where torch's type promotion would keep the product in bf16).
"""

import math
import random

import pytest
import torch
from torch import nn

from lowprec.numerics.formats import E4M3, E5M2, amax_to_scale, dequantize, quantize, sqnr_db
from lowprec.numerics.scaling import DelayedScaler, quantize_operand
from lowprec.optim.loss_scale import DynamicLossScaler, NoLossScaler, grad_underflow_share
from lowprec.optim.master import MasterWeightOptimizer

# ---- lowprec/numerics/formats.py --------------------------------------------------------------------------


@pytest.mark.parametrize("margin", [0, 1, 3, 5])
def test_margin_divides_the_scale_by_two_to_the_margin(margin):
    amax = torch.tensor(3.5)
    got = amax_to_scale(amax, E4M3, margin=margin)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(448.0 / 3.5 / 2**margin, rel=1e-6)


def test_quantize_multiplies_in_fp32_even_for_bf16_inputs_and_0_dim_scales():
    # torch keeps bf16 * (0-dim fp32 tensor) in bf16; the product must be taken in fp32 (torchao's rule), or
    # a double rounding (bf16, then e4m3) changes some casts.
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1 << 14, generator=g) * 3).bfloat16()
    scale = torch.tensor(448.0 / 13.37)
    expected = (x.float() * scale.item()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(quantize(x, scale, E4M3).view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dequantize_returns_the_requested_dtype(dtype):
    x = torch.randn(64, 256)
    q = quantize_operand(x, E4M3, "tile1x128")
    scale = q.scale.repeat_interleave(128, dim=1)
    expected = (q.data.float() / scale).to(dtype)
    for got in (dequantize(q.data, scale, dtype), q.dequantize(dtype)):
        assert got.dtype == dtype and torch.equal(got, expected)


def test_sqnr_db_known_values():
    ref = torch.tensor([10.0, 0.0])
    # noise norm exactly 1: 20 log10(10 / 1) = 20 dB
    assert sqnr_db(ref, torch.tensor([9.0, 0.0])) == pytest.approx(20.0, abs=1e-9)
    # ||ref|| = 5, noise 0.05: 20 log10(100) = 40 dB
    f64 = dict(dtype=torch.float64)
    assert sqnr_db(torch.tensor([3.0, 4.0], **f64), torch.tensor([3.0, 4.05], **f64)) == pytest.approx(40.0, abs=1e-6)
    assert sqnr_db(ref, ref.clone()) == math.inf


# ---- lowprec/numerics/scaling.py: DelayedScaler ---------------------------------------------------------


def _reference_scales(amaxes, length, algo, margin, fmt_max=448.0, power_of_2=False):
    """Transformer Engine's DelayedScaling written out: the scale used at step t comes from the amaxes of
    steps t-length .. t-1 (``max``) or step t-1 (``most_recent``); it starts at 1 and is kept when that
    amax is 0."""
    scales, scale = [], 1.0
    for t in range(len(amaxes) + 1):
        scales.append(scale)
        if t == len(amaxes):
            break
        window = amaxes[max(0, t + 1 - length) : t + 1]
        a = max(window) if algo == "max" else amaxes[t]
        if a > 0:
            scale = fmt_max / a / 2**margin
            if power_of_2:
                scale = 2.0 ** math.floor(math.log2(scale))
    return scales


@pytest.mark.parametrize("length", [1, 2, 4, 5])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaler_window_matches_transformer_engine_for_every_history_length(length, algo):
    rng = random.Random(length * 10 + len(algo))
    amaxes = [rng.choice([0.25, 0.5, 1.0, 2.0, 8.0, 64.0]) for _ in range(12)]
    amaxes[3] = 100.0  # one spike: it must leave the window exactly `length` steps later
    s = DelayedScaler(E4M3, amax_history_len=length, amax_compute_algo=algo, margin=0)
    s.reset()
    got = []
    for a in amaxes:
        got.append(s.scale.item())
        s.record(torch.tensor(a))
        s.update()
    got.append(s.scale.item())
    assert got == pytest.approx(_reference_scales(amaxes, length, algo, 0), rel=1e-6)


def test_delayed_scaler_rounds_to_a_power_of_two_when_asked():
    amaxes = [3.0, 0.7, 5.0]
    s = DelayedScaler(E5M2, amax_history_len=2, amax_compute_algo="max", margin=1, power_of_2=True)
    s.reset()
    got = []
    for a in amaxes:
        s.record(torch.tensor(a))
        s.update()
        got.append(s.scale.item())
    expected = _reference_scales(amaxes, 2, "max", 1, fmt_max=57344.0, power_of_2=True)[1:]
    assert got == expected
    assert all(math.log2(v).is_integer() for v in got)


@pytest.mark.parametrize("gran", ["tensorwise", "rowwise"])
def test_current_scaling_by_default_maps_each_groups_amax_to_the_format_max(gran):
    # power_of_2 defaults to False: the scale is exactly fmt.max / amax, not rounded down to a power of two
    x = torch.randn(16, 64) * 3.7
    q = quantize_operand(x, E4M3, gran)
    amax = x.abs().amax() if gran == "tensorwise" else x.abs().amax(dim=1, keepdim=True)
    expected = (448.0 / amax.double()).float()
    assert torch.equal(q.scale, expected)
    assert not all(math.log2(v).is_integer() for v in q.scale.flatten().tolist())
    # so each group's largest element lands on +-448 exactly
    peak = q.data.float().abs().amax() if gran == "tensorwise" else q.data.float().abs().amax(dim=1)
    assert torch.all(peak == 448.0)


# ---- lowprec/optim/loss_scale.py -----------------------------------------------------------------


def test_grad_underflow_share_counts_zero_elements_over_all_gradients():
    a, b, c = (
        torch.zeros(4, requires_grad=True),
        torch.zeros(2, requires_grad=True),
        torch.zeros(3, requires_grad=True),
    )
    a.grad = torch.tensor([0.0, 1.0, 0.0, 2.0])  # 2 zeros of 4
    b.grad = torch.tensor([0.0, 3.0])  # 1 zero of 2; c has no gradient and is not counted
    assert grad_underflow_share([a, b, c]) == 3 / 6
    assert math.isnan(grad_underflow_share([c]))


def test_loss_scaler_state_is_not_loaded_across_enabled_and_disabled_scalers():
    on, off = DynamicLossScaler(init_scale=2.0**12), NoLossScaler()
    with pytest.raises(ValueError):
        DynamicLossScaler().load_state_dict(off.state_dict())  # would silently train FP16 with S = 1
    with pytest.raises(ValueError):
        NoLossScaler().load_state_dict(on.state_dict())
    again = NoLossScaler()
    again.load_state_dict(off.state_dict())
    assert again.get_scale() == 1.0 and again.enabled is False


def test_loss_scaler_loads_a_state_saved_before_the_enabled_flag_and_counters_existed():
    state = {"scale": 2.0**7, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 10, "growth_tracker": 3}
    s = DynamicLossScaler()
    s.load_state_dict(state)
    assert s.get_scale() == 2.0**7 and s.growth_interval == 10
    assert (s.skipped_steps, s.steps, s.growths, s.backoffs) == (0, 0, 0, 0)


def _params_with_grads(*grads):
    ps = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    return ps


@pytest.mark.parametrize("bad_at", [0, 1, 2])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_loss_scaler_skips_the_step_when_any_one_gradient_is_not_finite(bad_at, bad):
    grads = [torch.full((3,), 4.0) for _ in range(3)]
    grads[bad_at][1] = bad
    ps = _params_with_grads(*grads)
    opt = torch.optim.SGD(ps, lr=1.0)
    scaler = DynamicLossScaler(init_scale=4.0)
    assert scaler.step(opt) is False
    scaler.update()
    assert all(torch.equal(p.detach(), torch.zeros(3)) for p in ps)  # no parameter moved
    assert scaler.get_scale() == 2.0
    # the finite gradients were unscaled (4 / S = 1) all the same
    assert all(torch.equal(p.grad, torch.ones(3)) for i, p in enumerate(ps) if i != bad_at)


def test_loss_scaler_steps_an_optimizer_without_gradients():
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = DynamicLossScaler()
    assert scaler.step(opt) is True and scaler.last_step_skipped is False
    scaler.update()


def test_loss_scaler_counters_and_growth_after_a_backoff_follow_gradscaler():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=3)

    def step(finite):
        p.grad = torch.tensor([1.0, 1.0 if finite else math.inf])
        ran = scaler.step(opt)
        scaler.update()
        return ran

    assert [step(False), step(False)] == [False, False]
    assert scaler.get_scale() == 2.0**6 and scaler.skipped_steps == 2 and scaler.backoffs == 2
    # growth needs growth_interval consecutive clean steps counted from the backoff
    assert step(True) and step(True)
    assert scaler.get_scale() == 2.0**6 and scaler.growths == 0
    assert step(True)
    assert scaler.get_scale() == 2.0**7 and scaler.growths == 1
    assert scaler.steps == 5
    assert scaler.metrics() == {"loss_scale": 2.0**7, "loss_scale_skipped_steps": 2.0}


def test_loss_scaler_passes_step_arguments_to_the_optimizer():
    class Recording(torch.optim.SGD):
        def step(self, *args, **kwargs):
            self.calls.append((args, kwargs))
            return super().step()

    for scaler in (DynamicLossScaler(), NoLossScaler()):
        p = nn.Parameter(torch.zeros(2))
        p.grad = torch.ones(2)
        opt = Recording([p], lr=1.0)
        opt.calls = []
        closure = lambda: None  # noqa: E731
        assert scaler.step(opt, closure, flag=1)
        assert opt.calls == [((closure,), {"flag": 1})]


# ---- lowprec/optim/master.py ---------------------------------------------------------------------


def test_master_optimizer_with_mixed_bf16_and_fp32_parameters():
    # an FP32 parameter (a norm weight, say) is its own master; only the BF16 one gets an FP32 copy
    w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16))
    n = nn.Parameter(torch.tensor([0.5, -0.5]))
    opt = MasterWeightOptimizer([w, n], lambda g: torch.optim.SGD(g, lr=2.0**-12))
    assert opt.master_of(n) is n and opt.master_of(w).dtype == torch.float32
    assert len(opt.master_params) == 1
    w.grad = torch.ones(3, dtype=torch.bfloat16)
    n.grad = torch.tensor([1.0, 2.0])
    opt.step()
    # SGD on the FP32 master: 1 - 2**-12 is kept there, while BF16 (8 bits) rounds it back to 1
    expected_master = torch.tensor([1.0, 2.0, 3.0]) - 2.0**-12
    assert torch.equal(opt.master_of(w), expected_master)
    assert torch.equal(w.detach(), expected_master.bfloat16())
    assert torch.equal(n.detach(), torch.tensor([0.5 - 2.0**-12, -0.5 - 2.0**-11]))


def test_master_optimizer_keep_master_grads_and_zero_grad():
    w = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = MasterWeightOptimizer([w], lambda g: torch.optim.SGD(g, lr=1.0), keep_master_grads=True)
    (m,) = opt.master_params
    for g in (1.0, 3.0):  # the second step copies into the kept FP32 buffer
        w.grad = torch.full((4,), g, dtype=torch.bfloat16)
        opt.step()
        assert m.grad is not None and m.grad.dtype == torch.float32 and torch.equal(m.grad, torch.full((4,), g))
    assert torch.equal(m.detach(), torch.full((4,), -4.0))
    opt.zero_grad(set_to_none=False)
    assert torch.equal(m.grad, torch.zeros(4)) and torch.equal(w.grad, torch.zeros(4, dtype=torch.bfloat16))
    opt.zero_grad()
    assert m.grad is None and w.grad is None
    # by default the FP32 gradient lives only during the step
    v = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt2 = MasterWeightOptimizer([v], lambda g: torch.optim.SGD(g, lr=1.0))
    v.grad = torch.ones(4, dtype=torch.bfloat16)
    opt2.step()
    assert opt2.master_params[0].grad is None


def test_master_optimizer_step_calls_the_closure_and_returns_its_loss():
    w = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    opt = MasterWeightOptimizer([w], lambda g: torch.optim.SGD(g, lr=0.5))
    calls = []

    def closure():
        calls.append(1)
        loss = (w.float() * torch.tensor([1.0, 2.0])).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert calls == [1] and loss.item() == 3.0
    assert torch.equal(w.detach(), torch.tensor([0.5, 0.0], dtype=torch.bfloat16))


def test_master_optimizer_refuses_inner_optimizers_that_reorder_and_late_param_groups():
    a, b = (nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)) for _ in range(2))
    with pytest.raises(ValueError):  # same length, other order: state would land on the wrong masters
        MasterWeightOptimizer([a, b], lambda g: torch.optim.SGD([{"params": g[0]["params"][::-1]}], lr=1.0))
    with pytest.raises(ValueError):
        MasterWeightOptimizer([a, b], lambda g: torch.optim.SGD(g[0]["params"][:1], lr=1.0))
    opt = MasterWeightOptimizer([a], lambda g: torch.optim.SGD(g, lr=1.0))
    with pytest.raises(ValueError):  # a group added later would never reach the inner optimizer
        opt.add_param_group({"params": [b]})


# ---- lowprec/float8/linear.py, config.py, gemm.py: Float8Linear -----------------------------------------


def _fp8_config(scaling="tensorwise", **groups):
    """lowprec's linear config for ``Float8Spec(backend="lowprec", scaling=...)`` with ``cast`` / ``gemm`` groups
    given as mappings."""
    from lowprec.float8 import linear_config
    from lowprec.recipe import Float8Spec

    return linear_config(Float8Spec.from_dict({"backend": "lowprec", "scaling": scaling, **groups}))


def _q(t, scale, dtype=torch.float8_e4m3fn, fmax=448.0):
    """Saturating FP8 cast with a multiplying scale, dequantized again: what the GEMM sees, in FP64."""
    scale = torch.as_tensor(scale, dtype=torch.float32)
    return ((t.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale).double()


def _close(got, ref):
    # FP32 accumulation of exactly representable FP8 products against an FP64 matmul of the same values
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_static_scaling_casts_every_role_with_its_own_fixed_scale():
    from lowprec.float8 import Float8Linear

    # exact in FP32, not powers of two, and far from the current-scaling scales, with some elements of each
    # role beyond the format's max so the casts saturate
    s_in, s_w, s_go = 100.0, 2500.0, 20_000_000.0
    cfg = _fp8_config(cast={"strategy": "static", "static_scales": (s_in, s_w, s_go)})
    assert (cfg.input.fmt.dtype, cfg.weight.fmt.dtype, cfg.grad_output.fmt.dtype) == (
        torch.float8_e4m3fn,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )  # hybrid: e5m2 gradients
    g = torch.Generator().manual_seed(1)
    m, k, n = 32, 64, 48
    lin = Float8Linear(k, n, bias=False, config=cfg)
    assert len(lin.scalers) == 0
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
    x = (torch.randn(m, k, generator=g) * 1.5).requires_grad_()
    dy = torch.randn(m, n, generator=g) * 1e-3
    assert (x.abs() * s_in > 448).any() and (lin.weight.abs() * s_w > 448).any()
    assert (dy.abs() * s_go > 57344).any()

    y = lin(x)
    y.backward(dy)

    qx, qw = _q(x.detach(), s_in), _q(lin.weight.detach(), s_w)
    qdy = _q(dy, s_go, torch.float8_e5m2, 57344.0)
    assert y.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32
    _close(y, qx @ qw.T)
    _close(x.grad, qdy @ qw)
    _close(lin.weight.grad, qdy.T @ qx)


def test_from_linear_with_bias_shares_parameters_and_adds_the_bias():
    from lowprec.float8 import Float8Linear

    cfg = _fp8_config()  # tensorwise current scaling, hybrid formats
    g = torch.Generator().manual_seed(2)
    m, k, n = 24, 64, 40
    src = nn.Linear(k, n, bias=True)
    with torch.no_grad():
        src.bias.copy_(torch.randn(n, generator=g))
    lin = Float8Linear.from_linear(src, cfg)
    assert lin.weight is src.weight and lin.bias is src.bias
    nobias = Float8Linear(k, n, bias=False, config=cfg)
    nobias.weight = src.weight

    x = torch.randn(m, k, generator=g).requires_grad_()
    dy = torch.randn(m, n, generator=g)
    y = lin(x)
    y.backward(dy)

    with torch.no_grad():
        assert torch.equal(y, nobias(x) + src.bias)
        # the FP8 GEMM itself, by hand: current tensorwise scales fmt.max / amax
        w = src.weight.detach()
        qx, qw = _q(x.detach(), 448.0 / x.abs().max().double()), _q(w, 448.0 / w.abs().max().double())
        qdy = _q(dy, 57344.0 / dy.abs().max().double(), torch.float8_e5m2, 57344.0)
    _close(y - src.bias.detach(), qx @ qw.T)
    # gradients land on the source linear's parameters
    assert torch.equal(src.bias.grad, dy.sum(0))
    _close(src.weight.grad, qdy.T @ qx)
    _close(x.grad, qdy @ qw)


def _round_mantissa_by_frexp(v, bits):
    # v = f * 2**e with 0.5 <= |f| < 1: keep bits + 1 significant bits, round half to even (torch.round)
    f, e = torch.frexp(v.double())
    return torch.ldexp(torch.round(f * 2.0 ** (bits + 1)), e - (bits + 1)).float()


@pytest.mark.parametrize("scaling", ["tensorwise", "blockwise"])
def test_float8_linear_passes_promotion_interval_and_accumulator_bits_to_the_gemm(scaling):
    from lowprec.float8 import Float8Linear
    from lowprec.float8.gemm import fp8_gemm

    cfg = _fp8_config(scaling, cast={"fp8_format": "e4m3"}, gemm={"promotion_interval": 128, "accum_mantissa_bits": 14})
    assert (cfg.gemm.promotion_interval, cfg.gemm.accum_mantissa_bits) == (128, 14)
    g = torch.Generator().manual_seed(3)
    m, k, n = 16, 2048, 64
    lin = Float8Linear(k, n, bias=False, config=cfg)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        x = torch.randn(m, k, generator=g)
        y = lin(x)
        qx, qw = lin.quantize("input", x), lin.quantize("weight", lin.weight)
        be = cfg.gemm.gemm_backend
        assert torch.equal(y, fp8_gemm(qx, qw, torch.float32, be, promotion_interval=128, accum_mantissa_bits=14))
        assert not torch.equal(y, fp8_gemm(qx, qw, torch.float32, be, promotion_interval=128))
        if scaling == "blockwise":
            return  # tile/block scaling promotes every 128 elements whatever promotion_interval says
        assert not torch.equal(y, fp8_gemm(qx, qw, torch.float32, be, accum_mantissa_bits=14))
        # and the emulated accumulator written out: raw FP8 products summed 32 at a time with the running sum
        # rounded to 14 mantissa bits, the 128-element partial sums promoted to FP32 and unscaled
        sx = (448.0 / x.abs().max().double()).float()
        sw = (448.0 / lin.weight.abs().max().double()).float()
        a = (x * sx).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        b = (lin.weight * sw).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        ref = torch.zeros(m, n)
        for k0 in range(0, k, 128):
            acc = torch.zeros(m, n)
            for s in range(k0, k0 + 128, 32):
                acc = _round_mantissa_by_frexp(acc + a[:, s : s + 32] @ b[:, s : s + 32].T, 14)
            ref += acc / sx / sw
        assert torch.equal(y, ref)


def test_float8_linear_creates_parameters_in_the_requested_dtype_and_device():
    from lowprec.float8 import Float8Linear

    cfg = _fp8_config()
    lin = Float8Linear(64, 32, bias=False, config=cfg, dtype=torch.bfloat16)
    assert lin.weight.dtype == torch.bfloat16 and lin.bias is None
    with_bias = Float8Linear(64, 32, bias=True, config=cfg, dtype=torch.bfloat16)
    assert with_bias.weight.dtype == with_bias.bias.dtype == torch.bfloat16
    assert Float8Linear(64, 32, bias=False, config=cfg).weight.dtype == torch.float32
    meta = Float8Linear(64, 32, bias=True, config=cfg, device="meta", dtype=torch.bfloat16)
    assert meta.weight.is_meta and meta.bias.is_meta and meta.weight.dtype == torch.bfloat16
    # and it trains in bf16: bf16 output, bf16 weight gradient
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    y.float().sum().backward()
    assert y.dtype == x.grad.dtype == lin.weight.grad.dtype == torch.bfloat16
