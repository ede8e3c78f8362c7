"""``lowprec.parallel.comm_meter``: exact FSDP2 all-gather / reduce-scatter bytes (padded, fp32 and bf16), TP and
sequence-parallel collectives through DTensor, ``comm_label`` re-labelling, and composition with other modes."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from toy_models import DIMS
from toy_models import mlp as _model

from lowprec.parallel.comm_meter import KINDS, CommMeter, comm_label, current_comm_label
from lowprec.parallel.spawn import run_ranks


def _padded_numel(model: nn.Module, ws: int) -> int:
    """FSDP2 pads every parameter's dim 0 up to a multiple of the world size."""
    return sum(-(-p.shape[0] // ws) * ws * (p[0].numel() if p.dim() > 1 else 1) for p in model.parameters())


def _sharded(ws: int, param_dtype=None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (ws,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype)
    model = _model()
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


def _fsdp_bytes(rank: int, ws: int) -> dict:
    out: dict = {"padded_numel": _padded_numel(_model(), ws)}
    for name, pdt in (("fp32", None), ("bf16", torch.bfloat16)):
        model = _sharded(ws, pdt)
        x = torch.randn(4, DIMS[0])
        meter = CommMeter()
        with meter:
            y = model(x)
        out[name, "fwd"] = (meter.bytes_by_kind_dtype(), meter.calls_by_kind())
        meter.reset()
        with meter:
            y.float().sum().backward()
        out[name, "bwd"] = (meter.bytes_by_kind_dtype(), meter.calls_by_kind())
        meter.reset()
        # Re-entering the same meter accumulates.
        for _ in range(2):
            with meter:
                model(x)
        out[name, "fwd2"] = meter.bytes_by_kind()["all_gather"]
    return out


def _labels(rank: int, ws: int) -> tuple:
    import torch.distributed as dist

    meter, outer = CommMeter(), CommMeter()
    with outer, meter:  # two meters stacked both see everything
        t = torch.ones(10)
        dist.all_reduce(t)
        with comm_label("reduce_scatter"):
            dist.all_reduce(t)
            with comm_label("other"):
                dist.broadcast(t, src=0)
            dist.all_to_all_single(torch.empty(6 * ws, dtype=torch.int32), torch.zeros(6 * ws, dtype=torch.int32))
        dist.broadcast(torch.zeros(3, dtype=torch.float64), src=0)
        dist.barrier()  # no payload: not counted
    assert outer.bytes_by_kind_dtype() == meter.bytes_by_kind_dtype()
    assert outer.calls_by_kind() == meter.calls_by_kind()
    return meter.bytes_by_kind_dtype(), meter.calls_by_kind()


def _tp(rank: int, ws: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (ws,))
    out: dict = {}

    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 16, requires_grad=True)
    meter, cdm = CommMeter(), CommDebugMode()
    with cdm, meter:  # the meter composes with torch's own dispatch mode
        y = mlp(x)
    out["fwd"] = (meter.bytes_by_kind_dtype(), meter.calls_by_kind(), cdm.get_total_counts())
    meter.reset()
    with meter:
        y.sum().backward()
    out["bwd"] = (meter.bytes_by_kind_dtype(), meter.calls_by_kind())

    # Sequence parallel: activations all-gathered into the colwise layer, reduce-scattered out of the rowwise one.
    sp = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16))
    parallelize_module(
        sp,
        mesh,
        {
            "0": SequenceParallel(sequence_dim=0),
            "1": ColwiseParallel(input_layouts=Shard(0)),
            "2": RowwiseParallel(output_layouts=Shard(0)),
        },
    )
    meter.reset()
    with meter:
        sp(torch.randn(3, 16)).sum().backward()  # local sequence shard of 3 rows
    out["sp"] = (meter.bytes_by_kind_dtype(), meter.calls_by_kind())
    return out


