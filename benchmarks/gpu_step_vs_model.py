"""lowprec's own training step on one GPU beside the cost model's and the memory model's predictions,
with torchao's FP8 training as peer rows in the same process and loop.

    python benchmarks/gpu_step_vs_model.py [--model llama3_1b] [--layers N] [--batch 1] [--seq 8192] [--steps 12]
                                           [--eager] [--recipes bf16,fp8_tensorwise,fp8_current,fp8_rowwise]
                                           [--fused-casts auto|on|off] [--out F.json] [--profile] [--dry-run]

Each recipe is built with ``lowprec.train.build`` (no MLflow, no Hydra: the core alone) on ``cuda`` with
``train.compile=true`` (``--eager``: false) and ``train.ac=selective``, telemetry off, and trained ``--steps``
steps on synthetic token sequences (an arithmetic progression mod the vocabulary from a random start: step time
does not depend on the data; the losses are not a quality measurement). ``--layers`` overrides the model's
number of blocks (``--model llama3_8b --layers 8``: Llama-3-8B layer shapes, 8 of them). Printed per recipe: the
median step time of the steps after the fourth (compilation happens in the first), tokens/s, the ratio to the
first row, ``torch.cuda.max_memory_allocated``, the blockwise GEMM kernel lowprec chose (``lowprec.kernels
.blockwise``); beside them the per-op cost model's tokens/s (``step_cost``, the shipped calibration, one GPU of
the detected part, same layout) and the memory model's allocated peak (``peak_breakdown``), with measured /
predicted. ``benchmarks/gpu_suite.py`` does the same through ``lowprec train`` with FSDP2 on a node.

Peer rows (``PEERS``), measured with the same build, loop and timing: ``torchao_rowwise`` (the catalog's
``fp8_tensorwise``, torchao's ``Float8Linear``, with torchao's rowwise recipe), ``torchao_blockwise`` and
``torchao_blockwise_triton`` (torchao's prototype ``Float8BlockwiseLinear``, DeepSeek-V3 1x128/128x128 scaling,
its GEMMs on torch's ``F.scaled_mm`` or on its own Triton kernels) swapped into the bf16 recipe's model in place
of the linears lowprec's blockwise recipes convert. A peer whose package is missing is skipped with a printed
reason; a row that fails to build or train prints its error and the others go on. Rows are written to ``--out``
as they finish, so a run cut short by a time limit keeps what it measured.

``--profile`` runs two more steps per row under ``torch.profiler`` and adds ``profile`` to the row
(``benchmarks/step_profile.py``): wall vs device-busy time per step, top-level host ops, kernels, host-device
synchronisations and the top kernels. It says whether a row is device-bound or waits on the host.

``--dry-run`` checks the arguments, the recipes and the model shapes without CUDA and exits. Exits with code 2
and one line on stderr without CUDA or on a GPU the hardware table does not know.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import lowprec.train.build as build_mod  # noqa: E402
from lowprec.build_optim import OptimHParams  # noqa: E402
from lowprec.convert import fp8_candidate_fqns  # noqa: E402
from lowprec.estimate.cost_model import Layout, step_cost  # noqa: E402
from lowprec.estimate.hardware import cuda_device_hardware  # noqa: E402
from lowprec.estimate.memory_model import peak_breakdown  # noqa: E402
from lowprec.model import model_args  # noqa: E402
from lowprec.recipes import get_recipe  # noqa: E402
from lowprec.train.build import build  # noqa: E402
from lowprec.train.spec import TrainSpec  # noqa: E402
from lowprec.train.step import train_step  # noqa: E402

#: Peer rows: name -> (catalog recipe it starts from, what it needs installed, how it differs).
PEERS = {
    "torchao_rowwise": ("fp8_tensorwise", "torchao", "torchao Float8Linear, rowwise recipe"),
    "torchao_blockwise": ("bf16", "torchao", "torchao Float8BlockwiseLinear, GEMMs on F.scaled_mm"),
    "torchao_blockwise_triton": ("bf16", "triton", "torchao Float8BlockwiseLinear, Triton GEMMs"),
}


def stamp() -> str:
    """Wall-clock time for progress lines."""
    return time.strftime("%H:%M:%S")


def resolve(name: str):
    """The recipe a row builds (peers: the one they start from, adjusted), and the linear swap of a torchao
    blockwise peer (``None`` otherwise)."""
    if name not in PEERS:
        return get_recipe(name), None
    base, _, _ = PEERS[name]
    recipe = get_recipe(base)
    if name == "torchao_rowwise":
        return dataclasses.replace(
            recipe,
            name=name,
            fp8=dataclasses.replace(
                recipe.fp8, scaling="rowwise", cast=dataclasses.replace(recipe.fp8.cast, fp8_format="e4m3")
            ),
        ), None
    return dataclasses.replace(recipe, name=name), name.endswith("_triton")


def peer_missing(name: str) -> str | None:
    """Why peer ``name`` cannot run here (a package is not installed), or ``None``."""
    if name not in PEERS:
        return None
    missing = [m for m in ("torchao", PEERS[name][1]) if importlib.util.find_spec(m) is None]
    return f"{' and '.join(dict.fromkeys(missing))} not installed" if missing else None


@contextlib.contextmanager
def torchao_blockwise_swap(use_triton: bool | None):
    """While building, swap the linears lowprec's blockwise recipes convert (``fp8_candidate_fqns`` of
    ``fp8_blockwise``) for torchao's ``Float8BlockwiseLinear`` (on the meta model, before AC and compile: the
    build's ``convert_kernels`` step). ``use_triton=None``: no swap."""
    if use_triton is None:
        yield
        return
    from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

    class AutocastInput(Float8BlockwiseLinear):
        # As lowprec's Float8Linear: the input is cast to the autocast dtype before it is quantized (torchao's
        # linear takes whatever it gets; under the bf16 recipe the residual stream is FP32).
        def forward(self, x):
            if torch.is_autocast_enabled(x.device.type):
                x = x.to(torch.get_autocast_dtype(x.device.type))
            return super().forward(x)

    real = build_mod.convert_kernels
    spec = get_recipe("fp8_blockwise").fp8

    def swap(model, policy):
        for fqn in fp8_candidate_fqns(model, spec):
            parent, _, child = fqn.rpartition(".")
            new = AutocastInput.from_float(model.get_submodule(fqn))
            new.use_triton = use_triton
            setattr(model.get_submodule(parent) if parent else model, child, new)
        return real(model, policy)

    build_mod.convert_kernels = swap
    try:
        yield
    finally:
        build_mod.convert_kernels = real


