"""The ``noise`` study: the noise floor of the ablation's setting, measured along the run.

The ablation trains the control (``fp32``) and the negative control (``fp32_reordered``: the same mathematics with
every FP32 matmul of the training step summing in reverse order) with the same seeds. At every validation point
this study states the control's seed sd, the paired sd of the negative control against the control and the seeds
a ``non-inferior`` verdict at the report's margin needs there for a recipe whose true gap is 0
(``lowprec_lab.stats.noise``): one set of runs gives the whole curve of seeds-needed against tokens.

At the final point it also tries the estimators of the final loss that need no new runs: the mean of each run's
last k validation points (``study.noise.last_k``). Any other recipe of the ablation (e.g. ``bf16``) gets its own
paired-sd curve against the control and final-point rows: a real numerics change beside the negative control's
floor. When the runs logged ``val_loss_ema`` (``train.eval_ema``: an EMA of the weights, evaluated beside them at every
validation point, the training unchanged bit for bit) the same runs also give the EMA estimator: the negative
control's paired-sd curve of the EMA's validation loss, and final-point rows ``ema`` (and ``<recipe> vs <control>
ema``) beside the plain ones. The other ways to lower the noise change the runs and are separate invocations whose
``noise.json`` the docs compare (docs/noise.md): more validation tokens (``train.val_batches``), a lower peak
learning rate with a longer warm-up (``optim.lr``, ``train.warmup_steps``).

Settings (``study.noise``): ``negative`` (the negative-control recipe, default ``fp32_reordered``), ``last_k``
(default ``[1, 2, 4]``). Writes ``noise.md``, ``noise.json`` and ``noise.csv`` beside the report and prints the
curve.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

from lowprec.errors import ConfigError
from lowprec_lab.plan.plan import Plan
from lowprec_lab.plan.preflight import saved_plan
from lowprec_lab.report.verdict_table import LEVEL
from lowprec_lab.stats.noise import NoisePoint, last_k_point, noise_curve
from lowprec_lab.stats.verdict import POWER
from lowprec_lab.studies.outputs import write_study_files
from lowprec_lab.studies.registry import StudyContext, register


@dataclass(frozen=True)
class Settings:
    """``study.noise``: ``negative``: the negative-control recipe (trained with the control's seeds);
    ``last_k``: the k of the "mean of the last k validation points" rows."""

    negative: str = "fp32_reordered"
    last_k: tuple[int, ...] = (1, 2, 4)

    @classmethod
    def from_dict(cls, d: dict) -> Settings:
        """Raises ``ConfigError`` for unknown fields or a k < 1."""
        known = {f.name for f in fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise ConfigError(f"study.noise has unknown field(s) {bad}; known: {sorted(known)}")
        s = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
        if not s.last_k or any(int(k) < 1 for k in s.last_k):
            raise ConfigError(f"study.noise.last_k={list(s.last_k)} must be a non-empty list of k >= 1")
        return s


def _plan(ctx: StudyContext) -> Plan:
    """The plan the first child run trained under, from its ``config.yaml`` artifact."""
    with tempfile.TemporaryDirectory() as d:
        path = ctx.tracker.client.download_artifacts(ctx.runs[0].run_id, "config.yaml", d)
        return saved_plan(Path(path).read_text())


def _curves(ctx: StudyContext, recipe: str, key: str = "val_loss") -> dict[int, list[tuple[int, float]]]:
    return {
        r.seed: [(s, v) for s, v in r.curves.get(key, []) if math.isfinite(v)]
        for r in ctx.runs
        if r.recipe == recipe and r.comparable
    }


def _pct(x: float | None) -> str:
    """A relative value in percent to 3 significant digits (a paired sd can be 1e-6%)."""
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.3g}%"


def _row(p: NoisePoint, label: str) -> list[str]:
    return [
        label,
        f"{p.tokens:,}",
        str(p.n),
        f"{p.control_mean:.4f}",
        f"{p.control_sd:.4f}",
        _pct(p.control_cv),
        _pct(p.paired_sd),
        _pct(p.mdd),
        "n/a" if p.seeds_needed is None else str(p.seeds_needed),
        "n/a" if p.seeds_needed_unpaired is None else str(p.seeds_needed_unpaired),
    ]


HEADER = [
    "point",
    "tokens",
    "seeds",
    "control loss",
    "control sd",
    "control sd %",
    "paired sd",
    "MDD at these seeds",
    "seeds needed",
    "seeds needed unpaired",
]


def _table(rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER), *("| " + " | ".join(r) + " |" for r in rows)]


def _setup(plan: Plan) -> dict:
    t = plan.train
    return {
        "model": plan.model_name,
        "steps": t.steps,
        "tokens_per_step": t.batch_size * t.grad_accum * t.seq_len,
        "val_every": t.val_every,
        "val_batches": t.val_batches,
        "val_tokens": t.val_batches * t.batch_size * t.seq_len,
        "lr": plan.optim.lr,
        "warmup_steps": t.warmup_steps,
        "device": plan.device,
        "eval_ema": t.eval_ema,
    }


@dataclass(frozen=True)
class _Measured:
    """What the study measured: the negative control's paired-sd ``curve`` against the control, ``others`` (recipe
    -> its curve against the control), ``ema_curve`` (the negative control's curve of ``val_loss_ema``; [] without
    one) and ``final`` (row label -> the final-point estimator)."""

    curve: list[NoisePoint]
    others: dict[str, list[NoisePoint]]
    ema_curve: list[NoisePoint]
    final: dict[str, NoisePoint]


def _measure(ctx: StudyContext, settings: Settings, tps: int, alpha: float) -> _Measured:
    """The curves and final-point estimators of the ablation's runs (module docstring); ``tps``: tokens per step,
    ``alpha``: the one-sided level of the seeds-needed rows."""
    neg, margin = settings.negative, ctx.margin
    ctl, negc = _curves(ctx, ctx.control), _curves(ctx, neg)
    curve = noise_curve(ctl, negc, tps, margin, alpha)
    final = {f"last_{k}": last_k_point(ctl, negc, int(k), tps, margin, alpha) for k in settings.last_k} if curve else {}
    others = {}
    for other in ctx.order:
        # a recipe that really changes the numerics (e.g. bf16), paired with the control the same way: its paired
        # sd along the run and at the final point, beside the negative control's floor
        oc = _curves(ctx, other)
        if other not in (ctx.control, neg) and any(oc.values()) and curve:
            others[other] = noise_curve(ctl, oc, tps, margin, alpha)
            for k in settings.last_k:
                final[f"{other} vs {ctx.control} last {k}"] = last_k_point(ctl, oc, int(k), tps, margin, alpha)
    # the EMA of the weights, when the runs kept one (train.eval_ema): the same runs, another estimator
    ctl_e, neg_e = _curves(ctx, ctx.control, "val_loss_ema"), _curves(ctx, neg, "val_loss_ema")
    ema_curve = noise_curve(ctl_e, neg_e, tps, margin, alpha) if any(ctl_e.values()) and any(neg_e.values()) else []
    if ema_curve:
        final["ema"] = last_k_point(ctl_e, neg_e, 1, tps, margin, alpha)
        for other in others:
            oe = _curves(ctx, other, "val_loss_ema")
            if any(oe.values()):
                final[f"{other} vs {ctx.control} ema"] = last_k_point(ctl_e, oe, 1, tps, margin, alpha)
    return _Measured(curve, others, ema_curve, final)


def _steps(points: list[NoisePoint]) -> list[str]:
    """The table of a curve: one row per validation point."""
    return _table([_row(p, f"step {p.step + 1}") for p in points])


def _finals(m: _Measured) -> list[str]:
    """The table of the final-point estimators."""
    return _table([_row(p, k.replace("_", " ")) for k, p in m.final.items()])


def _markdown(ctx: StudyContext, neg: str, setup: dict, alpha: float, m: _Measured) -> list[str]:
    """The lines of ``noise.md``: the setup, the rule, the curves and the final-point estimators."""
    margin = ctx.margin
    rule = (
        f"seeds needed: a recipe whose true gap is 0, with the negative control's paired sd, gets `non-inferior` at "
        f"margin {margin:.2%} with power {POWER} (one-sided paired t-test at alpha={alpha:.3g}, statsmodels "
        "TTestPower; per comparison, before Holm); unpaired: the same with sd = sqrt(2) x control sd %"
    )
    return [
        f"# Noise floor `{ctx.ablation_id}`",
        "",
        f"Control `{ctx.control}`, negative control `{neg}` (the same mathematics, every FP32 matmul of the "
        "training step summed in reverse order), trained with the same seeds. Setup: "
        + ", ".join(f"{k}={v}" for k, v in setup.items())
        + ".",
        "",
        f"Paired sd: sd over seeds of (negative - control) / control. {rule}.",
        "",
        "## Along the run (one row per validation point)",
        "",
        *_steps(m.curve),
        "",
        *(
            line
            for other, pts in m.others.items()
            for line in (
                f"## `{other}` against `{ctx.control}` along the run (a real numerics change)",
                "",
                *_steps(pts),
                "",
            )
        ),
        *(
            [
                f"## EMA of the weights (train.eval_ema), `{neg}` against `{ctx.control}` along the run",
                "",
                *_steps(m.ema_curve),
                "",
            ]
            if m.ema_curve
            else []
        ),
        "## Estimators of the final loss (same runs)",
        "",
        *_finals(m),
        "",
    ]


def _record(ctx: StudyContext, neg: str, setup: dict, alpha: float, m: _Measured) -> dict:
    """The content of ``noise.json``."""
    return {
        "ablation": ctx.ablation_id,
        "control": ctx.control,
        "negative": neg,
        "margin": ctx.margin,
        "alpha": alpha,
        "power": POWER,
        "setup": setup,
        "curve": [p.as_dict() for p in m.curve],
        "others": {o: [p.as_dict() for p in pts] for o, pts in m.others.items()},
        "ema_curve": [p.as_dict() for p in m.ema_curve],
        "final": {k: p.as_dict() for k, p in m.final.items()},
    }


#: The columns of ``noise.csv``: the row's point (``curve`` or the final estimator's label), then ``NoisePoint``.
_CSV_FIELDS = ["point", *(x.name for x in fields(NoisePoint))]


def _csv_rows(m: _Measured) -> list[list]:
    """The rows of ``noise.csv``: the negative control's curve, then the final-point estimators."""
    pairs = [*(("curve", p) for p in m.curve), *m.final.items()]
    return [[label, *(p.as_dict()[k] for k in _CSV_FIELDS[1:])] for label, p in pairs]


