"""The verdict table that leads the report: every recipe against the control at ``report.margin``, from MLflow alone.

This module only feeds ``lowprec_lab.stats`` (pure functions over per-seed arrays) with the runs the report read
back from MLflow, formats what they return, and records the verdicts on the ablation's parent run as tags and
metrics, so ``mlflow.search_runs`` finds them:

- tags ``verdict.<recipe>`` (final validation loss) and ``verdict_late.<recipe>`` (mean validation loss over the
  last quarter of training): one of ``lowprec_lab.stats.VERDICTS`` (non-inferior, inferior, inconclusive,
  no-interval, diverged: any judged run of the recipe diverged) or ``no-data`` (no finished run of the recipe paired
  with a finished control run);
  ``verdict_label.<recipe>`` and ``verdict_late_label.<recipe>``: the CONSORT label the table prints (one of
  ``lowprec_lab.stats.LABELS``, e.g. ``non-inferior (worse than control)``);
  ``verdict_status`` (``ok``, ``no-control``: no finished control run, ``nothing-to-compare``: only the control
  ran), ``verdict_reason`` (when not ok), ``verdict_control``, ``verdict_rule`` (the rule every row was judged by:
  under ``seeds=auto`` the rule common to all looks, each row's level in ``verdict_level.<recipe>``);
- metrics ``verdict/effect.<recipe>``, ``verdict/lo.<recipe>``, ``verdict/hi.<recipe>`` (relative differences:
  0.01 = 1% worse), ``verdict/seeds.<recipe>``, ``verdict/mdd.<recipe>``, ``verdict/seeds_needed.<recipe>``, the
  same under ``verdict_late/`` for the last quarter, ``ratio/throughput.<recipe>``, ``ratio/state_memory.<recipe>``,
  ``ratio/peak_memory.<recipe>``, and ``verdict/margin``, ``noise/control_sd``, ``noise/control_rel_sd``,
  ``noise/min_margin``;
- stability (``lowprec_lab.stats.stability``): tag ``stability.<recipe>`` (one of
  ``lowprec_lab.stats.stability.STABILITY_VERDICTS``: ``less stable``, ``as stable``, ``diverged``, ``no test
  possible``; or ``no-data``), metrics ``stability/loss_spikes.<recipe>`` and
  ``stability/grad_norm_spikes.<recipe>`` (mean spikes per judged run), ``stability/diverged.<recipe>`` (diverged
  runs) and ``stability/runs.<recipe>`` (judged runs), the control's included;
- predicted by ``lowprec estimate``: tag ``predicted_hardware``, metrics ``predicted/throughput_ratio.<recipe>`` and
  ``predicted/memory_ratio.<recipe>`` (recipe over control).

The metric keys are grouped by their part before ``/``, as MLflow's chart and compare views group them: one
section per quantity, one line per recipe.
MLflow keys may hold alphanumerics, ``_ - . / :`` and spaces; catalog recipe names are ``[a-z0-9_]``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from lowprec_lab.report import markdown
from lowprec_lab.stats import SeedDecision, StabilityMetrics, StabilityVerdict, Verdict, stability_verdict, verdicts
from lowprec_lab.stats.auto_seeds import AutoSeeds
from lowprec_lab.stats.order import TestingOrder
from lowprec_lab.stats.paired import smallest_sign_flip_p
from lowprec_lab.stats.stability import AS_STABLE
from lowprec_lab.stats.verdict import DIVERGED, INFERIOR, LEVEL, NON_INFERIOR, POWER, mark_diverged, rule_text
from lowprec_lab.tracking.tracker import MetricBuffer, Tracker

#: A run's validation points after this share of the optimizer steps make its "last quarter".
LATE_FROM = 0.75
NO_DATA = "no-data"


@dataclass(frozen=True)
class Prediction:
    """What ``lowprec estimate`` predicts for one recipe of the ablation on ``hardware``: ``tokens_per_s`` per GPU
    (None where it cannot predict, e.g. FP8 on a part without FP8) and ``total_bytes`` per GPU (None likewise)."""

    hardware: str
    tokens_per_s: float | None
    total_bytes: float | None


@dataclass(frozen=True)
class StabilityRow:
    """One recipe's judged runs (``judged_stability``): how many, mean loss and grad-norm spikes per run (None
    without runs, or grad norm when a run has no grad-norm series), and how many diverged."""

    runs: int
    loss_spikes: float | None
    grad_norm_spikes: float | None
    diverged: int

    @classmethod
    def of(cls, ms: list[StabilityMetrics]) -> StabilityRow:
        grads = [m.grad_norm_spikes for m in ms]
        return cls(
            runs=len(ms),
            loss_spikes=statistics.fmean(m.loss_spikes for m in ms) if ms else None,
            grad_norm_spikes=statistics.fmean(grads) if ms and None not in grads else None,
            diverged=sum(m.diverged for m in ms),
        )


@dataclass(frozen=True)
class RecipeRow:
    """One recipe against the control. ``paired``: the seeds where both it and the control have a finished,
    comparable run; ``final``/``late``: their verdicts (None without a paired seed, or ``late`` when the column is
    absent); ratios: means over finished runs, recipe over control (None when either has none); ``stability``: its
    judged runs and ``stability_verdict`` against the control's (None when either has no judged run);
    ``predicted_*_ratio``: ``lowprec estimate``'s tokens/s and total bytes per GPU, recipe over control."""

    recipe: str
    runs: int
    finished: int
    paired: tuple[int, ...]
    final: Verdict | None
    late: Verdict | None
    throughput_ratio: float | None
    state_ratio: float | None
    peak_ratio: float | None
    stability: StabilityRow = StabilityRow(0, None, None, 0)
    stability_verdict: StabilityVerdict | None = None
    predicted_throughput_ratio: float | None = None
    predicted_memory_ratio: float | None = None
    #: seeds=auto: why the recipe stopped getting seeds (its verdict is the one of that look)
    auto: SeedDecision | None = None


