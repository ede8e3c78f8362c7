"""After one optimizer step, each recipe's dtypes and exact state bytes match the README's memory accounting."""

import math

import pytest
import torch

from lowprec.build_optim import OptimHParams
from lowprec.data import TokenBatches
from lowprec.measure.accounting import measure_state_bytes
from lowprec.model import model_args
from lowprec.recipes import get_recipe
from lowprec.train.build import build
from lowprec.train.effective import (
    EffectiveRecipeError,
    check_effective,
    expected_effective,
    inspect_effective,
    record_linear_output_dtypes,
)
from lowprec.train.loop import train_step
from lowprec.train.spec import TrainSpec

F32, BF16 = torch.float32, torch.bfloat16
# recipe -> (param dtype, grad dtype, linear output dtype, moment kind of large tensors, FP8 linears in debug)
TABLE = {
    "fp32": (F32, F32, F32, "float32", 0),
    "bf16": (F32, F32, BF16, "float32", 0),
    "bf16_pure": (BF16, BF16, BF16, "bfloat16", 0),
    "fp8_tensorwise": (F32, F32, BF16, "float32", 14),  # 2 blocks x 7 linears; output stays high precision
    "bf16_adamw8bit": (F32, F32, BF16, "int8_blockwise", 0),
    "fp8_current": (F32, F32, BF16, "float32", 14),
    "fp8_delayed": (F32, F32, BF16, "float32", 14),
    "fp8_rowwise": (F32, F32, BF16, "float32", 14),
    "fp8_blockwise": (F32, F32, BF16, "float32", 14),
    "bf16_master": (BF16, BF16, BF16, "float32", 0),  # moments of the FP32 master copies
    "bf16_sr": (BF16, BF16, BF16, "bfloat16", 0),
    "bf16_moments": (F32, F32, BF16, "bfloat16", 0),
    "bf16_adamw8bit_ao": (F32, F32, BF16, "int8_blockwise", 0),
    "bf16_adamw4bit": (F32, F32, BF16, "int4_blockwise", 0),
    "fp8_msamp_o2": (F32, F32, BF16, "float8_e4m3fn", 14),
    "fp16_amp": (F32, F32, torch.float16, "float32", 0),
    "fp16_noscale": (F32, F32, torch.float16, "float32", 0),
    "deepseek_v3": (F32, F32, BF16, "bfloat16", 14),
}
SPEC = TrainSpec(steps=4, batch_size=2, seq_len=64, val_every=0, val_batches=1, timing_warmup_steps=1, progress=False)


def _one_step(name, token_data):
    b = build(get_recipe(name), model_args("debug"), SPEC, OptimHParams(), 0, torch.device("cpu"))
    batches = TokenBatches(token_data.train, token_data.val, SPEC.seq_len, SPEC.batch_size, 0)
    micro = [batches.train_batch(0)]
    with record_linear_output_dtypes(b.model) as out_dtypes:
        train_step(b, micro, 1.0, 0)
    return b, out_dtypes


@pytest.mark.parametrize("name", list(TABLE))
def test_dtypes_after_one_step(name, token_data):
    b, out_dtypes = _one_step(name, token_data)
    pdt, gdt, odt, moment, n_fp8 = TABLE[name]
    params = list(b.model.parameters())
    assert {p.dtype for p in params} == {pdt}
    assert {p.grad.dtype for p in params} == {gdt}
    eff = inspect_effective(b, out_dtypes)
    assert eff["linear_output_dtype"] == {str(odt).removeprefix("torch."): 15}
    assert sum(eff["fp8_linears"].values()) == n_fp8
    big = [p for p in params if p.numel() >= 4096]
    assert {eff_kind for eff_kind in eff["moment_dtype"]} >= {moment}
    assert eff["moment_dtype"][moment] >= sum(p.numel() for p in big)
    check_effective(eff, expected_effective(b))


def test_effective_check_catches_a_recipe_that_ran_as_something_else(token_data):
    b, out_dtypes = _one_step("bf16", token_data)
    b.model.to(torch.bfloat16)  # sabotage: weights no longer FP32 masters
    with pytest.raises(EffectiveRecipeError, match="param_dtype"):
        check_effective(inspect_effective(b, out_dtypes), expected_effective(b))


@pytest.mark.parametrize("name", ["fp8_delayed", "fp8_blockwise", "fp8_tensorwise"])
def test_inspection_changes_no_buffer_or_parameter(name, token_data):
    """The inspection reads the built objects only (it used to run a forward that fed its amaxes into the
    delayed-scaling histories of the next step)."""
    b, out_dtypes = _one_step(name, token_data)
    before = {k: v.clone() for k, v in b.model.state_dict().items()}
    assert any("amax_history" in k for k in before) == (name == "fp8_delayed")
    check_effective(inspect_effective(b, out_dtypes), expected_effective(b))
    after = b.model.state_dict()
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert torch.equal(v, after[k]), k


def _torch_adamw_bytes(params, state_bytes_per_elem):
    n = sum(p.numel() for p in params)
    return state_bytes_per_elem * n + 4 * len(params)  # + one fp32 `step` scalar per tensor


@pytest.mark.parametrize("name, per_param", [("fp32", 16), ("bf16", 16), ("bf16_pure", 8)])
def test_state_bytes_match_design_accounting(name, per_param, token_data):
    b, _ = _one_step(name, token_data)
    params = list(b.model.parameters())
    n = sum(p.numel() for p in params)
    sb = measure_state_bytes(b.model, b.optimizer)
    elem = 4 if name != "bf16_pure" else 2
    assert sb.params == elem * n and sb.grads == elem * n and sb.master == 0
    assert sb.optim_states == _torch_adamw_bytes(params, 2 * elem) - 0
    assert sb.total == per_param * n + 4 * len(params)
    assert math.isclose(sb.per_param, per_param, rel_tol=1e-3)


def test_adamw8bit_state_bytes_are_exact(token_data):
    b, _ = _one_step("bf16_adamw8bit", token_data)
    params = list(b.model.parameters())
    n = sum(p.numel() for p in params)
    expected_states = 2 * 256 * 4  # the signed and unsigned dynamic qmaps, shared by every tensor
    for p in params:
        if p.numel() >= 4096:
            expected_states += 2 * p.numel() + 2 * 4 * math.ceil(p.numel() / 256)  # uint8 m, v + fp32 absmax per block
        else:
            expected_states += 8 * p.numel()  # bitsandbytes keeps small tensors in 32-bit
    sb = measure_state_bytes(b.model, b.optimizer)
    assert sb.optim_states == expected_states
    assert sb.params == 4 * n and sb.grads == 4 * n
    # weights 4 + grads 4 + m, v 2 + block scales; the debug model's many small tensors add a little
    assert 10.0 < sb.per_param < 10.5


def test_gradient_accumulation_equals_the_concatenated_batch(token_data):
    """Two micro-batches of 2 give the gradients of one batch of 4 (mean loss over equal micro-batches)."""
    batches = TokenBatches(token_data.train, token_data.val, 32, 2, 0)
    m1, m2 = batches.train_batch(0, 0), batches.train_batch(0, 1)
    both = (torch.cat([m1[0], m2[0]]), torch.cat([m1[1], m2[1]]))
    grads, losses = [], []
    for micro in ([m1, m2], [both]):
        b = build(get_recipe("fp32"), model_args("debug"), SPEC, OptimHParams(), 0, torch.device("cpu"))
        losses.append(train_step(b, micro, 1e9, 0).loss)
        grads.append([p.grad.clone() for p in b.model.parameters()])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for ga, gb in zip(*grads):
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-7)
