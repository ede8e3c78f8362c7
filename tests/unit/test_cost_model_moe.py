"""A DeepSeekMoE model in the estimator: FLOPs per token from the activated
parameters, the cost model's per-expert GEMMs at the expected tokens per expert, the memory model's all-expert
state; hand computations from ``moe_debug``'s config numbers written here, not read from lowprec. Dense models
keep the predictions they had before MoE support (``DENSE_BEFORE``)."""

from __future__ import annotations

import pytest

from lowprec.estimate.cost_model import Calibration, Layout, step_cost
from lowprec.estimate.estimator import flops_per_token, predict_state_bytes
from lowprec.estimate.hardware import get_hardware
from lowprec.estimate.memory_model import peak_breakdown
from lowprec.model import model_args
from lowprec.recipes import get_recipe
from lowprec_lab.cli import main
from lowprec_lab.sizing.cost_validation import validate

#: moe_debug as lowprec/model/moe.py defines it (the first test checks these are still its numbers)
D, L, HEADS, KV, VOCAB, E, SHARED, TOPK, INTER = 32, 2, 4, 2, 8192, 8, 1, 2, 32
HD = D // HEADS


def hand_counts() -> dict[str, int]:
    """Parameters of moe_debug by hand (no dense blocks): attention wq wk wv wo, two norms, shared and routed
    SwiGLU experts (w1 w3: dim x inter, w2: inter x dim), router gate E x dim; final norm, output."""
    attn = D * HEADS * HD + 2 * D * KV * HD + HEADS * HD * D
    expert = 3 * D * INTER
    common = attn + 2 * D + SHARED * expert + E * D
    head = D + VOCAB * D  # final norm + output; the token embedding (VOCAB x D) does no FLOPs
    return {
        "total": L * (common + E * expert) + head,
        "activated": L * (common + TOPK * expert) + head,
        # FP8 linears of fp8_tensorwise on moe_debug: attention, shared expert, top_k routed experts (output stays hp)
        "fp8_activated": L * (attn + SHARED * expert + TOPK * expert),
        "fp8_block": attn + SHARED * expert + E * expert,
    }


def test_moe_debug_has_the_config_numbers_used_here():
    a = model_args("moe_debug")
    got = (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size, a.n_routed_experts, a.n_shared_experts)
    assert got == (D, L, HEADS, KV, VOCAB, E, SHARED)
    assert (a.top_k, a.moe_inter_dim, a.n_dense_layers) == (TOPK, INTER, 0)


def test_flops_per_token_counts_activated_parameters_only():
    h = hand_counts()
    assert (h["total"], h["activated"]) == (324_256, 287_392)
    f = flops_per_token(model_args("moe_debug"), 512, get_recipe("fp8_tensorwise"))
    assert f.is_moe and f.n_flop_params == h["activated"] and f.n_total_params == h["total"]
    assert f.flops_per_token == 6 * h["activated"] + 12 * L * D * 512
    assert f.fp8_flops_per_token == 6 * h["fp8_activated"]
    dense = flops_per_token(model_args("debug"), 512)
    assert not dense.is_moe and dense.n_total_params == dense.n_flop_params


def test_estimate_prints_activated_parameters_in_the_flops_line(capsys):
    assert main(["estimate", "model=moe_debug", "recipe=bf16"]) == 0
    out = capsys.readouterr().out
    assert "note: MoE step time NOT validated" in out and "compile=false" in out
    line = next(x for x in out.splitlines() if x.startswith("FLOPs/token"))
    assert f"N = {hand_counts()['activated']:,} activated parameters" in line
    assert f"{hand_counts()['total']:,} in total" in line


def _roofline(m, k, n, peak_tflops, eff, d0, in_bytes, hbm_tb_s):
    """The cost model's GEMM rule from its module doc, written out: max(FLOPs / rate, bytes / bandwidth)."""
    small = min(m, k, n)
    rate = peak_tflops * 1e12 * eff * small / (small + d0)
    return max(2 * m * k * n / rate, ((m * k + k * n) * in_bytes + m * n * 2) / (hbm_tb_s * 1e12 * 0.8))


def test_cost_model_times_each_expert_at_its_expected_tokens():
    hw, cal = get_hardware("h100"), Calibration()
    m = 512  # batch 1 x seq 512
    m_e = m * TOPK / E  # 128 tokens per routed expert

    def triple(rows, k, n, peak, in_bytes=2):  # forward, dgrad, wgrad
        g = lambda a, b, c: _roofline(a, b, c, peak, cal.gemm_eff_bf16, 128, in_bytes, hw.hbm_tb_s)  # noqa: E731
        return g(rows, k, n) + g(rows, n, k) + g(k, rows, n)

    bf16 = hw.bf16_tflops
    attn = triple(m, D, HEADS * HD, bf16) * 2 + triple(m, D, KV * HD, bf16) * 2
    swiglu = lambda rows, hid: 2 * triple(rows, D, hid, bf16) + triple(rows, hid, D, bf16)  # noqa: E731
    router = triple(m, D, E, hw.fp32_tflops, in_bytes=4)  # FP32 gate
    want = L * (attn + swiglu(m, SHARED * INTER) + E * swiglu(m_e, INTER) + router) + triple(m, D, VOCAB, bf16)
    got = step_cost(model_args("moe_debug"), get_recipe("bf16"), hw, Layout(batch=1, seq=512, ac="none"))
    assert got.gemm == pytest.approx(want, rel=1e-12)
    # more experts of the same activated size: the same FLOPs on smaller GEMMs, so slower (small-shape efficiency)
    wide = step_cost(
        model_args("moe_debug", n_routed_experts=16, top_k=4, moe_inter_dim=16),
        get_recipe("bf16"),
        hw,
        Layout(batch=1, seq=512, ac="none"),
    )
    assert wide.gemm > got.gemm


