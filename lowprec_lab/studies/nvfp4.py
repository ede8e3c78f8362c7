"""The ``nvfp4`` study: NVIDIA's NVFP4 stabiliser ablation (arXiv 2509.25149) reproduced at small scale.

For every ``nvfp4_no_<stabiliser>`` recipe of the ablation it judges the recipe against ``nvfp4`` (does removing
the stabiliser hurt?) with the lab's paired statistics (``lowprec_lab.stats.verdicts``: paired relative
difference of the final validation loss, t-interval at 95%, Holm over the family, non-inferiority at the
ablation's ``report.margin``), sets the main report's verdict against the control (bf16) beside it, quotes the
paper's finding for that stabiliser with its section and says whether this scale agrees (``agreement``). A last
part says what a few-million-parameter model trained for minutes cannot show of effects the paper measured
on a 12B model over 10T tokens.

Section numbers are those of arXiv 2509.25149v1 as lowprec cites them in the recipes (``lowprec/recipes/catalog.py``).
"""

from __future__ import annotations

import math
from pathlib import Path

from lowprec_lab.stats import verdicts
from lowprec_lab.stats.verdict import DIVERGED, INFERIOR, NON_INFERIOR
from lowprec_lab.studies.registry import StudyContext, register

#: removed stabiliser -> (ablation recipe, what it is, the paper's finding with its section)
PAPER: dict[str, tuple[str, str, str]] = {
    "rht": (
        "nvfp4_no_rht",
        "16x16 random Hadamard transform on the weight-gradient GEMM inputs",
        "section 4.2: RHT on the Wgrad inputs spreads block outliers; it improved loss at 12B, where the paper "
        "applies it to Wgrad only (not Fprop/Dgrad), and its benefit grows with model size",
    ),
    "2d": (
        "nvfp4_no_2d",
        "16x16 2-D weight scaling (forward and backward see one quantized weight)",
        "section 4.3: without 2-D weight blocks the forward and backward passes use different quantized weights "
        "(the chain rule is broken); removing it raised the 12B loss",
    ),
    "sr": (
        "nvfp4_no_sr",
        "stochastic rounding of gradients",
        "section 4.4: stochastic rounding of gradients is essential at 12B (round-to-nearest's bias accumulates); "
        "applied to forward tensors it hurts, so only gradients get it",
    ),
    "hp": (
        "nvfp4_no_hp",
        "last transformer block kept in BF16",
        "section 4.1: with every linear in NVFP4 the 12B run diverged; keeping about 16% of the linears (mostly the "
        "last blocks) in BF16 kept it stable",
    ),
}

CANNOT_SHOW = [
    "Token horizon: the paper's divergences and loss gaps grow over 10T tokens (the 12B run needed BF16 layers to "
    "stay stable, and switched to BF16 for the last 18% of tokens to close the remaining gap); these runs see "
    "{tokens} tokens each, where round-to-nearest's bias has not accumulated and nothing diverges.",
    "Outliers: RHT and 2-D scaling act on block outliers of large models' activations, gradients and weights; a "
    "model of a few million parameters trained for minutes has few, so their removal may show no effect here even "
    "when it matters at 12B.",
    "Effect size: the paper's differences are about 1% of the loss; with 2-3 seeds the intervals here are wider "
    "than that, so `inconclusive` is the expected verdict for a real but small effect, never evidence of no effect.",
    "Speed: block-scaled GEMMs are emulated exactly on CPU; no throughput or memory conclusion about Blackwell "
    "tensor cores follows from these runs.",
]


def _final(runs, name: str) -> dict[int, float]:
    out = {}
    for r in runs:
        v = r.metrics.get("final_val_loss")
        if r.recipe == name and r.comparable and v is not None and math.isfinite(v):
            out[r.seed] = v
    return out


def _cell(v) -> str:
    if v is None:
        return "no data"
    e = v.effect
    iv = f" [{e.lo:+.3%}, {e.hi:+.3%}]" if e.lo is not None else ""
    return f"{e.mean:+.3%}{iv} **{v.label}**"


