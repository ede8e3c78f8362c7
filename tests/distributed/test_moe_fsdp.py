"""The DeepSeekMoE model under FSDP2 world size 2 (gloo, CPU) against one process, with the tolerances of
tests/distributed/test_parallel_training.py: fp32 losses within 1e-5 relative, an FP8 recipe within 2% per step
and 1% over the last steps. The load-balancing biases must move identically on every rank (their counts are
summed over ranks), and as one process moves them."""

from __future__ import annotations

import os

import torch

from lowprec.parallel.spawn import run_ranks

STEPS_FP8 = 20


def _train(recipe_name: str, dims: dict | None, steps: int, comm: dict | None = None) -> dict:
    from lowprec.build_optim import OptimHParams
    from lowprec.data import DataSpec, TokenBatches, prepare
    from lowprec.model import model_args
    from lowprec.parallel import ParallelDims
    from lowprec.recipes import get_recipe
    from lowprec.train.build import build
    from lowprec.train.loop import run_training
    from lowprec.train.spec import TrainSpec

    recipe = get_recipe(recipe_name).with_fields("comm", **(comm or {}))
    data = prepare(DataSpec(cache_dir=os.environ.get("LOWPREC_CACHE", "~/.cache/lowprec")))
    spec = TrainSpec(
        steps=steps,
        batch_size=4,
        seq_len=64,
        warmup_steps=2,
        val_every=0,
        val_batches=1,
        timing_warmup_steps=1,
        telemetry_every=0,
        progress=False,
    )
    built = build(
        recipe,
        model_args("moe_debug", bias_update_speed=0.01),
        spec,
        OptimHParams(lr=3e-3),
        0,
        torch.device("cpu"),
        ParallelDims(**dims) if dims else None,
    )

    class Sink:
        def __init__(self):
            self.rows = []

        def log_metrics(self, metrics, step):
            self.rows.append(metrics)

    sink = Sink()
    res = run_training(built, TokenBatches(data.train, data.val, spec.seq_len, spec.batch_size, 0), spec, sink)
    biases = {fqn: m.router.expert_bias.clone() for fqn, m in built.model.moe_layers().items()}
    return {"losses": [r["loss"] for r in sink.rows], "effective": res.effective, "biases": biases}


def _train_many(rank: int, ws: int, jobs: list[tuple[str, dict | None, int, dict | None]]) -> list[dict]:
    return [_train(*job) for job in jobs]


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_moe_fsdp2_matches_one_process(token_data):
    single = {
        "fp32": _train("fp32", None, 5),
        "deepseek_v3": _train("deepseek_v3", None, STEPS_FP8),
    }
    jobs = [
        ("fp32", {"dp_shard": 2}, 5, None),
        ("deepseek_v3", {"dp_shard": 2}, STEPS_FP8, None),
        ("deepseek_v3_comm8", {"dp_shard": 2}, 3, None),  # FP8 weight all-gather and reduce-scatter of experts
    ]
    out = run_ranks(_train_many, 2, jobs)
    for rank_out in out:
        fp32, fp8, comm8 = rank_out
        assert _rel(fp32["losses"], single["fp32"]["losses"]) < 1e-5, (fp32["losses"], single["fp32"]["losses"])
        tail = abs(sum(fp8["losses"][-5:]) - sum(single["deepseek_v3"]["losses"][-5:]))
        assert tail / sum(single["deepseek_v3"]["losses"][-5:]) < 0.01
        assert _rel(fp8["losses"], single["deepseek_v3"]["losses"]) < 0.02
        assert fp8["effective"]["router_dtype"] == {"float32": 2} and fp8["effective"]["fp8_linears"]
        assert comm8["effective"]["comm"] == {"weight_all_gather": "fp8", "grad_reduce": "fp8"}
        # fp32: same routing as one process at every step, so the same bias moves (multiples of gamma, exact)
        for fqn, b in single["fp32"]["biases"].items():
            assert torch.equal(fp32["biases"][fqn], b), fqn
            assert b.abs().sum() > 0, fqn
    for fqn in out[0][1]["biases"]:  # every rank holds the same biases
        assert torch.equal(out[0][1]["biases"][fqn], out[1][1]["biases"][fqn]), fqn
