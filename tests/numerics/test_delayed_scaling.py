"""Delayed scaling inside lowprec's Float8Linear (Transformer Engine's ``DelayedScaling`` semantics): every cast of
a step uses the scale computed from the amax history of the steps BEFORE it, never the tensor's own amax, even
when the tensor's amax is far from what the history says (the cast then saturates or wastes range, by design).

References are plain torch casts, ``(x * scale).clamp(-max, max).to(fp8 dtype)``, and dequantize-then-matmul in
FP32, with the scales computed here from the amaxes this test fed in, not read from the module."""

from __future__ import annotations

import pytest
import torch

from lowprec.float8 import Float8Linear, LinearFP8Config, linear_config
from lowprec.recipes import get_recipe

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
FMT = {
    "input": (torch.float8_e4m3fn, E4M3_MAX),
    "weight": (torch.float8_e4m3fn, E4M3_MAX),
    "grad_output": (torch.float8_e5m2, E5M2_MAX),
}  # the HYBRID format of fp8_delayed
K, N, M = 64, 32, 16
HISTORY = 16


def _config(algo: str = "max") -> LinearFP8Config:
    spec = get_recipe("fp8_delayed").fp8
    if algo != spec.cast.amax_compute_algo:
        spec = get_recipe("fp8_delayed").with_fields("fp8.cast", amax_compute_algo=algo).fp8
    cfg = linear_config(spec)
    assert all(cfg.role(r).strategy == "delayed" and cfg.role(r).granularity == "tensorwise" for r in FMT)
    assert cfg.cast.amax_history_len == HISTORY and cfg.cast.margin == 0 and not cfg.cast.power_of_2_scales
    return cfg


def _linear(algo: str = "max") -> Float8Linear:
    torch.manual_seed(0)
    lin = Float8Linear(K, N, bias=False, config=_config(algo))
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K) * 2.0)  # amax ~ 7: with scale 1.0 the e4m3 cast is far from optimal
    lin.init_buffers()
    return lin


def _cast(x: torch.Tensor, scale: float, role: str) -> torch.Tensor:
    dtype, fmax = FMT[role]
    return (x.float() * torch.tensor(scale, dtype=torch.float32)).clamp(-fmax, fmax).to(dtype)


def _dq(x8: torch.Tensor, scale: float) -> torch.Tensor:
    return x8.float() / torch.tensor(scale, dtype=torch.float32)


def _scale_from(amaxes: list[float], role: str) -> float:
    """TE's rule for the scale of the next step: fmt.max / amax, in float64 then rounded to float32."""
    return float(torch.tensor(FMT[role][1] / max(amaxes), dtype=torch.float64).to(torch.float32))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


class CastRecorder:
    """A telemetry object that records every cast the linear makes (role, operand, quantized result)."""

    def __init__(self):
        self.casts: list[tuple[str, torch.Tensor, object]] = []

    def observe_cast(self, mod, role, t, q):
        self.casts.append((role, t.detach().clone(), q))

    def observe_gemm(self, *args, **kwargs):
        pass


