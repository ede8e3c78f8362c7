"""The DeepSeekMoE model (lowprec/model/moe.py) against independent computations from DeepSeek-V3's definitions
(arXiv 2412.19437 section 2.1.2): routing and gates in float64 by hand, the bias update in integer arithmetic,
the sequence-wise balance loss from eq. 17-20 with Python loops, the layer's output token by token."""

from __future__ import annotations

import math

import pytest
import torch

from lowprec.build_optim import OptimHParams
from lowprec.data import TokenBatches
from lowprec.estimate.inventory import param_counts
from lowprec.model import MOE_CONFIGS, MoE, MoEArgs, build_model, model_args
from lowprec.model.moe import Router, sequence_balance_loss
from lowprec.recipes import get_recipe
from lowprec.train.build import build
from lowprec.train.moe_balance import ExpertBalance, load_metrics
from lowprec.train.spec import TrainSpec
from lowprec.train.step import train_step


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def _reference_routing(x, w, bias, k):
    """Per token, in float64 Python: scores s_i = sigmoid(x . e_i), the k largest s_i + b_i, gates s_i / sum."""
    out = []
    for row in x.double().tolist():
        s = [_sigmoid(sum(a * b for a, b in zip(row, e, strict=True))) for e in w.double().tolist()]
        biased = [si + bi for si, bi in zip(s, bias.tolist(), strict=True)]
        chosen = sorted(range(len(s)), key=lambda i: -biased[i])[:k]
        total = sum(s[i] for i in chosen)
        out.append({i: s[i] / total for i in chosen})
    return out


def test_routing_selects_on_biased_scores_and_gates_with_unbiased_normalised_scores():
    torch.manual_seed(0)
    router = Router(dim=16, n_experts=6, top_k=2)
    with torch.no_grad():
        router.gate.weight.normal_(0, 0.5)
        # Expert 5 gets a large bias: chosen for every token, but its gate is still its plain sigmoid score.
        router.expert_bias.copy_(torch.tensor([0.0, 0.01, -0.02, 0.0, 0.0, 2.0]))
    x = torch.randn(40, 16)
    scores, idx, gates = router(x)
    ref = _reference_routing(x, router.gate.weight, router.expert_bias, 2)
    assert scores.dtype == gates.dtype == torch.float32
    for t, want in enumerate(ref):
        got = dict(zip(idx[t].tolist(), gates[t].tolist(), strict=True))
        assert set(got) == set(want) and 5 in got, (t, got, want)
        for i, g in want.items():
            assert abs(got[i] - g) < 1e-6, (t, i, got[i], g)
    # the counts of the training forward: every token once per chosen expert
    assert router.pop_counts().tolist() == [sum(i in r for r in ref) for i in range(6)]


def test_router_gate_runs_in_fp32_under_bf16_autocast_and_bf16_weights():
    router = Router(dim=8, n_experts=4, top_k=1).to(torch.bfloat16)
    with torch.no_grad():
        router.gate.weight.normal_()
    assert router.expert_bias.dtype == torch.float32  # kept FP32 by model.to(dtype): gamma-sized steps survive
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = router.gate(torch.randn(3, 8, dtype=torch.bfloat16))
    assert logits.dtype == torch.float32