def measure(
    recipe, swap, args, batch: int, seq: int, steps: int, compile_: bool, profile: bool = False, fused: str = "auto"
) -> dict:
    """Median step seconds (steps after the fourth), tokens/s and peak allocated GiB of ``recipe``; with
    ``profile``, two more steps under ``torch.profiler`` summarised by ``step_profile.summarize`` (``profile``)."""
    torch.manual_seed(0)
    spec = TrainSpec(
        steps=steps,
        batch_size=batch,
        seq_len=seq,
        val_every=0,
        val_batches=1,
        progress=False,
        ac="selective",
        compile=compile_,
        warmup_steps=2,
        telemetry_every=0,
        fused_casts=fused,
    )
    with torchao_blockwise_swap(swap):
        b = build(recipe, args, spec, OptimHParams(), 0, torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    times, losses = [], []
    for s in range(steps):
        seq_ids = torch.randint(0, args.vocab_size, (batch, 1), generator=gen) + 7 * torch.arange(seq + 1)
        seq_ids = seq_ids % args.vocab_size
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = train_step(b, [(seq_ids[:, :-1], seq_ids[:, 1:])], 1.0, s)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(r.loss))
    step = statistics.median(times[4:])
    prof = _profiled_steps(b, args, batch, seq, steps, gen) if profile else None
    out = {
        "step_s": step,
        "tokens_per_s": batch * seq / step,
        "first_step_s": times[0],
        "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "losses": losses,
        "blockwise_gemm": b.kernels.blockwise if b.kernels.blockwise != "emulated" else None,
    }
    if prof is not None:
        out["profile"] = prof
    del b, r
    return out


def _profiled_steps(b, args, batch: int, seq: int, first: int, gen, n: int = 2) -> dict:
    """``n`` more training steps under ``torch.profiler`` (CPU and CUDA activity), summarised per step."""
    from step_profile import summarize
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(first, first + n):
            ids = (
                torch.randint(0, args.vocab_size, (batch, 1), generator=gen) + 7 * torch.arange(seq + 1)
            ) % args.vocab_size
            train_step(b, [(ids[:, :-1], ids[:, 1:])], 1.0, s)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return summarize(p.events(), n, wall)


def _release() -> None:
    gc.collect()
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3_1b")
    ap.add_argument("--layers", type=int, default=None, help="override the model's number of blocks")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--eager", action="store_true", help="train.compile=false")
    ap.add_argument("--recipes", default="bf16,fp8_tensorwise,fp8_current,fp8_rowwise")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--fused-casts", default="auto", choices=("auto", "on", "off"), help="train.fused_casts (eager FP8 casts)"
    )
    ap.add_argument(
        "--profile", action="store_true", help="two more steps per row under torch.profiler: device busy vs wall"
    )
    ap.add_argument("--dry-run", action="store_true", help="check arguments, recipes and shapes; no CUDA")
    a = ap.parse_args(argv)
    if a.steps < 6:
        ap.error(f"--steps {a.steps}: the median is over the steps after the fourth; use at least 6")
    for rn in a.recipes.split(","):
        resolve(rn)  # unknown names fail here, before any GPU work
    return a


