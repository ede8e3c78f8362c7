"""FP8 linear on this machine, side by side in one run.

1. fwd+bwd time of lowprec's FP8 linear per scaling against torchao's ``Float8Linear`` (tensorwise and
   rowwise), a BF16 linear and an FP32 linear; ratio lowprec/torchao for tensorwise (target <= 1.1); and
   lowprec's block-scaled linear (``MXLinear``: ``mxfp8``, ``nvfp4`` with its stabilisers), emulated exactly.
2. Quantization throughput (GB/s of high-precision input read) per granularity against a plain copy of
   the same bytes, eager and fused (``train.fused_casts``: one compiled kernel per cast, the same bits; compile
   time excluded), block-scaled formats included (MXFP8 RCEIL and FLOOR, MXFP4, NVFP4 1x16 and 16x16, eager and
   fused, and NVFP4 with stochastic rounding, eager only; ``lowprec.numerics.microscaling``,
   ``lowprec.kernels.fused_mx_casts``) beside the per-tensor FP8 ones.
3. Bytes saved for backward with and without FP8 activation caching, for one linear and for one training
   step of the `tiny` Llama under ``fp8_blockwise``.
4. Telemetry cost: the `tiny` Llama's ``fp8_current`` step with telemetry on every step against off, and
   the amortized share at the default sampling interval (target under 5%).

CPU timings say nothing about FP8 speed on a GPU: on this CPU, FP8 GEMMs are emulated by ``_scaled_mm``'s
CPU path and are slower than FP32.

    .venv/bin/python benchmarks/fp8_linear.py [--tokens 2048] [--dim 1024] [--hidden 1024] [--reps 10] [--quant-only]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from lowprec.float8 import Float8Linear, linear_config
from lowprec.float8.mx_linear import MXLinear, mx_config
from lowprec.kernels import cpu_model
from lowprec.kernels.fused_casts import fused_quantize_operand
from lowprec.kernels.fused_mx_casts import fused_quantize_mx, fused_quantize_nvfp4
from lowprec.numerics.formats import E4M3
from lowprec.numerics.microscaling import quantize_mx, quantize_nvfp4
from lowprec.numerics.scaling import quantize_operand
from lowprec.recipe import CastSpec, Float8Spec, SavedSpec

LOWPREC = {
    "current tensorwise": Float8Spec(backend="lowprec", scaling="tensorwise", cast=CastSpec(fp8_format="hybrid")),
    "delayed tensorwise": Float8Spec(
        backend="lowprec", scaling="tensorwise", cast=CastSpec(strategy="delayed", fp8_format="hybrid")
    ),
    "rowwise": Float8Spec(
        backend="lowprec", scaling="rowwise", cast=CastSpec(fp8_format="e4m3", power_of_2_scales=True)
    ),
    "blockwise": Float8Spec(backend="lowprec", scaling="blockwise", cast=CastSpec(fp8_format="e4m3")),
    "blockwise + fp8 cache": Float8Spec(
        backend="lowprec",
        scaling="blockwise",
        cast=CastSpec(fp8_format="e4m3"),
        saved=SavedSpec(cache_fp8_activations=True),
    ),
}


def fwd_bwd(mod, x, g, autocast: bool):
    def run():
        xi = x.detach().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = mod(xi)
        y.backward(g)
        mod.weight.grad = None

    return run


def timeit(fns: dict, reps: int) -> dict[str, float]:
    """Median seconds per call, calls interleaved round-robin so machine noise hits all alike."""
    for f in fns.values():
        f(), f()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def saved_bytes(fn, module) -> int:
    """Activation bytes autograd saves in ``fn()`` (each storage once, parameters excluded)."""
    from lowprec.measure.saved_tensors import measure_saved_bytes

    return measure_saved_bytes(fn, module).activations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quant-only", action="store_true", help="section 2 alone")
    a = ap.parse_args()
    torch.manual_seed(0)
    base = torch.nn.Linear(a.dim, a.hidden, bias=False)
    x, g = torch.randn(a.tokens, a.dim), torch.randn(a.tokens, a.hidden)
    print(
        f"linear {a.dim} -> {a.hidden}, {a.tokens} tokens, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"CPU: {cpu_model()}. CPU timings: they say nothing about FP8 speed on a GPU.\n")
    if a.quant_only:
        quantization(a.reps)
        return

    fns = {
        "fp32 nn.Linear": fwd_bwd(copy.deepcopy(base), x, g, False),
        "bf16 nn.Linear (autocast)": fwd_bwd(copy.deepcopy(base), x, g.bfloat16(), True),
    }
    for recipe in ("tensorwise", "rowwise"):
        m = torch.nn.Sequential(copy.deepcopy(base))
        convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(recipe))
        fns[f"torchao {recipe}"] = fwd_bwd(m[0], x, g, False)
    for name, spec in LOWPREC.items():
        mod = Float8Linear.from_linear(copy.deepcopy(base), linear_config(spec))
        mod.init_buffers()
        fns[f"lowprec {name}"] = fwd_bwd(mod, x, g, False)
    for name in ("mxfp8", "nvfp4"):
        from lowprec.recipes import get_recipe

        mod = MXLinear.from_linear(copy.deepcopy(base), mx_config(get_recipe(name).fp8))
        mod.init_buffers(torch.Generator().manual_seed(0))
        fns[f"lowprec mx {name}"] = fwd_bwd(mod, x, g, True)
    t = timeit(fns, a.reps)
    print("1. fwd+bwd time (median)")
    for k, v in t.items():
        print(
            f"   {k:<32} {v * 1e3:8.1f} ms   x{v / t['fp32 nn.Linear']:.2f} of fp32   "
            f"x{v / t['bf16 nn.Linear (autocast)']:.2f} of bf16"
        )
    print(
        f"   ratio lowprec/torchao tensorwise: {t['lowprec current tensorwise'] / t['torchao tensorwise']:.3f} "
        "(target <= 1.1)"
    )
    print(f"   ratio lowprec/torchao rowwise:    {t['lowprec rowwise'] / t['torchao rowwise']:.3f}")
    quantization(a.reps)

    print("\n3. bytes saved for backward")
    for name in ("blockwise", "blockwise + fp8 cache"):
        mod = Float8Linear.from_linear(copy.deepcopy(base), linear_config(LOWPREC[name]))
        b = saved_bytes(lambda: mod(x.detach().requires_grad_()).sum(), mod)
        print(f"   one linear ({a.tokens} x {a.dim} fp32 input), lowprec {name:<22} {b / 2**20:8.2f} MiB")
    model_saved()


def quantization(reps: int) -> None:
    big = torch.randn(4096, 4096)
    q = {"plain copy (clone)": lambda: big.clone()}
    for gran in ("tensorwise", "rowwise", "tile1x128", "block128x128"):
        q[gran] = (lambda gg: lambda: quantize_operand(big, E4M3, gg))(gran)
        q[f"{gran} fused"] = (lambda gg: lambda: fused_quantize_operand(big, E4M3, gg))(gran)
    q |= {
        "mxfp8 rceil": lambda: quantize_mx(big, "e4m3", 32, "rceil"),
        "mxfp8 floor": lambda: quantize_mx(big, "e4m3", 32, "floor"),
        "mxfp4 rceil": lambda: quantize_mx(big, "e2m1", 32, "rceil"),
        "nvfp4 1x16": lambda: quantize_nvfp4(big),
        "nvfp4 16x16": lambda: quantize_nvfp4(big, two_d=True),
        "nvfp4 1x16 SR": lambda: quantize_nvfp4(big, "stochastic"),
    }
    # the fused block-scaled casts beside the eager ones (SR stays eager: lowprec.kernels.fused_mx_casts)
    q |= {
        "mxfp8 rceil fused": lambda: fused_quantize_mx(big, "e4m3", 32, "rceil"),
        "mxfp8 floor fused": lambda: fused_quantize_mx(big, "e4m3", 32, "floor"),
        "mxfp4 rceil fused": lambda: fused_quantize_mx(big, "e2m1", 32, "rceil"),
        "nvfp4 1x16 fused": lambda: fused_quantize_nvfp4(big),
        "nvfp4 16x16 fused": lambda: fused_quantize_nvfp4(big, two_d=True),
    }
    tq = timeit(q, reps)  # the fused casts compile in timeit's two warm-up calls
    nbytes = big.numel() * big.element_size()
    print(f"\n2. quantization of a {tuple(big.shape)} fp32 tensor ({nbytes / 2**20:.0f} MiB read; e4m3 unless named)")
    for k, v in tq.items():
        print(
            f"   {k:<20} {nbytes / v / 1e9:7.2f} GB/s   {v * 1e3:7.1f} ms   "
            f"{tq['plain copy (clone)'] / v:5.3f} of a copy's throughput"
        )


def model_saved() -> None:
    from dataclasses import replace

    from lowprec.build_optim import OptimHParams
    from lowprec.data import DataSpec, TokenBatches, prepare
    from lowprec.model import model_args
    from lowprec.recipes import get_recipe
    from lowprec.train.build import build
    from lowprec.train.spec import TrainSpec

    data = prepare(DataSpec())
    spec = TrainSpec(steps=4, batch_size=8, seq_len=256, progress=False, telemetry_every=0)
    xb, yb = TokenBatches(data.train, data.val, 256, 8, 0).train_batch(0)
    base = get_recipe("fp8_blockwise")
    out = {}
    for label, cache in (("without FP8 cache", False), ("with FP8 cache", True)):
        recipe = replace(base, fp8=replace(base.fp8, saved=replace(base.fp8.saved, cache_fp8_activations=cache)))
        built = build(recipe, model_args("tiny"), spec, OptimHParams(), 0, torch.device("cpu"))

        def step():
            with built.precision():
                logits = built.model(xb)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), yb.flatten())

        out[label] = saved_bytes(step, built.model)
        print(f"   tiny Llama step (8 x 256 tokens), fp8_blockwise {label:<18} {out[label] / 2**20:8.2f} MiB")
    print(f"   ratio with/without: {out['with FP8 cache'] / out['without FP8 cache']:.3f}")

    from lowprec.train.loop import train_step

    every = TrainSpec().telemetry_every
    batches = TokenBatches(data.train, data.val, 256, 8, 0)
    builds = {
        k: build(
            get_recipe("fp8_current"),
            model_args("tiny"),
            replace(spec, telemetry_every=v),
            OptimHParams(),
            0,
            torch.device("cpu"),
        )
        for k, v in (("off", 0), ("every step", 1))
    }

    def stepper(b):
        state = {"step": 0}

        def run():
            s = state["step"]
            for h in b.before_step:
                h(s, b)
            train_step(b, [batches.train_batch(s)], 1.0, s)
            for h in b.after_step:
                h(s, b)
            state["step"] += 1

        return run

    t = timeit({k: stepper(b) for k, b in builds.items()}, 6)
    extra = t["every step"] / t["off"] - 1
    print("\n4. FP8 telemetry cost, tiny Llama fp8_current step (8 x 256 tokens)")
    print(
        f"   off {t['off'] * 1e3:.0f} ms, sampled {t['every step'] * 1e3:.0f} ms: +{100 * extra:.1f}% on a sampled "
        "step, "
        f"+{100 * extra / every:.2f}% amortized at telemetry_every={every} (target < 5%)"
    )


if __name__ == "__main__":
    main()
