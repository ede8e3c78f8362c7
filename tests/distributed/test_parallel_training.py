"""Training the Llama model under FSDP2, TP and both (gloo, CPU) against one process: same initial weights,
same losses for fp32, FP8 recipes tracking their single-process loss, FP8 communication bytes measured by the
meter, and checkpoints that resume on another world size."""

from __future__ import annotations

import os

import pytest
import torch

from lowprec.parallel.spawn import run_ranks

STEPS_FP8 = 30


def _train(
    recipe_name: str,
    dims: dict | None,
    steps: int,
    *,
    batch_size: int = 4,
    seq_len: int = 64,
    comm: dict | None = None,
    checkpoint_dir=None,
    checkpoint_every: int = 0,
    resume_from=None,
    telemetry_every: int = 0,
) -> dict:
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
        batch_size=batch_size,
        seq_len=seq_len,
        warmup_steps=2,
        val_every=0,
        val_batches=1,
        timing_warmup_steps=1,
        telemetry_every=telemetry_every,
        checkpoint_every=checkpoint_every,
        progress=False,
    )
    built = build(
        recipe,
        model_args("debug"),
        spec,
        OptimHParams(lr=3e-3),
        0,
        torch.device("cpu"),
        ParallelDims(**dims) if dims else None,
    )

    class Sink:
        rows: list[dict] = []

        def log_metrics(self, metrics, step):
            self.rows.append(metrics)

    sink = Sink()
    sink.rows = []
    res = run_training(
        built,
        TokenBatches(data.train, data.val, spec.seq_len, spec.batch_size, 0),
        spec,
        sink,
        checkpoint_dir=checkpoint_dir,
        resume_from=resume_from,
    )
    return {
        "losses": [r["loss"] for r in sink.rows],
        "effective": res.effective,
        "rows": sink.rows,
        "summary": res.summary,
    }


def _train_many(rank: int, ws: int, jobs: list[tuple[str, dict | None, int, dict]]) -> list[dict]:
    return [_train(name, dims, steps, **kw) for name, dims, steps, kw in jobs]


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


FP32_AT_2 = [{"dp_shard": 2}, {"tp": 2}]
FP8_GRADS = {"grad_reduce": "fp8"}
#: FP8 communication under FSDP2: BF16/FP32 wire, FP8 both ways, torchao's and the rowwise recipe's FP8 all-gather
BYTES_JOBS = [
    ("fp8_current", {"dp_shard": 2}, 3, {"telemetry_every": 1}),
    ("fp8_current", {"dp_shard": 2}, 3, {"telemetry_every": 1, "comm": {"weight_all_gather": "fp8", **FP8_GRADS}}),
    ("fp8_tensorwise", {"dp_shard": 2}, 3, {"telemetry_every": 1, "comm": {"weight_all_gather": "fp8"}}),
    ("fp8_rowwise", {"dp_shard": 2}, 3, {"telemetry_every": 1, "comm": {"weight_all_gather": "fp8"}}),
]
#: sequence parallel under TP 2 with the compute-dtype and the FP8 activation all-gather
SP_JOBS = [
    ("fp8_rowwise", {"tp": 2}, 6, {"telemetry_every": 1}),
    ("fp8_rowwise", {"tp": 2}, 6, {"telemetry_every": 1, "comm": {"activation_all_gather": "fp8"}}),
]


def _all_at_2(rank: int, ws: int, ckpt_root: str) -> dict:
    """Every world-size-2 run that resumes nothing, one after the other in one spawn: each spawn's ranks pay their
    first FP8, torchao and bitsandbytes use again (~4-8 s of CPU per rank), more than most of these runs. The
    checkpointed runs write under ``ckpt_root/<recipe>``; ``resumed`` continues them in a fresh spawn."""
    ckpt = [
        (n, {"dp_shard": 2}, 6, {"checkpoint_dir": f"{ckpt_root}/{n}", "checkpoint_every": 3}) for n in CKPT_RECIPES
    ]
    return {
        "fp32": _train_many(rank, ws, [("fp32", dims, 5, {}) for dims in FP32_AT_2]),
        "bytes": _train_many(rank, ws, BYTES_JOBS),
        "grads": _full_grads_after_backward(rank, ws, ["fp32", "fp8"]),
        "sp": _train_many(rank, ws, SP_JOBS),
        "fp8_fsdp2": _train_many(rank, ws, [(r, {"dp_shard": 2}, STEPS_FP8, {}) for r in FP8_RECIPES]),
        "ckpt": _train_many(rank, ws, ckpt),
    }