def _all_at_2(rank: int, ws: int) -> dict:
    """The world-size-2 checks in one spawn (a spawn costs ~8 s of the 2 cores, more than any of them)."""
    return {"fsdp": _fsdp_bytes(rank, ws), "labels": _labels(rank, ws), "tp": _tp(rank, ws)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """Each rank's ``_all_at_2`` results, shared by the world-size-2 tests."""
    return run_ranks(_all_at_2, 2)


@pytest.mark.parametrize("ws", [2, 3])
def test_fsdp2_all_gather_and_reduce_scatter_bytes_are_padded_param_bytes(ws, request):
    r = [x["fsdp"] for x in request.getfixturevalue("two_ranks")] if ws == 2 else run_ranks(_fsdp_bytes, ws)
    n = r[0]["padded_numel"]
    n_linear = len(DIMS) - 1
    for rank, res in enumerate(r):
        fwd, fwd_calls = res["fp32", "fwd"]
        bwd, bwd_calls = res["fp32", "bwd"]
        assert fwd["all_gather"] == {"float32": 4 * n}, f"rank {rank}"
        assert fwd_calls["all_gather"] == n_linear and sum(fwd_calls.values()) == n_linear
        assert bwd["reduce_scatter"] == {"float32": 4 * n}, f"rank {rank}"
        assert bwd_calls["reduce_scatter"] == n_linear
        # Non-root modules reshard after forward, so backward all-gathers their parameters again.
        assert bwd["all_gather"]["float32"] <= 4 * n
        assert res["fp32", "fwd2"] == 2 * 4 * n

        # param_dtype=bf16 halves the all-gather; reduce_dtype defaults to param_dtype, so the reduce-scatter too.
        bf_fwd, _ = res["bf16", "fwd"]
        bf_bwd, _ = res["bf16", "bwd"]
        assert bf_fwd["all_gather"] == {"bfloat16": 2 * n}
        assert bf_bwd["reduce_scatter"] == {"bfloat16": 2 * n}
        assert sum(bf_fwd["all_gather"].values()) * 2 == sum(fwd["all_gather"].values())


def test_comm_label_relabels_and_barriers_are_not_counted(two_ranks):
    ws = 2
    by_dtype, calls = two_ranks[0]["labels"]
    assert by_dtype["all_reduce"] == {"float32": 40}
    assert by_dtype["reduce_scatter"] == {"float32": 40, "int32": 4 * 6 * ws}  # all-reduce + all-to-all, relabelled
    assert by_dtype["other"] == {"float32": 40}  # innermost label wins
    assert by_dtype["broadcast"] == {"float64": 24}
    assert by_dtype["all_to_all"] == {} and by_dtype["all_gather"] == {}
    assert calls == {"all_gather": 0, "reduce_scatter": 2, "all_reduce": 1, "all_to_all": 0, "broadcast": 1, "other": 1}


def test_tensor_parallel_collectives_are_seen(two_ranks):
    r = [x["tp"] for x in two_ranks]
    for res in r:
        fwd, fwd_calls, cdm_count = res["fwd"]
        # RowwiseParallel turns the Partial output (4 x 8 fp32) into Replicate with one all-reduce.
        assert fwd["all_reduce"] == {"float32": 4 * 8 * 4}
        assert sum(fwd_calls.values()) == fwd_calls["all_reduce"] == 1 == cdm_count
        bwd, bwd_calls = res["bwd"]
        # ColwiseParallel's input gradient (4 x 16) is Partial and all-reduced.
        assert bwd["all_reduce"] == {"float32": 4 * 16 * 4} and sum(bwd_calls.values()) == 1
        sp, sp_calls = res["sp"]
        full = 6 * 16 * 4  # the gathered sequence, 2 ranks x 3 rows x 16
        # forward all-gather + backward all-gather of the reduce-scattered output's gradient, and vice versa
        assert sp["all_gather"] == {"float32": 2 * full} and sp_calls["all_gather"] == 2
        assert sp["reduce_scatter"] == {"float32": 2 * full} and sp_calls["reduce_scatter"] == 2


def test_meter_lets_fake_tensors_and_other_modes_through():
    from torch._subclasses.fake_tensor import FakeTensorMode

    meter = CommMeter()
    with FakeTensorMode():
        with meter:
            y = (torch.randn(3, 4) @ torch.randn(4, 2)).sum()
        with meter, FakeTensorMode():
            z = torch.ones(2) * 3
    assert y.shape == () and z.shape == (2,)
    assert meter.bytes_by_kind() == {k: 0 for k in KINDS} and meter.total_bytes() == 0
    with meter:
        assert torch.equal(torch.arange(3) + 1, torch.tensor([1, 2, 3]))


def test_comm_label_is_thread_local_and_validated():
    seen = []
    with comm_label("reduce_scatter"):
        assert current_comm_label() == "reduce_scatter"
        t = threading.Thread(target=lambda: seen.append(current_comm_label()))
        t.start()
        t.join()
    assert seen == [None] and current_comm_label() is None
    with pytest.raises(ValueError, match="unknown collective kind"):
        with comm_label("allgather"):
            pass