@dataclass(frozen=True)
class VerdictTable:
    """Everything the verdict section prints and the parent run records.

    ``no_verdict``: why no verdict is possible (None when verdicts exist). ``late_reason``: why the last-quarter
    column is absent (None when present); ``late_points``: validation points per run in the last quarter.
    ``control_values``: the control's final validation losses by seed (finished runs). ``control_stability``: the
    control's judged runs; ``stability_rules``: the spike rules the judged runs were scanned with.
    ``predicted_hardware``/``predicted_setup``: what the predicted ratios assume (setup: or why there are none).
    """

    control: str
    margin: float
    level: float
    steps: int
    rows: list[RecipeRow]
    control_runs: int
    control_values: dict[int, float]
    no_verdict: str | None
    late_reason: str | None
    late_points: int
    control_failures: tuple[str, ...] = ()
    control_stability: StabilityRow = StabilityRow(0, None, None, 0)
    stability_rules: tuple[str, ...] = ()
    predicted_hardware: str | None = None
    predicted_setup: str | None = None
    #: seeds=auto: one line on the procedure (None for a fixed seed count)
    auto_note: str | None = None
    #: seeds=auto: the final analysis' one-sided alpha, at which MDD and seeds needed are stated (else None)
    auto_final_alpha: float | None = None
    #: seeds=auto: (seeds, recipes in its Holm families) of every look taken
    auto_holm: tuple[tuple[int, int], ...] = ()
    #: ``controls=true``: (negative, positive) control recipes, rows of the table like any other; None: no controls
    controls: tuple[str, str] | None = None
    #: the order the comparisons were tested in (controls, ``report.primary``, the rest); None: one Holm family
    order: TestingOrder | None = None

    def role(self, recipe: str) -> str | None:
        """``negative control`` / ``positive control`` for a control recipe of the ablation, else None."""
        if self.controls is None:
            return None
        return {self.controls[0]: "negative control", self.controls[1]: "positive control"}.get(recipe)

    @property
    def control_sd(self) -> float | None:
        """Seed-to-seed standard deviation (ddof=1) of the control's final validation loss, nats."""
        vals = list(self.control_values.values())
        return statistics.stdev(vals) if len(vals) > 1 else None

    @property
    def min_mdd(self) -> tuple[float, str] | None:
        """The smallest minimum detectable difference over the recipes (final val loss) and its recipe."""
        mdds = [(r.final.mdd, r.recipe) for r in self.rows if r.final and r.final.mdd is not None]
        return min(mdds) if mdds else None


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


def late_val_loss(curve: list[tuple[int, float]], steps: int) -> tuple[float | None, int]:
    """Mean of the validation losses measured in the last quarter of ``steps`` optimizer steps (after step ``t``
    with ``t + 1 > 0.75 * steps``) and how many there were; None unless at least two: with one point the mean is
    the final validation loss, which the table already judges."""
    pts = [v for s, v in curve if s + 1 > LATE_FROM * steps]
    if len(pts) < 2 or not all(math.isfinite(v) for v in pts):
        return None, len(pts)
    return statistics.fmean(pts), len(pts)


def _ratio(runs, control_runs, key: str) -> float | None:
    num = [r.metrics[key] for r in runs if _finite(r.metrics.get(key))]
    den = [r.metrics[key] for r in control_runs if _finite(r.metrics.get(key))]
    if not num or not den or statistics.fmean(den) == 0:
        return None
    return statistics.fmean(num) / statistics.fmean(den)


def _paired(runs, control: str, name: str, value: Callable) -> dict[int, tuple[float, float]]:
    """``{seed: (recipe value, control value)}`` over the seeds where both runs are comparable and finite."""
    ctrl = {r.seed: value(r) for r in runs if r.recipe == control and r.comparable}
    out = {}
    for r in runs:
        if r.recipe == name and r.comparable and _finite(value(r)) and _finite(ctrl.get(r.seed)):
            out[r.seed] = (value(r), ctrl[r.seed])
    return dict(sorted(out.items()))


def _verdicts(
    pairs: dict[str, dict[int, tuple[float, float]]], margin: float, metric: str, order: TestingOrder | None = None
) -> dict[str, Verdict]:
    results = {
        name: ([p[0] for p in by_seed.values()], [p[1] for p in by_seed.values()])
        for name, by_seed in pairs.items()
        if by_seed
    }
    return verdicts(results, margin, LEVEL, "holm", metric=metric, order=order) if results else {}


def _late_at_looks(
    late_pairs: dict[str, dict[int, tuple[float, float]]], auto: AutoSeeds, margin: float
) -> dict[str, Verdict]:
    """Under ``seeds=auto``: each recipe's last-quarter verdict on the seeds of the look where it stopped, at that
    look's level, Holm over the recipes running at that look, as its final-loss verdict (a fixed 95% on seeds chosen
    adaptively would not keep the 2.5% error rate)."""
    out: dict[str, Verdict] = {}
    for lk in auto.looks:  # a later look overwrites: each recipe ends with the verdict of its last look
        seeds = set(auto.seeds[: lk.n])
        pairs = {n: {s: p for s, p in late_pairs.get(n, {}).items() if s in seeds} for n in lk.decisions}
        results = {n: ([p[0] for p in by.values()], [p[1] for p in by.values()]) for n, by in pairs.items() if by}
        if results:
            out.update(verdicts(results, margin, lk.level, "holm", metric="late_val_loss"))
    return out


def judged_stability(r) -> StabilityMetrics | None:
    """The run's ``StabilityMetrics`` as the stability verdict counts it, or None when the run is left out.

    Counted: finished comparable runs, and FAILED runs stopped by a non-finite value (a ``NonFiniteError``, or
    metrics with a non-finite loss or grad norm) or whose metrics say diverged; such a failure counts as a
    divergence at its last step even when the loss series alone would not show one (a NaN grad norm stops the run
    as surely). Runs that crashed for another reason, were killed or ran another effective recipe are left out.
    """
    m = r.stability
    if m is None or (not r.comparable and r.status != "FAILED"):
        return None
    if r.comparable or m.diverged:
        return m
    nonfinite = r.reason.startswith("NonFiniteError") or m.nonfinite_loss > 0 or (m.nonfinite_grad_norm or 0) > 0
    return replace(m, divergence_step=max(m.steps - 1, 0)) if nonfinite else None


def _stability(runs, name: str) -> list[StabilityMetrics]:
    return [m for r in runs if r.recipe == name and (m := judged_stability(r)) is not None]


def _predicted_ratio(predicted: dict[str, Prediction], name: str, control: str, key: str) -> float | None:
    num, den = getattr(predicted.get(name), key, None), getattr(predicted.get(control), key, None)
    return num / den if _finite(num) and _finite(den) and den else None