@pytest.fixture(scope="module")
def two_ranks(token_data, tmp_path_factory) -> dict:
    """``ranks``: each rank's ``_all_at_2`` results, read by the tests of those runs; ``ckpt_root``: the folder of
    the checkpointed runs (``root/<recipe>/step_3``)."""
    root = tmp_path_factory.mktemp("ckpt")
    return {"ranks": run_ranks(_all_at_2, 2, str(root)), "ckpt_root": root}


def test_fp32_losses_match_one_process_on_fsdp_tp_2d_and_hsdp(token_data, two_ranks):
    single = _train("fp32", None, 5)["losses"]
    # The layouts of one world size train one after the other in the same ranks: a spawn of 2 ranks costs ~8 s and
    # one of 4 ~19 s on 2 cores, more than the training itself; each build makes its own device mesh.
    at_4 = [{"dp_shard": 2, "tp": 2}, {"dp_replicate": 2, "dp_shard": 2}]
    outs = {
        2: [r["fp32"] for r in two_ranks["ranks"]],
        4: run_ranks(_train_many, 4, [("fp32", dims, 5, {}) for dims in at_4]),
    }
    for ws, layouts in ((2, FP32_AT_2), (4, at_4)):
        for rank_out in outs[ws]:  # every rank holds the same (reduced) losses
            for dims, run in zip(layouts, rank_out, strict=True):
                assert _rel(run["losses"], single) < 1e-5, (dims, run["losses"], single)


FP8_RECIPES = ["fp8_current", "fp8_delayed", "fp8_rowwise", "fp8_blockwise"]


@pytest.fixture(scope="module")
def fp8_single_losses(token_data):
    """``losses(steps)``: each FP8 recipe's one-process losses over ``steps`` steps, trained once per step count and
    shared by the FSDP2 and TP cases."""
    done: dict[int, dict[str, list[float]]] = {}

    def losses(steps: int) -> dict[str, list[float]]:
        if steps not in done:
            done[steps] = {name: _train(name, None, steps)["losses"] for name in FP8_RECIPES}
        return done[steps]

    return losses


# The suite trains 30 steps under FSDP2: the debug model's loss has fallen 6.7% from 9.53 by then (11% at 50), so a
# layout that learns differently shows (every rank on the same batch rows: 4.0% at step 30 against the 2% bound).
# The 50-step FSDP2 run is a long check (marker slow; [fsdp2] asserts the same over 30 steps), and so is TP 2 (~40 s):
# TP's FP8 numerics stay in the suite through the fp32 2-D/HSDP match, the sequence-parallel all-gather below and
# test_ac_parallel.py's TP losses.
@pytest.mark.parametrize(
    "dims, steps",
    [
        ({"dp_shard": 2}, STEPS_FP8),
        pytest.param({"dp_shard": 2}, 50, marks=pytest.mark.slow),
        pytest.param({"tp": 2}, 50, marks=pytest.mark.slow),
    ],
    ids=["fsdp2", "fsdp2-50-steps", "tp2-50-steps"],
)
def test_fp8_recipes_track_one_process(fp8_single_losses, request, dims, steps):
    if request.node.callspec.id == "fsdp2":  # trained in the shared spawn of the world-size-2 runs
        out = request.getfixturevalue("two_ranks")["ranks"][0]["fp8_fsdp2"]
    else:
        out = run_ranks(_train_many, 2, [(r, dims, steps, {}) for r in FP8_RECIPES])[0]
    for name, par in zip(FP8_RECIPES, out):
        single = fp8_single_losses(steps)[name]
        # Mean loss over the last 10 steps within 1%, and no step further than 2% away.
        tail = abs(sum(par["losses"][-10:]) - sum(single[-10:])) / sum(single[-10:])
        assert tail < 0.01, (name, dims, tail)
        assert _rel(par["losses"], single) < 0.02, (name, dims)
        assert par["effective"]["fp8_linears"], name


