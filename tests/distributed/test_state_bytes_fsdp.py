"""The estimator's rank-0 state bytes under FSDP2 (world size 2) equal the measured bytes exactly, and its saved
activations are within 0.2% (measured: 0.044% on debug, at most 0.15% on tiny: the prediction is 512 to 4,608 bytes
short), for every recipe that runs on CPU, on the debug and tiny models (issue: precision-aware memory, first
acceptance line)."""

from __future__ import annotations

import os

import pytest
import torch

from lowprec.parallel.spawn import run_ranks
from lowprec.recipes import CATALOG

NON_TE = [n for n, r in CATALOG.items() if r.fp8.backend != "te"]


def _measure_all(rank: int, ws: int, size: str, names: list[str]) -> list[tuple]:
    from lowprec.build_optim import OptimHParams
    from lowprec.data import DataSpec, TokenBatches, prepare
    from lowprec.estimate.activations import predict_saved_activations
    from lowprec.estimate.estimator import predict_state_bytes
    from lowprec.measure.accounting import measure_state_bytes
    from lowprec.measure.saved_tensors import measure_fp8_scaling_bytes, measure_saved_bytes
    from lowprec.model import model_args
    from lowprec.parallel import ParallelDims
    from lowprec.recipes import get_recipe
    from lowprec.train.build import build
    from lowprec.train.loop import _loss, train_step
    from lowprec.train.spec import TrainSpec

    torch.compile = lambda fn=None, **kw: (
        fn if fn is not None else (lambda f: f)
    )  # torchao's step, eagerly: same states
    data = prepare(DataSpec(cache_dir=os.environ.get("LOWPREC_CACHE", "~/.cache/lowprec")))
    spec = TrainSpec(
        steps=2, batch_size=2, seq_len=32, val_every=0, val_batches=1, timing_warmup_steps=1, progress=False
    )
    batches = TokenBatches(data.train, data.val, spec.seq_len, spec.batch_size, 0)
    out = []
    for name in names:
        recipe = get_recipe(name)
        b = build(recipe, model_args(size), spec, OptimHParams(), 0, torch.device("cpu"), ParallelDims(dp_shard=ws))
        train_step(b, [batches.train_batch(0)], 1.0, 0)
        m = measure_state_bytes(b.model, b.optimizer, b.master_params)
        x, y = b.dist.shard_batch(*batches.train_batch(1))
        saved = measure_saved_bytes(lambda: _loss(b, x, y), b.model)
        act = predict_saved_activations(model_args(size), recipe, x.shape[0], spec.seq_len, "cpu", dp_shard=ws)
        p = predict_state_bytes(model_args(size), recipe, dp_shard=ws).as_state_bytes()
        fields = ("n_params", "params", "grads", "master", "optim_states")
        out.append(
            (
                name,
                {f: (getattr(p, f), getattr(m, f)) for f in fields},
                (
                    predict_state_bytes(model_args(size), recipe, dp_shard=ws).fp8_scaling_state,
                    measure_fp8_scaling_bytes(b.model),
                ),
                (act.total, saved.total),
            )
        )

    return out


# tiny (~45 s: every recipe built and stepped under FSDP2 again) is a long check (marker slow); debug is in the suite
@pytest.mark.parametrize("size", ["debug", pytest.param("tiny", marks=pytest.mark.slow)])
def test_fsdp2_world_size_2_state_bytes_are_predicted_exactly(token_data, size):
    rank0 = run_ranks(_measure_all, 2, size, NON_TE)[0]
    bad = [(name, f, pm) for name, comps, _, _ in rank0 for f, pm in comps.items() if pm[0] != pm[1]]
    bad += [(name, "fp8_scaling_state", sc) for name, _, sc, _ in rank0 if sc[0] != sc[1]]
    # Saved activations: within 0.2% (measured 0.044% on debug, 0.15% on tiny; README says the same).
    bad += [(name, "saved_activations", act) for name, _, _, act in rank0 if abs(act[0] - act[1]) > 0.002 * act[1]]
    assert not bad, f"{size}: (recipe, component, (predicted, measured)): {bad}"
    assert len(rank0) == len(NON_TE)