def build_table(
    runs,
    order: list[str],
    control: str,
    margin: float,
    steps: int,
    predicted: dict[str, Prediction] | None = None,
    predicted_setup: str | None = None,
    auto: AutoSeeds | None = None,
    controls: tuple[str, str] | None = None,
    primary: tuple[str, ...] = (),
) -> VerdictTable:
    """The verdicts of every recipe of ``order`` (but the control) against ``control`` from the report's
    ``RunData``: final validation loss, and the mean over the last quarter of the ``steps`` optimizer steps where
    the validation history holds at least two points there. Holm across the recipes (``lowprec_lab.stats``).
    Stability: ``stability_verdict`` of each recipe's judged runs (``judged_stability``) against the control's.
    ``predicted``: ``{recipe: Prediction}`` for the predicted ratio columns, ``predicted_setup`` what they assume.
    ``auto``: the replayed ``seeds=auto`` procedure (``lowprec_lab.stats.auto_seeds``); each recipe's final-loss verdict
    is then the one of the look where it stopped (Holm at that look's level), not a fixed-n 95% verdict.
    ``controls``: ``(negative, positive)`` control recipes (``controls=true``): rows of ``order`` judged by the same
    rule as every recipe, tested first and each alone; ``primary``: ``report.primary``, tested next; the other
    recipes last, each stage only where the earlier ones were rejected (``lowprec_lab.stats.order``). Under
    ``seeds=auto`` each look is one Holm family (its looks stop recipes one at a time), so no order applies."""
    predicted = predicted or {}
    ctrl_runs = sorted((r for r in runs if r.recipe == control), key=lambda r: r.seed)
    ctrl_ok = [r for r in ctrl_runs if r.comparable and _finite(r.metrics.get("final_val_loss"))]
    names = [n for n in order if n != control]
    late_of = {r.run_id: late_val_loss(r.curves.get("val_loss", []), steps) for r in runs}
    points, late_reason = _late_points(runs, late_of, steps)
    final_pairs = {n: _paired(runs, control, n, lambda r: r.metrics.get("final_val_loss")) for n in names}
    order_ = None
    if auto is None and (controls is not None or primary):
        order_ = TestingOrder(*(controls or (None, None)), primary=tuple(primary))
    final_v = _verdicts(final_pairs, margin, "final_val_loss", order_)
    if auto is not None:
        final_v.update({n: v for n, (v, _) in auto.final.items()})
    late_v: dict[str, Verdict] = {}
    if late_reason is None:
        late_pairs = {n: _paired(runs, control, n, lambda r: late_of[r.run_id][0]) for n in names}
        late_v = (
            _verdicts(late_pairs, margin, "late_val_loss", order_)
            if auto is None
            else _late_at_looks(late_pairs, auto, margin)
        )
    ctrl_stab = _stability(runs, control)
    rows = []
    for n in names:
        fin = [r for r in runs if r.recipe == n and r.comparable]
        stab = _stability(runs, n)
        srow = StabilityRow.of(stab)
        fv, lv = final_v.get(n), late_v.get(n)
        if srow.diverged:  # a diverged run decides the row, whatever its finished seeds show
            fv = mark_diverged(fv, srow.diverged, srow.runs) if fv else None
            lv = mark_diverged(lv, srow.diverged, srow.runs) if lv else None
        rows.append(
            RecipeRow(
                recipe=n,
                runs=sum(r.recipe == n for r in runs),
                finished=len(fin),
                paired=tuple(final_pairs[n]),
                final=fv,
                late=lv,
                throughput_ratio=_ratio(fin, ctrl_ok, "mean_tokens_per_s"),
                state_ratio=_ratio(fin, ctrl_ok, "state_bytes_per_param"),
                peak_ratio=_ratio(fin, ctrl_ok, "mem_peak_bytes"),
                stability=srow,
                stability_verdict=stability_verdict(stab, ctrl_stab) if stab and ctrl_stab else None,
                predicted_throughput_ratio=_predicted_ratio(predicted, n, control, "tokens_per_s"),
                predicted_memory_ratio=_predicted_ratio(predicted, n, control, "total_bytes"),
                auto=auto.final[n][1] if auto is not None and n in auto.final else None,
            )
        )
    judged = [r for r in runs if judged_stability(r) is not None]
    return VerdictTable(
        control=control,
        margin=margin,
        level=LEVEL,
        steps=steps,
        rows=rows,
        control_runs=len(ctrl_runs),
        control_values={r.seed: r.metrics["final_val_loss"] for r in ctrl_ok},
        no_verdict=_no_verdict(ctrl_runs, ctrl_ok, names, control),
        late_reason=late_reason,
        late_points=points,
        control_failures=_control_failures(ctrl_runs),
        control_stability=StabilityRow.of(ctrl_stab),
        stability_rules=tuple(sorted({r.stability_rule for r in judged if r.stability_rule})),
        predicted_hardware=next((p.hardware for p in predicted.values()), None),
        predicted_setup=predicted_setup,
        auto_note=_auto_note(auto) if auto is not None else None,
        auto_final_alpha=auto.final_alpha if auto is not None else None,
        auto_holm=tuple((lk.n, _tested(lk.verdicts)) for lk in auto.looks) if auto is not None else (),
        controls=controls,
        order=order_,
    )


def _no_verdict(ctrl_runs: list, ctrl_ok: list, names: list[str], control: str) -> str | None:
    """Why the table has no verdict at all (no control run, none comparable, nothing to compare), or None."""
    if not ctrl_runs:
        return f"the control {markdown.code(control)} has no run in this ablation"
    if not ctrl_ok:
        return f"every run of the control {markdown.code(control)} failed, so no recipe has a seed to pair with"
    if not names:
        return f"only the control {markdown.code(control)} ran: there is nothing to compare"
    return None


def _control_failures(ctrl_runs: list) -> tuple[str, ...]:
    """One escaped line per control run that cannot be paired: its seed and why."""
    return tuple(
        f"seed {r.seed}: "
        + markdown.text(r.reason or ("effective recipe did not match" if r.status == "FINISHED" else r.status))
        for r in ctrl_runs
        if not r.comparable
    )


def _late_points(runs: list, late_of: dict, steps: int) -> tuple[int, str | None]:
    """The most validation points any comparable run has in the last quarter of ``steps``, and why the late-loss
    column is left out (None: it is there): no per-step history, or too few late points to differ from the final."""
    ok = [r for r in runs if r.comparable]
    points = max((late_of[r.run_id][1] for r in ok), default=0)
    if not any(r.curves.get("val_loss") for r in ok):
        return points, "no run has a per-step `val_loss` history in MLflow"
    if not any(late_of[r.run_id][0] is not None for r in ok):
        return points, (
            f"only {points} validation point(s) per run fall in the last quarter of the {steps} steps (after step "
            f"{math.floor(LATE_FROM * steps)}), so its mean would repeat the final validation loss; validate more "
            "often (`train.val_every`) to get it"
        )
    return points, None


def _tested(vs: dict[str, Verdict]) -> int:
    """The recipes in the Holm families of one ``verdicts`` call (0 for none)."""
    return next((v.n_tests for v in vs.values()), 0)


def _auto_note(auto: AutoSeeds) -> str:
    """The note under the verdict table on the ``seeds=auto`` procedure (template ``auto_seeds_note.md.j2``)."""
    return markdown.render("auto_seeds_note.md.j2", auto=auto).removesuffix("\n")


# --- markdown ---------------------------------------------------------------------------------------------------


_pct = markdown.pct


def shown_name(t: VerdictTable, recipe: str) -> str:
    """The recipe as the tables print it: its code span, with its role after it for a control recipe
    (```bf16_reordered` (negative control)``)."""
    role = t.role(recipe)
    return markdown.code(recipe) + (f" ({role})" if role else "")