def test_memory_holds_every_expert_and_each_experts_fp8_transposed_copy():
    h = hand_counts()
    st = predict_state_bytes(model_args("moe_debug"), get_recipe("bf16"))
    assert st.n_params == h["total"] + VOCAB * D  # every expert's weights, grads and moments
    assert st.params == st.grads == 4 * st.n_params  # bf16 recipe: FP32 weights
    # a dense first block is smaller than a MoE block: the transposed copies follow the largest block
    args = model_args("moe_debug", n_dense_layers=1)
    pk = peak_breakdown(args, get_recipe("fp8_tensorwise"), dp_shard=2, batch=1, seq=512, ac="none")
    assert pk.fp8_transposed == 2 * h["fp8_block"]


def test_tensor_parallel_of_a_moe_model_is_refused():
    with pytest.raises(ValueError, match="tensor/expert parallelism of a MoE model is not modelled"):
        step_cost(model_args("moe_debug"), get_recipe("bf16"), get_hardware("h100"), Layout(tp=2, seq=512))
    with pytest.raises(ValueError, match="tensor/expert parallelism of a MoE model is not modelled"):
        peak_breakdown(model_args("moe_debug"), get_recipe("bf16"), tp=2, seq=512)


#: dense predictions recorded with the code before MoE support (commit aff1fd2): validate() rows (tokens/s or
#: ratio, allocated GiB) and flops_per_token (total, FP8) at seq 2048. MoE support must not move them. The
#: validate() rows were re-recorded when GEMMs on other parts began to follow measured matmul ceilings and the
#: memory model learned the compiled loss (both dense-model changes, README "Step time").
DENSE_BEFORE = {
    "tt_8b_8gpu_bf16_eager": [5762.136881766589, 78.28045286238194],
    "tt_8b_8gpu_bf16": [6667.2068725563, 78.28045286238194],
    "tt_8b_8gpu_fp8": [8532.135985232957, 78.68670369684696],
    "tt_8b_128gpu_bf16_eager": [5647.589579846323, 64.25777114927769],
    "tt_8b_128gpu_bf16": [6514.326539506572, 64.25777114927769],
    "tt_8b_128gpu_fp8": [8362.114608935617, 64.66402198374271],
    "tt_8b_8gpu_fp8_32k": [4331.84590920516, 88.90553905069828],
    "tt_70b_256gpu_2d_fp8": [791.0298957472388, 68.05622049793601],
    "tt_70b_256gpu_2d_asynctp_fp8": [931.2519738603418, 72.05622049793601],
    "ao_h100_bf16": [6594.741892608565, 48.00576604902744],
    "ao_h100_tensorwise": [8378.322932274194, 48.41201688349247],
    "ao_h100_rowwise": [6768.285450710997, 48.41201604902744],
    "mx_b200_tensorwise": [1.358846942228446, 40.58395208418369],
    "ao_mi300x_bf16": [5376.767527059641, 40.17770208418369],
    "ao_mi300x_tensorwise": [6952.623949613306, 40.58395291864872],
    "ao_mi300x_rowwise": [5869.758615298684, 40.58395208418369],
    "trainy_h200_32gpu_fp8": [10266.853980331194, 51.81243039667606],
    "trainy_h200_64gpu_fp8": [10268.864053094052, 49.9427395015955],
    "flops/debug/bf16": [3294144, 0],
    "flops/debug/fp8_tensorwise": [3294144, 147456],
    "flops/tiny/bf16": [61355520, 0],
    "flops/tiny/fp8_tensorwise": [61355520, 23592960],
    "flops/llama3_8b/bf16": [48250773504, 0],
    "flops/llama3_8b/fp8_tensorwise": [48250773504, 41875931136],
}


def test_dense_predictions_are_the_ones_before_moe_support():
    got = {r.point.id: [r.predicted, r.predicted_memory_gib] for r in validate()}
    for m in ("debug", "tiny", "llama3_8b"):
        for rec in ("bf16", "fp8_tensorwise"):
            f = flops_per_token(model_args(m), 2048, get_recipe(rec))
            got[f"flops/{m}/{rec}"] = [f.flops_per_token, f.fp8_flops_per_token]
    assert got.keys() == DENSE_BEFORE.keys()
    for k, (a, b) in DENSE_BEFORE.items():
        assert got[k][0] == pytest.approx(a, rel=1e-12), k
        assert got[k][1] == (None if b is None else pytest.approx(b, rel=1e-12)), k
