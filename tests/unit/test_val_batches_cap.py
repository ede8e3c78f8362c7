"""``train.val_batches`` beyond the validation split (100,000 batches on a 4-step run were still
evaluating after 150 s): capped to the batches of distinct windows the split holds, with a warning that says so."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lowprec.build_optim import OptimHParams
from lowprec.data import TokenBatches
from lowprec.model import model_args
from lowprec.recipes import CATALOG
from lowprec.train.build import build
from lowprec.train.spec import TrainSpec
from lowprec.train.validator import Validator


def _batches(val_tokens: int, batch: int = 2, seq: int = 16) -> TokenBatches:
    rng = np.random.default_rng(0)
    train = [rng.integers(0, 100, 4096).astype(np.uint16)]
    val = [rng.integers(0, 100, val_tokens).astype(np.uint16)]
    return TokenBatches(train, val, seq, batch, 0)


def test_max_val_batches_counts_distinct_windows():
    assert _batches(17 * 2 * 5).max_val_batches() == 5  # 10 windows of 17 tokens, 2 per batch


def test_validator_caps_val_batches_to_the_split_and_says_so():
    data = _batches(17 * 2 * 5)
    spec = TrainSpec(steps=2, batch_size=2, seq_len=16, val_batches=100_000, timing_warmup_steps=1, progress=False)
    b = build(CATALOG["fp32"], model_args("debug"), spec, OptimHParams(), 0, torch.device("cpu"))
    with pytest.warns(UserWarning, match=r"train.val_batches=100000 capped to 5: the validation split holds 5"):
        v = Validator(b, data, spec)
    assert len(v.batches) == 5 and v.val_batches_cap.startswith("train.val_batches=100000 capped to 5")
    spec = TrainSpec(steps=2, batch_size=2, seq_len=16, val_batches=3, timing_warmup_steps=1, progress=False)
    v = Validator(b, data, spec)
    assert len(v.batches) == 3 and v.val_batches_cap is None
