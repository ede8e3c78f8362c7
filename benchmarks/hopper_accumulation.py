"""Hopper's FP8 accumulator measured directly, and lowprec's emulated accumulator fitted to it.

    python benchmarks/hopper_accumulation.py [--out benchmarks/results/hopper_accumulation.json]    # CUDA
    python benchmarks/hopper_accumulation.py --emulate [--bits 14 --rounding nearest --group 0]     # CPU
    python benchmarks/hopper_accumulation.py --fit benchmarks/results/hopper_accumulation.json      # CPU

Measurement (CUDA): e4m3 operands with tensorwise scales of 1.0 (the values are e4m3 numbers, so the FP64
product of the *same* operands is exact up to FP64 and only the accumulation is measured), multiplied by
``torch._scaled_mm`` with FP32 output, once with ``use_fast_accum=True`` (``fast``: all of K in the tensor core's
accumulator, no promotion) and once with ``use_fast_accum=False`` (``promoted``: cuBLAS promotes the partial sums
to FP32), for K = 256, 512, ..., ``--k-max``, against the FP64 product. Operands (``DATASETS``): Gaussian; Gaussian
with a few K channels of the left operand x100 (activation outliers); all-positive (|Gaussian|: no cancellation,
so the accumulator's bias is not hidden); and per-channel log-normal magnitudes (the spread of captured LLM
activations). Each K uses the first K columns of one operand pair, so the K rows are prefixes of one another.

Errors (``lowprec.float8.accumulator.accumulation_error``): ``max_rel_err``, the DeepSeek-V3 study's definition
(``lowprec_lab/studies/deepseek_numerics.py``: max relative error over the outputs at least as large as their
median; the paper, arXiv 2412.19437 3.3.2: "maximum relative error of nearly 2%" at K = 4096 without promotion on
H800); ``max_elem_rel_err``, the max over every non-zero output; ``rel_err``, Frobenius. Each over the whole
M x N output and over its top-left ``--block`` x ``--block`` corner (``block``), the part the CPU fit re-computes.
M = N = 2048 by default so the GEMM fills the GPU's SMs: a small output would let cuBLAS split K over CTAs and
add the parts in FP32, which is a promotion.

``--emulate`` runs the same table on the CPU through lowprec's emulated accumulator (``--bits``, ``--rounding``,
``--group``; default: ``HOPPER_ACCUMULATOR``) on the block: ``fast`` without promotion, ``promoted`` with FP32
promotion every 128 (DeepSeek-V3's N_C). ``--fit JSON`` grid-searches the emulation's mantissa bits, rounding and
alignment group (``fit_accumulator``) to minimise the mean squared log10 mismatch of the block's ``rel_err`` and
``max_rel_err`` over every dataset and K of the ``fast`` rows, and prints the best models with their largest
factor off the measurement and the ``HOPPER_ACCUMULATOR`` line to paste into ``lowprec/float8/accumulator.py``.

Imports only torch (numpy not needed) and ``lowprec/float8/accumulator.py`` loaded by path (it imports only torch),
so it runs on a machine with nothing else installed. Without CUDA and without ``--emulate``/``--fit`` it exits
with code 2 and one line on stderr. Runs in well under a minute on an H100.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "hopper_accumulation.json"
DATASETS = ("gaussian", "outliers", "positive", "channel_lognormal")
E4M3_MAX = 448.0
OUTLIER_CHANNELS, OUTLIER_FACTOR = 4, 100.0
PROMOTION_INTERVAL = 128  # DeepSeek-V3's N_C, for the emulated "promoted" rows
FIT_GRID = {"bits": tuple(range(10, 17)), "rounding": ("nearest", "truncate", "floor"), "group": (None, 4, 8, 16, 32)}


def _load_accumulator():
    # by path: the package's __init__ may import libraries the GPU machine lacks
    spec = importlib.util.spec_from_file_location("_lowprec_accumulator", ROOT / "lowprec/float8/accumulator.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


acc = _load_accumulator()


def operands(dataset: str, m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` (m, k) and ``b`` (n, k) float32 on CPU whose values are e4m3 numbers (cast with scale 1, saturated at
    448): ``dataset`` one of ``DATASETS`` (module doc). Outlier channels lie in the first 256 columns so every K
    has them. Deterministic in ``seed``; raises ``ValueError`` for an unknown dataset."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; known: {DATASETS}")
    g = torch.Generator().manual_seed(seed * 1000 + DATASETS.index(dataset))
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    if dataset == "outliers":
        a[:, torch.randperm(min(k, 256), generator=g)[:OUTLIER_CHANNELS]] *= OUTLIER_FACTOR
    elif dataset == "positive":
        a, b = a.abs(), b.abs()
    elif dataset == "channel_lognormal":
        a *= torch.randn(1, k, generator=g).exp()
    return tuple(x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() for x in (a, b))


def ks_up_to(k_max: int) -> list[int]:
    """256, 512, ..., ``k_max`` (powers of two)."""
    return [2**e for e in range(8, int(math.log2(k_max)) + 1)]


def checksum(a: torch.Tensor, b: torch.Tensor, block: int) -> float:
    """A fingerprint of the block's operands, so a fit on another machine knows it regenerated the same values."""
    w = torch.arange(1, a.shape[1] + 1, dtype=torch.float64)
    return float((a[:block].double() * w).sum() + (b[:block].double() * w).sum())


