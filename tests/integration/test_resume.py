"""Kill-and-resume: a run stopped at step N and resumed continues with bit-identical losses, for every
optimizer-state and master-weight policy (and the FP8 delayed-scaling state)."""

import pytest
import torch

from lowprec.data import TokenBatches
from lowprec.model import model_args
from lowprec.optim import OptimHParams
from lowprec.train.build import build
from lowprec.train.loop import run_training
from lowprec.train.spec import TrainSpec
from recipes import get_recipe

POLICIES = ["fp32", "bf16_pure", "bf16_master", "bf16_sr", "bf16_moments", "bf16_adamw8bit", "bf16_adamw8bit_ao",
            "bf16_adamw4bit", "fp8_msamp_o2", "fp16_amp", "fp8_delayed"]


class Sink:
    def __init__(self):
        self.losses = {}

    def log_metrics(self, m, step):
        self.losses[step] = m["loss"]


def _run(recipe, token_data, spec, rng_seed, **kw):
    b = build(get_recipe(recipe), model_args("debug"), spec, OptimHParams(lr=3e-3), 0, torch.device("cpu"))
    sink = Sink()
    torch.manual_seed(rng_seed)  # the global RNG (stochastic rounding) must come back from the checkpoint
    run_training(b, TokenBatches(token_data.train, token_data.val, spec.seq_len, spec.batch_size, 0), spec, sink, **kw)
    return sink.losses


@pytest.fixture
def no_compile(monkeypatch):
    """torchao's low-bit optimizers compile their step (seconds each); eager gives the same states."""
    monkeypatch.setattr(torch, "compile", lambda fn=None, *a, **k: fn if fn is not None else (lambda f: f))


@pytest.mark.parametrize("recipe", POLICIES)
def test_resumed_run_continues_bit_identically(recipe, token_data, tmp_path, no_compile):
    spec = TrainSpec(steps=15, batch_size=2, seq_len=64, warmup_steps=3, val_every=0, val_batches=1,
                     timing_warmup_steps=1, telemetry_every=0, checkpoint_every=5, progress=False)
    full = _run(recipe, token_data, spec, 1234, checkpoint_dir=tmp_path)
    assert (tmp_path / "step_5" / ".metadata").exists()
    resumed = _run(recipe, token_data, spec, 999, resume_from=tmp_path / "step_5")  # another RNG state
    assert sorted(resumed) == list(range(5, 15))
    assert [resumed[s] for s in range(5, 15)] == [full[s] for s in range(5, 15)]
