import pytest
import torch

from lowprec.errors import ConfigError
from lowprec.model import LLAMA_CONFIGS, Transformer, model_args
from lowprec.train.build import build_model_meta, materialize


def _count(m):
    return sum(p.numel() for p in m.parameters())


def test_llama3_8b_has_the_published_parameter_count():
    m = build_model_meta(LLAMA_CONFIGS["llama3_8b"])
    assert _count(m) == 8_030_261_248
    assert LLAMA_CONFIGS["llama3_8b"].num_params() == 8_030_261_248
    assert all(p.device.type == "meta" for p in m.parameters())


@pytest.mark.parametrize("name", list(LLAMA_CONFIGS))
def test_num_params_matches_the_module_tree(name):
    assert _count(build_model_meta(LLAMA_CONFIGS[name])) == LLAMA_CONFIGS[name].num_params()


def test_named_sizes():
    assert _count(build_model_meta(LLAMA_CONFIGS["debug"])) < 600_000
    assert 7_500_000 < _count(build_model_meta(LLAMA_CONFIGS["tiny"])) < 8_500_000


def test_torchtitan_module_names():
    names = {n for n, _ in build_model_meta(LLAMA_CONFIGS["debug"]).named_parameters()}
    for n in [
        "tok_embeddings.weight",
        "layers.0.attention.wq.weight",
        "layers.1.attention.wo.weight",
        "layers.0.feed_forward.w1.weight",
        "layers.0.feed_forward.w2.weight",
        "layers.0.feed_forward.w3.weight",
        "layers.0.attention_norm.weight",
        "layers.0.ffn_norm.weight",
        "norm.weight",
        "output.weight",
    ]:
        assert n in names


def test_same_seed_same_weights_and_meta_init_is_complete():
    a, b, c = (build_model_meta(LLAMA_CONFIGS["debug"]) for _ in range(3))
    materialize(a, torch.device("cpu"), 7)
    materialize(b, torch.device("cpu"), 7)
    materialize(c, torch.device("cpu"), 8)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        assert torch.isfinite(pa).all(), n
    assert not torch.equal(a.output.weight, c.output.weight)


def test_forward_is_causal_and_shapes():
    m = build_model_meta(model_args("debug"))
    materialize(m, torch.device("cpu"), 0)
    x = torch.randint(0, 8192, (2, 16))
    y = m(x)
    assert y.shape == (2, 16, 8192) and y.dtype == torch.float32
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % 8192
    y2 = m(x2)
    torch.testing.assert_close(y[:, :10], y2[:, :10])
    assert not torch.allclose(y[:, 10:], y2[:, 10:])


def test_invalid_shapes_raise():
    with pytest.raises(ValueError, match="n_kv_heads"):
        model_args("debug", n_kv_heads=3)
    with pytest.raises(ConfigError, match="known"):
        model_args("nope")
    m = Transformer(model_args("debug", max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, 9, dtype=torch.long))


def test_seed_i_of_every_recipe_starts_from_the_same_weights():
    """The paired design: seed i of each recipe shares the initial weights (as stored: bf16_pure holds their BF16
    rounding; FP8 recipes swap modules but keep the FQNs and the weights). Under FSDP2/TP,
    ``build.materialize_sharded`` initialises a full replica the same way (tests/distributed: equal fp32 losses)."""
    from lowprec.build_optim import OptimHParams
    from lowprec.recipes import CATALOG
    from lowprec.train.build import build
    from lowprec.train.spec import TrainSpec

    spec = TrainSpec(steps=2, batch_size=2, seq_len=32, timing_warmup_steps=1, progress=False)

    def weights(recipe, seed):
        b = build(CATALOG[recipe], model_args("debug"), spec, OptimHParams(), seed, torch.device("cpu"))
        return {n: p.detach().float() for n, p in b.model.named_parameters()}

    ref = weights("fp32", 5)
    for recipe in ("bf16", "fp8_rowwise", "fp8_blockwise", "bf16_adamw8bit", "bf16_pure"):
        got = weights(recipe, 5)
        assert got.keys() == ref.keys(), recipe
        for n, w in got.items():
            expect = ref[n].bfloat16().float() if recipe == "bf16_pure" else ref[n]
            assert torch.equal(w, expect), (recipe, n)
    assert not torch.equal(weights("bf16", 6)["output.weight"], ref["output.weight"])
