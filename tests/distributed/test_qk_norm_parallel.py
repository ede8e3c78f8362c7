"""``model.qk_norm`` under tensor parallelism (gloo, CPU): the per-head norms stay replicated, train to the same
weights on every rank and give the one-process losses."""

from __future__ import annotations

import os

import torch

from lowprec.parallel.spawn import run_ranks


def _train(rank: int, ws: int, dims: dict | None, steps: int) -> dict:
    from torch.distributed.tensor import DTensor

    from lowprec.build_optim import OptimHParams
    from lowprec.data import DataSpec, TokenBatches, prepare
    from lowprec.model import model_args
    from lowprec.parallel import ParallelDims
    from lowprec.recipes import get_recipe
    from lowprec.train.build import build
    from lowprec.train.loop import run_training
    from lowprec.train.spec import TrainSpec

    data = prepare(DataSpec(cache_dir=os.environ.get("LOWPREC_CACHE", "~/.cache/lowprec")))
    spec = TrainSpec(
        steps=steps,
        batch_size=2,
        seq_len=32,
        warmup_steps=1,
        val_every=0,
        val_batches=1,
        timing_warmup_steps=1,
        telemetry_every=0,
        progress=False,
    )
    built = build(
        get_recipe("fp32"),
        model_args("debug", qk_norm=True),
        spec,
        OptimHParams(lr=1e-2),
        0,
        torch.device("cpu"),
        ParallelDims(**dims) if dims else None,
    )

    class Sink:
        def __init__(self):
            self.losses: list[float] = []

        def log_metrics(self, metrics, step):
            if "loss" in metrics:
                self.losses.append(metrics["loss"])

    sink = Sink()
    run_training(built, TokenBatches(data.train, data.val, spec.seq_len, spec.batch_size, 0), spec, sink)
    norms = {}
    for name, p in built.model.named_parameters():
        if "q_norm" in name or "k_norm" in name:
            norms[name] = (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
    return {"losses": sink.losses, "norms": norms}


def test_qk_norm_trains_replicated_under_tp_and_matches_one_process(token_data):
    single = _train(0, 1, None, 3)
    out = run_ranks(_train, 2, {"tp": 2}, 3)
    for rank_out in out:
        for a, b in zip(rank_out["losses"], single["losses"], strict=True):
            assert abs(a - b) / b < 1e-5, (rank_out["losses"], single["losses"])
        assert set(rank_out["norms"]) == set(single["norms"])
        for name, w in single["norms"].items():
            assert not torch.equal(w, torch.ones_like(w)), name  # the norms trained
            # every rank holds the whole (head_dim,) weight, equal to the one-process one
            torch.testing.assert_close(rank_out["norms"][name], w, atol=1e-5, rtol=1e-4)
