"""Optimizer step time of each lowprec state policy against the underlying library called directly, and
the state bytes per parameter, side by side in one run (tiny Llama parameters, random gradients).

Where lowprec only calls a library (torch, bitsandbytes, torchao) the ratio shows lowprec's overhead
(target <= 1.1). Where lowprec implements the policy itself (BF16 and MS-AMP O2 moments, explicit master
copies) no library offers the same thing, so the reference is the closest one (named in the table) and
the ratio is information, not a target.

    .venv/bin/python benchmarks/optim_step.py [--model tiny] [--reps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lowprec.backends.optimizers import MIN_8BIT_NUMEL
from lowprec.build_optim import OptimHParams, _param_groups, build_optimizer
from lowprec.measure.accounting import measure_state_bytes
from lowprec.model import model_args
from lowprec.recipes import get_recipe
from lowprec.train.build import build_model_meta, cast_weights, materialize


def direct(name: str, model, hp: OptimHParams):
    """(label, the library optimizer called directly) for recipe ``name``."""
    groups = _param_groups(model, hp.weight_decay)
    kw = dict(lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps)
    if name in ("fp32", "bf16_pure", "bf16_moments", "fp8_msamp_o2", "bf16_master"):
        return "torch.optim.AdamW", torch.optim.AdamW(groups, **kw)
    if name == "bf16_adamw8bit":
        import bitsandbytes as bnb

        return "bnb.optim.AdamW8bit", bnb.optim.AdamW8bit(groups, min_8bit_size=MIN_8BIT_NUMEL, **kw)
    from torchao.optim import AdamW4bit, AdamW8bit, _AdamW

    if name == "bf16_adamw8bit_ao":
        return "torchao AdamW8bit", AdamW8bit(groups, **kw)
    if name == "bf16_adamw4bit":
        return "torchao AdamW4bit", AdamW4bit(groups, **kw)
    if name == "bf16_sr":
        return "torchao _AdamW(bf16_stochastic_round)", _AdamW(groups, **kw, bf16_stochastic_round=True)
    raise KeyError(name)


LIBRARY_ONLY = {"fp32", "bf16_pure", "bf16_sr", "bf16_adamw8bit", "bf16_adamw8bit_ao", "bf16_adamw4bit"}


def make_model(name: str, size: str):
    recipe = get_recipe(name)
    model = build_model_meta(model_args(size))
    materialize(model, torch.device("cpu"), 0)
    cast_weights(model, recipe)
    return recipe, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    hp = OptimHParams()
    names = [
        "fp32",
        "bf16_pure",
        "bf16_master",
        "bf16_sr",
        "bf16_moments",
        "bf16_adamw8bit",
        "bf16_adamw8bit_ao",
        "bf16_adamw4bit",
        "fp8_msamp_o2",
    ]
    print(
        f"model={a.model} parameters, random gradients, median of {a.reps} interleaved steps, torch {torch.__version__}"
    )
    print(f"{'recipe':<18} {'lowprec ms':>10} {'direct ms':>10} {'ratio':>6}  {'state B/param':>13}  reference")
    for name in names:
        recipe, m1 = make_model(name, a.model)
        _, m2 = make_model(name, a.model)
        o1 = build_optimizer(m1, recipe, hp)
        label, o2 = direct(name, m2, hp)
        for m in (m1, m2):
            for p in m.parameters():
                p.grad = torch.randn_like(p) * 1e-3
        for _ in range(2):  # warm-up (torchao compiles its step)
            o1.step(), o2.step()
        t1, t2 = [], []
        for _ in range(a.reps):
            for opt, ts in ((o1, t1), (o2, t2)):
                t0 = time.perf_counter()
                opt.step()
                ts.append(time.perf_counter() - t0)
        bpp = measure_state_bytes(m1, o1, getattr(o1, "master_params", [])).per_param
        r = statistics.median(t1) / statistics.median(t2)
        tag = "(target <= 1.1)" if name in LIBRARY_ONLY else "(no library equivalent: information)"
        print(
            f"{name:<18} {statistics.median(t1) * 1e3:10.1f} {statistics.median(t2) * 1e3:10.1f} {r:6.2f}  "
            f"{bpp:13.2f}  {label} {tag}"
        )


if __name__ == "__main__":
    main()
