"""``train.fused_casts``: the compiled FP8 casts give the eager casts' bits, and a run records whether they ran.

Each compiled kernel costs a second or two on a 2-core CPU, so the cases are chosen to cover each granularity with
and without power-of-2 scales once (float32, contiguous), and the other inputs (bfloat16, a transposed backward
operand, E5M2) on one granularity each; every case holds the edge values in one tensor: ragged tiles, an all-zero
group (the amax floor), values that saturate, amaxes one ulp either side of a power-of-2 scale, subnormal products.
"""

from __future__ import annotations

import pytest
import torch

from lowprec.errors import ConfigError
from lowprec.kernels.fused_casts import fused_quantize_operand, resolve_fused_casts
from lowprec.numerics.formats import E4M3, E5M2
from lowprec.numerics.scaling import quantize_operand


def _operand(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    x[:130, :130] = 0.0  # all-zero rowwise rows, 1x128 tiles and a 128x128 block: amax floored
    # amaxes one ulp either side of 448 / 2**k: power-of-2 rounding of the scale at its edge
    edge = torch.tensor(448.0 / 2**6)
    x[140, 0], x[141, 0] = torch.nextafter(edge, torch.tensor(0.0)), torch.nextafter(edge, torch.tensor(1e9))
    x[142, :] = 1e-30  # products below FP8's smallest subnormal
    x[143, 1] = 3e38  # a huge amax next to tiny values: those flush to zero
    return x.to(dtype)


def _same(x: torch.Tensor, fmt, granularity: str, power_of_2: bool, amax_floor: float = 1e-12) -> None:
    eager = quantize_operand(x, fmt, granularity, power_of_2=power_of_2, amax_floor=amax_floor)
    fused = fused_quantize_operand(x, fmt, granularity, power_of_2=power_of_2, amax_floor=amax_floor)
    assert fused.data.dtype == eager.data.dtype and fused.data.shape == eager.data.shape
    # exact, NaN where eager has NaN (a NaN's payload bits are not compared: inductor's differ)
    torch.testing.assert_close(fused.scale, eager.scale, rtol=0, atol=0, equal_nan=True)
    nan = eager.data.float().isnan()
    assert torch.equal(fused.data.float().isnan(), nan)  # NaN where eager has NaN, whatever its sign bit
    diff = ((fused.data.view(torch.uint8) != eager.data.view(torch.uint8)) & ~nan).sum()
    assert diff == 0, f"{granularity}, power_of_2={power_of_2}: {int(diff)} FP8 codes differ"


@pytest.mark.parametrize("power_of_2", [False, True])
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "tile1x128", "block128x128"])
def test_fused_cast_is_the_eager_cast_bit_for_bit(granularity, power_of_2):
    for shape in ((384, 256), (300, 200)):  # on the 128-grid, and ragged tiles/blocks (dynamic shapes: one kernel)
        _same(_operand(*shape, torch.float32), E4M3, granularity, power_of_2)


@pytest.mark.parametrize(
    "granularity, dtype, transposed, fmt, amax_floor",
    [
        ("tile1x128", torch.bfloat16, False, E4M3, 1e-4),  # autocast's inputs; DeepSeek-V3's amax floor
        ("tile1x128", torch.float32, True, E4M3, 1e-12),  # dy.t() / x.t() in the weight-gradient GEMM
        ("tensorwise", torch.float32, False, E5M2, 1e-12),  # HYBRID's gradients
    ],
)
def test_fused_cast_of_other_inputs_is_the_eager_cast(granularity, dtype, transposed, fmt, amax_floor):
    x = _operand(384, 256, dtype)
    _same(x.t().contiguous().t() if transposed else x, fmt, granularity, True, amax_floor)


def test_nan_stays_nan_as_in_eager():
    x = _operand(256, 256, torch.float32)
    x[3, 5] = float("nan")
    _same(x, E4M3, "rowwise", False)