def _input(amax: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x = x / x.abs().max() * amax * 0.9
    x[3, 5], x[7, 9] = amax, -amax * 0.95
    assert x.abs().max().item() == pytest.approx(amax, rel=1e-6)
    return x


def test_first_step_casts_with_the_initial_scale_not_the_current_amax():
    lin = _linear()
    x = _input(1000.0, 0)
    assert lin.scalers["input"].scale.item() == 1.0 and lin.scalers["input"].amax_history.abs().sum() == 0
    q = lin.quantize("input", x)
    expected = _cast(x, 1.0, "input")
    current = _cast(x, E4M3_MAX / x.abs().max().item(), "input")
    assert not torch.equal(_bits(expected), _bits(current))  # the two candidate behaviours do differ here
    assert int((expected.float().abs() == E4M3_MAX).sum()) >= 2  # scale 1.0: values above 448 saturate
    assert q.scale.item() == 1.0
    assert torch.equal(_bits(q.data), _bits(expected))
    # ... while the history recorded this step's amax for the next step
    assert lin.scalers["input"].amax_history[0].item() == x.abs().max().item()
    assert lin.scalers["input"].scale.item() == 1.0  # recording does not change the scale of this step


def _check_step(lin: Float8Linear, x: torch.Tensor, g: torch.Tensor, scales: dict[str, float]):
    """One forward/backward; every cast uses ``scales``; outputs match dequantize-then-matmul with them."""
    rec = CastRecorder()
    lin.telemetry = rec
    lin.weight.grad = None
    xr = x.clone().requires_grad_()
    y = lin(xr)
    y.backward(g)
    lin.telemetry = None

    w = lin.weight.detach()
    operands = {"input": x, "weight": w, "grad_output": g}
    assert {r for r, _, _ in rec.casts} == set(FMT)
    for role, t, q in rec.casts:
        assert torch.equal(t, operands[role]), role
        assert q.scale.item() == scales[role], (role, q.scale.item(), scales[role])
        assert torch.equal(_bits(q.data), _bits(_cast(t, scales[role], role))), role

    qx, qw, qg = (_dq(_cast(operands[r], scales[r], r), scales[r]) for r in ("input", "weight", "grad_output"))
    torch.testing.assert_close(y.detach(), qx @ qw.t(), rtol=1e-6, atol=1e-6 * float((qx @ qw.t()).abs().max()))
    torch.testing.assert_close(xr.grad, qg @ qw, rtol=1e-6, atol=1e-6 * float((qg @ qw).abs().max()))
    torch.testing.assert_close(lin.weight.grad, qg.t() @ qx, rtol=1e-6, atol=1e-6 * float((qg.t() @ qx).abs().max()))
    return y.detach()


def _current_scaling_output(x, w):
    sx, sw = E4M3_MAX / x.abs().max().item(), E4M3_MAX / w.abs().max().item()
    return _dq(_cast(x, sx, "input"), sx) @ _dq(_cast(w, sw, "weight"), sw).t()


def test_forward_and_backward_use_the_delayed_scales_over_two_steps():
    lin = _linear()
    w = lin.weight.detach().clone()

    # step 1: history empty -> every scale is 1.0; the input (amax 1000) saturates, the gradient (amax 1e5) too
    x1 = _input(1000.0, 1)
    g1 = torch.randn(M, N, generator=torch.Generator().manual_seed(2)) * 1e4
    g1[0, 0] = 1e5
    y1 = _check_step(lin, x1, g1, {"input": 1.0, "weight": 1.0, "grad_output": 1.0})
    cur = _current_scaling_output(x1, w)
    assert (y1 - cur).abs().max() > 0.05 * cur.abs().max()  # saturation at 448 vs a current-amax cast: far apart

    lin.update_scales()  # the post-optimizer hook
    amax1 = {"input": x1.abs().max().item(), "weight": w.abs().max().item(), "grad_output": g1.abs().max().item()}
    scales2 = {r: _scale_from([amax1[r]], r) for r in FMT}
    for r in FMT:
        assert lin.scalers[r].scale.item() == scales2[r], r

    # step 2: amaxes 200x smaller than the history says; the casts still use the history's (small) scales
    x2 = _input(5.0, 3)
    g2 = torch.randn(M, N, generator=torch.Generator().manual_seed(4))
    _check_step(lin, x2, g2, scales2)
    current_in = _cast(x2, E4M3_MAX / x2.abs().max().item(), "input")
    assert not torch.equal(_bits(current_in), _bits(_cast(x2, scales2["input"], "input")))

    lin.update_scales()  # algo "max": the step-1 amaxes still dominate the 16-step window
    amax2 = {"input": x2.abs().max().item(), "weight": w.abs().max().item(), "grad_output": g2.abs().max().item()}
    for r in FMT:
        assert lin.scalers[r].scale.item() == _scale_from([amax1[r], amax2[r]], r), r


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_input_scale_follows_the_amax_history_window(algo):
    """One outlier step (amax 1000) then small steps: with ``max`` the outlier sets the scale for exactly
    ``amax_history_len`` steps after it; with ``most_recent`` only for the step right after it."""
    lin = _linear(algo)
    amaxes = [1000.0] + [4.0 + 0.25 * (t % 5) for t in range(1, HISTORY + 4)]
    for t, a in enumerate(amaxes):
        seen = amaxes[:t]
        if not seen:
            expected = 1.0
        elif algo == "max":
            expected = _scale_from(seen[-HISTORY:], "input")
        else:
            expected = _scale_from(seen[-1:], "input")
        x = _input(a, 10 + t)
        q = lin.quantize("input", x)
        assert q.scale.item() == expected, (t, q.scale.item(), expected)
        assert torch.equal(_bits(q.data), _bits(_cast(x, expected, "input"))), t
        lin.update_scales()
    # the window really moved: the outlier's scale held for 16 steps (max) and was then replaced
    if algo == "max":
        assert _scale_from(amaxes[1 : HISTORY + 1], "input") != _scale_from(amaxes[:HISTORY], "input")