def test_bias_update_matches_integer_arithmetic():
    """gamma = 2**-10 makes every bias an exact multiple of gamma in FP32, so the update is compared exactly with
    integer arithmetic: b_i += sign(mean - load_i), in units of gamma."""
    model = build_model(model_args("moe_debug", n_layers=2, n_dense_layers=0, bias_update_speed=2**-10))
    moe = model.layers["0"].moe
    moe.router.expert_bias.zero_()
    balance = ExpertBalance.of(model, every=1)
    units = [0] * 8
    for loads in ([10, 30, 20, 20, 5, 35, 20, 20], [1, 1, 1, 1, 1, 1, 1, 57], [8, 8, 8, 8, 8, 8, 8, 8]):
        for m in model.moe_layers().values():
            m.router.tokens_per_expert = torch.tensor(loads, dtype=torch.float32)
        metrics = balance.after_step(0, None)
        total = sum(loads)
        for i, n in enumerate(loads):  # sign(mean - n) with mean = total / 8, compared as 8n against total
            units[i] += (8 * n < total) - (8 * n > total)
        assert (moe.router.expert_bias * 2**10).tolist() == units, (loads, units)
        assert metrics["moe/layers.0.moe/tokens_e07"] == loads[7]
        mean = total / 8
        assert metrics["moe/layers.0.moe/max_over_mean"] == pytest.approx(max(loads) / mean, rel=1e-12)
        cv = math.sqrt(sum((n - mean) ** 2 for n in loads) / 8) / mean
        assert metrics["moe/layers.0.moe/load_cv"] == pytest.approx(cv, rel=1e-12)
    assert units == [2, 0, 1, 1, 2, 0, 1, -1]
    assert moe.router.tokens_per_expert is None  # counts are consumed by the update


def _paper_seq_loss(scores, idx, k, alpha):
    """Eq. 17-20 of the paper with loops in float64: per sequence f_i, P_i, alpha * sum f_i P_i; batch mean."""
    b, s, n = scores.shape
    losses = []
    for bi in range(b):
        f = [0.0] * n
        p = [0.0] * n
        for t in range(s):
            row = scores[bi, t].double().tolist()
            chosen = idx[bi, t].tolist()
            denom = sum(row)
            for i in range(n):
                f[i] += (n / (k * s)) * (1.0 if i in chosen else 0.0)
                p[i] += row[i] / denom / s
        losses.append(alpha * sum(fi * pi for fi, pi in zip(f, p, strict=True)))
    return sum(losses) / b


def test_sequence_balance_loss_matches_the_paper_formula():
    torch.manual_seed(1)
    scores = torch.rand(3, 17, 8, dtype=torch.float64)
    idx = torch.topk(scores, 3, dim=-1).indices
    got = sequence_balance_loss(scores, idx, 3, 0.01)
    assert abs(got.item() - _paper_seq_loss(scores, idx, 3, 0.01)) < 1e-15
    # perfectly balanced routing of uniform scores: f_i = 1 and P_i = 1/N, so L = alpha
    uniform = torch.full((1, 8, 4), 0.3, dtype=torch.float64)
    rr = torch.tensor([[[0, 1], [2, 3]] * 4], dtype=torch.int64).view(1, 8, 2)
    assert sequence_balance_loss(uniform, rr, 2, 0.5).item() == pytest.approx(0.5, rel=1e-15)


def test_moe_layer_output_and_aux_loss_token_by_token():
    """y_t = shared(x_t) + sum over chosen i of g_i * expert_i(x_t), each SwiGLU in float64 by hand."""
    torch.manual_seed(2)
    args = model_args("moe_debug", seq_aux_alpha=0.1)
    moe = MoE(args)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    x = torch.randn(2, 5, args.dim)
    y = moe(x)
    scores, idx, gates = moe.router(x.reshape(-1, args.dim))

    def swiglu(ff, v):
        w1, w2, w3 = (getattr(ff, n).weight.double() for n in ("w1", "w2", "w3"))
        a = w1 @ v
        return w2 @ (a / (1 + torch.exp(-a)) * (w3 @ v))

    for t, v in enumerate(x.reshape(-1, args.dim).double()):
        want = swiglu(moe.shared_experts, v)
        for i, g in zip(idx[t].tolist(), gates[t].double().tolist(), strict=True):
            want = want + g * swiglu(moe.experts[i], v)
        assert torch.allclose(y.reshape(-1, args.dim)[t].double(), want, rtol=1e-5, atol=1e-6), t
    want_aux = _paper_seq_loss(scores.view(2, 5, -1), idx.view(2, 5, -1), args.top_k, 0.1)
    assert abs(moe.last_aux_loss.item() - want_aux) < 1e-6