def _stats(c: torch.Tensor, exact: torch.Tensor, block: int) -> dict:
    return {
        "full": acc.accumulation_error(c, exact),
        "block": acc.accumulation_error(c[:block, :block], exact[:block, :block]),
    }


def measure(args, device: str = "cuda") -> list[dict]:
    """The hardware rows (module doc): one per dataset, K and accumulation (``fast`` | ``promoted``), from
    ``torch._scaled_mm`` on ``device`` (CUDA; a CPU runs the same calls, whose kernel has no fast mode)."""
    dev = torch.device(device)
    one = torch.ones((), device=dev)
    rows = []
    for ds in args.datasets:
        a, b = operands(ds, args.m, args.n, args.k_max, args.seed)
        fp = checksum(a, b, args.block)
        a8, b8 = a.to(dev).to(torch.float8_e4m3fn), b.to(dev).to(torch.float8_e4m3fn)
        a64, b64 = a.to(dev).double(), b.to(dev).double()
        for k in ks_up_to(args.k_max):
            exact = a64[:, :k] @ b64[:, :k].t()
            ak, bk = a8[:, :k].contiguous(), b8[:, :k].contiguous().t()  # row-major a, column-major b
            for mode, fast in (("fast", True), ("promoted", False)):
                c = torch._scaled_mm(ak, bk, one, one, out_dtype=torch.float32, use_fast_accum=fast)
                rows.append(
                    {"dataset": ds, "k": k, "accumulation": mode, **_stats(c, exact, args.block), "operands": fp}
                )
        del a8, b8, a64, b64
    return rows


def emulate(
    model, datasets, k_max: int, block: int, seed: int = 0, m: int | None = None, n: int | None = None
) -> list[dict]:
    """The same rows through ``model`` (an ``AccumulatorModel``) on the CPU, for the top-left ``block`` x ``block``
    outputs of the (``m`` or ``block``) x (``n`` or ``block``) operands (the measurement's corner): ``fast``
    without promotion, ``promoted`` with FP32 promotion every 128."""
    ks = ks_up_to(k_max)
    rows = []
    for ds in datasets:
        a, b = operands(ds, m or block, n or block, k_max, seed)
        a, b = a[:block], b[:block]
        fp = checksum(a, b, block)
        exact = {k: a[:, :k].double() @ b[:, :k].double().t() for k in ks}
        fast = acc.limited_accumulation(a, b, model, ks=ks)
        chunks = [
            acc.limited_accumulation(a[:, s : s + PROMOTION_INTERVAL], b[:, s : s + PROMOTION_INTERVAL], model)[0]
            for s in range(0, k_max, PROMOTION_INTERVAL)
        ]
        promoted, run = {}, torch.zeros_like(chunks[0])
        for i, ch in enumerate(chunks):
            run = run + ch  # FP32 promotion: the chunk's result added to an FP32 sum
            promoted[(i + 1) * PROMOTION_INTERVAL] = run
        for k, c in zip(ks, fast):
            for mode, ck in (("fast", c), ("promoted", promoted[k])):
                st = acc.accumulation_error(ck, exact[k])
                rows.append({"dataset": ds, "k": k, "accumulation": mode, "full": st, "block": st, "operands": fp})
    return rows


def _log_mismatch(emulated: dict, measured: dict, metrics) -> list[float]:
    return [math.log10(max(emulated[x], 1e-12)) - math.log10(max(measured[x], 1e-12)) for x in metrics]


