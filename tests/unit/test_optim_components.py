"""Optimizer-side components on CPU: low-bit AdamW, FP32 master weights, BF16 update rounding,
dynamic loss scaling and optimizer-state telemetry (real components, no mocks)."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from lowprec.build_optim import moment_kind
from lowprec.measure.accounting import measure_state_bytes
from lowprec.optim.loss_scale import DynamicLossScaler, NoLossScaler, grad_underflow_share
from lowprec.optim.lowbit_adamw import LowBitAdamW
from lowprec.optim.master import MasterWeightOptimizer
from lowprec.optim.rounding import stochastic_round_bf16
from lowprec.optim.state_telemetry import OptimStateTelemetry, dequantized_moments

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SHAPES = ((64, 96), (96,), (128, 64))
BF16_ULP_BELOW_1 = 2.0**-8  # spacing of bf16 just below 1.0


def _params(dtype=torch.float32, seed=0, shapes=SHAPES) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _set_grads(params, step: int) -> None:
    """Deterministic gradients of varied magnitude (per-element scale spans ~3 decades)."""
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        mag = torch.exp(torch.randn(p.shape, generator=g) * 1.5) * 1e-3
        p.grad = (torch.randn(p.shape, generator=g) * mag).to(p.dtype)


def _train(opt, params, steps: int, start: int = 0) -> None:
    for s in range(start, start + steps):
        _set_grads(params, s)
        opt.step()


def _clone(params):
    return [nn.Parameter(p.detach().clone()) for p in params]


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.fixture
def eager_compile(monkeypatch):
    """torchao's optimizers torch.compile their per-parameter step (inductor, ~10 s here); run it eagerly:
    same ops, same states (as tests/unit/test_estimate.py does)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)


# ---- LowBitAdamW --------------------------------------------------------------------------------


def test_lowbit_fp32_state_matches_torch_adamw_bit_for_bit():
    ref_p, our_p = _params(), _params()
    ref = torch.optim.AdamW(ref_p, foreach=False, **HP)
    ours = LowBitAdamW(our_p, state_dtype="fp32", **HP)
    _train(ref, ref_p, 5)
    _train(ours, our_p, 5)
    for a, b in zip(ref_p, our_p):
        assert torch.equal(a, b)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ref.state[a][k], ours.state[b][k])
    # torch's default (foreach) path agrees to fp32 rounding
    dflt_p = _params()
    _train(torch.optim.AdamW(dflt_p, **HP), dflt_p, 5)
    for a, b in zip(dflt_p, our_p):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "state_dtype, m_dtype, v_dtype, tol",
    [
        ("bf16", torch.bfloat16, torch.bfloat16, 5e-3),
        ("fp8_fp16", torch.float8_e4m3fn, torch.float16, 0.05),
    ],
)
def test_lowbit_states_have_their_dtypes_and_stay_close_to_fp32(state_dtype, m_dtype, v_dtype, tol):
    p0 = _params()
    ref_p, our_p = _clone(p0), _clone(p0)
    ref = torch.optim.AdamW(ref_p, foreach=False, **HP)
    ours = LowBitAdamW(our_p, state_dtype=state_dtype, **HP)
    _train(ref, ref_p, 5)
    _train(ours, our_p, 5)
    for p in our_p:
        st = ours.state[p]
        assert st["exp_avg"].dtype == m_dtype and st["exp_avg_sq"].dtype == v_dtype
        assert st["step"].dtype == torch.float32 and st["step"].item() == 5
        assert moment_kind(ours, p) == str(m_dtype).removeprefix("torch.")
    for a, b, p in zip(ref_p, our_p, p0):
        d_ref, d_ours = (a - p).detach().double(), (b - p).detach().double()
        assert (d_ours - d_ref).norm() / d_ref.norm() < tol


def test_lowbit_state_bytes_are_counted_exactly():
    params = _params()
    n, t = sum(p.numel() for p in params), len(params)
    model = nn.ParameterList(params)
    for state_dtype, per_elem, per_tensor in (("fp32", 8, 4), ("bf16", 4, 4), ("fp8_fp16", 3, 12)):
        opt = LowBitAdamW(params, state_dtype=state_dtype, **HP)
        _train(opt, params, 1)
        assert measure_state_bytes(model, opt).optim_states == per_elem * n + per_tensor * t, state_dtype


