"""Known-answer checks that train: the lab's verdict rule on recipe pairs whose answer is known, on the real corpus.

Each check trains both arms in-process on the ``debug`` model (lowprec's real build, step and evaluation; no MLflow),
seed i of both arms sharing initial weights and batches, and returns the paired final validation losses; the
registry judges them with the report's rule (``lowprec_lab.stats``). The configurations were found by measurement
(README, "Known-answer checks"); each ``why`` says what makes the effect visible at this scale.
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import cache

import torch

from lowprec.build_optim import OptimHParams
from lowprec.data import DataSpec, TokenBatches, TokenData, prepare
from lowprec.model import ModelArgs, model_args
from lowprec.numerics.reorder import reversed_reductions
from lowprec.optim.loss_scale import grad_underflow_share
from lowprec.recipes import CATALOG
from lowprec.train.build import build
from lowprec.train.spec import TrainSpec
from lowprec.train.step import evaluate, train_step
from lowprec_lab.selfcheck.registry import INFERIOR, NON_INFERIOR, Paired, known_answer


@cache
def corpus() -> TokenData:
    """The built-in corpus (stdlib sources, the default data cache), prepared once per process."""
    return prepare(DataSpec())


@dataclasses.dataclass(frozen=True)
class Setting:
    """One training configuration of a check: ``model`` (a ``LLAMA_CONFIGS`` name) with ``overrides`` of its
    fields, ``steps`` optimizer steps of ``batch`` x ``seq`` tokens, AdamW at ``lr`` (cosine after ``warmup``),
    final validation over ``val_batches`` fixed batches."""

    model: str = "debug"
    steps: int = 40
    batch: int = 8
    seq: int = 64
    lr: float = 3e-3
    warmup: int = 4
    val_batches: int = 4
    overrides: tuple[tuple[str, object], ...] = ()

    def args(self) -> ModelArgs:
        return dataclasses.replace(model_args(self.model), **dict(self.overrides))


def final_val_loss(recipe: str, seed: int, s: Setting, reorder: bool = False) -> float:
    """Final validation loss (nats/token) of ``recipe`` trained under ``s`` with ``seed`` on the built-in corpus.

    ``reorder``: every FP32 matmul of forward and backward sums its contraction in reverse order
    (``ReversedReductionOrder``); the optimizer step and the validation run in the normal order.
    """
    spec = TrainSpec(
        steps=s.steps,
        batch_size=s.batch,
        seq_len=s.seq,
        warmup_steps=s.warmup,
        val_batches=s.val_batches,
        timing_warmup_steps=0,
        telemetry_every=0,
        progress=False,
    )
    hp = OptimHParams(lr=s.lr)
    b = build(CATALOG[recipe], s.args(), spec, hp, seed, torch.device("cpu"), None, "auto")
    data = corpus()
    batches = TokenBatches(data.train, data.val, s.seq, s.batch, seed)
    mode = reversed_reductions(b.optimizer) if reorder else contextlib.nullcontext()
    with mode:
        for i in range(s.steps):
            train_step(b, [batches.train_batch(i)], spec.grad_clip, i)
    return float(evaluate(b, batches.val_batches(spec.val_batches)))


SEEDS = (0, 1, 2)


@cache
def _losses(recipe: str, s: Setting, reorder: bool = False) -> tuple[float, ...]:
    """Final validation losses of ``recipe`` under ``s`` for ``SEEDS`` (cached: checks share their controls)."""
    return tuple(final_val_loss(recipe, seed, s, reorder) for seed in SEEDS)


#: Negative control: ``debug`` widened to dim 64 (every matmul sums at least 64 products) at lr 1e-2, where the
#: trajectories part soonest: at dim 32 or lr 3e-3 the reversed order changed no bit of the 12-step final loss; here
#: it moves it by about one FP32 ulp (1e-7 nats). The 0.2% that reordering moves a 200-step ``tiny`` run is this
#: difference amplified by the chaotic training dynamics.
NEGATIVE = Setting(steps=12, lr=1e-2, overrides=(("dim", 64),))
#: Updates below BF16's resolution: at lr 1e-3 an AdamW step (about lr in size) is below half a BF16 spacing for
#: every weight of magnitude above 0.26 (spacing |w| * 2^-7), among them every RMSNorm weight (1.0, spacing 2^-7).
SMALL_LR = Setting(steps=40, lr=1e-3)
MARGIN = 0.0025  # the report's default: the checks judge at the margin users judge at


@known_answer(
    "negative control: fp32 vs fp32 with reversed FP32 reductions",
    expected=NON_INFERIOR,
    quick=True,
    why="the same mathematics with another FP32 rounding order (every matmul's contraction reversed); "
    "debug at dim 64, lr 1e-2, 12 steps, 3 seeds: the rule must call it non-inferior, never inferior",
)
def negative_control() -> Paired:
    rec, ctl = _losses("fp32", NEGATIVE, True), _losses("fp32", NEGATIVE)
    gap = max(abs(a - b) for a, b in zip(rec, ctl, strict=True))
    return Paired(
        rec,
        ctl,
        MARGIN,
        unit="nats",
        metric="final val loss",
        recipe_label="fp32 reversed",
        control_label="fp32",
        detail=f"largest per-seed gap {gap:.2g} nats (nonzero: the order did change the roundings)",
    )


def _bf16_pair(recipe: str) -> Paired:
    return Paired(
        _losses(recipe, SMALL_LR),
        _losses("bf16", SMALL_LR),
        MARGIN,
        unit="nats",
        metric="final val loss",
        recipe_label=recipe,
        control_label="bf16",
    )


_WHY_LR = (
    "debug, lr 1e-3, 40 steps, 3 seeds: an update of ~lr is below half a BF16 spacing for every weight above 0.26 "
    "in magnitude (all RMSNorm weights), so pure BF16 rounds it away"
)


@known_answer("pure BF16 weights at lr 1e-3 vs bf16 (FP32 weights)", expected=INFERIOR, why=_WHY_LR)
def bf16_pure_small_lr() -> Paired:
    return _bf16_pair("bf16_pure")


@known_answer(
    "BF16 weights + stochastic rounding at lr 1e-3 vs bf16",
    expected=NON_INFERIOR,
    why=_WHY_LR + "; stochastic rounding keeps the update in expectation",
)
def bf16_sr_small_lr() -> Paired:
    return _bf16_pair("bf16_sr")


@known_answer(
    "BF16 weights + FP32 master at lr 1e-3 vs bf16",
    expected=NON_INFERIOR,
    why=_WHY_LR + "; the FP32 master accumulates the update",
)
def bf16_master_small_lr() -> Paired:
    return _bf16_pair("bf16_master")


#: Gradient underflow: the mean cross-entropy over 64 x 128 = 8192 tokens gives each non-target logit a gradient
#: of about p / 8192 ~ 1.5e-8 at init (vocab 8192, p ~ 1/8192), below half FP16's smallest subnormal (6e-8).
FP16_UNDERFLOW = Setting(steps=30, batch=64, seq=128)


def underflow_share(recipe: str, s: Setting, seed: int = 0) -> float:
    """``grad_underflow_share`` (share of gradient elements exactly zero) after the first step of ``recipe``, without
    ``tok_embeddings`` (whose rows of tokens absent from the batch are zero by structure, not by underflow)."""
    spec = TrainSpec(steps=2, batch_size=s.batch, seq_len=s.seq, timing_warmup_steps=0, telemetry_every=0)
    b = build(CATALOG[recipe], s.args(), spec, OptimHParams(lr=s.lr), seed, torch.device("cpu"), None, "auto")
    data = corpus()
    train_step(b, [TokenBatches(data.train, data.val, s.seq, s.batch, seed).train_batch(0)], spec.grad_clip, 0)
    return grad_underflow_share(p for n, p in b.model.named_parameters() if not n.startswith("tok_embeddings"))


@known_answer(
    "FP16 autocast without loss scaling vs fp16_amp, 8192-token batches",
    expected=INFERIOR,
    why="debug, 64 x 128 tokens per step, 30 steps, 3 seeds: logit gradients of ~p/8192 flush to zero in FP16; "
    "fp16_amp's loss scale (65536) keeps them",
)
def fp16_underflow() -> Paired:
    share, scaled = underflow_share("fp16_noscale", FP16_UNDERFLOW), underflow_share("fp16_amp", FP16_UNDERFLOW)
    return Paired(
        _losses("fp16_noscale", FP16_UNDERFLOW),
        _losses("fp16_amp", FP16_UNDERFLOW),
        MARGIN,
        unit="nats",
        metric="final val loss",
        recipe_label="fp16_noscale",
        control_label="fp16_amp",
        detail=f"grad_underflow_share after step 0 (tok_embeddings aside): {100 * share:.2f}% of gradient elements "
        f"(fp16_amp: {100 * scaled:.2f}%)",
    )