def test_fp8_all_gather_and_reduce_scatter_bytes_and_effective_recipe(two_ranks):
    """The meter is the proof: FP8 weight all-gather <= 0.55x the BF16 all-gather of the same recipe, FP8
    reduce-scatter <= 0.30x the FP32 one, and the effective recipe records the wire dtypes."""
    base, fp8, ao, row = two_ranks["ranks"][0]["bytes"]  # BYTES_JOBS
    b, f = base["rows"][1], fp8["rows"][1]
    assert base["effective"]["comm"] == {"weight_all_gather": "bfloat16", "grad_reduce": "float32"}
    assert fp8["effective"]["comm"] == {"weight_all_gather": "fp8", "grad_reduce": "fp8"}
    assert ao["effective"]["comm"]["weight_all_gather"] == "fp8"
    assert row["effective"]["comm"]["weight_all_gather"] == "fp8"
    # Only the FP8 linears' weights move in FP8 (plus their FP32 scales); tok_embeddings, norms and the output
    # head, which the recipe keeps in high precision, gather in BF16 in both runs (and dominate the debug
    # model's bytes: vocab 8192 x dim 32). Compare the bytes of the weights the recipe gathers in FP8.
    assert b.get("comm_all_gather_fp8_bytes", 0) == 0 and f["comm_all_gather_fp8_bytes"] > 0
    same_bf16 = f["comm_all_gather_bfloat16_bytes"]
    lin_fp8 = f["comm_all_gather_bytes"] - same_bf16
    lin_bf16 = b["comm_all_gather_bytes"] - same_bf16
    assert lin_fp8 <= 0.55 * lin_bf16, (lin_fp8, lin_bf16)
    assert f["comm_reduce_scatter_bytes"] <= 0.30 * b["comm_reduce_scatter_bytes"], (f, b)
    for run in (fp8, ao, row):  # and they still train like the BF16-gather run
        assert abs(run["losses"][-1] - base["losses"][-1]) / base["losses"][-1] < 0.01


def _torchao_uneven(rank: int, ws: int) -> str:
    from lowprec.recipe import RecipeError

    try:
        _train("fp8_tensorwise_fsdp8", {"dp_shard": 3}, 2, batch_size=6)
    except RecipeError as e:
        return str(e)
    return "no error"


@pytest.mark.slow  # ~18 s; world size 3 (uneven shards) stays in the suite in test_fp8_all_gather.py
def test_fp8_all_gather_at_world_size_3(token_data):
    """Uneven shards: the debug model's dims (16, 32, 96, 8192 rows) do not divide by 3."""
    jobs = [
        (r, {"dp_shard": 3}, 3, {"batch_size": 6, "comm": {"weight_all_gather": "fp8"}})
        for r in ("fp8_current", "fp8_blockwise")
    ]
    outs = run_ranks(_train_many, 3, jobs)[0]
    for (name, *_), out in zip(jobs, outs):
        single = _train(name, None, 3, batch_size=6)["losses"]
        assert _rel(out["losses"], single) < 0.01, (name, out["losses"], single)
        assert out["effective"]["comm"]["weight_all_gather"] == "fp8"
    # torchao's float8 all-gather breaks on uneven shards (ao#3982): refused before training, not a hang.
    msg = run_ranks(_torchao_uneven, 3)[0]
    assert "ao#3982" in msg and "dp_shard=3" in msg, msg


#: the checkpointed FSDP2 runs (6 steps, a checkpoint at step 3) that the resume tests continue
CKPT_RECIPES = ["fp32", "bf16_adamw8bit", "fp8_delayed"]


@pytest.fixture(scope="module")
def resumed(two_ranks) -> dict:
    """Each ``CKPT_RECIPES`` run uninterrupted under FSDP2 world size 2 (in ``two_ranks``' spawn), then continued
    from its step-3 checkpoint in a fresh spawn: ``fp32`` on FSDP2 and on TP 2, the others on FSDP2. Returns
    ``root`` (the checkpoints are under ``root/<recipe>/step_3``), ``full`` (recipe -> rank 0's result) and
    ``resumed`` (rank -> list in the order of the jobs: ``CKPT_RECIPES`` on FSDP2, then ``fp32`` on TP)."""
    root = two_ranks["ckpt_root"]
    fsdp = {"dp_shard": 2}
    full = dict(zip(CKPT_RECIPES, two_ranks["ranks"][0]["ckpt"], strict=True))
    again = [(n, fsdp, 6, {"resume_from": str(root / n / "step_3")}) for n in CKPT_RECIPES]
    again.append(("fp32", {"tp": 2}, 6, {"resume_from": str(root / "fp32" / "step_3")}))
    return {"root": root, "full": full, "resumed": run_ranks(_train_many, 2, again)}


def test_checkpoint_resumes_on_another_world_size(resumed):
    """An fp32 checkpoint written under FSDP2 world size 2 resumes bit for bit on the same layout, and, resharded
    by DCP, on one process and under TP 2 within 1e-6 relative (measured: 2.0e-7, 2 ulps of a loss near 9.4,
    the same on both; the reduction order differs)."""
    full = resumed["full"]["fp32"]
    one = _train("fp32", None, 6, resume_from=str(resumed["root"] / "fp32" / "step_3"))["losses"]
    assert resumed["resumed"][0][0]["losses"] == full["losses"][3:]
    assert _rel(one, full["losses"][3:]) < 1e-6, (one, full["losses"])
    for rank_out in resumed["resumed"]:  # every TP rank holds the same (reduced) losses
        assert _rel(rank_out[3]["losses"], full["losses"][3:]) < 1e-6, (rank_out[3]["losses"], full["losses"])