# ---- BF16 resolution: where an update below half an ulp goes -------------------------------------


def _ones_bf16(n=4096):
    return nn.Parameter(torch.ones(n, dtype=torch.bfloat16))


def _const_grad_steps(opt, p, steps):
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        opt.step()


def test_bf16_update_below_resolution_is_lost_without_master_and_kept_with_one():
    lr = 1e-4  # Adam's step is ~lr per element; bf16 spacing at 1.0 is 7.8e-3 above, 3.9e-3 below
    plain = _ones_bf16()
    _const_grad_steps(torch.optim.AdamW([plain], lr=lr, weight_decay=0.0), plain, 1)
    assert torch.all(plain == 1.0)
    nearest = _ones_bf16()
    _const_grad_steps(LowBitAdamW([nearest], lr=lr, weight_decay=0.0), nearest, 30)
    assert torch.all(nearest == 1.0)  # stagnation: 30 lost updates

    p = _ones_bf16()
    opt = MasterWeightOptimizer([p], lambda g: torch.optim.AdamW(g, lr=lr, weight_decay=0.0))
    _const_grad_steps(opt, p, 1)
    (master,) = opt.master_params
    assert master.dtype == torch.float32 and torch.all(p == 1.0)
    torch.testing.assert_close(master, torch.full_like(master, 1 - lr), rtol=1e-6, atol=0)
    _const_grad_steps(opt, p, 29)
    torch.testing.assert_close(master, torch.full_like(master, 1 - 30 * lr), rtol=1e-5, atol=0)
    assert torch.all(p == 1 - BF16_ULP_BELOW_1)  # round-to-nearest of the master 0.997
    assert p.grad is not None and master.grad is None  # the fp32 master gradient is transient


def test_kahan_compensation_keeps_the_lost_update():
    lr = 1e-4
    p = _ones_bf16()
    opt = LowBitAdamW([p], lr=lr, weight_decay=0.0, update_rounding="kahan")
    _const_grad_steps(opt, p, 1)
    comp = opt.state[p]["kahan_comp"]
    assert comp.dtype == torch.bfloat16 and torch.all(p == 1.0)
    torch.testing.assert_close(comp.float(), torch.full((p.numel(),), -lr), rtol=1e-2, atol=0)
    _const_grad_steps(opt, p, 29)
    assert torch.all(p < 1.0)
    # comp is stored in bf16, so a few 1e-6 are lost per step; the total move is 3e-3
    torch.testing.assert_close(p.float() + comp.float(), torch.full((p.numel(),), 1 - 30 * lr), rtol=0, atol=1e-4)


def test_stochastic_rounding_moves_bf16_weights_in_expectation(eager_compile):
    lr, n = 1e-4, 1 << 16
    x = torch.full((n,), 1 - lr)
    sr = stochastic_round_bf16(x, torch.Generator().manual_seed(0)).float()
    assert set(sr.unique().tolist()) == {1 - BF16_ULP_BELOW_1, 1.0}
    assert abs(sr.mean().item() - (1 - lr)) < 0.1 * lr

    ours = _ones_bf16(n)
    _const_grad_steps(
        LowBitAdamW(
            [ours], lr=lr, weight_decay=0.0, update_rounding="stochastic", generator=torch.Generator().manual_seed(1)
        ),
        ours,
        1,
    )
    assert abs(ours.float().mean().item() - (1 - lr)) < 0.1 * lr

    from torchao.optim import _AdamW

    torch.manual_seed(0)  # torchao draws its rounding bits from the global generator
    for stochastic in (True, False):
        ao = _ones_bf16(n)
        _const_grad_steps(_AdamW([ao], lr=lr, weight_decay=0.0, bf16_stochastic_round=stochastic), ao, 1)
        if stochastic:
            assert abs(ao.float().mean().item() - (1 - lr)) < 0.1 * lr
        else:
            assert torch.all(ao == 1.0)


# ---- MasterWeightOptimizer integration -----------------------------------------------------------