def test_fused_casts_resolve_per_device_and_refuse_what_cannot_run():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_fused_casts("on", cpu, compiled_model=False) == "on"
    assert resolve_fused_casts("auto", cpu, compiled_model=False).startswith("off: train.fused_casts=auto on cpu")
    assert resolve_fused_casts("off", cuda, compiled_model=False) == "off: train.fused_casts=off"
    assert resolve_fused_casts("on", cpu, compiled_model=True).startswith("off: train.compile")
    with pytest.raises(ConfigError, match="train.fused_casts='fast' is not one of auto, on, off"):
        resolve_fused_casts("fast", cpu, compiled_model=False)


def test_a_cast_past_dynamos_recompile_limit_raises_instead_of_running_eager():
    """No silent fallback: a key whose kernels would exceed dynamo's recompile limit raises (dynamo would otherwise
    run the cast in eager from then on), and the process's own setting is left as it was. (The limit is patched
    with dynamo's own ``config.patch``: pytest's monkeypatch deleted the entry on undo.)"""
    import torch._dynamo

    before = torch._dynamo.config.fail_on_recompile_limit_hit, torch._dynamo.config.recompile_limit
    with torch._dynamo.config.patch(recompile_limit=1):
        fused_quantize_operand(torch.randn(16, 128), E4M3, "rowwise", amax_floor=3e-7)  # a key of its own
        with pytest.raises(Exception, match="recompile"):
            fused_quantize_operand(torch.randn(1, 128), E4M3, "rowwise", amax_floor=3e-7)  # size 1: a recompile
    assert (torch._dynamo.config.fail_on_recompile_limit_hit, torch._dynamo.config.recompile_limit) == before


NO_COMPILER = "torch.compile of the casts failed on {}: BackendCompilerFailed: no C++ compiler"


@pytest.fixture
def casts_cannot_compile(monkeypatch):
    """This machine as one whose compiler cannot build the casts (the probe's answer, not a broken torch)."""
    import lowprec.kernels.fused_casts as fc

    monkeypatch.setattr(fc, "fused_casts_unavailable", lambda device_type: NO_COMPILER.format(device_type))


def test_fused_casts_on_where_they_cannot_compile_is_an_error_not_off(casts_cannot_compile):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for device in (cpu, cuda):
        with pytest.raises(ConfigError, match=r"train.fused_casts=on cannot run: torch.compile of the casts failed"):
            resolve_fused_casts("on", device, compiled_model=False)
    # auto is a request for "where they run": off, with the reason recorded in the run
    assert resolve_fused_casts("auto", cuda, compiled_model=False) == "off: " + NO_COMPILER.format("cuda")


def test_the_build_refuses_fused_casts_on_where_they_cannot_compile(casts_cannot_compile):
    from lowprec.build_optim import OptimHParams
    from lowprec.model import model_args
    from lowprec.recipes import CATALOG
    from lowprec.train.build import build
    from lowprec.train.spec import TrainSpec

    spec = TrainSpec(steps=2, batch_size=2, seq_len=64, timing_warmup_steps=1, fused_casts="on")
    with pytest.raises(ConfigError, match="train.fused_casts=on cannot run"):
        build(CATALOG["fp8_current"], model_args("debug"), spec, OptimHParams(), 0, torch.device("cpu"))


def test_lowprec_train_refuses_fused_casts_on_before_any_run(casts_cannot_compile, run_dirs, tmp_path, capsys):
    from lowprec_lab.cli import main

    args = ["model=debug", "train.steps=2", "train.batch_size=2", "train.seq_len=64", "train.val_every=0"]
    assert main(["train", *run_dirs, *args, "recipe=fp8_current", "train.fused_casts=on"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "lowprec train: error: train.fused_casts=on cannot run: " + NO_COMPILER.format("cpu") + (
        "; use train.fused_casts=off"
    )
    assert not (tmp_path / "runs" / "mlflow.db").exists()  # preflight refused it: no store, no FAILED run