def test_low_bit_and_delayed_scaling_state_resume_bit_exactly_on_the_same_layout(resumed):
    """bitsandbytes 8-bit states live on local shards (saved as DTensors, per-rank absmax rows); delayed-scaling
    amax histories are max-reduced over ranks, so rank 0's copy is every rank's."""
    for i, n in enumerate(CKPT_RECIPES[1:], start=1):
        assert resumed["resumed"][0][i]["losses"] == resumed["full"][n]["losses"][3:], n
    from lowprec.train.checkpoint import CheckpointError

    # one process holds the 8-bit states whole, not as the per-rank local shards the checkpoint recorded
    with pytest.raises(CheckpointError, match="has no tensor record for optim.state"):
        _train("bf16_adamw8bit", None, 6, resume_from=str(resumed["root"] / "bf16_adamw8bit" / "step_3"))


def _full_grads_after_backward(rank: int, ws: int, grad_reduces: list[str]) -> list[torch.Tensor]:
    """Each ``grad_reduces`` setting's full gradients after one backward, built one after the other in this rank."""
    return [_full_grads_one(ws, g) for g in grad_reduces]


def _full_grads_one(ws: int, grad_reduce: str) -> torch.Tensor:
    from lowprec.build_optim import OptimHParams
    from lowprec.data import DataSpec, TokenBatches, prepare
    from lowprec.model import model_args
    from lowprec.parallel import ParallelDims
    from lowprec.recipes import get_recipe
    from lowprec.train.build import build
    from lowprec.train.loop import _loss
    from lowprec.train.spec import TrainSpec

    data = prepare(DataSpec(cache_dir=os.environ.get("LOWPREC_CACHE", "~/.cache/lowprec")))
    spec = TrainSpec(steps=2, batch_size=4, seq_len=64, timing_warmup_steps=1, progress=False)
    b = build(
        get_recipe("bf16").with_fields("comm", grad_reduce=grad_reduce),
        model_args("debug"),
        spec,
        OptimHParams(),
        0,
        torch.device("cpu"),
        ParallelDims(dp_shard=ws),
    )
    x, y = b.dist.shard_batch(*TokenBatches(data.train, data.val, 64, 4, 0).train_batch(0, 0))
    _loss(b, x, y).backward()
    return torch.cat([p.grad.full_tensor().flatten().float() for p in b.model.parameters()])


def test_fp8_reduce_scatter_gradients_reach_20_db_against_fp32_on_llama(two_ranks):
    from lowprec.numerics.formats import sqnr_db

    ref, fp8 = two_ranks["ranks"][0]["grads"]
    db = sqnr_db(ref, fp8)
    assert db >= 20, db


def test_fp8_sequence_parallel_all_gather_under_tp(two_ranks):
    """recipe.comm.activation_all_gather=fp8: the SP all-gathers of attention/feed_forward inputs move e4m3 plus
    one fp32 scale per token; the run tracks one process and the effective recipe records it."""
    hp, f8 = two_ranks["ranks"][0]["sp"]  # SP_JOBS
    single = _train("fp8_rowwise", None, 6)["losses"]
    # Measured over the 6 steps: 3.2e-5 relative with the FP8 all-gather, 2.0e-5 without it (TP alone: its FP8
    # GEMMs scale the local shards, a finer granularity than one process).
    assert _rel(f8["losses"], single) < 5e-5, (f8["losses"], single)
    assert hp["effective"]["comm"] == {"activation_all_gather": "compute"}
    assert f8["effective"]["comm"] == {"activation_all_gather": "fp8"}
    a, b = hp["rows"][1], f8["rows"][1]
    assert a.get("comm_all_gather_fp8_bytes", 0) == 0 and b["comm_all_gather_fp8_bytes"] > 0
    # The residual stream is FP32 here: the gathered activations shrink from 4 to ~1 byte per element (+ scales).
    moved_hp = a["comm_all_gather_bytes"] - b["comm_all_gather_bytes"] + b["comm_all_gather_fp8_bytes"]
    assert b["comm_all_gather_fp8_bytes"] <= 0.30 * moved_hp, (a, b)