#: What each control must come out as for the experiment to have shown it could see the margin.
EXPECTED = {"negative control": NON_INFERIOR, "positive control": INFERIOR}


def controls_line(t: VerdictTable) -> str:
    """The report's first line: whether the controls came out as they must (negative ``non-inferior``, positive
    ``inferior``, by the same rule as every recipe); when one did not, the experiment could not tell at the margin
    and its verdicts are not evidence. Without controls: says so, and that ``controls=true`` adds them."""
    margin = f"{100 * t.margin:.3g}%"
    if t.controls is None:
        return (
            f"This experiment ran without controls: nothing shows it could see a difference of the {margin} margin "
            "(`controls=true` adds a negative and a positive control)."
        )
    rows = {r.recipe: r for r in t.rows}
    failed, passed = [], []
    for name in t.controls:
        role = t.role(name)
        row = rows.get(name)
        v = row.final if row is not None else None
        if v is None:
            got = NO_DATA if row is None or not _is_diverged(row) else DIVERGED
            failed.append(f"the {role} {markdown.code(name)} has no verdict ({got})")
            continue
        what = f"{v.label} ({_effect_cell(v)})"
        (passed if v.verdict == EXPECTED[role] else failed).append(f"the {role} {markdown.code(name)} came out {what}")
    if failed:
        return (
            f"**This experiment could not tell at the {margin} margin**: {' and '.join(failed)}; its verdicts are "
            "not evidence."
        )
    return f"**Controls passed at the {margin} margin**: {' and '.join(passed)}."


def _level(level: float) -> str:
    """A confidence level as a percentage with the digits that tell the looks apart (99.95%, 98.6%, 95%)."""
    return f"{100 * level:.4g}%"


def _bound(x: float, margin: float) -> str:
    """A relative difference as a signed percentage (``markdown.pct``: 3 decimals), with more decimals where 3 would
    print it equal to 0 or to the margin though it is not (``-0.0004%`` is no ``-0.000%``, ``+0.24996%`` no
    ``+0.250%``); a value within 1e-11 of either, but not on it, gets a ``<`` or ``>`` before it instead."""
    for digits in range(3, 10):
        shown = round(100 * x, digits)
        if all(x == b or shown != round(100 * b, digits) for b in (0.0, margin)):
            return f"{100 * x:+.{digits}f}%"
    near = min((0.0, margin), key=lambda b: abs(x - b))
    return f"{'<' if x < near else '>'}{100 * near:+.3f}%"


def _effect_cell(v: Verdict | None, with_level: bool = False) -> str:
    """The mean and interval; ``with_level`` (seeds=auto, where rows differ) appends the interval's level."""
    if v is None:
        return "n/a (no paired seed)"
    e, m = v.effect, v.margin
    if not e.has_interval:
        return f"{_bound(e.mean, m)}, no interval (1 seed)"
    level = f" ({_level(v.level)} CI)" if with_level else ""
    return f"{_bound(e.mean, m)} [{_bound(e.lo, m)}, {_bound(e.hi, m)}]{level}"


def _verdict_cell(v: Verdict | None, stab: StabilityRow | None = None) -> str:
    """The verdict as printed: its label, what Holm changed, and for a diverged recipe what its finished seeds alone
    showed (``stab``: its judged runs, for a recipe without a paired seed that diverged)."""
    if v is None:
        if stab is not None and stab.diverged:
            return f"**{DIVERGED}** ({stab.diverged}/{stab.runs} runs; no finished seed to pair)"
        return NO_DATA
    if v.verdict == DIVERGED:
        return (
            f"**{DIVERGED}** ({v.diverged_runs}/{v.judged_runs} runs; the {v.effect.n} paired seed(s) alone: "
            f"{v.label_finished})"
        )
    if v.untested:  # an earlier stage of the testing order kept this comparison from being tested
        return f"**{v.label}** (CI alone: {v.label_unadjusted}; not tested: {v.untested})"
    if v.verdict != v.verdict_unadjusted or v.label != v.label_unadjusted:  # say what Holm changed, never hide it
        return f"**{v.label}** (CI alone: {v.label_unadjusted}; Holm does not confirm)"
    return f"**{v.label}**"


def _seeds_cell(row: RecipeRow) -> str:
    n = len(row.paired)
    if row.auto is not None:
        # the seeds behind the row's interval (those of the look where it stopped at this margin), not every
        # paired seed the ablation trained: a report re-judged at another margin can stop at an earlier look
        n = row.final.effect.n if row.final is not None else n
        why = {"conclusive": "conclusive", "max_seeds": "max_seeds reached"}.get(row.auto.reason, "still open")
        unused = len(row.paired) - n
        later = f"; {unused} later paired seed(s) unused at this margin" if unused > 0 else ""
        return f"{n} of {row.runs} (auto: {why}{later})" if n != row.runs else f"{n} (auto: {why})"
    if n == row.runs:
        return str(n)
    failed = row.runs - row.finished
    why = f"{failed} failed" if failed else "control failed on the others"
    return f"{n} of {row.runs} ({why})"


