"""GPU throughput suite: bf16 and every FP8 recipe on a Llama 3 sized to the node, trained with torch.compile,
selective activation checkpointing and FSDP2, measured, and written beside the published torchtitan/torchao
numbers. One command on an H100/H200 node:

    .venv/bin/python benchmarks/gpu_suite.py [--steps 50] [--recipes bf16,fp8_tensorwise,...] [--model SIZE]
                                             [--local-batch 1] [--seq 8192] [--out gpu_suite.json]

Defaults: ``llama3_8b`` with 8 or more GPUs (torchtitan's benchmark: FSDP2 over 8 GPUs, local batch 1, seq 8192),
``llama3_1b`` below that (one GPU: no sharding); recipes ``bf16`` plus every catalog recipe with FP8 GEMMs (those
with FP8 communication only with 2+ GPUs; ``te_*`` only with Transformer Engine installed; block-scaled recipes,
``mxfp8``/``nvfp4``/``te_mxfp8``/``te_nvfp4``..., only on Blackwell sm100). Each recipe is one
``lowprec train`` run (``python -m lowprec_lab train ... device=cuda train.compile=true train.ac=selective
parallel.dp_shard=<GPUs>``; the command line starts torchrun itself for more than one GPU) on the stdlib corpus,
tracked in a fresh MLflow store under ``runs/gpu_suite/<time>/``, one log per run beside it.

Per recipe, read back from MLflow (units in the names):

- ``tokens_per_s_per_gpu``: the run's ``mean_tokens_per_s`` (global tokens of the steps after
  ``train.timing_warmup_steps``, which absorb compilation) divided by the GPU count;
- ``mfu``: model FLOPs (6N + 12 L dim seq per token, N without the embedding; ``lowprec.estimate``) per GPU
  over the peak of the dtypes that ran (FP8 recipes: a blend of FP8 and BF16 peaks weighted by the FP8 share of
  FLOPs); ``mfu_vs_bf16_peak`` over the dense BF16 peak, the convention of published BF16 MFU figures
  (torchtitan reports none for FP8 runs);
- ``peak_mem_gib``: ``mem_peak_bytes`` / 2^30, rank 0's ``torch.cuda.max_memory_allocated`` (torchtitan's
  "Memory" column is the allocator's reserved peak, which is larger);
- ``final_loss`` (the last step's training loss, nats/token), ``mean_loss_last10``, ``final_val_loss``;
- ``predicted_tokens_per_s_per_gpu``: the per-op cost model's prediction (``lowprec.estimate.cost_model.step_cost``,
  calibrated on ``published.yaml``, held-out error up to 13%) for the suite's layout: FSDP2 over the GPUs, local
  batch, seq, selective AC, compile; ``measured_over_predicted`` their ratio; ``predicted_step_parts_s`` its
  breakdown (GEMMs, attention, memory-bound kernels, FP8 casts, exposed communication); ``None`` where the
  hardware cannot run the recipe (FP8 on A100) or is unknown;
- ``predicted_allocated_gib``: ``lowprec.estimate.memory_model.peak_breakdown(...).allocated`` / 2^30, to set
  beside ``peak_mem_gib`` (both allocated, not reserved);
- ``published``: the matching published rows with ``measured / published``; ``same_setup`` says whether the
  model, GPU count, local batch and sequence length are theirs.

Without CUDA it exits with code 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lowprec.estimate.cost_model import Layout, step_cost  # noqa: E402
from lowprec.estimate.estimator import mfu  # noqa: E402
from lowprec.estimate.hardware import Hardware, hardware_from_device_name  # noqa: E402
from lowprec.estimate.memory_model import peak_breakdown  # noqa: E402
from lowprec.model import model_args  # noqa: E402
from lowprec.recipes import CATALOG, get_recipe  # noqa: E402

#: Published measurements, each from the page its ``source`` names (the headline numbers those projects publish),
#: keyed by lowprec recipe. ``memory_kind`` says what their memory column measures, as far as the source says.
PUBLISHED = [
    {
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Dec 2024)",
        "setup": "Llama-3.1-8B, 8 x H100 96GB HBM2e at 500 W, FSDP2 + torch.compile; Float8 = tensorwise + FP8 "
        "all-gather",
        "model": "llama3_8b",
        "gpus": 8,
        "rows": {
            "bf16": {"tokens_per_s_per_gpu": 6667, "memory_gib": 77.0},
            "fp8_tensorwise_fsdp8": {"tokens_per_s_per_gpu": 8532, "memory_gib": 76.8},
        },
        "memory_kind": "GiB as torchtitan's metrics log it (allocator reserved peak)",
    },
    {
        "source": "torchao docs/source/workflows/training.md, float8 table",
        "setup": "Llama3-8B, 8 x H100, local batch 1, seq 8192, torch.compile, FSDP2, per-op selective AC",
        "model": "llama3_8b",
        "gpus": 8,
        "rows": {
            "bf16": {"tokens_per_s_per_gpu": 6150, "memory_gb": 47.65},
            "fp8_tensorwise_fsdp8": {"tokens_per_s_per_gpu": 7689.5, "memory_gb": 47.77},
            # torchao's rowwise recipe with BF16 all-gather; lowprec's fp8_rowwise has the same scaling
            # (rowwise, e4m3, power-of-2 scales) in lowprec's own implementation.
            "fp8_rowwise": {"tokens_per_s_per_gpu": 6768, "memory_gb": 47.79},
        },
        "memory_kind": "peak memory in GB as the table states it",
    },
]


def needs_fsdp(name: str) -> bool:
    """FP8 communication recipes run only on a sharded layout (refused on one process)."""
    c = get_recipe(name).comm
    return c.weight_all_gather == "fp8" or c.grad_reduce == "fp8"


def default_model(ngpu: int) -> str:
    return "llama3_8b" if ngpu >= 8 else "llama3_1b"


def default_recipes(ngpu: int) -> list[str]:
    """``bf16`` and every catalog recipe with FP8 GEMMs that the layout can run."""
    return ["bf16"] + [n for n, r in CATALOG.items() if r.fp8.enabled and (ngpu > 1 or not needs_fsdp(n))]


def skip_reason(name: str, ngpu: int) -> str | None:
    if get_recipe(name).fp8.backend == "te" and importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine is not installed (pip install -e '.[te]')"
    if get_recipe(name).fp8.scaling in ("mxfp8", "mxfp4", "nvfp4"):
        cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
        if cap < (10, 0):
            return f"block-scaled GEMMs (MXFP8/MXFP4/NVFP4) need Blackwell sm100; this GPU is sm{cap[0]}{cap[1]}"
    if ngpu == 1 and needs_fsdp(name):
        return "FP8 communication needs FSDP2 (2+ GPUs)"
    return None


def overrides(name: str, model: str, ngpu: int, a: argparse.Namespace, runs: Path) -> list[str]:
    """The ``lowprec train`` command line of one recipe (Hydra overrides)."""
    return [
        f"recipe={name}",
        f"model={model}",
        "device=cuda",
        f"parallel.dp_shard={ngpu}",
        f"train.steps={a.steps}",
        f"train.batch_size={a.local_batch * ngpu}",
        f"train.seq_len={a.seq}",
        f"train.timing_warmup_steps={a.warmup}",
        "train.compile=true",
        f"train.ac={AC}",
        "train.val_every=0",
        "train.val_batches=1",
        "train.telemetry_every=0",
        "train.progress=false",
        f"paths.runs={runs}",
        f"tracking.uri=sqlite:///{runs / 'mlflow.db'}",
    ]


def published_for(name: str, model: str, ngpu: int, local_batch: int, seq: int, tokens_per_gpu: float | None):
    """Published rows for recipe ``name`` with ``measured / published`` tokens/s/GPU."""
    out = []
    for p in PUBLISHED:
        row = p["rows"].get(name)
        if row is None:
            continue
        ratio = tokens_per_gpu / row["tokens_per_s_per_gpu"] if tokens_per_gpu else None
        same = model == p["model"] and ngpu == p["gpus"] and local_batch == 1 and seq == 8192
        out.append({"source": p["source"], **row, "measured_over_published": ratio, "same_setup": same})
    return out


#: the suite's activation checkpointing (``train.ac``), also the layout the cost model predicts
AC = "selective"


def predicted(args, recipe, ngpu: int, local_batch: int, seq: int, hw: Hardware | None):
    """The cost model's ``StepCost`` for the suite's layout (FSDP2 over ``ngpu``, selective AC, compile), or
    ``None`` without hardware or where it cannot run the recipe."""
    if hw is None:
        return None
    try:
        return step_cost(args, recipe, hw, Layout(dp_shard=ngpu, batch=local_batch, seq=seq, ac=AC, compile=True))
    except ValueError:
        return None


def summarize(
    name: str,
    model: str,
    ngpu: int,
    seq: int,
    local_batch: int,
    metrics: dict,
    losses: list[float],
    hw: Hardware | None,
) -> dict:
    """One result row from a finished run's MLflow ``metrics`` and per-step ``losses`` (module doc)."""
    args, recipe = model_args(model), get_recipe(name)
    per_gpu = metrics["mean_tokens_per_s"] / ngpu
    m = mfu(args, recipe, seq, per_gpu, hw)
    pred = predicted(args, recipe, ngpu, local_batch, seq, hw)
    try:
        mem_pred = peak_breakdown(args, recipe, dp_shard=ngpu, batch=local_batch, seq=seq, ac=AC).allocated / 2**30
    except ValueError:
        mem_pred = None
    return {
        "tokens_per_s_per_gpu": per_gpu,
        "achieved_tflops_per_gpu": m.achieved_tflops,
        "mfu": m.mfu,
        "mfu_peak": m.peak.label if m.peak else None,
        "mfu_vs_bf16_peak": m.achieved_tflops / hw.bf16_tflops if hw else None,
        "mean_step_time_s": metrics.get("mean_step_time_s"),
        "peak_mem_gib": metrics["mem_peak_bytes"] / 2**30,
        "peak_reserved_gib": metrics["mem_peak_reserved_bytes"] / 2**30
        if "mem_peak_reserved_bytes" in metrics
        else None,
        "final_loss": losses[-1] if losses else None,
        "mean_loss_last10": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "final_val_loss": metrics.get("final_val_loss"),
        "predicted_tokens_per_s_per_gpu": pred.tokens_per_s_per_gpu if pred else None,
        "measured_over_predicted": per_gpu / pred.tokens_per_s_per_gpu if pred else None,
        "predicted_step_parts_s": {
            "gemm": pred.gemm,
            "attention": pred.attention,
            "kernels": pred.kernels,
            "fp8_casts": pred.fp8_casts,
            "exposed_comm": pred.exposed_comm,
        }
        if pred
        else None,
        "predicted_allocated_gib": mem_pred,
    }


