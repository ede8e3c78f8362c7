"""``lowprec_lab.runner.run.utilization_metrics``: FLOPs and MFU are per device, so a sharded run's (global) tokens/s is
divided by its world size before they are computed."""

from __future__ import annotations

import pytest
import torch

from lowprec.estimate.estimator import flops_per_token
from lowprec.model import model_args
from lowprec.recipes import get_recipe
from lowprec.train.spec import TrainSpec
from lowprec_lab.runner.run import utilization_metrics


def test_achieved_tflops_are_per_device():
    args, recipe, spec = model_args("tiny"), get_recipe("bf16"), TrainSpec(seq_len=128)
    one = utilization_metrics(args, recipe, spec, torch.device("cpu"), 8000.0)
    two = utilization_metrics(args, recipe, spec, torch.device("cpu"), 8000.0, world_size=2)
    per_token = flops_per_token(args, 128, recipe).flops_per_token
    assert one["achieved_tflops"] == pytest.approx(per_token * 8000 / 1e12)
    assert two["achieved_tflops"] == pytest.approx(one["achieved_tflops"] / 2)
    assert "mfu" not in one  # no peak on a CPU
