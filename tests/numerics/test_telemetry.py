"""FP8 telemetry: sampled steps only, real overflow/underflow/SQNR figures."""

import pytest
import torch

from lowprec.float8 import Float8Linear, linear_config
from lowprec.measure.telemetry import FP8Telemetry
from lowprec.recipe import CastSpec, Float8Spec


def _model(strategy="current"):
    torch.manual_seed(0)
    spec = Float8Spec(backend="lowprec", scaling="tensorwise", cast=CastSpec(strategy=strategy, fp8_format="hybrid"))
    m = torch.nn.Sequential()
    m.add_module("proj", Float8Linear.from_linear(torch.nn.Linear(64, 32, bias=False), linear_config(spec)))
    m.proj.init_buffers()
    return m


def _step(m, tel, step, x, g=None):
    tel.before_step(step)
    y = m(x.requires_grad_())
    y.backward(torch.ones_like(y) if g is None else g)
    return tel.after_step(step)


def test_samples_only_every_k_steps_and_reports_every_role():
    m = _model()
    tel = FP8Telemetry(m, every=3)
    x = torch.randn(16, 64)
    got = [_step(m, tel, s, x.clone()) for s in range(4)]
    assert got[1] == {} and got[2] == {} and got[3] != {}
    keys = set(got[0])
    for role in ("input", "weight", "grad_output"):
        for stat in ("amax", "scale", "overflow", "underflow"):
            assert f"fp8/proj/{role}/{stat}" in keys
    assert {"fp8/proj/output/sqnr_db", "fp8/proj/grad_input/sqnr_db"} <= keys
    assert got[0]["fp8/proj/input/amax"] == pytest.approx(x.abs().max().item())
    assert got[0]["fp8/proj/input/overflow"] == 0.0  # current scaling cannot saturate
    assert got[0]["fp8/proj/output/sqnr_db"] > 25
    assert m.proj.telemetry is None  # disarmed outside sampled steps


def test_delayed_scaling_overflow_and_underflow_are_seen():
    m = _model("delayed")
    tel = FP8Telemetry(m, every=1)
    x = torch.randn(16, 64)
    first = _step(m, tel, 0, x.clone(), g=torch.full((16, 32), 1e-6))
    # step 0 uses the initial scale 1.0: tiny e5m2 gradients below 2**-16 flush to zero
    assert first["fp8/proj/grad_output/underflow"] == 1.0
    m.proj.update_scales()
    spike = x.clone()
    spike[0, :8] = 1000.0  # far above the amax history: these elements saturate
    second = _step(m, tel, 1, spike)
    assert second["fp8/proj/input/overflow"] == pytest.approx(8 / spike.numel(), rel=0.01)
    assert second["fp8/proj/output/sqnr_db"] < first["fp8/proj/output/sqnr_db"]
