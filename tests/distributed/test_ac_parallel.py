"""Activation checkpointing (``train.ac``) under FSDP2 and TP on gloo: the losses of ``ac=none``, and under TP
the recompute repeats no delayed-scaling amax all-reduce (``tests/integration/test_activation_checkpointing.py``
covers one process)."""

from __future__ import annotations

import os

import torch

from lowprec.parallel.spawn import run_ranks


class _Sink:
    def __init__(self):
        self.rows = []

    def log_metrics(self, m, step):
        self.rows.append(dict(m))


def _ac_rank(rank: int, ws: int, jobs: list[tuple[str, dict, str]]) -> list[dict]:
    from lowprec.build_optim import OptimHParams
    from lowprec.data import DataSpec, TokenBatches, prepare
    from lowprec.model import model_args
    from lowprec.parallel import ParallelDims
    from lowprec.recipes import get_recipe
    from lowprec.train.build import build
    from lowprec.train.loop import run_training
    from lowprec.train.spec import TrainSpec

    data = prepare(DataSpec(cache_dir=os.environ.get("LOWPREC_CACHE", "~/.cache/lowprec")))
    out = []
    for recipe, dims, ac in jobs:
        spec = TrainSpec(
            steps=3,
            batch_size=4,
            seq_len=64,
            warmup_steps=1,
            val_every=0,
            val_batches=1,
            timing_warmup_steps=1,
            telemetry_every=1,
            progress=False,
            ac=ac,
        )
        b = build(
            get_recipe(recipe),
            model_args("debug"),
            spec,
            OptimHParams(lr=3e-3),
            0,
            torch.device("cpu"),
            ParallelDims(**dims),
        )
        sink = _Sink()
        run_training(b, TokenBatches(data.train, data.val, 64, 4, 0), spec, sink)
        out.append(
            {
                "losses": [r["loss"] for r in sink.rows],
                "all_reduce": [r.get("comm_all_reduce_bytes", 0.0) for r in sink.rows],
                "scalers": {k: v.clone() for k, v in b.model.state_dict().items() if "scalers." in k},
            }
        )
    return out


def test_checkpointing_under_fsdp2_and_tp_gives_the_same_losses(token_data):
    """FSDP2 (dp_shard=2) fp32 and TP=2 fp8_delayed (amaxes max-reduced over the TP group) on gloo: ac=full
    (and selective under TP) gives the losses of ac=none; under TP the recompute repeats no amax all-reduce
    (the communication meter's all-reduce bytes are those of ac=none) and the amax histories are equal."""
    jobs = [
        ("fp32", {"dp_shard": 2}, "none"),
        ("fp32", {"dp_shard": 2}, "full"),
        ("fp8_delayed", {"tp": 2}, "none"),
        ("fp8_delayed", {"tp": 2}, "full"),
        ("fp8_delayed", {"tp": 2}, "selective"),
    ]
    for rank_out in run_ranks(_ac_rank, 2, jobs):
        fsdp_none, fsdp_full, tp_none, *tp_ac = rank_out
        assert fsdp_full["losses"] == fsdp_none["losses"]
        assert tp_none["all_reduce"][0] > 0 and tp_none["scalers"]
        for tp in tp_ac:
            assert tp["losses"] == tp_none["losses"]
            assert tp["all_reduce"] == tp_none["all_reduce"]
            assert tp["scalers"].keys() == tp_none["scalers"].keys()
            assert all(torch.equal(tp["scalers"][k], v) for k, v in tp_none["scalers"].items())