def fit_accumulator(measured: dict, grid: dict | None = None, metrics=("rel_err", "max_rel_err")) -> list[dict]:
    """Grid search of the emulated accumulator against a measurement (``measured``: this script's JSON). For every
    (bits, rounding, group) of ``grid`` (default ``FIT_GRID``) the ``fast`` rows are emulated on the block of the
    measurement's operands (same datasets, seed, K) and scored by the mean squared log10 mismatch of ``metrics``;
    returns one dict per model, best first: ``bits``, ``rounding``, ``group``, ``score``, ``max_factor`` (the
    largest ratio either way between emulated and measured over the rows and metrics) and ``rows``. Needs no
    GPU. Raises ``ValueError`` when ``measured`` has no ``fast`` rows or its operands' ``checksum`` differs from
    the regenerated ones (another torch generating other random numbers)."""
    cfg = measured["config"]
    meas = {(r["dataset"], r["k"]): r["block"] for r in measured["rows"] if r["accumulation"] == "fast"}
    if not meas:
        raise ValueError("the measurement has no 'fast' (no-promotion) rows to fit")
    grid = {**FIT_GRID, **(grid or {})}
    datasets = sorted({d for d, _ in meas}, key=DATASETS.index)
    k_max = max(k for _, k in meas)
    block = cfg["block"]
    ops = {ds: operands(ds, cfg["m"], cfg["n"], k_max, cfg["seed"]) for ds in datasets}
    ops = {ds: (a[:block], b[:block]) for ds, (a, b) in ops.items()}
    for r in measured["rows"]:
        # relative tolerance: another CPU may sum in another order
        if "operands" in r and not math.isclose(r["operands"], checksum(*ops[r["dataset"]], block), rel_tol=1e-9):
            raise ValueError(f"the {r['dataset']} operands regenerated here differ from the measurement's")
    exact = {(ds, k): a[:, :k].double() @ b[:, :k].double().t() for ds, (a, b) in ops.items() for _, k in meas}
    ks = sorted({k for _, k in meas})
    out = []
    for bits, rounding, group in itertools.product(grid["bits"], grid["rounding"], grid["group"]):
        model = acc.AccumulatorModel(bits, rounding, group)
        diffs, rows = [], []
        for ds, (a, b) in ops.items():
            for k, c in zip(ks, acc.limited_accumulation(a, b, model, ks=ks)):
                if (ds, k) not in meas:
                    continue
                e = acc.accumulation_error(c, exact[(ds, k)])
                d = _log_mismatch(e, meas[(ds, k)], metrics)
                diffs += d
                rows.append({"dataset": ds, "k": k, "emulated": e, "measured": meas[(ds, k)]})
        score = sum(x * x for x in diffs) / len(diffs)
        out.append(
            {
                "bits": bits,
                "rounding": rounding,
                "group": group,
                "score": score,
                "max_factor": 10 ** max(abs(x) for x in diffs),
                "rows": rows,
            }
        )
    return sorted(out, key=lambda r: r["score"])


def print_table(rows: list[dict], title: str) -> None:
    """One line per dataset and K: fast and promoted errors (full output), and fast over promoted."""
    print(title)
    by = {(r["dataset"], r["k"], r["accumulation"]): r["full"] for r in rows}
    head = (
        f"{'dataset':<18} {'K':>6} | {'fast max_rel':>12} {'max_elem':>10} {'frob':>10} | "
        f"{'prom max_rel':>12} {'max_elem':>10} {'frob':>10} | {'fast/prom':>9}"
    )
    print(head)
    print("-" * len(head))
    for ds, k, _ in [key for key in by if key[2] == "fast"]:
        f, p = by[(ds, k, "fast")], by.get((ds, k, "promoted"))
        ratio = f["max_rel_err"] / p["max_rel_err"] if p and p["max_rel_err"] > 0 else float("nan")
        pcols = f"{p['max_rel_err']:>12.3e} {p['max_elem_rel_err']:>10.3e} {p['rel_err']:>10.3e}" if p else " " * 34
        print(
            f"{ds:<18} {k:>6} | {f['max_rel_err']:>12.3e} {f['max_elem_rel_err']:>10.3e} {f['rel_err']:>10.3e} | "
            f"{pcols} | {ratio:>9.2f}"
        )