def run_one(name: str, model: str, ngpu: int, a: argparse.Namespace, runs: Path, hw: Hardware | None) -> dict:
    """Train ``name`` in a subprocess and read its run back from MLflow."""
    from mlflow.tracking import MlflowClient

    row: dict = {"recipe": name}
    reason = skip_reason(name, ngpu)
    if reason:
        return {**row, "status": "SKIPPED", "reason": reason}
    log = runs / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lowprec_lab", "train", *overrides(name, model, ngpu, a, runs)]
    t0 = time.perf_counter()
    with log.open("w") as f:
        # A session of its own, so that a timeout ends torchrun and its ranks together (they hold the GPUs).
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    row |= {"wall_s": time.perf_counter() - t0, "log": str(log), "exit_code": rc}
    text = log.read_text(errors="replace")
    found = re.search(r"(FINISHED|FAILED) run (\w+)", text)
    if not found:
        last = [ln for ln in text.splitlines() if ln.strip()][-1:] or ["no output"]
        return {**row, "status": "ERROR", "reason": last[0][:500]}
    client = MlflowClient(f"sqlite:///{runs / 'mlflow.db'}")
    run = client.get_run(found.group(2))
    row |= {"status": run.info.status, "run_id": run.info.run_id}
    if run.info.status != "FINISHED":
        return {**row, "reason": run.data.tags.get("failure_reason", "")}
    hist = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda x: x.step)
    row |= {
        "effective_matches": run.data.tags.get("effective_matches"),
        "mem_peak_kind": run.data.tags.get("mem_peak_kind"),
    }
    return row | summarize(name, model, ngpu, a.seq, a.local_batch, run.data.metrics, [x.value for x in hist], hw)


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(results: list[dict]) -> str:
    head = (
        f"{'recipe':<22} {'status':<9} {'tok/s/GPU':>10} {'MFU':>6} {'MFU bf16':>8} {'peak GiB':>8} {'loss':>7}"
        "  published (measured / published)"
    )
    lines = [head]
    for r in results:
        pub = "; ".join(
            f"{p['source'].split()[0]} {p['tokens_per_s_per_gpu']:,} ({_f(p['measured_over_published'], '.2f')}x)"
            for p in r.get("published", [])
        )
        lines.append(
            f"{r['recipe']:<22} {r['status']:<9} {_f(r.get('tokens_per_s_per_gpu'), ',.0f'):>10} "
            f"{_f(r.get('mfu'), '.1%'):>6} {_f(r.get('mfu_vs_bf16_peak'), '.1%'):>8} "
            f"{_f(r.get('peak_mem_gib'), '.1f'):>8} {_f(r.get('final_loss'), '.3f'):>7}  {pub or r.get('reason', '')}"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None, ngpu: int) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_suite.py", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="optimizer steps per recipe (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of tokens/s (compilation)")
    p.add_argument("--recipes", default=None, help="comma-separated recipe names (default: bf16 + every FP8 recipe)")
    p.add_argument("--model", default=None, help="model size (default: llama3_8b on 8+ GPUs, else llama3_1b)")
    p.add_argument("--local-batch", type=int, default=1, help="sequences per GPU per step (default 1)")
    p.add_argument("--seq", type=int, default=8192, help="tokens per sequence (default 8192)")
    p.add_argument("--gpus", type=int, default=ngpu, help=f"GPUs to use (default: all, {ngpu})")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run before it is killed")
    p.add_argument("--out", default="gpu_suite.json", help="JSON output path (default gpu_suite.json)")
    a = p.parse_args(argv)
    if not 1 <= a.warmup < a.steps:
        p.error(f"--warmup {a.warmup} must be in [1, --steps {a.steps})")
    return a


def main(argv: list[str] | None = None) -> int:
    if not torch.cuda.is_available():
        print("gpu_suite: error: needs CUDA (an H100/H200 node); this machine has no CUDA device", file=sys.stderr)
        return 2
    a = parse(argv, torch.cuda.device_count())
    ngpu, gpu = a.gpus, torch.cuda.get_device_name(0)
    model = a.model or default_model(ngpu)
    recipes = a.recipes.split(",") if a.recipes else default_recipes(ngpu)
    unknown = [n for n in recipes if n not in CATALOG]
    if unknown:
        print(f"gpu_suite: error: unknown recipe(s) {', '.join(unknown)}; known: {', '.join(CATALOG)}", file=sys.stderr)
        return 2
    hw = hardware_from_device_name(gpu)
    runs = ROOT / "runs" / "gpu_suite" / time.strftime("%Y%m%d-%H%M%S")
    print(f"gpu_suite: {model} on {ngpu} x {gpu}, {len(recipes)} recipes, {a.steps} steps each; runs in {runs}")
    results = []
    for n in recipes:
        r = run_one(n, model, ngpu, a, runs, hw)
        r["published"] = published_for(n, model, ngpu, a.local_batch, a.seq, r.get("tokens_per_s_per_gpu"))
        results.append(r)
        print(format_table([r]).splitlines()[1], flush=True)
    out = {
        "suite": {
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "model": model,
            "gpus": ngpu,
            "gpu": gpu,
            "hardware": hw.to_dict() if hw else None,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "local_batch": a.local_batch,
            "seq": a.seq,
            "steps": a.steps,
            "timing_warmup_steps": a.warmup,
            "settings": "train.compile=true train.ac=selective parallel.dp_shard=<gpus>",
            "tracking_uri": f"sqlite:///{runs / 'mlflow.db'}",
        },
        "published_sources": [{k: v for k, v in p.items() if k != "rows"} for p in PUBLISHED],
        "results": results,
    }
    Path(a.out).write_text(json.dumps(out, indent=1))
    print("\n" + format_table(results) + f"\n\nwritten: {a.out}")
    return 0 if all(r["status"] in ("FINISHED", "SKIPPED") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
