"""Step time of lowprec's `fp32` recipe against a plain hand-written PyTorch loop, side by side.

Both loops train the same Llama (same init) on the same batches with the same AdamW, LR schedule and
gradient clipping; they run in alternating blocks so machine noise hits both alike. The ratio is
median(lowprec step) / median(plain step); the target is at most 1.05.

    .venv/bin/python benchmarks/loop_overhead.py [--model tiny] [--steps 40] [--block 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lowprec.build_optim import OptimHParams
from lowprec.data import DataSpec, TokenBatches, prepare
from lowprec.model import model_args
from lowprec.recipes import get_recipe
from lowprec.train.build import build, build_model_meta, materialize
from lowprec.train.loop import train_step
from lowprec.train.schedule import warmup_cosine
from lowprec.train.spec import TrainSpec


def plain_loop(args, hp: OptimHParams, spec: TrainSpec):
    model = build_model_meta(args)
    materialize(model, torch.device("cpu"), 0)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=hp.lr,
        betas=(hp.beta1, hp.beta2),
        eps=hp.eps,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, spec.warmup_steps, spec.steps, spec.min_lr_ratio)
    )

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        sched.step()
        return loss.item()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=40, help="measured steps per loop")
    ap.add_argument("--block", type=int, default=5, help="steps per alternating block")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    a = ap.parse_args()
    args = model_args(a.model)
    spec = TrainSpec(steps=a.steps + 10, batch_size=a.batch_size, seq_len=a.seq_len, progress=False)
    hp = OptimHParams()
    data = prepare(DataSpec())
    batches = TokenBatches(data.train, data.val, spec.seq_len, spec.batch_size, 0)
    built = build(get_recipe("fp32"), args, spec, hp, 0, torch.device("cpu"))
    plain = plain_loop(args, hp, spec)
    times = {"lowprec": [], "plain": []}
    losses = {"lowprec": [], "plain": []}

    def run(which, step):
        x, y = batches.train_batch(step)
        t0 = time.perf_counter()
        if which == "lowprec":
            loss = train_step(built, [(x, y)], spec.grad_clip, step).loss
        else:
            loss = plain(x, y)
        return time.perf_counter() - t0, loss

    for s in range(3):  # warm-up, not measured
        run("lowprec", s), run("plain", s)
    step = 3
    while len(times["plain"]) < a.steps:
        for which in ("lowprec", "plain"):
            for k in range(a.block):
                dt, loss = run(which, step + k)
                times[which].append(dt)
                losses[which].append(loss)
        step += a.block
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"model={a.model} ({args.num_params():,} params), batch {spec.batch_size} x seq {spec.seq_len}, "
        f"{a.steps} measured steps each, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    for k in ("plain", "lowprec"):
        print(
            f"  {k:<8} median step {med[k] * 1e3:8.1f} ms   mean {statistics.fmean(times[k]) * 1e3:8.1f} ms   "
            f"{spec.tokens_per_step / med[k]:8.0f} tokens/s"
        )
    same = all(abs(p - q) < 1e-4 for p, q in zip(losses["plain"], losses["lowprec"]))
    print(f"  losses identical between the loops: {same}")
    print(f"ratio lowprec/plain (median step time): {med['lowprec'] / med['plain']:.3f}  (target <= 1.05)")


if __name__ == "__main__":
    main()
