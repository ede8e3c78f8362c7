"""``train.fused_casts`` for the block-scaled formats: the compiled MXFP8/MXFP4/NVFP4 casts give the eager casts'
bits, a block-scaled linear and a training run give the same numbers with them on and off, and the run records
which ran.

Each compiled kernel costs seconds on a 2-core CPU, so the cases share kernels: every bitwise case is also a key
the linear and the training run use (float32 and bfloat16, contiguous and transposed operands; the run compiles
none of its own), and each case holds the edge values in one tensor with a ragged second shape (dynamic shapes: the
same kernel).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from lowprec.errors import ConfigError
from lowprec.float8.mx_linear import MXLinear, mx_config
from lowprec.kernels.fused_casts import resolve_fused_casts
from lowprec.kernels.fused_mx_casts import fused_quantize_mx, fused_quantize_nvfp4
from lowprec.numerics.microscaling import E2M1_VALUES, BlockQTensor, quantize_mx, quantize_nvfp4
from lowprec.recipes import CATALOG


def _operand(rows: int, cols: int, dtype: torch.dtype = torch.float32, huge: float = 3e38) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows)[:, None]  # rows 6 decades apart
    x[:4, :64] = 0.0  # all-zero blocks (and 16x16 tiles): the smallest scale
    x[4, :] = 1e-30  # tiny blocks, scaled up by 2**127 at most: saturation of the exponent clamp
    x[5, :] = 1e-40  # float32 subnormals
    x[6, 1] = huge  # a huge element next to tiny ones in its block: they flush to zero
    x[7, :32] = -0.0
    halves = torch.tensor(E2M1_VALUES[1:] + (7.0,))  # E2M1's grid, a value past it, the ties between
    x[8, :30] = torch.cat((halves, (halves[:-1] + halves[1:]) / 2, -halves, -(halves[:-1] + halves[1:]) / 2))
    x[9, :] = torch.linspace(-1000, 1000, cols)  # ties between FP8 codes and saturation
    x[10, 2] = torch.nextafter(torch.tensor(448.0 * 2**-5), torch.tensor(1e9))  # one ulp past a power-of-2 amax
    return x.to(dtype)


def _same(fused: BlockQTensor, eager: BlockQTensor) -> None:
    assert (fused.elem, fused.block, fused.shape, fused.two_d) == (eager.elem, eager.block, eager.shape, eager.two_d)
    assert fused.data.dtype == eager.data.dtype and fused.data.shape == eager.data.shape
    assert fused.scale.dtype == eager.scale.dtype
    assert torch.equal(fused.scale.view(torch.uint8), eager.scale.view(torch.uint8)), "block scales differ"
    if eager.tensor_scale is None:
        assert fused.tensor_scale is None
    else:
        assert torch.equal(fused.tensor_scale.view(torch.int32), eager.tensor_scale.view(torch.int32))
    codes_f, codes_e = fused.data.view(torch.uint8), eager.data.view(torch.uint8)
    nan = eager.data.float().isnan() if eager.fmt.dtype is not None else torch.zeros_like(codes_e, dtype=torch.bool)
    if eager.fmt.dtype is not None:  # an FP8 NaN where eager has one, whatever its payload (inductor's differs)
        assert torch.equal(fused.data.float().isnan(), nan)
    diff = int(((codes_f != codes_e) & ~nan).sum())
    assert diff == 0, f"{diff} element bytes differ"


@pytest.mark.parametrize(
    "elem, mode, dtype, transposed",
    [
        ("e4m3", "rceil", torch.float32, False),  # MXFP8 (torchao's default scale rounding)
        ("e4m3", "rceil", torch.float32, True),  # weight.t() / x.t() in the backward GEMMs
        ("e5m2", "floor", torch.float32, False),  # HYBRID gradients, OCP's scale rounding
        ("e2m1", "rceil", torch.float32, False),  # MXFP4
        ("e2m1", "rceil", torch.bfloat16, False),  # autocast's activations
        ("e2m1", "rceil", torch.float32, True),  # the MXFP4 run's weight.t()
        ("e2m1", "rceil", torch.bfloat16, True),  # and its x.t() and dy.t() under autocast
    ],
)
def test_fused_mx_cast_is_the_eager_cast_bit_for_bit(elem, mode, dtype, transposed):
    for rows, cols in ((64, 128), (37, 96)):  # and a ragged row count and K (dynamic shapes: one kernel)
        x = _operand(cols, rows, dtype).t() if transposed else _operand(rows, cols, dtype)
        _same(fused_quantize_mx(x, elem, 32, mode), quantize_mx(x, elem, 32, mode))


@pytest.mark.parametrize("two_d", [False, True])
def test_fused_nvfp4_cast_is_the_eager_cast_bit_for_bit(two_d):
    # NVFP4's tensor scale follows the largest element: 3e38 flushes every other block to zero, 1e4 spreads the
    # block scales over E4M3's range, from its clamp at the smallest normal to 448
    for rows, cols, huge in ((64, 128, 1e4), (48, 80, 1e4), (64, 128, 3e38)):
        x = _operand(rows, cols, huge=huge)
        _same(fused_quantize_nvfp4(x, two_d=two_d), quantize_nvfp4(x, two_d=two_d))
    if not two_d:  # a tensor amax from elsewhere, larger than this operand's (a kernel of its own)
        x, amax = _operand(64, 128, huge=1e4), torch.tensor(5e5)
        _same(fused_quantize_nvfp4(x, tensor_amax=amax), quantize_nvfp4(x, tensor_amax=amax))


def test_nan_and_inf_are_handled_as_the_eager_cast_handles_them():
    x = _operand(64, 128)
    x[11, 3], x[12, 4], x[13, 5] = float("inf"), float("-inf"), float("nan")
    _same(fused_quantize_mx(x, "e4m3", 32, "rceil"), quantize_mx(x, "e4m3", 32, "rceil"))  # NaN stays NaN
    for cast in (quantize_mx, fused_quantize_mx):  # E2M1 has no NaN: both refuse with the same line
        with pytest.raises(ValueError, match="^E2M1 has no NaN; the block holds NaN$"):
            cast(x, "e2m1", 32, "rceil")
    x[13, 5] = 0.0
    _same(fused_quantize_mx(x, "e2m1", 32, "rceil"), quantize_mx(x, "e2m1", 32, "rceil"))  # infinities saturate
    for cast in (quantize_nvfp4, fused_quantize_nvfp4):  # an infinite tensor amax: NaN block scales, refused
        with pytest.raises(ValueError, match="^E2M1 has no NaN"):
            cast(x)


def test_shapes_the_eager_cast_refuses_are_refused_alike():
    for bad in (torch.zeros(4, 40), torch.zeros(2, 4, 32)):
        with pytest.raises(ValueError) as eager:
            quantize_mx(bad, "e2m1")
        with pytest.raises(ValueError) as fused:
            fused_quantize_mx(bad, "e2m1")
        assert str(fused.value) == str(eager.value)
    with pytest.raises(ValueError, match="2-D 16x16 scaling needs rows divisible by 16"):
        fused_quantize_nvfp4(torch.zeros(8, 32), two_d=True)


def _linear(recipe: str, fused: bool) -> MXLinear:
    torch.manual_seed(0)
    lin = MXLinear(128, 64, False, mx_config(CATALOG[recipe].fp8))
    lin.init_buffers(torch.Generator().manual_seed(1))
    lin.fused_casts = fused
    return lin


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_a_block_scaled_linear_gives_the_same_numbers_with_fused_casts(recipe):
    # nvfp4 has every stabiliser: its stochastically rounded gradients stay eager, drawing the same random numbers
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(64, 128, generator=g), torch.randn(64, 64, generator=g)
    out = {}
    for fused in (False, True):
        lin = _linear(recipe, fused)
        xi = x.clone().requires_grad_(True)
        torch.manual_seed(7)  # the global generator SR draws from
        y = lin(xi)
        y.backward(dy)
        out[fused] = (y, xi.grad, lin.weight.grad)
    for a, b in zip(out[False], out[True], strict=True):
        assert torch.equal(a, b)


def test_fused_mx_casts_resolve_with_their_own_probe(monkeypatch):
    import lowprec.kernels.fused_mx_casts as fm

    cpu = torch.device("cpu")
    assert resolve_fused_casts("on", cpu, compiled_model=False, block_scaled=True) == "on"
    why = "torch.compile of the block-scaled casts failed on cpu: BackendCompilerFailed: no C++ compiler"
    monkeypatch.setattr(fm, "fused_mx_casts_unavailable", lambda device_type: why)
    with pytest.raises(ConfigError, match="^train.fused_casts=on cannot run: torch.compile of the block-scaled"):
        resolve_fused_casts("on", cpu, compiled_model=False, block_scaled=True)
    assert resolve_fused_casts("on", cpu, compiled_model=False) == "on"  # the FP8 casts' probe is another one


def test_the_build_refuses_fused_mx_casts_where_they_cannot_compile(monkeypatch):
    import lowprec.kernels.fused_mx_casts as fm
    from lowprec.build_optim import OptimHParams
    from lowprec.model import model_args
    from lowprec.train.build import build
    from lowprec.train.spec import TrainSpec

    monkeypatch.setattr(fm, "fused_mx_casts_unavailable", lambda device_type: "no C++ compiler")
    spec = TrainSpec(steps=2, batch_size=2, seq_len=64, timing_warmup_steps=1, fused_casts="on")
    with pytest.raises(ConfigError, match=re.escape("train.fused_casts=on cannot run: no C++ compiler; use")):
        build(CATALOG["mxfp4"], model_args("debug"), spec, OptimHParams(), 0, torch.device("cpu"))


def test_an_mxfp4_run_has_the_same_losses_with_fused_casts_and_records_them(run_dirs, tmp_path):
    from mlflow import MlflowClient

    from lowprec_lab.cli import main

    # The debug model at dim 64 with 4 KV heads: no GEMM operand has K = 32 = the block (debug's dim 32 and KV width
    # 16 do), for which dynamo specialises a kernel of its own; every cast this run makes then runs one of the four
    # MXFP4 kernels the bitwise cases above compiled (E2M1; float32 and bfloat16; contiguous and transposed).
    common = ["model=debug", "model.dim=64", "model.n_kv_heads=4", "recipe=mxfp4", "train.steps=2"]
    common += ["train.timing_warmup_steps=1", "train.batch_size=2", "train.seq_len=32", "train.val_every=0"]
    for setting in ("on", "off"):
        assert main(["train", *run_dirs, *common, f"train.fused_casts={setting}"]) == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], order_by=["start_time"])
    assert len(runs) == 2
    losses = [[m.value for m in sorted(client.get_metric_history(r.info.run_id, "loss"), key=lambda m: m.step)]
              for r in runs]  # fmt: skip
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    on, off = (r.data.tags for r in runs)
    assert on["fused_casts"] == "on" and off["fused_casts"] == "off: train.fused_casts=off"
    assert json.loads(on["effective_recipe"])["kernels"]["fp8_casts"] == "fused"
    assert json.loads(off["effective_recipe"])["kernels"]["fp8_casts"] == "eager"
    assert on["effective_matches"] == off["effective_matches"] == "true"