def print_fit(results: list[dict], measured: dict, top: int = 5) -> None:
    """The best ``top`` models, the best one's rows against the measurement, and its ``HOPPER_ACCUMULATOR`` line."""
    cur = acc.HOPPER_ACCUMULATOR
    print(f"{'bits':>4} {'rounding':>9} {'group':>5} | {'score':>8} {'max factor':>10}")
    for r in results[:top]:
        print(f"{r['bits']:>4} {r['rounding']:>9} {r['group']!s:>5} | {r['score']:>8.4f} {r['max_factor']:>10.2f}")
    now = [r for r in results if (r["bits"], r["rounding"], r["group"]) == (cur.bits, cur.rounding, cur.group)]
    if now:
        print(
            f"current HOPPER_ACCUMULATOR ({cur.describe()}): score {now[0]['score']:.4f}, max factor "
            f"{now[0]['max_factor']:.2f}"
        )
    best = results[0]
    print(f"\nbest: {acc.AccumulatorModel(best['bits'], best['rounding'], best['group']).describe()}")
    print(f"{'dataset':<18} {'K':>6} | {'meas max_rel':>12} {'emu max_rel':>12} | {'meas frob':>10} {'emu frob':>10}")
    for r in best["rows"]:
        me, em = r["measured"], r["emulated"]
        print(
            f"{r['dataset']:<18} {r['k']:>6} | {me['max_rel_err']:>12.3e} {em['max_rel_err']:>12.3e} | "
            f"{me['rel_err']:>10.3e} {em['rel_err']:>10.3e}"
        )
    env = measured.get("environment", {})
    src = (
        f"fitted to {env.get('device', '?')} measurement, {env.get('date', '?')}, "
        f"{env.get('command', 'benchmarks/hopper_accumulation.py')}; --fit max factor {best['max_factor']:.2f}"
    )
    print(
        "\nlowprec/float8/accumulator.py:\nHOPPER_ACCUMULATOR = AccumulatorModel(\n"
        f"    bits={best['bits']},\n    rounding={best['rounding']!r},\n    group={best['group']},\n"
        f"    source={src!r},\n    fitted=True,\n)"
    )


def _environment(device: str) -> dict:
    return {
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def _model_from_args(args):
    if args.bits is None and args.rounding is None and args.group is None:
        return acc.HOPPER_ACCUMULATOR
    cur = acc.HOPPER_ACCUMULATOR
    group = cur.group if args.group is None else (args.group or None)
    return acc.AccumulatorModel(args.bits or cur.bits, args.rounding or cur.rounding, group)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="hopper_accumulation", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--m", type=int, default=2048)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--k-max", type=int, default=16384)
    p.add_argument("--block", type=int, default=64, help="top-left corner the CPU fit re-computes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--datasets", default=",".join(DATASETS))
    p.add_argument("--emulate", action="store_true", help="CPU: lowprec's emulated accumulator instead of CUDA")
    p.add_argument("--bits", type=int)
    p.add_argument("--rounding", choices=("nearest", "truncate", "floor"))
    p.add_argument("--group", type=int, help="alignment group (0: none, per-32-step rounding)")
    p.add_argument("--fit", type=Path, help="CPU: fit the emulation to this measurement JSON")
    p.add_argument("--fit-out", type=Path, help="write the fit's ranking as JSON here")
    args = p.parse_args(argv)
    args.datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    if args.fit:
        measured = json.loads(args.fit.read_text())
        t = time.perf_counter()
        results = fit_accumulator(measured)
        print(f"fit of {len(results)} models in {time.perf_counter() - t:.0f} s (CPU)")
        print_fit(results, measured)
        if args.fit_out:
            args.fit_out.write_text(json.dumps(results, indent=1))
        return 0
    t = time.perf_counter()
    if args.emulate:
        model = _model_from_args(args)
        rows = emulate(model, args.datasets, args.k_max, args.block, args.seed)
        env = {**_environment("CPU emulation"), "model": model.describe()}
        m = n = args.block
    else:
        if not torch.cuda.is_available():
            print("hopper_accumulation: error: needs CUDA (or --emulate / --fit on a CPU)", file=sys.stderr)
            return 2
        rows = measure(args)
        env = _environment(torch.cuda.get_device_name())
        m, n = args.m, args.n
    env["seconds"] = round(time.perf_counter() - t, 1)
    cfg = {"m": m, "n": n, "k_max": args.k_max, "block": args.block, "seed": args.seed, "datasets": args.datasets}
    print_table(rows, f"{env['device']}: e4m3 GEMM {m} x K x {n}, scales 1.0, errors against FP64 (full output)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"environment": env, "config": cfg, "rows": rows}, indent=1))
    print(f"wrote {args.out} ({env['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