def _print_curves(ctx: StudyContext, neg: str, m: _Measured) -> None:
    """Print the curves and the final-point estimators to stdout."""
    print(f"noise floor ({ctx.control} vs {neg}, margin {ctx.margin:.2%}): seeds needed against tokens")
    print("\n".join(_steps(m.curve)))
    for other, pts in m.others.items():
        print(f"{other} vs {ctx.control} along the run:")
        print("\n".join(_steps(pts)))
    if m.ema_curve:
        print(f"EMA of the weights, {neg} vs {ctx.control} along the run:")
        print("\n".join(_steps(m.ema_curve)))
    print("final-loss estimators (same runs):")
    print("\n".join(_finals(m)))


@register("noise", check_settings=lambda d: Settings.from_dict(d))
def noise_study(ctx: StudyContext) -> Path:
    """Write ``noise.md``, ``noise.json`` and ``noise.csv`` beside the report and print the curve (module
    docstring); returns the markdown path. Raises ``ConfigError`` when the ablation lacks the negative control."""
    plan = _plan(ctx)
    settings = Settings.from_dict(dict(plan.study.get("noise") or {}))
    neg = settings.negative
    if neg not in ctx.order or neg == ctx.control:
        raise ConfigError(
            f"the noise study needs the negative control {neg!r} among the recipes, beside the control "
            f"{ctx.control!r} (recipes={ctx.order})"
        )
    alpha = (1 - LEVEL) / 2
    setup = _setup(plan)
    m = _measure(ctx, settings, setup["tokens_per_step"], alpha)
    lines = _markdown(ctx, neg, setup, alpha, m)
    path = write_study_files(ctx.out, "noise", lines, _record(ctx, neg, setup, alpha, m), _CSV_FIELDS, _csv_rows(m))
    _print_curves(ctx, neg, m)
    print(f"noise study: {path}")
    return path
