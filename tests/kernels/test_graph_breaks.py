"""Every FP8 catalog recipe's training step traces as one graph: ``torch._dynamo.explain`` reports no graph break.

A graph break inside an FP8 linear (a tensor read as a Python value, a closure over a tensor, a
global table) is what made ``train.compile`` fail with ``fullgraph=True`` on CUDA. ``explain`` runs dynamo alone (no
AOTAutograd, no inductor code generation), so this holds on a CPU whatever inductor's C++ backend can compile. The
step is the lab's: the model built by ``lowprec.train.build`` with the recipe applied, ``forward_loss`` under the
recipe's precision context, then ``backward``, traced too (``trace_autograd_ops``: the backward joins the graph, and
dynamo traces each FP8 autograd Function's backward when it meets the Function).

Recipes whose traced step is the same (they differ only in the optimizer or in FSDP2 communication, which a
one-process build does not apply) run once, under the first name. Transformer Engine recipes are left out: they
need CUDA and run TE's kernels outside ``torch.compile`` (``compile_blocker`` refuses them).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lowprec.build_optim import OptimHParams
from lowprec.model import model_args
from lowprec.recipe import CommSpec
from lowprec.recipes import CATALOG
from lowprec.train.build import build
from lowprec.train.spec import TrainSpec
from lowprec.train.step import forward_loss

FP8_RECIPES = [n for n, r in CATALOG.items() if r.fp8.enabled and r.fp8.backend != "te"]


def _hp_blocks(name: str) -> int:
    f = CATALOG[name].fp8
    return f.layers.hp_first_blocks + f.layers.hp_last_blocks


def _traced_step_key(name: str):
    # The blocks kept in high precision are plain BF16 blocks around the same low-precision block: a recipe that
    # keeps some traces every piece of code that the same recipe without them traces (nvfp4 and nvfp4_no_hp).
    r = CATALOG[name]
    return (
        dataclasses.replace(r.fp8, layers=dataclasses.replace(r.fp8.layers, hp_first_blocks=0, hp_last_blocks=0)),
        r.compute,
        r.weights,
    )


def _representatives() -> dict[str, list[str]]:
    """One recipe of each distinct traced step (the first listed of those with the most high-precision blocks)
    -> every FP8 recipe it stands for."""
    groups: dict = {}
    for n in FP8_RECIPES:
        groups.setdefault(_traced_step_key(n), []).append(n)
    return {max(names, key=_hp_blocks): names for names in groups.values()}


REPRESENTATIVES = _representatives()


def test_the_catalog_has_every_kind_of_fp8_step():
    # every kind of FP8 step compile must trace; a change that drops one should be seen here, not by a shorter list
    specs = [CATALOG[n].fp8 for n in REPRESENTATIVES]
    assert {s.backend for s in specs} >= {"lowprec", "torchao", "mx"}
    assert {s.scaling for s in specs} >= {"tensorwise", "rowwise", "blockwise", "mxfp8", "mxfp4", "nvfp4"}
    assert any(s.saved.cache_fp8_activations for s in specs) and any(s.saved.e5m6_inputs for s in specs)
    assert any(s.saved.swiglu_cache == "fp8" for s in specs) and any(s.cast.strategy == "delayed" for s in specs)
    assert any(s.cast.grad_output_granularity == "block128x128" for s in specs)
    assert sum(len(v) for v in REPRESENTATIVES.values()) == len(FP8_RECIPES)


@pytest.mark.parametrize("recipe", list(REPRESENTATIVES), ids=lambda n: "+".join(REPRESENTATIVES[n]))
def test_one_training_step_traces_without_a_graph_break(recipe):
    r = dataclasses.replace(CATALOG[recipe], comm=CommSpec())
    # One block, plus the blocks the recipe keeps in high precision, so at least one block runs in low precision.
    args = model_args("debug", n_layers=1 + r.fp8.layers.hp_first_blocks + r.fp8.layers.hp_last_blocks)
    spec = TrainSpec(steps=2, timing_warmup_steps=1, warmup_steps=1, batch_size=2, seq_len=32, telemetry_every=0)
    b = build(r, args, spec, OptimHParams(), 0, torch.device("cpu"))
    ids = torch.randint(0, args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))

    def step(x, y):
        loss = forward_loss(b, x, y)
        loss.backward()
        return loss.detach()

    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        ex = torch._dynamo.explain(step)(ids[:, :-1], ids[:, 1:])
    reasons = [f"{br.reason.splitlines()[0]} at {br.user_stack[-1:]}" for br in ex.break_reasons]
    assert ex.graph_break_count == 0 and ex.graph_count == 1 and not reasons, "\n".join(reasons)
    params = list(b.model.parameters())
    assert all(p.grad is not None for p in params), "the traced step did not reach every parameter's gradient"