def main(argv: list[str]) -> int:
    a = parse(argv)
    args = model_args(a.model, **({"n_layers": a.layers} if a.layers else {}))
    compile_ = not a.eager
    mode = "compile" if compile_ else "eager"
    names = a.recipes.split(",")
    if a.dry_run:
        for rn in names:
            why = peer_missing(rn)
            print(f"{rn:<26} {resolve(rn)[0].name:<26} {'skip: ' + why if why else 'ok'}")
        print(f"dry run: {a.model} ({args.n_layers} layers, dim {args.dim}), {a.batch} x {a.seq}, {mode}, ok")
        return 0
    try:
        name, hw = cuda_device_hardware()
    except (RuntimeError, LookupError) as e:
        print(f"gpu_step_vs_model: {e}", file=sys.stderr)
        return 2
    lo = Layout(1, 1, a.batch, a.seq, "selective", compile_)
    print(
        f"{name} ({hw.name}), torch {torch.__version__}; {a.model} ({args.n_layers} layers), {a.batch} x {a.seq}, "
        f"{mode}, selective AC",
        flush=True,
    )
    head = f"{'recipe':<26}{'tok/s':>9}{'vs 1st':>8}{'predicted':>11}{'ratio':>7}{'alloc GiB':>11}{'predicted':>11}"
    print(f"{head}  blockwise GEMM", flush=True)
    rows: dict[str, dict] = {}
    first = None
    for rn in names:
        why = peer_missing(rn)
        if why:
            rows[rn] = {"skipped": why}
            print(f"{rn:<26} skipped: {why}", flush=True)
            continue
        recipe, swap = resolve(rn)
        print(f"[{stamp()}] {rn} ...", flush=True)
        error = None
        try:
            m = measure(recipe, swap, args, a.batch, a.seq, a.steps, compile_, a.profile, a.fused_casts)
        except Exception as e:  # noqa: BLE001 - one failing row must not cost the others
            error = f"{type(e).__name__}: {e}"
        _release()  # after the except clause: its traceback no longer holds the failed row's tensors
        if error is not None:
            rows[rn] = {"error": error[:2000]}
            print(f"{rn:<26} failed: {error.splitlines()[0]}"[:400], flush=True)
            _write(a.out, name, args, a, mode, rows)
            continue
        first = first or m["tokens_per_s"]
        row = {**m, "vs_first": m["tokens_per_s"] / first}
        try:
            pred = step_cost(args, recipe, hw, lo).tokens_per_s_per_gpu if swap is None else None
            mem = peak_breakdown(args, recipe, batch=a.batch, seq=a.seq, ac="selective", compiled_loss=compile_)
            mem_gib = mem.allocated / 2**30 if swap is None else None
        except Exception as e:  # noqa: BLE001 - the models may not know a peer; the measurement stands
            pred = mem_gib = None
            row["model_error"] = f"{type(e).__name__}: {e}"[:300]
        rows[rn] = {**row, "predicted_tokens_per_s": pred, "predicted_allocated_gib": mem_gib}
        ratio = f"{m['tokens_per_s'] / pred:>7.3f}" if pred else f"{'-':>7}"
        print(
            f"{rn:<26}{m['tokens_per_s']:>9,.0f}{row['vs_first']:>8.3f}{pred or 0:>11,.0f}{ratio}"
            f"{m['max_allocated_gib']:>11.1f}{mem_gib or 0:>11.1f}  {m['blockwise_gemm'] or '-'}",
            flush=True,
        )
        if "profile" in m:
            pr = m["profile"]
            print(
                f"{'':<26}profile: wall {pr['wall_ms']:.1f} ms, device busy {pr['device_busy_ms']:.1f} ms "
                f"({pr['device_busy_fraction']:.2f}), {pr['host_ops']:.0f} host ops, {pr['kernels']:.0f} kernels, "
                f"syncs {pr['syncs'] or 'none'}",
                flush=True,
            )
        _write(a.out, name, args, a, mode, rows)
    return 0


def _write(out: str | None, device: str, args, a, mode: str, rows: dict) -> None:
    if out:
        meta = {"device": device, "torch": torch.__version__, "model": a.model, "n_layers": args.n_layers}
        meta |= {"batch": a.batch, "seq": a.seq, "steps": a.steps, "mode": mode, "ac": "selective"}
        meta |= {"fused_casts": a.fused_casts}
        Path(out).write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
