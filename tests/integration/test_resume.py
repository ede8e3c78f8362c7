"""Kill-and-resume: a run stopped at step 4 and resumed (with another global RNG state) continues with
bit-identical losses, for every catalog recipe that runs on one CPU process (every optimizer-state,
master-weight, loss-scaling and FP8 scaling policy, the delayed-scaling amax history included) and for
fp8_delayed with ``amax_compute_algo=most_recent``.

Left out, by construction: Transformer Engine recipes (``fp8.backend="te"``, GPU only) and recipes whose
``comm`` differs from the default ``CommSpec()`` (FP8 all-gather / reduce-scatter need FSDP2); sharded resume
is tested in tests/distributed/test_parallel_training.py (same layout bit for bit, other layouts to 1e-6)."""

import pytest
import torch

from lowprec.build_optim import OptimHParams
from lowprec.data import TokenBatches
from lowprec.model import model_args
from lowprec.recipe import CommSpec, Recipe
from lowprec.recipes import CATALOG
from lowprec.train.build import build
from lowprec.train.loop import run_training
from lowprec.train.spec import TrainSpec

CPU_RECIPES: dict[str, Recipe] = {n: r for n, r in CATALOG.items() if r.fp8.backend != "te" and r.comm == CommSpec()}
CASES: dict[str, Recipe] = {
    **CPU_RECIPES,
    "fp8_delayed-most_recent": CATALOG["fp8_delayed"].with_fields("fp8.cast", amax_compute_algo="most_recent"),
}


class Sink:
    def __init__(self):
        self.losses = {}

    def log_metrics(self, m, step):
        self.losses[step] = m["loss"]


def _run(recipe: Recipe, token_data, spec, rng_seed, **kw):
    b = build(recipe, model_args("debug"), spec, OptimHParams(lr=3e-3), 0, torch.device("cpu"))
    sink = Sink()
    torch.manual_seed(rng_seed)  # the global RNG (stochastic rounding) must come back from the checkpoint
    run_training(b, TokenBatches(token_data.train, token_data.val, spec.seq_len, spec.batch_size, 0), spec, sink, **kw)
    return sink.losses


@pytest.fixture
def no_compile(monkeypatch):
    """torchao's low-bit optimizers compile their step (seconds each); eager gives the same states."""
    monkeypatch.setattr(torch, "compile", lambda fn=None, *a, **k: fn if fn is not None else (lambda f: f))


def test_every_cpu_catalog_recipe_is_covered():
    assert len(CPU_RECIPES) == 34, sorted(CPU_RECIPES)


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_run_continues_bit_identically(case, token_data, tmp_path, no_compile):
    recipe = CASES[case]
    spec = TrainSpec(
        steps=8,
        batch_size=2,
        seq_len=64,
        warmup_steps=3,
        val_every=0,
        val_batches=1,
        timing_warmup_steps=1,
        telemetry_every=0,
        checkpoint_every=4,
        progress=False,
    )
    full = _run(recipe, token_data, spec, 1234, checkpoint_dir=tmp_path)
    assert (tmp_path / "step_4" / ".metadata").exists()
    resumed = _run(recipe, token_data, spec, 999, resume_from=tmp_path / "step_4")  # another RNG state
    assert sorted(resumed) == list(range(4, 8))
    assert [resumed[s] for s in range(4, 8)] == [full[s] for s in range(4, 8)]