def test_master_optimizer_accounting_state_view_scheduler_and_hooks():
    params = _params(torch.bfloat16)
    model = nn.ParameterList(params)
    n, t = sum(p.numel() for p in params), len(params)
    opt = MasterWeightOptimizer(params, lambda g: torch.optim.AdamW(g, **HP))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    calls = []
    opt.register_step_post_hook(lambda o, a, k: calls.append(o.master_params[0].grad is None))
    _train(opt, params, 1)
    sched.step()
    assert calls == [True]
    assert opt.param_groups[0]["lr"] == opt.inner.param_groups[0]["lr"] * 0.5  # synced at the next step
    _train(opt, params, 1, start=1)
    assert opt.inner.param_groups[0]["lr"] == HP["lr"] * 0.5
    assert moment_kind(opt, params[0]) == "float32" and len(opt.state) == t
    sb = measure_state_bytes(model, opt, opt.master_params)
    assert (sb.params, sb.grads, sb.master, sb.optim_states) == (2 * n, 2 * n, 4 * n, 8 * n + 4 * t)
    assert sb.total == 16 * n + 4 * t
    for p, m in zip(params, opt.master_params):
        assert torch.equal(p, m.to(torch.bfloat16))


@pytest.mark.parametrize("inner", ["torch", "lowbit_bf16"])
def test_master_optimizer_state_dict_round_trip_is_bit_identical(inner):
    def factory(groups):
        if inner == "torch":
            return torch.optim.AdamW(groups, **HP)
        return LowBitAdamW(groups, state_dtype="bf16", **HP)

    params = _params(torch.bfloat16)
    opt = MasterWeightOptimizer(params, factory)
    _train(opt, params, 3)
    sd = _roundtrip(opt.state_dict())
    assert all("master" in s and s["master"].dtype == torch.float32 for s in sd["state"].values())

    params2 = _clone(params)
    opt2 = MasterWeightOptimizer(params2, factory)
    opt2.load_state_dict(sd)
    for a, b in zip(opt.master_params, opt2.master_params):
        assert torch.equal(a, b)
    _train(opt, params, 1, start=3)
    _train(opt2, params2, 1, start=3)
    for a, b in zip(params, params2):
        assert torch.equal(a, b)
    for a, b in zip(opt.master_params, opt2.master_params):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "state_dtype, rounding", [("fp32", "nearest"), ("bf16", "nearest"), ("fp8_fp16", "nearest"), ("bf16", "kahan")]
)
def test_lowbit_state_dict_round_trip_is_bit_identical(state_dtype, rounding):
    params = _params(torch.bfloat16)
    opt = LowBitAdamW(params, state_dtype=state_dtype, update_rounding=rounding, **HP)
    _train(opt, params, 3)
    sd = _roundtrip(opt.state_dict())
    params2 = _clone(params)
    opt2 = LowBitAdamW(params2, state_dtype=state_dtype, update_rounding=rounding, **HP)
    opt2.load_state_dict(sd)
    for a, b in zip(params, params2):
        for k, v in opt.state[a].items():
            assert opt2.state[b][k].dtype == v.dtype and torch.equal(opt2.state[b][k], v), k
    _train(opt, params, 1, start=3)
    _train(opt2, params2, 1, start=3)
    for a, b in zip(params, params2):
        assert torch.equal(a, b)


def test_master_optimizer_dcp_checkpoint_round_trip(tmp_path):
    from lowprec.train.checkpoint import load_checkpoint, save_checkpoint

    def make(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16)).to(torch.bfloat16)
        return model, MasterWeightOptimizer(model.parameters(), lambda g: torch.optim.AdamW(g, **HP))

    model, opt = make(0)
    params = list(model.parameters())
    _train(opt, params, 2)
    save_checkpoint(tmp_path / "ck", model, opt, 2)
    model2, opt2 = make(1)
    assert load_checkpoint(tmp_path / "ck", model2, opt2) == 2
    for a, b in zip(opt.master_params, opt2.master_params):
        assert torch.equal(a, b)
    params2 = list(model2.parameters())
    _train(opt, params, 1, start=2)
    _train(opt2, params2, 1, start=2)
    for a, b in zip(params, params2):
        assert torch.equal(a, b)


# ---- loss scaling --------------------------------------------------------------------------------


def _scaled_backward(scaler, w, x):
    w.grad = None
    scaler.scale((w * x).sum()).backward()


