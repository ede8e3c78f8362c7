"""Which lowprec FP8 linears ``torch.compile(fullgraph=True)`` traces on this torch, and why not where it fails.

    python benchmarks/compile_probe.py [--device cuda] [--model debug] [--recipes a,b] [--out F.json]

On an H100/H200 with torch 2.11.0+cu130 the FP8 activation cache and blockwise scaling failed to trace
("lift_tracked_freevar_to_input should not be called on root SubgraphTracer" inside the FP8 autograd Function,
or a fake-tensor dtype mismatch at SDPA). This probe found the causes (a stride query in the backward, a global
decode table; fixed 2026-11-26; on a CPU, inductor's loop split of the expanded tile/block scales, fixed the
same day: ``lowprec.numerics.scaling._blocked_views``).
This probe records, for one torch build, two things the restructure of ``lowprec.float8.linear`` needs:

1. per catalog recipe: a three-step ``train.compile`` run of ``lowprec.train.build`` (any refusal bypassed), OK or
   the dynamo error with its user-code frames;
2. minimal ``torch.autograd.Function`` variants, each one suspected construct alone (a closure over a tensor made
   inside ``forward``, a closure called through a helper object, an ``nn.Module`` passed as an input, Python
   objects on ``ctx``, a float8 tensor in ``save_for_backward``, lowprec's blockwise ``quantize_operand``), compiled
   ``fullgraph=True`` through forward and backward.

Only torch and lowprec are imported (the GPU machine has no torchao, MLflow or Hydra). Exits 0 whatever it finds:
a failure to trace is the finding.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lowprec.build_optim import OptimHParams  # noqa: E402
from lowprec.model import model_args  # noqa: E402
from lowprec.numerics.formats import E4M3  # noqa: E402
from lowprec.numerics.scaling import quantize_operand  # noqa: E402
from lowprec.recipes import get_recipe  # noqa: E402
from lowprec.train.build import build  # noqa: E402
from lowprec.train.spec import TrainSpec  # noqa: E402
from lowprec.train.step import train_step  # noqa: E402

DEFAULT_RECIPES = "fp8_current,deepseek_v3_tensorwise,deepseek_v3_no_fp8_cache,fp8_blockwise,deepseek_v3"


def _failure(e: BaseException) -> dict:
    # paths relative to the repository, so a result file names no folder of the machine that made it
    msg = str(e).replace(str(ROOT) + "/", "")
    return {
        "ok": False,
        "error": f"{type(e).__name__}: {msg.splitlines()[0][:300] if msg else ''}",
        "message_tail": "\n".join(msg.splitlines()[-40:]),
        "traceback_tail": "".join(traceback.format_exception(e)[-12:]).replace(str(ROOT) + "/", ""),
    }


def probe_recipe(name: str, model: str, device: torch.device) -> dict:
    """Three compiled training steps of ``name`` on ``model`` (batch 2 x 128, selective AC, telemetry off)."""
    spec = TrainSpec(
        steps=3,
        batch_size=2,
        timing_warmup_steps=1,
        seq_len=128,
        val_every=0,
        val_batches=1,
        progress=False,
        ac="selective",
        compile=True,
        warmup_steps=1,
        telemetry_every=0,
    )
    args = model_args(model)
    torch._dynamo.reset()
    try:
        b = build(get_recipe(name), args, spec, OptimHParams(), 0, device)
        gen = torch.Generator().manual_seed(0)
        losses = []
        for s in range(3):
            ids = torch.randint(0, args.vocab_size, (2, 129), generator=gen).to(device)
            losses.append(float(train_step(b, [(ids[:, :-1], ids[:, 1:])], 1.0, s).loss))
        return {"ok": True, "losses": losses}
    except Exception as e:  # the failure is the finding
        return _failure(e)


# ---- minimal autograd.Function variants ------------------------------------------------------------------------


class _Helper:
    @staticmethod
    def output(compute):
        return compute()


class ClosureOverForwardTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        q = x * 2.0

        def gemm():
            return q @ w.t()

        ctx.save_for_backward(x, w)
        return gemm()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return 2.0 * dy @ w, dy.t() @ (2.0 * x)


class ClosureThroughHelper(ClosureOverForwardTensor):
    """The same closure, called through a helper object (as ``recompute.matmul_unit().output`` does)."""

    @staticmethod
    def forward(ctx, x, w):
        q = x * 2.0

        def gemm():
            return q @ w.t()

        ctx.save_for_backward(x, w)
        return _Helper.output(gemm)


class ModuleAsInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, mod):
        ctx.mod = mod
        ctx.save_for_backward(x, w)
        return (x * mod.factor) @ w.t()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        f = ctx.mod.factor
        return f * dy @ w, dy.t() @ (f * x), None


class Fp8SavedWithCtxObjects(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        q = quantize_operand(x, E4M3, "tensorwise")
        ctx.meta = (q.granularity, q.fmt)
        ctx.save_for_backward(q.data, q.scale, w)
        return q.dequantize(x.dtype) @ w.t()

    @staticmethod
    def backward(ctx, dy):
        data, scale, w = ctx.saved_tensors
        x = data.to(dy.dtype) / scale
        return dy @ w, dy.t() @ x


class BlockwiseQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        qx = quantize_operand(x, E4M3, "tile1x128")
        qw = quantize_operand(w, E4M3, "block128x128")
        ctx.save_for_backward(x, w)
        return qx.dequantize(x.dtype) @ qw.dequantize(x.dtype).t()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return dy @ w, dy.t() @ x


class _Factor(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("factor", torch.tensor(2.0))


VARIANTS = {
    "closure_over_forward_tensor": lambda x, w, m: ClosureOverForwardTensor.apply(x, w),
    "closure_through_helper": lambda x, w, m: ClosureThroughHelper.apply(x, w),
    "module_as_input": lambda x, w, m: ModuleAsInput.apply(x, w, m),
    "fp8_saved_with_ctx_objects": lambda x, w, m: Fp8SavedWithCtxObjects.apply(x, w),
    "blockwise_quantize_operand": lambda x, w, m: BlockwiseQuantize.apply(x, w),
}


def probe_variant(name: str, device: torch.device) -> dict:
    torch._dynamo.reset()
    fn = VARIANTS[name]
    mod = _Factor().to(device)
    x = torch.randn(256, 256, device=device, requires_grad=True)
    w = torch.randn(384, 256, device=device, requires_grad=True)
    try:
        out = torch.compile(lambda a, b: fn(a, b, mod).sum(), fullgraph=True)(x, w)
        out.backward()
        return {"ok": True}
    except Exception as e:
        return _failure(e)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="debug")
    ap.add_argument("--recipes", default=DEFAULT_RECIPES)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    print(f"compile probe: torch {torch.__version__} on {where}")
    result = {"torch": torch.__version__, "device": where, "variants": {}, "recipes": {}}
    for name in VARIANTS:
        r = probe_variant(name, device)
        result["variants"][name] = r
        print(f"  variant {name:<30} {'OK' if r['ok'] else r['error'][:160]}", flush=True)
        _save(result, a.out)
    for name in a.recipes.split(","):
        r = probe_recipe(name, a.model, device)
        result["recipes"][name] = r
        print(f"  recipe  {name:<30} {'OK' if r['ok'] else r['error'][:160]}", flush=True)
        _save(result, a.out)
    return 0


def _save(result: dict, out: str | None) -> None:
    if out:  # after every probe: a run stopped by a time limit keeps what it found
        Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
