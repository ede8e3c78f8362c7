"""One object per FP8 backend and optimizer implementation: a backend defined in this file alone, registered,
builds, trains, is inspected and estimated like the built-in ones."""

import math

import pytest
import torch
from torch import nn

from lowprec.backends import (
    Float8Backend,
    check_fp8,
    check_recipe,
    fp8_backends,
    optim_impls,
    register_fp8_backend,
    registry,
    short_str,
)
from lowprec.build_optim import OptimHParams
from lowprec.data import TokenBatches
from lowprec.estimate import predict_state_bytes
from lowprec.model import model_args
from lowprec.recipe import ComputeSpec, Float8Spec, OptimSpec, Recipe, RecipeError
from lowprec.train.build import build
from lowprec.train.loop import run_training
from lowprec.train.spec import TrainSpec


class FakeQuantLinear(nn.Linear):
    """Input and weight rounded through e4m3 (tensorwise current scaling), GEMM in FP32: a toy FP8 linear."""

    def forward(self, x):
        def fq(t):
            scale = 448.0 / t.detach().abs().amax().clamp(min=1e-12)
            q = (t * scale).to(torch.float8_e4m3fn).to(t.dtype) / scale
            return t + (q - t).detach()  # straight-through estimator

        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        with torch.autocast(dev, enabled=False):
            return nn.functional.linear(fq(x.float()), fq(self.weight.float())).to(out_dtype)


class DummyFloat8(Float8Backend):
    name = "dummy"
    scalings = ("tensorwise",)
    module_class = f"{__name__}.FakeQuantLinear"

    def kernel_of(self, module) -> str:
        return module.fp8_kernel

    def convert(self, model, spec, fqns, fp8_weight_all_gather, fp8_kernel):
        for fqn in fqns:
            old = model.get_submodule(fqn)
            new = FakeQuantLinear(
                old.in_features, old.out_features, bias=False, device=old.weight.device, dtype=old.weight.dtype
            )
            new.weight = old.weight
            new.fp8_kernel = fp8_kernel  # its GEMM is FP32 whatever the kernels: both choices hold
            parent, _, child = fqn.rpartition(".")
            setattr(model.get_submodule(parent), child, new)


@pytest.fixture
def dummy_backend():
    register_fp8_backend(DummyFloat8())
    yield
    registry._FP8.pop("dummy")


def test_a_backend_defined_in_a_test_trains_and_is_inspected(dummy_backend, token_data):
    recipe = Recipe(name="dummy8", compute=ComputeSpec(autocast_dtype="bf16"), fp8=Float8Spec(backend="dummy"))
    assert recipe.fp8.enabled and "fp8=dummy:tensorwise" in short_str(recipe)
    spec = TrainSpec(
        steps=2,
        batch_size=2,
        seq_len=64,
        warmup_steps=1,
        val_every=0,
        val_batches=1,
        timing_warmup_steps=1,
        telemetry_every=0,
        progress=False,
    )
    b = build(recipe, model_args("debug"), spec, OptimHParams(), 0, torch.device("cpu"))
    res = run_training(
        b,
        TokenBatches(token_data.train, token_data.val, 64, 2, 0),
        spec,
        type("S", (), {"log_metrics": lambda *a: None})(),
    )
    assert res.effective_checked
    assert res.effective["fp8_linears"] == {DummyFloat8.module_class: 14}  # 2 blocks x 7 linears
    assert all(math.isfinite(h["loss"]) for h in res.history) and len(res.history) == 2
    assert predict_state_bytes(model_args("debug"), recipe).fp8_scaling_state == 0


def test_a_backend_validates_its_own_fields(dummy_backend):
    # a Float8Spec is a pure value: the backend's checks run where it is built (convert_fp8, build, preflight)
    with pytest.raises(RecipeError, match=r"recipe.fp8.scaling='rowwise' is not one of \['tensorwise'\]"):
        check_fp8(Float8Spec(backend="dummy", scaling="rowwise"))
    with pytest.raises(RecipeError, match="recipe.fp8.backend='nope' is not one of"):
        check_fp8(Float8Spec(backend="nope"))


def test_builtin_registries():
    assert set(fp8_backends()) >= {"none", "lowprec", "torchao", "te"}
    assert set(optim_impls()) == {"torch", "lowprec", "bitsandbytes", "torchao"}
    with pytest.raises(
        RecipeError,
        match=r"recipe.optim.state='int8' conflicts with recipe.optim.impl='torch'.*"
        r"use impl in \['bitsandbytes', 'torchao'\]",
    ):
        check_recipe(Recipe(name="x", optim=OptimSpec(state="int8")))