def test_loss_scaler_skips_inf_step_backs_off_and_grows():
    w = nn.Parameter(torch.randn(8))
    x = torch.randn(8)
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    _scaled_backward(scaler, w, x)
    scaler.unscale_(opt)
    torch.testing.assert_close(w.grad, x)  # unscaled in place
    with pytest.raises(RuntimeError):
        scaler.unscale_(opt)
    assert scaler.step(opt) is True
    scaler.update()

    _scaled_backward(scaler, w, x)
    w.grad[3] = float("inf")
    before = w.detach().clone()
    assert scaler.step(opt) is False
    scaler.update()
    assert torch.equal(w, before) and scaler.skipped_steps == 1 and scaler.get_scale() == 2.0**9

    for _ in range(3):  # growth_interval clean steps
        _scaled_backward(scaler, w, x)
        assert scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0**10 and scaler.growths == 1 and scaler.backoffs == 1
    assert scaler.metrics() == {"loss_scale": 2.0**10, "loss_scale_skipped_steps": 1.0}

    again = DynamicLossScaler()
    again.load_state_dict(_roundtrip(scaler.state_dict()))
    assert again.state_dict() == scaler.state_dict()


def test_no_loss_scaler_is_a_pass_through():
    w = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=1.0)
    s = NoLossScaler()
    loss = (w * 2).sum()
    assert s.scale(loss) is loss
    loss.backward()
    s.unscale_(opt)
    assert s.step(opt) is True
    s.update()
    assert torch.equal(w.detach(), torch.full((4,), -1.0)) and s.get_scale() == 1.0 and s.metrics() == {}


def test_fp16_gradients_underflow_without_scaling():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, generator=g) * 1e-3).half()
    for scaler, lo, hi in ((NoLossScaler(), 0.99, 1.0), (DynamicLossScaler(init_scale=2.0**16), 0.0, 0.01)):
        w = nn.Parameter(torch.ones(4096, dtype=torch.float16))
        scaler.scale((w * x).sum() * 1e-5).backward()  # true gradients ~1e-8 < fp16's smallest subnormal 6e-8
        assert lo <= grad_underflow_share([w]) <= hi


# ---- optimizer-state telemetry -------------------------------------------------------------------


def _telemetry_errors(make_opt, steps=6):
    params = _params(shapes=((64, 128), (128, 64)))
    opt = make_opt(params)
    tel = OptimStateTelemetry(opt, {"a": params[0], "b": params[1]}, every=5)
    out = {}
    for s in range(steps):
        _set_grads(params, s)
        opt.step()
        out = tel.after_step(s) or out
    assert set(out) == {f"optim/{n}/{k}_rel_err" for n in "ab" for k in "mv"}
    return max(out[f"optim/{n}/m_rel_err"] for n in "ab"), max(out[f"optim/{n}/v_rel_err"] for n in "ab")


def test_state_telemetry_small_for_bf16_larger_for_8bit(eager_compile):
    fp32 = _telemetry_errors(lambda ps: LowBitAdamW(ps, state_dtype="fp32", **HP))
    assert fp32 == (0.0, 0.0)
    bf16 = _telemetry_errors(lambda ps: LowBitAdamW(ps, state_dtype="bf16", **HP))
    assert max(bf16) < 5e-3
    fp8 = _telemetry_errors(lambda ps: LowBitAdamW(ps, state_dtype="fp8_fp16", **HP))
    assert fp8[0] > bf16[0] and fp8[0] < 0.1

    from torchao.optim import AdamW4bit, AdamW8bit

    ao = _telemetry_errors(lambda ps: AdamW8bit(ps, **HP))
    assert ao[0] > bf16[0] and max(ao) < 0.5
    ao4 = _telemetry_errors(lambda ps: AdamW4bit(ps, **HP))
    assert ao4[0] > ao[0] and ao4[1] > ao[1]
    import bitsandbytes as bnb  # a hard dependency (pyproject): a missing install must fail, not skip

    bnb_err = _telemetry_errors(lambda ps: bnb.optim.AdamW8bit(ps, **HP))
    assert bnb_err[0] > bf16[0] and max(bnb_err) < 0.5


def test_dequantized_moments_of_a_master_optimizer_are_keyed_by_model_params():
    params = _params(torch.bfloat16)
    opt = MasterWeightOptimizer(params, lambda g: LowBitAdamW(g, state_dtype="fp8_fp16", **HP))
    assert dequantized_moments(opt, params[0]) is None
    _train(opt, params, 2)
    m, v = dequantized_moments(opt, params[0])
    assert m.shape == params[0].shape and m.dtype == torch.float32 and float(v.min()) >= 0
