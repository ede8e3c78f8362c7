"""The ``lr`` study: which peak learning rate and warm-up train the control well AND give verdicts their power.

An experiment with a ``grid`` (lowprec_lab/plan/grid.py; ``experiment=lr_sweep``: peak learning rates spanning 8x
and two warm-ups) runs one ablation per point: the control and one real precision change (``fp32`` against the
``bf16`` control) with paired seeds. After each point's report this study reads every ablation of the group from
the store and writes, per point: the control's final validation loss (mean and seed sd), its gap to the sweep's
best point, the control runs that spiked (the stability detector's loss and grad-norm events) or diverged, and the
paired sd of the precision change with the seeds a 0.25% verdict of a zero-gap recipe would need there
(``lowprec_lab.stats.lr_sweep``). It then names the setting a verdict experiment should train: no spiking control
run (loss spikes and divergence; grad-norm spikes are tabulated, ``lowprec_lab.stats.lr_sweep.SweepRow.stable``
says why they do not count), the control within 1% (``study.lr.within``) of the best final loss, and the smallest
paired sd among those.

Settings (``study.lr``): ``pair`` (the compared recipe; default: the first recipe of the ablation that is not the
control), ``within`` (default 0.01). Writes ``lr.md``, ``lr.json`` and ``lr.csv`` beside the report and prints the
table. Every cell comes from MLflow (tags ``grid_point``, ``control``; each run's ``final_val_loss`` and stability).
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

from lowprec.errors import ConfigError
from lowprec_lab.plan.grid import POINT_TAG
from lowprec_lab.plan.preflight import saved_plan
from lowprec_lab.report.markdown import code, md_row, md_rule, text
from lowprec_lab.report.verdict_table import LEVEL
from lowprec_lab.stats.lr_sweep import WITHIN_BEST, SweepRow, rank, sweep_row
from lowprec_lab.studies.outputs import write_study_files
from lowprec_lab.studies.registry import StudyContext, group_ablations, register
from lowprec_lab.tracking.runs import load_runs


@dataclass(frozen=True)
class Settings:
    """``study.lr``: ``pair``: the recipe whose paired sd against the control is tabulated (None: the first other
    recipe of the ablation); ``within``: the chosen point's control must end within this share of the best."""

    pair: str | None = None
    within: float = WITHIN_BEST

    @classmethod
    def from_dict(cls, d: dict) -> Settings:
        """Raises ``ConfigError`` for unknown fields or ``within`` outside (0, 1)."""
        known = {f.name for f in fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise ConfigError(f"study.lr has unknown field(s) {bad}; known: {sorted(known)}")
        s = cls(**d)
        if not (isinstance(s.within, int | float) and 0 < float(s.within) < 1):
            raise ConfigError(f"study.lr.within={s.within!r} must be a share in (0, 1), e.g. 0.01 for 1%")
        return s


def _settings(ctx: StudyContext) -> Settings:
    """``study.lr`` as the ablation ran it: from its first child run's ``config.yaml`` artifact."""
    if not ctx.runs:
        return Settings()
    with tempfile.TemporaryDirectory() as d:
        plan = saved_plan(Path(ctx.tracker.client.download_artifacts(ctx.runs[0].run_id, "config.yaml", d)).read_text())
    return Settings.from_dict(dict(plan.study.get("lr") or {}))


def _point(parent) -> dict:
    """The grid point of an ablation's parent run (tag ``grid_point``); {} for an ablation outside a grid or a tag
    that is not a JSON object (a tag is a record anyone who writes the store can set: read as data)."""
    try:
        point = json.loads(parent.data.tags.get(POINT_TAG, "{}"))
    except ValueError:
        return {}
    return point if isinstance(point, dict) else {}


def sweep_rows(ctx: StudyContext, settings: Settings) -> list[SweepRow]:
    """One ``SweepRow`` per ablation of the group, oldest first, from the store alone."""
    alpha = (1 - LEVEL) / 2
    rows = []
    for _, parent in group_ablations(ctx):
        control = parent.data.tags.get("control", ctx.control)
        runs = load_runs(ctx.tracker, parent.info.run_id)
        # the ablation's own recipe order (its parent's ``recipes`` tag): the first recipe after the control pairs
        names = _recipes(parent) or [r.recipe for r in runs]
        pair = settings.pair or next((n for n in names if n != control), None)
        ctl = [r for r in runs if r.recipe == control]
        finals = {r.seed: _final(r) for r in ctl}
        spikes = {r.seed: _spikes(r) for r in ctl}
        paired = {r.seed: _final(r) for r in runs if r.recipe == pair}
        rows.append(sweep_row(_point(parent), finals, spikes, pair, paired, ctx.margin, alpha))
    return rows


def _recipes(parent) -> list[str]:
    """The ablation's recipes in order (tag ``recipes``, JSON); [] for a tag that is not a list of names."""
    try:
        names = json.loads(parent.data.tags.get("recipes", "[]"))
    except ValueError:
        return []
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def _final(run) -> float | None:
    v = run.metrics.get("final_val_loss") if run.status == "FINISHED" else None
    return float(v) if v is not None and math.isfinite(v) else None


def _spikes(run) -> tuple[int, int, bool]:
    s = run.stability
    if s is None:
        return 0, 0, run.status != "FINISHED"
    return int(s.loss_spikes), int(s.grad_norm_spikes or 0), bool(s.diverged or s.nonfinite_loss)


HEADER = [
    "point",
    "control loss",
    "seed sd",
    "gap to best",
    "spiking runs",
    "loss / grad-norm spikes",
    "pair",
    "paired mean",
    "paired sd",
    "seeds needed",
    "chosen",
]


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{100 * x:+.3f}%" if signed else f"{100 * x:.3f}%"


def _cells(r: SweepRow) -> list[str]:
    point = " ".join(f"{k}={v}" for k, v in r.point.items()) or "(no grid)"
    return [
        code(point),
        "n/a" if r.loss_mean is None else f"{r.loss_mean:.4f}",
        "n/a" if r.loss_sd is None else f"{r.loss_sd:.4f}",
        _pct(r.gap_to_best, signed=True),
        f"{r.spiking_runs}/{r.runs}" + (f" ({r.diverged} diverged)" if r.diverged else ""),
        f"{r.loss_spikes} / {r.grad_spikes}",
        code(r.pair) if r.pair else "n/a",
        _pct(r.paired_mean, signed=True),
        _pct(r.paired_sd),
        "n/a" if r.seeds_needed is None else str(r.seeds_needed),
        "**yes**" if r.chosen else "",
    ]


def _table(rows: list[SweepRow]) -> list[str]:
    return [md_row(HEADER), md_rule(HEADER), *(md_row(_cells(r)) for r in rows)]


def choice_line(chosen: SweepRow | None, rows: list[SweepRow], within: float) -> str:
    """The study's conclusion in one line: the chosen point and why, or why none qualifies."""
    if chosen is not None:
        point = " ".join(f"{k}={v}" for k, v in chosen.point.items())
        return (
            f"Chosen: {code(point)}: no control run had a loss spike, its control ends "
            f"{_pct(chosen.gap_to_best, True)} from the best point (within {within:.0%}), "
            f"paired sd {_pct(chosen.paired_sd)} "
            f"({chosen.seeds_needed if chosen.seeds_needed is not None else 'n/a'} seeds for a zero-gap verdict)."
        )
    stable = [r for r in rows if r.stable]
    if not stable:
        return "No point qualifies: the control had a loss spike or diverged at every point of the grid."
    return (
        f"No point qualifies: every point whose control had no loss spike ends more than {within:.0%} above the "
        "best point; a stabiliser (warm-up, QK-norm, z-loss) must let the best learning rate train without spikes."
    )


def _csv_row(r: SweepRow, keys: list[str]) -> list:
    """One row of ``lr.csv``: the grid point as sorted-key JSON, then ``keys`` of ``SweepRow.as_dict``."""
    d = r.as_dict()
    return [json.dumps(d.pop("point"), sort_keys=True), *(d[k] for k in keys)]


@register("lr", check_settings=lambda d: Settings.from_dict(d))
def lr_study(ctx: StudyContext) -> Path:
    """Write ``lr.md``, ``lr.json`` and ``lr.csv`` beside the report and print the table (module docstring);
    returns the markdown path."""
    settings = _settings(ctx)
    rows, chosen = rank(sweep_rows(ctx, settings), settings.within)
    alpha = (1 - LEVEL) / 2
    lines = [
        f"# Learning-rate study `{ctx.ablation_id}`",
        "",
        f"One ablation per grid point, control {code(ctx.control)}, margin {ctx.margin:.2%}. Control loss: mean "
        "final validation loss over seeds (nats); gap to best: against the lowest mean of the grid; spiking runs: "
        "control runs with a loss or grad-norm spike (the report's stability rule; only loss spikes and divergence "
        "rule a point out); paired sd: sd over seeds of "
        f"(pair - control) / control; seeds needed: for a zero-gap recipe at that paired sd to come out "
        f"`non-inferior` at {ctx.margin:.2%} with power 0.8 (one-sided alpha {alpha:.3g}, before Holm).",
        "",
        *_table(rows),
        "",
        choice_line(chosen, rows, settings.within),
        "",
    ]
    record = {
        "ablation": ctx.ablation_id,
        "control": ctx.control,
        "margin": ctx.margin,
        "within": settings.within,
        "rows": [r.as_dict() for r in rows],
        "chosen": None if chosen is None else chosen.point,
    }
    keys = [k for k in rows[0].as_dict() if k != "point"] if rows else []
    csv_rows = [_csv_row(r, keys) for r in rows]
    path = write_study_files(ctx.out, "lr", lines, record, ["point", *keys], csv_rows, json_default=str)
    print(f"learning-rate study ({len(rows)} points, control {text(ctx.control)}):")
    print("\n".join(_table(rows)))
    print(choice_line(chosen, rows, settings.within))
    print(f"lr study: {path}")
    return path