def _ratio_cell(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def _spikes_cell(s: StabilityRow) -> str:
    if not s.runs:
        return "n/a"
    grad = "n/a" if s.grad_norm_spikes is None else f"{s.grad_norm_spikes:.1f}"
    return f"{s.loss_spikes:.1f} / {grad}"


def _diverged_cell(s: StabilityRow) -> str:
    return f"{s.diverged}/{s.runs}" if s.runs else "n/a"


def _stability_cell(v: StabilityVerdict | None) -> str:
    if v is None:
        return NO_DATA
    return f"**{v.verdict}**" + (f" ({v.reason})" if v.verdict != AS_STABLE else "")


def _throughput_cell(x: float | None, contended: int) -> str:
    """The measured throughput ratio, marked beside the number when ``contended`` > 1 runs trained at a time: each
    run's tokens/s was then measured under the others' load (two workers on 2 CPU cores: fp32 read 7.94x)."""
    if x is None or contended <= 1:
        return _ratio_cell(x)
    return f"{_ratio_cell(x)} (contended: {contended} runs at a time)"


def _row(row: RecipeRow, with_late: bool, auto: bool = False, contended: int = 1, name: str | None = None) -> list[str]:
    """The cells of a recipe's row of the verdict table (``name``: the recipe as shown, ``shown_name``)."""
    v = row.final
    mdd = "n/a" if v is None or v.mdd is None else f"{100 * v.mdd:.3f}%"
    needed = "n/a" if v is None or v.seeds_needed is None else str(v.seeds_needed)
    cells = [
        name or markdown.code(row.recipe),
        _seeds_cell(row),
        _effect_cell(v, auto),
        _verdict_cell(v, row.stability),
    ]
    if with_late:
        cells += [_effect_cell(row.late, auto), _verdict_cell(row.late, row.stability)]
    cells += [_spikes_cell(row.stability), _diverged_cell(row.stability), _stability_cell(row.stability_verdict)]
    memory = f"{_ratio_cell(row.state_ratio)} ({_ratio_cell(row.peak_ratio)})"
    cells += [mdd, needed, _throughput_cell(row.throughput_ratio, contended), memory]
    return [*cells, _ratio_cell(row.predicted_throughput_ratio), _ratio_cell(row.predicted_memory_ratio)]


def _columns(with_late: bool, hardware: str | None, level: float, auto: bool = False) -> list[str]:
    ci = "[CI at the row's look level]" if auto else f"[{_level(level)} CI]"
    cols = ["recipe", "seeds", f"final val loss vs control {ci}", "verdict"]
    if with_late:
        cols += [f"last-quarter val loss vs control {ci}", "verdict (last quarter)"]
    cols += ["spikes per run: loss / grad norm", "diverged", "stability vs control"]
    cols += ["MDD (final)", "seeds needed (final)", "throughput ratio (measured)", "memory ratio: state (peak)"]
    on = hardware or "GPU"
    return cols + [f"predicted throughput ratio ({on})", f"predicted memory ratio ({on})"]


def _control_row(t: VerdictTable, with_late: bool) -> list[str]:
    """The cells of the control's row of the verdict table."""
    n = len(t.control_values)
    seeds = str(n) if n == t.control_runs else f"{n} of {t.control_runs} ({t.control_runs - n} failed)"
    cells = [markdown.code(t.control), seeds, "control", "control"]
    if with_late:
        cells += ["control", "control"]
    stab = t.control_stability
    cells += [_spikes_cell(stab), _diverged_cell(stab), "control", "", "", "1.00x", "1.00x (1.00x)"]
    predicted = "1.00x" if t.predicted_hardware else "n/a"
    return [*cells, predicted, predicted]


def verdict_section(
    t: VerdictTable,
    on_cpu: bool,
    finished_runs: list | None = None,
    contended: int = 1,
    forest: str | None = None,
    warmup: int | None = None,
) -> list[str]:
    """The report's first section. With verdicts: the one-line summary (``summary_line``), the advice to add seeds
    (``add_seeds_line``), the forest plot (``forest``: its file name in the report folder, drawn from
    ``forest_rows``; None: none), the compact verdict table (five columns that fit a 1280 px screen), then the full
    table with its rules and the noise floor. Without: why no verdict is possible, followed by every finished
    run's numbers. ``finished_runs``: the report's comparable runs (their anomaly events can be the summary's
    cause); ``contended``: how many runs trained at a time (the parent's ``workers``); above 1 each measured
    throughput ratio says so beside the number; ``warmup``: the runs' ``train.warmup_steps`` (the summary puts
    anomaly steps beside it), None when unknown. Its text: templates ``verdicts.md.j2``, ``verdict_notes.md.j2``
    and ``noise_floor.md.j2``."""
    if t.no_verdict:
        head, rows = _runs_table(finished_runs or [])
        return markdown.lines(
            "verdicts.md.j2",
            t=t,
            runs_head=head,
            runs_rows=rows,
            diverged=_diverged_line(t),
            controls=controls_line(t),
        )
    with_late = t.late_reason is None
    auto = t.auto_note is not None
    sd = t.control_sd
    best = t.min_mdd
    verdicts_ = [(r.recipe, v) for r in t.rows for v in (r.final, r.late) if v]
    return markdown.lines(
        "verdicts.md.j2",
        t=t,
        diverged=None,
        controls=controls_line(t),
        summary=summary_line(t, finished_runs or [], warmup),
        advice=add_seeds_line(t),
        forest=forest,
        compact_cols=_compact_columns(t.level, auto),
        compact_rows=[_compact_row(r, auto, shown_name(t, r.recipe)) for r in t.rows],
        resolution_cols=RESOLUTION_COLUMNS,
        resolution_rows=[_resolution_row(r, shown_name(t, r.recipe)) for r in t.rows],
        cols=_columns(with_late, t.predicted_hardware, t.level, auto),
        control=_control_row(t, with_late),
        rows=[_row(r, with_late, auto, contended, shown_name(t, r.recipe)) for r in t.rows],
        on_cpu=on_cpu,
        auto=auto,
        rule=_rule(t),
        tested=_tested({r.recipe: r.final for r in t.rows if r.final}),
        order_text=t.order.text() if t.order is not None else None,
        holm_looks=", ".join(f"{k} recipe(s) at {n} seeds" for n, k in t.auto_holm),
        alpha=(1 - t.level) / 2,
        late_from=math.floor(LATE_FROM * t.steps),
        power=POWER,
        disagreements=[(name, v) for name, v in verdicts_ if v.effect.disagree],
        perm_disagreements=[(name, v, _perm_line(v)) for name, v in verdicts_ if v.perm_disagrees],
        perm_min_seeds=next(n for n in range(2, 64) if smallest_sign_flip_p(n) <= (1 - t.level) / 2),
        # the noise floor: the control's seed-to-seed sd and the smallest margin it resolves
        n=len(t.control_values),
        sd=sd,
        mean=statistics.fmean(t.control_values.values()) if sd is not None else None,
        best=best,
        mdds=[r.final.mdd for r in t.rows if r.final and r.final.mdd is not None],
    )


def _rule(t: VerdictTable) -> str | None:
    """The rule every row was judged by: the rows' own (one ``verdicts`` call) or, under ``seeds=auto``, where each
    row has its look's level and Holm family, the rule common to every look; None without a verdict."""
    rule = next((r.final.rule for r in t.rows if r.final), None)
    if t.auto_note is not None and rule is not None:
        return rule_text(t.margin, None, "holm", None)
    return rule


def _diverged_names(t: VerdictTable) -> str | None:
    """```name` in k of n run(s)`` for each recipe (and the control) with a diverged run, or None when none."""
    names = [(r.recipe, r.stability) for r in t.rows if r.stability.diverged]
    if t.control_stability.diverged:
        names.append((t.control, t.control_stability))
    if not names:
        return None
    return ", ".join(f"{markdown.code(n)} in {s.diverged} of {s.runs} run(s)" for n, s in names)


def _diverged_line(t: VerdictTable) -> str | None:
    """The verdict section's first line when any run diverged (the recipe's and the control's), else None."""
    which = _diverged_names(t)
    if which is None:
        return None
    return (
        f"**Diverged: {which}.** A recipe with a diverged run is reported `diverged`, whatever its finished seeds "
        "and the stability test over runs say."
    )


# --- the first screen: summary, advice, forest plot, compact table -----------------------------------------------

CONCLUSIVE = (NON_INFERIOR, INFERIOR)


def _is_diverged(row: RecipeRow) -> bool:
    return (row.final is not None and row.final.verdict == DIVERGED) or (row.final is None and row.stability.diverged)


def _open_rows(t: VerdictTable) -> list[RecipeRow]:
    """The recipes without a conclusive verdict that did not diverge (inconclusive, no interval, no paired seed)."""
    return [r for r in t.rows if not _is_diverged(r) and (r.final is None or r.final.verdict not in CONCLUSIVE)]


def _span(xs: list[float], fmt: Callable[[float], str]) -> str:
    """``fmt`` of the one value, or ``lo-hi`` of several (``7-48``, ``0.21-0.35``)."""
    lo, hi = fmt(min(xs)), fmt(max(xs))
    return lo if lo == hi else f"{lo}-{hi}"


def _pct_span(xs: list[float]) -> str:
    return _span([100 * x for x in xs], lambda x: f"{x:.3g}") + "%"


def _seeds_needed_text(t: VerdictTable) -> str | None:
    """``7-48 seeds needed (3 ran)`` over the open recipes that have a seeds-needed figure; None when none has."""
    rows = [r for r in _open_rows(t) if r.final is not None and r.final.seeds_needed is not None]
    if not rows:
        return None
    needed = _span([r.final.seeds_needed for r in rows], lambda x: str(int(x)))
    ran = _span([r.final.effect.n for r in rows], lambda x: str(int(x)))
    return f"{needed} seeds needed ({ran} ran)"


def _anomaly_cause(names: list[str], runs, warmup: int | None) -> str | None:
    """The anomaly events of the runs of ``names`` (the open recipes and the control): how many of each kind and at
    which steps, with the end of the LR warmup beside them; None when those runs recorded none."""
    events = [e for r in runs if r.recipe in names for e in r.anomalies if isinstance(e, dict)]
    if not events:
        return None
    kinds: dict[str, int] = {}
    for e in events:
        kinds[str(e.get("kind", "?"))] = kinds.get(str(e.get("kind", "?")), 0) + 1
    what = ", ".join(f"{k} {markdown.text(kind)}" for kind, k in sorted(kinds.items(), key=lambda kv: -kv[1]))
    steps = [int(e["step"]) for e in events if isinstance(e.get("step"), int)]
    at = f" at steps {_span(steps, str)}" if steps else ""
    lr = f" (LR warmup ends at step {warmup})" if warmup else ""
    return f"anomaly events in their runs or the control's: {what}{at}{lr}"


def _cause(t: VerdictTable, runs, warmup: int | None) -> str | None:
    """Why the open recipes are open, from what the table measured: intervals wider than the margin (the paired
    sd), a mean near the margin, one paired seed, Holm's correction, and the runs' anomaly events; None when no
    recipe is open."""
    open_ = _open_rows(t)
    if not open_:
        return None
    parts = []
    with_ci = [r.final for r in open_ if r.final is not None and r.final.effect.has_interval]
    wide = [v for v in with_ci if (v.effect.hi - v.effect.lo) / 2 >= t.margin]
    if wide:
        level = "" if t.auto_note is not None else f"{_level(t.level)} "
        parts.append(
            f"paired sd {_pct_span([v.effect.sd for v in wide])} of the loss, so {level}intervals of "
            f"±{_pct_span([(v.effect.hi - v.effect.lo) / 2 for v in wide])} at "
            f"{_span([v.effect.n for v in wide], str)} seeds, wider than the margin"
        )
    near = [v for v in with_ci if v not in wide and v.verdict_unadjusted not in CONCLUSIVE]
    if near:
        parts.append(
            "mean difference near the margin: "
            + ", ".join(f"{markdown.code(v.recipe)} {_bound(v.effect.mean, t.margin)}" for v in near)
        )
    holm = [v for v in with_ci if v.verdict_unadjusted in CONCLUSIVE and not v.untested]
    if holm:
        parts.append("Holm does not confirm " + ", ".join(markdown.code(v.recipe) for v in holm))
    for why in dict.fromkeys(v.untested for v in with_ci if v.verdict_unadjusted in CONCLUSIVE and v.untested):
        names = ", ".join(markdown.code(v.recipe) for v in with_ci if v.untested == why)
        parts.append(f"not tested, as the testing order asks ({why}): {names}")
    one = [r.recipe for r in open_ if r.final is not None and not r.final.effect.has_interval]
    if one:
        parts.append("1 paired seed, no interval: " + ", ".join(markdown.code(n) for n in one))
    none = [r.recipe for r in open_ if r.final is None]
    if none:
        parts.append("no paired seed: " + ", ".join(markdown.code(n) for n in none))
    anomalies = _anomaly_cause([*(r.recipe for r in open_), t.control], runs, warmup)
    if anomalies:
        parts.append(anomalies)
    return "; ".join(parts) or None


def summary_line(t: VerdictTable, runs=(), warmup: int | None = None) -> str:
    """The report's first line: the recipes that diverged (named first), how many recipes are conclusive at the
    margin, the seeds the others need (``seeds_needed`` at the observed mean and sd) and the measured cause
    (``_cause``), e.g. ``**0 of 3 recipes conclusive at 0.25%**; 7-48 seeds needed (3 ran); cause: paired sd ...``.
    ``runs``: the report's comparable runs (their anomaly events); ``warmup``: ``train.warmup_steps`` or None."""
    parts = []
    diverged = _diverged_names(t)
    head = f"**Diverged: {diverged}.** " if diverged else ""
    conclusive = [r for r in t.rows if r.final is not None and r.final.verdict in CONCLUSIVE]
    which = ", ".join(f"{markdown.code(r.recipe)} {r.final.label}" for r in conclusive)
    parts.append(
        f"**{len(conclusive)} of {len(t.rows)} recipes conclusive at {100 * t.margin:.3g}%**"
        + (f" ({which})" if which else "")
    )
    needed = _seeds_needed_text(t)
    if needed:
        parts.append(needed)
    cause = _cause(t, runs, warmup)
    if cause:
        parts.append(f"cause: {cause}")
    return head + "; ".join(parts) + "."


#: An open recipe whose seeds-needed exceeds this many times the seeds it ran is out of reach at this scale: the
#: advice names the measured reason instead of a seed count to run.
OUT_OF_REACH = 10


def add_seeds_line(t: VerdictTable) -> str | None:
    """The advice under the summary when a recipe is open: the seeds per recipe that make each open one conclusive
    with power ``POWER`` (if its observed mean and sd are the truth), as a ``seeds={others: N, ...}`` to rerun with
    and what that costs in runs; for a recipe needing more than ``OUT_OF_REACH`` times the seeds it ran, the
    measured reason it is out of reach (its mean's distance from the margin against its paired sd) instead; and the
    smallest margin these seeds resolve. None when no open recipe has a seeds-needed figure."""
    rows = [r for r in _open_rows(t) if r.final is not None and r.final.seeds_needed is not None]
    if not rows:
        return None
    rows.sort(key=lambda r: r.final.seeds_needed)
    each = ", ".join(f"{markdown.code(r.recipe)} {r.final.seeds_needed}" for r in rows)
    reach = [r for r in rows if r.final.seeds_needed <= OUT_OF_REACH * max(r.runs, 1)]
    far = [r for r in rows if r not in reach]
    best = t.min_mdd
    wider = (
        f"; or judge at a margin of at least {100 * best[0]:.3g}% (`report.margin={best[0]:.3g}`, the smallest these "
        "seeds resolve: noise floor below)"
        if best is not None and best[0] > t.margin
        else ""
    )
    sentences = []
    if reach:
        most = reach[-1].final.seeds_needed
        # the counts to rerun with: each open recipe within reach at its seeds needed, every other one as it ran;
        # the control trains the most of them
        counts = {r.recipe: (r.final.seeds_needed if r in reach else r.runs) for r in t.rows}
        if t.auto_note is not None:
            how = f"raise `max_seeds` to {most} (`seeds=auto` adds them one look at a time)"
        else:
            how = f"rerun with `{seeds_mapping(counts)}` (the control trains the most)"
        # what the advice costs, in this ablation's own runs, against the runs it trained (a verdict at this scale
        # may need more compute than the experiment's budget)
        ran_runs = sum(r.runs for r in t.rows) + len(t.control_values)
        need_runs = sum(counts.values()) + max([*counts.values(), len(t.control_values)])
        cost = (
            f" That is about {need_runs} runs against the {ran_runs} this ablation trained "
            f"({need_runs / ran_runs:.1f}x its compute at this model and schedule)."
            if ran_runs and need_runs > ran_runs
            else ""
        )
        sentences.append(f"**Add seeds:** {how}. Seeds for a conclusive verdict with power {POWER}, if the observed "
                         f"mean and paired sd are the truth: {each}{wider}.{cost}")  # fmt: skip
    else:
        sentences.append(f"Seeds for a conclusive verdict with power {POWER}, if the observed mean and paired sd are "
                         f"the truth: {each}{wider}.")  # fmt: skip
    for r in far:
        e = r.final.effect
        gap = abs(e.mean - t.margin)
        sentences.append(
            f"**Out of reach at this scale:** {markdown.code(r.recipe)} needs {r.final.seeds_needed} seeds, "
            f"{r.final.seeds_needed / max(r.runs, 1):.0f}x the {r.runs} it ran: its mean ({markdown.pct(e.mean)}) lies "
            f"{100 * gap:.3g}% from the margin, {gap / e.sd:.2g} of its paired sd ({100 * e.sd:.3g}%), so seeds "
            "shrink the interval without moving it off the margin; less noise per seed (a longer run) or another "
            "margin would decide it."
        )
    return " ".join(sentences)


def seeds_mapping(counts: dict[str, int]) -> str:
    """``counts`` (recipe -> seeds) as the ``seeds=`` argument that trains them, single-quoted for a shell (a brace
    list would otherwise be expanded): the most common count as ``others``, each other count named, e.g.
    ``'seeds={others: 3, fp8_blockwise: 13}'``."""
    values = sorted(counts.values())
    others = max(values, key=lambda n: (values.count(n), -n))  # the most common; the smaller on a tie
    named = "".join(f", {name}: {n}" for name, n in counts.items() if n != others)
    return f"'seeds={{others: {others}{named}}}'"


def forest_rows(t: VerdictTable) -> list:
    """One ``lowprec_lab.report.plots.ForestRow`` per recipe of the table (the control is the zero line), from its
    final-loss verdict: the mean, the interval, the label as the compact table prints it, and its kind."""
    from lowprec_lab.report.plots import ForestRow  # matplotlib only when a figure is drawn

    out = []
    for r in t.rows:
        v = r.final
        kind = "diverged" if _is_diverged(r) else (v.verdict if v and v.verdict in CONCLUSIVE else "open")
        label = _compact_verdict(r, short=True).replace("**", "")
        role = t.role(r.recipe)
        name = f"{r.recipe} ({role})" if role else r.recipe
        if v is None:
            out.append(ForestRow(name, None, None, None, label, kind))
        else:
            e = v.effect
            out.append(ForestRow(name, e.mean, e.lo, e.hi, label, kind))
    return out


def _compact_verdict(row: RecipeRow, short: bool = False) -> str:
    """The verdict in a few words: the label, ``(k/n runs)`` when diverged, ``(Holm; CI alone: ...)`` when Holm
    changed it (``short``: ``(Holm)`` alone, for the forest plot)."""
    v = row.final
    if v is None:
        return f"**{DIVERGED}** ({row.stability.diverged}/{row.stability.runs} runs)" if _is_diverged(row) else NO_DATA
    if v.verdict == DIVERGED:
        return f"**{DIVERGED}** ({v.diverged_runs}/{v.judged_runs} runs)"
    if v.untested:
        return f"**{v.label}** (not tested)" if short else f"**{v.label}** (not tested; CI alone: {v.label_unadjusted})"
    if v.verdict != v.verdict_unadjusted or v.label != v.label_unadjusted:
        return f"**{v.label}** (Holm)" if short else f"**{v.label}** (Holm; CI alone: {v.label_unadjusted})"
    return f"**{v.label}**"


def _compact_columns(level: float, auto: bool) -> list[str]:
    ci = "[CI at the row's look level]" if auto else f"[{_level(level)} CI]"
    return ["recipe", f"final val loss vs control {ci}", "verdict", "seeds needed", "stability"]


def _compact_row(row: RecipeRow, auto: bool = False, name: str | None = None) -> list[str]:
    """The cells of a recipe's row of the compact table at the top of the report (``name``: as shown)."""
    v = row.final
    if v is not None and v.verdict in CONCLUSIVE:
        needed = f"{v.effect.n} sufficed"
    elif v is None or v.seeds_needed is None:
        needed = "n/a"
    else:
        needed = f"{v.seeds_needed} ({v.effect.n} ran)"
    stab = f"**{row.stability_verdict.verdict}**" if row.stability_verdict else NO_DATA
    return [name or markdown.code(row.recipe), _effect_cell(v, auto), _compact_verdict(row), needed, stab]


#: The resolution table under the compact one: what each comparison could resolve at the seeds it ran.
RESOLUTION_COLUMNS = ["recipe", "paired sd", "MDD at the seeds run", "seeds needed"]


def _resolution_row(row: RecipeRow, name: str) -> list[str]:
    """A recipe's resolution on the final loss: the paired sd of its relative differences to the control, the
    minimum detectable difference at the seeds its verdict used (``minimum_detectable_difference``) and the seeds
    the verdict would need at the observed mean and sd (``seeds_needed``); ``n/a`` where undefined."""
    v = row.final
    if v is None:
        return [name, "n/a", "n/a", "n/a"]
    sd = "n/a" if not _finite(v.effect.sd) or v.effect.n < 2 else f"{100 * v.effect.sd:.3f}%"
    mdd = "n/a" if v.mdd is None else f"{100 * v.mdd:.3f}% ({v.effect.n} seeds)"
    needed = "n/a" if v.seeds_needed is None else str(v.seeds_needed)
    return [name, sd, mdd, needed]


def _perm_line(v: Verdict) -> str:
    """What the sign-flip permutation cross-check decided, for the note on a disagreement."""
    n = v.effect.n
    flips = f"all {2**n:,} sign flips" if smallest_sign_flip_p(n) == 2.0**-n else "random sign flips"
    return (
        f"exact sign-flip permutation test of the {n} paired differences ({flips}) against the margin: "
        f"p={v.p_noninferior_perm:.3g} (non-inferior), p={v.p_inferior_perm:.3g} (inferior) at alpha "
        f"{(1 - v.level) / 2:.3g}: **{v.verdict_perm}**, against the t-interval's **{v.verdict_unadjusted}**"
    )


def _runs_table(runs) -> tuple[list[str], list[list[str]]]:
    """Every finished run's numbers: the header and one row of cells per run, by recipe and seed."""
    head = ["recipe", "seed", "final val loss", "tokens/s", "state B/param", "peak memory (bytes)", "run"]
    rows = []
    for r in sorted(runs, key=lambda r: (r.recipe, r.seed)):
        m = r.metrics
        rows.append(
            [
                markdown.code(r.recipe),
                str(r.seed),
                _num(m.get("final_val_loss"), ".4f"),
                _num(m.get("mean_tokens_per_s"), ",.0f"),
                _num(m.get("state_bytes_per_param"), ".2f"),
                _num(m.get("mem_peak_bytes"), ",.0f"),
                markdown.code(r.run_id),
            ]
        )
    return head, rows


def _num(x, fmt: str) -> str:
    return format(x, fmt) if _finite(x) else "n/a"


# --- MLflow -----------------------------------------------------------------------------------------------------


def parent_records(t: VerdictTable) -> tuple[dict[str, str], dict[str, float]]:
    """The tags and metrics that record ``t`` on the parent run (names: module docstring)."""
    status = "ok" if not t.no_verdict else ("no-control" if not t.control_values else "nothing-to-compare")
    tags = {"verdict_status": status, "verdict_control": t.control, "verdict_controls": _controls_status(t)}
    if t.controls is not None:
        tags["verdict_negative_control"], tags["verdict_positive_control"] = t.controls
    metrics: dict[str, float] = {"verdict/margin": t.margin}
    _record_stability_and_predictions(t, tags, metrics)
    if t.no_verdict:
        tags["verdict_reason"] = t.no_verdict
        tags.update({f"verdict.{r.recipe}": NO_DATA for r in t.rows})
        tags.update({f"verdict_label.{r.recipe}": NO_DATA for r in t.rows})
        return tags, metrics
    tags["verdict_rule"] = _rule(t) or ""
    for r in t.rows:
        _record(tags, metrics, "verdict", r.recipe, r.final, r.stability.diverged)
        if t.late_reason is None:
            _record(tags, metrics, "verdict_late", r.recipe, r.late, r.stability.diverged)
        for key, x in (
            ("ratio/throughput", r.throughput_ratio),
            ("ratio/state_memory", r.state_ratio),
            ("ratio/peak_memory", r.peak_ratio),
        ):
            if _finite(x):
                metrics[f"{key}.{r.recipe}"] = x
    if t.control_sd is not None:
        metrics["noise/control_sd"] = t.control_sd
        metrics["noise/control_rel_sd"] = t.control_sd / statistics.fmean(t.control_values.values())
    if t.min_mdd is not None:
        metrics["noise/min_margin"] = t.min_mdd[0]
    return tags, metrics


def _controls_status(t: VerdictTable) -> str:
    """``off`` (no controls), ``passed`` or ``failed`` (``controls_line``), for the parent run's tag."""
    if t.controls is None:
        return "off"
    return "failed" if controls_line(t).startswith("**This experiment could not tell") else "passed"


def _record_stability_and_predictions(t: VerdictTable, tags: dict, metrics: dict) -> None:
    """``stability.<recipe>`` tags and ``stability_*.<recipe>`` metrics (the control's too), and the predicted
    ratios (module docstring); recorded whether or not loss verdicts exist: divergence needs no paired seed."""
    for name, stab in [(t.control, t.control_stability), *((r.recipe, r.stability) for r in t.rows)]:
        if not stab.runs:
            continue
        metrics[f"stability/runs.{name}"] = float(stab.runs)
        metrics[f"stability/diverged.{name}"] = float(stab.diverged)
        metrics[f"stability/loss_spikes.{name}"] = stab.loss_spikes
        if stab.grad_norm_spikes is not None:
            metrics[f"stability/grad_norm_spikes.{name}"] = stab.grad_norm_spikes
    for r in t.rows:
        tags[f"stability.{r.recipe}"] = r.stability_verdict.verdict if r.stability_verdict else NO_DATA
        for key, x in (
            ("predicted/throughput_ratio", r.predicted_throughput_ratio),
            ("predicted/memory_ratio", r.predicted_memory_ratio),
        ):
            if _finite(x):
                metrics[f"{key}.{r.recipe}"] = x
    if t.predicted_hardware:
        tags["predicted_hardware"] = t.predicted_hardware


def _record(tags: dict, metrics: dict, prefix: str, recipe: str, v: Verdict | None, diverged: int = 0) -> None:
    """``<prefix>.<recipe>`` = the verdict (``diverged`` for a recipe without a paired seed whose runs diverged, or
    ``no-data``), its label, its level, and its numbers as ``<prefix>/<field>.<recipe>``."""
    if v is None:
        tags[f"{prefix}.{recipe}"] = tags[f"{prefix}_label.{recipe}"] = DIVERGED if diverged else NO_DATA
        return
    tags[f"{prefix}.{recipe}"] = v.verdict
    tags[f"{prefix}_label.{recipe}"] = v.label
    tags[f"{prefix}_level.{recipe}"] = f"{v.level:.6g}"
    e = v.effect
    values = {"effect": e.mean, "lo": e.lo, "hi": e.hi, "seeds": e.n, "mdd": v.mdd, "seeds_needed": v.seeds_needed}
    for key, x in values.items():
        if _finite(x):  # no interval with one seed: absent, never a made-up number
            metrics[f"{prefix}/{key}.{recipe}"] = float(x)


def log_verdicts(tracker: Tracker, parent_run_id: str, t: VerdictTable) -> None:
    """Record ``t`` on the parent run (tags replace earlier ones; metrics are logged at step 0, the latest wins)."""
    tags, metrics = parent_records(t)
    tracker.set_tags(parent_run_id, tags)
    sink = MetricBuffer(tracker, parent_run_id)
    sink.log_metrics(metrics, step=0)
    sink.flush()