def test_param_counts_total_and_activated():
    for name, args in MOE_CONFIGS.items():
        model = build_model(args)
        total = sum(p.numel() for p in model.parameters())
        counted = param_counts(args)
        assert counted.total == total == args.param_counts()[0], name
        # activated by hand: all but (experts - top_k) experts of 3 * dim * moe_inter_dim per MoE block
        idle = (args.n_layers - args.n_dense_layers) * (args.n_routed_experts - args.top_k)
        assert counted.activated == total - idle * 3 * args.dim * args.moe_inter_dim == args.param_counts()[1], name
    dense = model_args("tiny")
    assert param_counts(dense).total == param_counts(dense).activated == dense.num_params()


def test_moe_tiny_activates_about_as_many_parameters_as_tiny():
    tiny, moe = param_counts(model_args("tiny")), param_counts(model_args("moe_tiny"))
    assert 0.8 < moe.activated / tiny.total < 1.05 and moe.total > 1.9 * tiny.total


def test_bad_shapes_are_one_line_config_errors():
    from lowprec.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.top_k=9 is larger than model.n_routed_experts=8"):
        MoEArgs(n_routed_experts=8, top_k=9)
    with pytest.raises(ConfigError, match=r"model.n_dense_layers=4 leaves no MoE block"):
        MoEArgs(n_layers=4, n_dense_layers=4)


SPEC = TrainSpec(steps=2, batch_size=2, seq_len=32, val_every=0, val_batches=1, timing_warmup_steps=1, progress=False)


def _step(token_data, args, ac="none"):
    spec = TrainSpec(**{**SPEC.__dict__, "ac": ac})
    built = build(get_recipe("fp32"), args, spec, OptimHParams(), 0, torch.device("cpu"))
    batches = TokenBatches(token_data.train, token_data.val, spec.seq_len, spec.batch_size, 0)
    for hook in built.before_step:
        hook(0, built)
    train_step(built, [batches.train_batch(0)], 1.0, 0)
    return built


def test_full_activation_checkpointing_does_not_count_the_recompute(token_data):
    """Every token goes to top_k experts once per forward; the backward's recompute must not count again."""
    for ac in ("none", "full"):
        built = _step(token_data, model_args("moe_debug"), ac)
        metrics = next(h for h in built.after_step if hasattr(h, "__self__") and isinstance(h.__self__, ExpertBalance))(
            0, built
        )
        counts = [v for k, v in metrics.items() if k.startswith("moe/layers.1.moe/tokens_e")]
        assert sum(counts) == SPEC.batch_size * SPEC.seq_len * 2, (ac, counts)


def test_the_sequence_loss_reaches_the_router_gradient_not_the_reported_loss(token_data):
    plain = _step(token_data, model_args("moe_debug", seq_aux_alpha=0.0))
    aux = _step(token_data, model_args("moe_debug", seq_aux_alpha=1.0))
    # Gradients stay after the step (zeroed at its start). Same weights, same routing: the experts' gradients
    # agree, the router's differ by the balance loss's.
    blocks = plain.model.layers["1"].moe, aux.model.layers["1"].moe
    e0, e1 = (b.experts[3].w1.weight.grad for b in blocks)
    g0, g1 = (b.router.gate.weight.grad for b in blocks)
    assert torch.equal(e0, e1)
    assert (g0 - g1).abs().max() > 1e-3 * g0.abs().max()
    assert aux.model.layers["1"].moe.last_aux_loss is None  # consumed by the step's objective


def test_load_metrics_of_no_tokens_are_zero():
    assert load_metrics(torch.zeros(4)) == {"max_over_mean": 0.0, "load_cv": 0.0}


def test_lowprec_estimate_states_the_activated_parameters(capsys):
    from lowprec_lab.cli import main

    assert main(["estimate", "model=moe_debug", "recipe=deepseek_v3"]) == 0
    out = capsys.readouterr().out
    assert "model=moe_debug: 586,400 parameters" in out
    assert "MoE: 549,536 parameters activated per token of 586,400" in out
    assert main(["estimate", "model=debug", "recipe=bf16"]) == 0
    assert "activated" not in capsys.readouterr().out