def agreement(v) -> str:
    """How the row at this scale stands against the paper, which found every stabiliser helps (its removal raises
    the loss): from ``v``, the recipe's ``Verdict`` against ``nvfp4`` (None: no paired seed). ``inferior``: agrees;
    ``non-inferior``: disagrees (no harm beyond the margin here); ``inconclusive``: the direction of the mean, not
    resolved, with the seeds the verdict would need; ``diverged``: a run without the stabiliser diverged, as the
    paper's runs did without BF16 layers."""
    if v is None:
        return "no paired seed"
    if v.verdict == DIVERGED:
        return "agrees: a run without it diverged"
    if v.verdict == INFERIOR:
        return "agrees: removing it hurt beyond the margin"
    if v.verdict == NON_INFERIOR:
        return "disagrees: no harm beyond the margin at this scale"
    side = "same direction as the paper" if v.effect.mean > 0 else "opposite direction to the paper"
    need = f"{v.seeds_needed} seeds needed" if v.seeds_needed else "no seed count reaches a verdict"
    return f"{side} ({v.effect.mean:+.3%}), not resolved: {need}"


def _mean_of(runs, name: str, suffix: str) -> float | None:
    vals = [
        v
        for r in runs
        if r.recipe == name and r.comparable
        for k, v in r.metrics.items()
        if k.startswith("mx/") and k.endswith(suffix) and math.isfinite(v)
    ]
    return sum(vals) / len(vals) if vals else None


def _telemetry_lines(ctx: StudyContext) -> list[str]:
    """Block-scale telemetry of the last sampled step (``lowprec.measure.block_telemetry``), mean over linears and
    seeds: the weight-gradient GEMM's SQNR with and without RHT, and the gradients' underflow."""
    rows = []
    for name in ctx.order:
        rht, plain = _mean_of(ctx.runs, name, "/wgrad_sqnr_db_rht"), _mean_of(ctx.runs, name, "/wgrad_sqnr_db_plain")
        under = _mean_of(ctx.runs, name, "/grad_output/elem_underflow")
        sqnr = _mean_of(ctx.runs, name, "/output/sqnr_db")
        if under is None:
            continue

        def f(x, fmt):
            return "" if x is None else format(x, fmt)

        rows.append(f"| `{name}` | {f(sqnr, '.1f')} | {f(plain, '.1f')} | {f(rht, '.1f')} | {f(under, '.2%')} |")
    if not rows:
        return []
    return [
        "",
        "## Block-scale telemetry (last sampled step, mean over linears and seeds)",
        "",
        "| recipe | forward SQNR dB | wgrad SQNR dB, no RHT | wgrad SQNR dB, RHT | gradient elements to zero |",
        "|---|---|---|---|---|",
        *rows,
    ]


@register("nvfp4")
def nvfp4_study(ctx: StudyContext) -> Path:
    """Write ``nvfp4.md`` beside the report (module doc); returns its path."""
    base = _final(ctx.runs, "nvfp4")
    present = {k: v for k, v in PAPER.items() if v[0] in ctx.order}
    results = {}
    for _, (name, _, _) in present.items():
        mine = _final(ctx.runs, name)
        seeds = sorted(set(mine) & set(base))
        if seeds:
            results[name] = ([mine[s] for s in seeds], [base[s] for s in seeds])
    vs_nvfp4 = verdicts(results, ctx.margin, 0.95, "holm", metric="final_val_loss") if results else {}
    vs_control = {row.recipe: row.final for row in ctx.table.rows}
    lines = [
        f"# NVFP4 stabiliser study `{ctx.ablation_id}`",
        "",
        "Each row removes one stabiliser from `nvfp4` (one recipe field). Cells: paired relative difference of the "
        "final validation loss (> 0 = worse), its 95% t-interval and the verdict at margin "
        f"{ctx.margin:.2%} (Holm over the rows); `inferior` against `nvfp4` means the stabiliser helped here.",
        "",
        f"| removed | recipe | vs `nvfp4` | vs `{ctx.control}` | paper (arXiv 2509.25149) | this scale vs the paper |",
        "|---|---|---|---|---|---|",
    ]
    for _, (name, what, finding) in present.items():
        v = vs_nvfp4.get(name)
        lines.append(f"| {what} | `{name}` | {_cell(v)} | {_cell(vs_control.get(name))} | {finding} | {agreement(v)} |")
    for name in ("nvfp4", "mxfp8", "mxfp4"):
        if name in ctx.order and name != ctx.control:
            lines.append(f"| (reference) | `{name}` | | {_cell(vs_control.get(name))} | | |")
    if not present:
        lines.append("| (no nvfp4_no_* recipe in this ablation) | | | | | |")
    lines += _telemetry_lines(ctx)
    tokens = max((r.tokens(ctx.table.steps - 1) for r in ctx.runs), default=0)
    cannot = [c.format(tokens=f"{tokens:,}") for c in CANNOT_SHOW]
    lines += ["", "## What this scale cannot show", ""] + [f"- {c}" for c in cannot] + [""]
    path = ctx.out / "nvfp4.md"
    path.write_text("\n".join(lines))
    return path
