"""Small-scale training stabilisers (Wortsman et al. 2023, arXiv 2309.14322): QK-norm (``model.qk_norm``, RMSNorm
of each query/key head before RoPE) and z-loss (``train.z_loss``, ``z * mean(logsumexp(logits) ** 2)`` added to the
objective). Both off by default and then exactly today's model and loss; on, they change what they should and the
logged loss stays the cross-entropy."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lowprec.build_optim import OptimHParams
from lowprec.convert import fp8_candidate_fqns
from lowprec.data import TokenBatches
from lowprec.errors import ConfigError
from lowprec.estimate.inventory import param_counts
from lowprec.model import model_args
from lowprec.model.llama import RMSNorm, apply_rope, rope_cos_sin
from lowprec.recipes import CATALOG
from lowprec.train.build import build, build_model_meta, materialize
from lowprec.train.compile import build_z_loss, cross_entropy_fp32, z_loss_fp32
from lowprec.train.loop import run_training
from lowprec.train.spec import TrainSpec
from lowprec.train.step import train_step


def _model(name: str = "debug", **kw):
    m = build_model_meta(model_args(name, **kw))
    materialize(m, torch.device("cpu"), seed=0)
    return m


def _tokens(args, batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))


# ---- QK-norm ----


@pytest.mark.parametrize("name", ["debug", "moe_debug"])
def test_qk_norm_adds_q_and_k_norms_of_head_dim_and_changes_the_forward(name):
    off, on = _model(name), _model(name, qk_norm=True)
    hd = on.args.head_dim
    extra = set(on.state_dict()) - set(off.state_dict())
    assert extra == {f"layers.{i}.attention.{n}.weight" for i in on.layers for n in ("q_norm", "k_norm")}
    for block in on.layers.values():
        for norm in (block.attention.q_norm, block.attention.k_norm):
            assert isinstance(norm, RMSNorm) and norm.weight.shape == (hd,) and norm.eps == on.args.norm_eps
            assert torch.equal(norm.weight, torch.ones(hd))
    # The norms draw no random numbers: every shared weight is the same for one seed.
    for k, v in off.state_dict().items():
        assert torch.equal(v, on.state_dict()[k]), k
    x = _tokens(on.args)
    with torch.no_grad():
        assert not torch.allclose(off(x), on(x))
    # Parameter counts: by hand (ModelArgs / MoEArgs), by the estimator and on the module tree agree.
    n = sum(p.numel() for p in on.parameters())
    assert n - sum(p.numel() for p in off.parameters()) == 2 * hd * on.args.n_layers
    assert on.args.num_params() == n == param_counts(on.args).total


def test_qk_norm_off_keeps_the_module_tree_and_the_forward():
    """Off: no q_norm/k_norm key (old checkpoints load strictly) and the forward is the one without the option."""
    m = _model()
    keys = set(m.state_dict())
    assert not any("q_norm" in k or "k_norm" in k for k in keys)
    ref = _model()
    ref.load_state_dict(m.state_dict(), strict=True)
    assert all(b.attention.q_norm is None and b.attention.k_norm is None for b in m.layers.values())


def test_qk_norm_normalises_each_head_before_rope():
    m = _model(qk_norm=True)
    att = m.layers["0"].attention
    with torch.no_grad():
        att.q_norm.weight.copy_(torch.linspace(0.5, 2.0, att.head_dim))
        att.k_norm.weight.copy_(torch.linspace(2.0, 0.5, att.head_dim))
    x = torch.randn(2, 8, m.args.dim, generator=torch.Generator().manual_seed(2))
    cos, sin = rope_cos_sin(att.head_dim, 8, m.args.rope_theta)
    seen = {}
    att.sdpa = lambda q, k, v, is_causal: (
        seen.update(q=q, k=k) or F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    )
    with torch.no_grad():
        att(x, cos, sin)

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + m.args.norm_eps) * w

    q = att.wq(x).view(2, 8, -1, att.head_dim)
    k = att.wk(x).view(2, 8, -1, att.head_dim)
    want_q = apply_rope(rms(q, att.q_norm.weight), cos, sin).transpose(1, 2)
    want_k = apply_rope(rms(k, att.k_norm.weight), cos, sin).repeat_interleave(2, dim=2).transpose(1, 2)
    torch.testing.assert_close(seen["q"], want_q)
    torch.testing.assert_close(seen["k"], want_k)


def test_qk_norms_stay_out_of_fp8_conversion():
    m = build_model_meta(model_args("debug", qk_norm=True))
    fqns = fp8_candidate_fqns(m, CATALOG["fp8_current"].fp8)
    assert fqns and not any("norm" in f for f in fqns)


def test_qk_norm_block_compiles_whole_and_matches_eager():
    """The compile path (``train.compile``: each block ``fullgraph=True``): a QK-norm block traces whole (dynamo +
    AOTAutograd) and gives the eager block's output. ``aot_eager`` rather than inductor keeps the test fast; the
    norm is the same RMSNorm inductor already compiles in every block."""
    torch._dynamo.reset()
    m = _model(qk_norm=True)
    block = m.layers["0"]
    x = torch.randn(2, 8, m.args.dim, generator=torch.Generator().manual_seed(4))
    cos, sin = rope_cos_sin(m.args.head_dim, 8, m.args.rope_theta)
    with torch.no_grad():
        want = block(x, cos, sin)
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x, cos, sin), want, atol=1e-5, rtol=1e-5)


# ---- z-loss ----


def test_z_loss_is_weight_times_mean_squared_logsumexp_in_fp32():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [3.0, -1.0, 0.5]]], dtype=torch.bfloat16)
    lse = [math.log(sum(math.exp(float(v)) for v in row)) for row in logits[0]]
    want = 1e-3 * (lse[0] ** 2 + lse[1] ** 2) / 2
    got = z_loss_fp32(logits, 1e-3)
    assert got.dtype == torch.float32 and got.shape == ()
    assert got.item() == pytest.approx(want, rel=1e-6)
    fn = build_z_loss(1e-3)
    assert fn(logits).item() == pytest.approx(want, rel=1e-6)
    assert build_z_loss(0.0) is None


@pytest.mark.parametrize("bad", [-1e-4, float("nan"), float("inf")])
def test_bad_z_loss_is_refused_in_one_line(bad):
    with pytest.raises(ConfigError, match=r"^train\.z_loss=.* must be finite and >= 0") as e:
        TrainSpec(z_loss=bad)
    assert "\n" not in str(e.value)


SPEC = dict(steps=3, batch_size=2, seq_len=32, warmup_steps=1, val_every=0, val_batches=1, timing_warmup_steps=1)


def _built(spec: TrainSpec, recipe: str = "fp32"):
    return build(CATALOG[recipe], model_args("debug"), spec, OptimHParams(lr=3e-3), 0, torch.device("cpu"))


def _batch(spec: TrainSpec):
    return [(_tokens(model_args("debug"), spec.batch_size, spec.seq_len),) * 2]


def test_z_loss_zero_trains_exactly_as_before():
    """z_loss=0 builds no z term: the step's loss, gradients and weights are bit-identical to a plain CE step."""
    spec = TrainSpec(**SPEC, telemetry_every=0, progress=False)
    b = _built(spec)
    assert b.z_loss_fn is None
    ref = _built(spec)
    micro = _batch(spec)
    res = train_step(b, micro, spec.grad_clip, 0)
    # The reference step by hand: CE alone.
    ref.optimizer.zero_grad()
    x, y = micro[0]
    loss = cross_entropy_fp32(ref.model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.model.parameters(), spec.grad_clip)
    ref.optimizer.step()
    assert res.loss == loss.item() and res.z_loss is None
    for (n, p), q in zip(b.model.named_parameters(), ref.model.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_z_loss_joins_the_objective_but_not_the_reported_loss():
    off, on = (TrainSpec(**SPEC, telemetry_every=0, progress=False, z_loss=z) for z in (0.0, 0.5))
    b_off, b_on = _built(off), _built(on)
    micro = _batch(on)
    r_off, r_on = train_step(b_off, micro, on.grad_clip, 0), train_step(b_on, micro, on.grad_clip, 0)
    assert r_on.loss == r_off.loss  # same weights before the step: the reported CE is the same
    x, _ = micro[0]
    with torch.no_grad():
        want = z_loss_fp32(_built(on).model(x), 0.5).item()
    assert r_on.z_loss == pytest.approx(want, rel=1e-6) and r_on.z_loss > 0
    # ... but the update differs: the z term has a gradient.
    p_off = dict(b_off.model.named_parameters())
    assert any(not torch.equal(p, p_off[n]) for n, p in b_on.model.named_parameters())


def test_z_loss_is_logged_beside_the_plain_loss(token_data):
    spec = TrainSpec(**SPEC, telemetry_every=0, progress=False, z_loss=1e-4)

    class Sink:
        rows: list[dict] = []

        def log_metrics(self, m, step):
            self.rows.append(m)

    sink = Sink()
    data = TokenBatches(token_data.train, token_data.val, spec.seq_len, spec.batch_size, 0)
    run_training(_built(spec), data, spec, sink)
    steps = [r for r in sink.rows if "loss" in r]
    assert len(steps) == 3 and all(0 < r["z_loss"] < 1 for r in steps)


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_qk_norm_under_activation_checkpointing_gives_the_same_step(ac):
    """Activation checkpointing recomputes the norms in backward: same loss and gradients as without it."""
    spec = dict(SPEC, telemetry_every=0, progress=False)
    args = model_args("debug", qk_norm=True)
    plain, ckpt = (
        build(CATALOG["fp32"], args, TrainSpec(**spec, ac=a), OptimHParams(lr=3e-3), 0, torch.device("cpu"))
        for a in ("none", ac)
    )
    micro = _batch(TrainSpec(**spec))
    r0, r1 = train_step(plain, micro, 1.0, 0), train_step(ckpt, micro, 1.0, 0)
    assert r0.loss == r1.loss and r0.grad_norm == pytest.approx(r1.grad_norm, rel=1e-6)
    g0 = plain.model.layers["0"].attention.q_norm.weight
    g1 = ckpt.model.layers["0"].attention.q_norm.weight
    torch.testing.assert_close(g0, g1)


def test_qk_norm_trains_under_an_fp8_recipe_with_its_effective_recipe_checked(token_data):
    """FP8 conversion leaves the norms in high precision; the effective-recipe check (which linears ran in FP8)
    passes with them in the blocks."""
    spec = TrainSpec(**SPEC, telemetry_every=0, progress=False)
    b = build(
        CATALOG["fp8_current"], model_args("debug", qk_norm=True), spec, OptimHParams(lr=3e-3), 0, torch.device("cpu")
    )
    assert type(b.model.layers["0"].attention.q_norm) is RMSNorm
    assert b.model.layers["0"].attention.q_norm.weight.dtype == torch.float32

    class Sink:
        def log_metrics(self, m, step):
            pass

    res = run_training(b, TokenBatches(token_data.train, token_data.val, 32, 2, 0), spec, Sink())
    assert res.effective_checked and res.effective["fp8_linears"]
    assert not any("norm" in f for f in res.effective["fp8_linears"])
