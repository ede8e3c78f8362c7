"""Ablation report built from MLflow alone: ``reports/<ablation-id>/report.md``, its PNG plots and ``report.html``
(one self-contained page, ``lowprec_lab.report.html``), all logged as artifacts of the ablation's parent run.

Every number in the report is read back from the tracking store; nothing is carried over in memory
from the runs, so ``lowprec report ID`` rebuilds the same report later, on any machine that reaches the store.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowprec.errors import UserError
from lowprec_lab.plan.config import ReportConfig
from lowprec_lab.report import markdown, plots, verdict_table
from lowprec_lab.report.anomalies import anomalies_section
from lowprec_lab.report.html import markdown_to_html
from lowprec_lab.report.predicted import predict_recipes
from lowprec_lab.report.verdict_table import LEVEL
from lowprec_lab.stats import (
    TRAIN_SMOOTH_WINDOW,
    check_margin,
    relative_loss_error,
    seed_band,
)
from lowprec_lab.stats.auto_seeds import replay_results
from lowprec_lab.tracking.runs import (
    TELEMETRY_PANELS,
    RunData,
    load_runs,
)
from lowprec_lab.tracking.tracker import ABLATION_TAG, Tracker

if TYPE_CHECKING:  # lowprec_lab.tracking.tracker sets MLflow's environment before mlflow is first imported
    from mlflow.entities import Run

#: Components drawn measured vs predicted (``pred_<name>`` is the estimator's figure for ``<name>``).
MEM_COMPONENTS = (
    "mem_params_bytes",
    "mem_grads_bytes",
    "mem_master_bytes",
    "mem_optim_states_bytes",
    "mem_fp8_scaling_state_bytes",
    "mem_saved_activations_bytes",
    "mem_saved_weight_copies_bytes",
)


class ReportError(UserError, RuntimeError):
    """The ablation cannot be found or holds no runs."""


#: What an ablation id may look like before it is used as a folder name or in an MLflow filter: ``abl-`` and
#: letters, digits and dashes (``lowprec ablate`` prints ``abl-YYYYMMDD-HHMMSS-xxxx``). An id can reach
#: ``lowprec report`` from the store (the UI's API sets tags), so it is checked as an id, never trusted as a path.
ABLATION_ID_FORM = re.compile(r"abl-[A-Za-z0-9-]{1,64}")


def check_report_id(ablation_id: str) -> str:
    """``ablation_id`` if it has the form of an ablation id (``ABLATION_ID_FORM``); else ``ReportError``: a path
    would write the report outside ``paths.reports``, a quote would break the store's filter."""
    if not ABLATION_ID_FORM.fullmatch(str(ablation_id)):
        raise ReportError(
            f"{str(ablation_id)[:80]!r} is not an ablation id (abl-YYYYMMDD-HHMMSS-xxxx: letters, digits and "
            "dashes after abl-)"
        )
    return str(ablation_id)


def find_ablation(tracker: Tracker, ablation_id: str) -> Run:
    """The parent run of ``ablation_id``; raises ``ReportError`` for an id that is not one, or that the store
    does not hold."""
    ablation_id = check_report_id(ablation_id)
    runs = tracker.client.search_runs(
        [tracker.experiment_id],
        filter_string=f"tags.`{ABLATION_TAG}` = '{ablation_id}' and tags.`lowprec.kind` = 'ablation'",
    )
    if not runs:
        raise ReportError(f"no ablation {ablation_id!r} in {tracker.uri} (experiment id {tracker.experiment_id})")
    return runs[0]


def _fmt_bytes(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def _late_max(curve: list[tuple[int, float]]) -> float:
    """Largest value after the first tenth of the steps (the start of training is left out)."""
    return max((v for _, v in curve[len(curve) // 10 :]), default=math.nan)


def _m_rel_err(metrics: dict[str, float]) -> float:
    """Mean over the sampled tensors of the stored first moment's relative error (NaN: none sampled)."""
    return _mean([v for k, v in metrics.items() if k.startswith("optim/") and k.endswith("/m_rel_err")])


def summarise(runs: list[RunData], order: list[str], control: str) -> list[dict]:
    """One row per recipe (means over seeds of comparable runs)."""
    ctrl = {r.seed: r.metrics.get("final_val_loss") for r in runs if r.recipe == control and r.comparable}
    rows = []
    for name in order:
        rs = [r for r in runs if r.recipe == name]
        ok = [r for r in rs if r.comparable]
        vals = [r.metrics["final_val_loss"] for r in ok]
        gaps = [100 * (r.metrics["final_val_loss"] / ctrl[r.seed] - 1) for r in ok if ctrl.get(r.seed)]
        rows.append(
            {
                "recipe": name,
                "short": rs[0].short if rs else "",
                "status": "FINISHED" if rs and len(ok) == len(rs) else f"{len(rs) - len(ok)}/{len(rs)} FAILED",
                "val_loss": _mean(vals),
                "val_loss_std": statistics.stdev(vals) if len(vals) > 1 else math.nan,
                "gap_pct": _mean(gaps),
                "tokens_per_s": _mean([r.metrics["mean_tokens_per_s"] for r in ok]),
                "bytes_per_param": _mean([r.metrics["state_bytes_per_param"] for r in ok]),
                "peak_bytes": _mean([r.metrics["mem_peak_bytes"] for r in ok]),
                "peak_growth_bytes": _mean([r.metrics["mem_peak_growth_bytes"] for r in ok]),
                "spikes": _mean([r.stability.loss_spikes for r in ok if r.stability]),
                "max_grad_norm": _mean([_late_max(r.curves["grad_norm"]) for r in ok]),
                "m_rel_err": _mean([_m_rel_err(r.metrics) for r in ok]),
                "n_ok": len(ok),
            }
        )
    return rows


TELEMETRY_WARMUP_NOTE = (
    "step 0 is left out: delayed scaling casts each step with the scale computed from the amaxes of the steps "
    "before it, and step 0 has none, so it casts with the initial scale 1.0 and nearly every grad_output element "
    "flushes to zero on that step (as with Transformer Engine's DelayedScaling); its metrics stay in MLflow"
)


def _num(x: float, fmt: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _first_per_recipe(runs: list[RunData]) -> dict[str, RunData]:
    """The first run of each recipe (its first seed): tables that show one run per recipe show this one."""
    first: dict[str, RunData] = {}
    for r in runs:
        first.setdefault(r.recipe, r)
    return first


@dataclass(frozen=True)
class ReportContext:
    """What the report hands its ``after`` hook (the studies): the store, the ablation, its runs and the verdict table.

    ``tracker``: ``lowprec_lab.tracking.tracker.Tracker``. ``parent``: the parent ``mlflow.entities.Run``. ``runs``: the
    ``lowprec_lab.tracking.runs.RunData`` of every child run. ``table``: the ``verdict_table.VerdictTable`` (verdicts at
    ``margin`` against ``control``). ``out``: the report folder (``<reports>/<ablation id>``).
    """

    tracker: Any
    ablation_id: str
    parent: Any
    runs: list
    order: list[str]
    control: str
    margin: float
    table: Any
    out: Path


def build_report(
    tracker: Tracker,
    ablation_id: str,
    reports_root: Path,
    margin: float | None = None,
    after: Callable[[ReportContext], list[Path]] | None = None,
) -> Path:
    """Write ``<reports_root>/<ablation_id>/report.md``, its PNGs and ``report.html``, record the verdicts on the
    parent run (``lowprec_lab.report.verdict_table``) and log the report as its artifacts; returns the markdown path.
    ``margin``: the relative non-inferiority margin; None uses the ``report.margin`` the ablation ran with (its
    parent run's param; ``ReportConfig``'s default for an ablation that predates it). ``after``: called once the
    report is written with its ``ReportContext``; the markdown pages it returns and their figures are logged beside
    the report (``lowprec_lab.studies.report_studies``: the ablation's studies; the studies sit above the report and
    the report never imports them).

    Raises ``ReportError`` if ``ablation_id`` is not an id (``check_report_id``), if the ablation is unknown or
    has no child runs, ``ConfigError`` for a bad margin.
    """
    ablation_id = check_report_id(ablation_id)
    parent = find_ablation(tracker, ablation_id)
    ptags = parent.data.tags
    margin = check_margin(parent.data.params.get("report.margin", ReportConfig.margin) if margin is None else margin)
    skipped: list[tuple[str, str]] = []  # child runs whose record is incomplete (killed as they were created)
    runs = load_runs(tracker, parent.info.run_id, skipped)
    if not runs:
        incomplete = f" ({len(skipped)} incomplete)" if skipped else ""
        raise ReportError(f"ablation {ablation_id!r} has no runs{incomplete}")
    order = [n for n in _names(ptags.get("recipes")) if any(r.recipe == n for r in runs)]
    control = ptags.get("control")
    if not control:
        raise ReportError(f"ablation {ablation_id!r}: its parent run has no control tag")
    out = Path(reports_root) / ablation_id
    out.mkdir(parents=True, exist_ok=True)
    rows = summarise(runs, order, control)
    ok = [r for r in runs if r.comparable]
    on_cpu = ptags.get("device_type") == "cpu"
    contended = contention(ptags)
    predicted, predicted_setup = predict_recipes(parent, order)
    table = verdict_table.build_table(
        runs,
        order,
        control,
        margin,
        _steps(parent, runs),
        predicted=predicted,
        predicted_setup=predicted_setup,
        auto=auto_seeds_of(parent, runs, order, control, margin),
        controls=controls_of(parent),
        primary=primary_of(parent, order),
    )
    verdict_table.log_verdicts(tracker, parent.info.run_id, table)
    sections = {
        "verdicts": verdict_table.verdict_section(
            table, on_cpu, ok, contended, _forest(table, out), _int_param(parent, "train.warmup_steps")
        ),
        "curves": _curves_section(ok, order, control, margin, out),
        "setup": _header_section(parent, ok, control, tracker.uri),
        "cpu_warning": _cpu_timing_warning(on_cpu),
        "summary": _summary_section(rows, control, on_cpu, contended),
        "failed": _failed_section(runs, skipped),
        "anomalies": anomalies_section(runs),
        "figures": _figure_sections(_figures(rows, ok, order, out, contended), contended),
        "telemetry": _telemetry_section(_telemetry_figures(ok, order, out), _telemetry_left_out(ok)),
        "reconcile": _reconcile_table(ok, order),
        "comm": _comm_section(ok, order, out),
        "effective": _effective_section(ok, order),
    }
    title = f"Precision ablation `{ablation_id}`"

    def page(order_: tuple[str, ...]) -> str:  # template report.md.j2: the title, the sections, where to browse
        texts = ["\n".join(sections[key]) for key in order_ if sections[key]]
        return markdown.render("report.md.j2", title=title, sections=texts, uri=tracker.uri)

    path = out / "report.md"
    path.write_text(page(MARKDOWN_ORDER))
    html_path = out / "report.html"
    links = _run_links(tracker, runs)
    html_path.write_text(markdown_to_html(page(HTML_ORDER), out, title.replace("`", ""), links))
    log_report_artifacts(tracker, parent.info.run_id, path, html_path)
    if after is not None:
        ctx = ReportContext(tracker, ablation_id, parent, runs, order, control, margin, table, out)
        for extra_md in after(ctx):
            for f in (extra_md, *report_figures(extra_md)):
                tracker.log_artifact(parent.info.run_id, f)
    return path


#: The markdown keeps the setup beside the summary; the HTML page puts the verdicts first, then every figure, then
#: the detail tables (the reading order of a colleague who opens it in the MLflow UI).
MARKDOWN_ORDER = (
    "verdicts", "curves", "setup", "cpu_warning", "summary", "failed", "anomalies", "figures", "telemetry",
    "reconcile", "comm", "effective",
)  # fmt: skip
HTML_ORDER = (
    "verdicts", "curves", "figures", "telemetry", "comm", "setup", "cpu_warning", "summary", "failed", "anomalies",
    "reconcile", "effective",
)  # fmt: skip
_FIGURE_REF = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def report_figures(markdown_path: Path) -> list[Path]:
    """The figure files ``report.md`` shows, in order of appearance."""
    names = dict.fromkeys(_FIGURE_REF.findall(markdown_path.read_text()))
    return [markdown_path.parent / n for n in names]


def log_report_artifacts(tracker: Tracker, parent_run_id: str, markdown: Path, html_page: Path) -> None:
    """``report.md``, ``report.html`` and every figure the report shows, at the parent run's artifact root (a
    rebuild overwrites them), so the comparison is on the tracking server, not only on the machine that ran it."""
    for f in (markdown, html_page, *report_figures(markdown)):
        tracker.log_artifact(parent_run_id, f)


def _run_links(tracker: Tracker, runs: list[RunData]) -> dict[str, str]:
    """Recipe -> the MLflow UI page of its lowest-seed run (comparable runs first); empty for a local store."""
    links: dict[str, str] = {}
    for r in sorted(runs, key=lambda r: (not r.comparable, r.seed)):
        url = tracker.run_url(r.run_id)
        if url and r.recipe not in links:
            links[r.recipe] = url
    return links


def contention(parent_tags: dict) -> int:
    """How many runs of the ablation trained at a time (its parent's ``workers`` tag; 1 when absent or not a
    number): above 1, every measured tokens/s of the report was measured under the other runs' load."""
    try:  # ``runs_per_device``: 1 when each worker had its own GPU(s) (lowprec_lab.plan.placement)
        return max(1, int(parent_tags.get("runs_per_device", parent_tags.get("workers", "1"))))
    except ValueError:
        return 1


def contended_mark(contended: int) -> str:
    """The words the report puts beside a throughput measured under contention ("" without contention)."""
    return f"contended: {contended} runs at a time" if contended > 1 else ""


def _workers_note(workers: str | None, alone: bool = False) -> str:
    if workers in (None, "1"):
        return ""
    if alone:
        return (
            f"; {workers} runs trained at a time, each alone on its own GPU(s) (parent tag `placement`, each run's "
            "`gpus`), so each run's tokens/s is its device's own"
        )
    return f"; {workers} runs trained at a time (`workers`), so each run's tokens/s was measured under the others' load"


def controls_of(parent: Run) -> tuple[str, str] | None:
    """``(negative, positive)`` control recipes of the ablation from its parent run's params (``controls``,
    ``negative_control``, ``positive_control``: preflight records the names it resolved), or None when the ablation
    ran without controls (or predates them). Raises ``ReportError`` for ``controls`` on without both names: the
    report would otherwise judge the experiment's sensitivity from a guess."""
    params = parent.data.params
    if params.get("controls", "False") != "True":
        return None
    names = (params.get("negative_control"), params.get("positive_control"))
    if any(n in (None, "", "None") for n in names):
        raise ReportError(
            f"the parent run says controls=True but names negative_control={names[0]} and positive_control={names[1]}"
        )
    return names[0], names[1]


def primary_of(parent: Run, order: list[str]) -> tuple[str, ...]:
    """The ablation's primary comparisons (``report.primary``) from its parent run's ``primary`` tag (a JSON list the
    ablation wrote; absent before the option existed: none). The tag is store data: ``ReportError`` unless it is a
    list of names of the ablation's recipes (``order``) other than its control and its control recipes, so a
    tampered tag cannot reorder the tests behind the reader's back."""
    raw = parent.data.tags.get("primary")
    if raw is None:
        return ()
    try:
        names = json.loads(raw)
    except ValueError:
        names = None
    barred = {parent.data.tags.get("control"), *(controls_of(parent) or ())}
    if not isinstance(names, list) or not all(isinstance(n, str) and n in order and n not in barred for n in names):
        raise ReportError(f"the parent run's primary tag is not a list of this ablation's recipes: {raw[:200]!r}")
    return tuple(names)


def _forest(table: verdict_table.VerdictTable, out: Path) -> str | None:
    """The forest plot of the verdicts (``plots.verdict_forest``, ``verdict_forest.png`` in ``out``) and its file
    name; None when the table has no verdict to draw."""
    if table.no_verdict or not table.rows:
        return None
    level = "look's" if table.auto_note is not None else f"{100 * table.level:.4g}%"
    rows = verdict_table.forest_rows(table)
    return plots.verdict_forest(rows, table.margin, table.control, level, out / "verdict_forest.png").name


def _int_param(parent: Run, key: str) -> int | None:
    """The parent run's param ``key`` as an int, or None when absent or not an integer (a param is store data)."""
    try:
        return int(parent.data.params[key])
    except (KeyError, ValueError):
        return None


def auto_seeds_of(parent: Run, runs: list[RunData], order: list[str], control: str, margin: float):
    """The ``seeds=auto`` procedure replayed from the runs alone (``lowprec_lab.stats.auto_seeds.replay_results``: what
    the ablation decided with); None for an ablation with a fixed seed count or without the control."""
    tags = parent.data.tags
    if tags.get("seeds") != "auto" or control not in order:
        return None
    results = [(r.recipe, r.seed, r.metrics.get("final_val_loss") if r.comparable else None) for r in runs]
    names = [n for n in order if n != control]
    return replay_results(results, control, names, int(tags["seed0"]), int(tags["max_seeds"]), margin)


def _steps(parent: Run, runs: list[RunData]) -> int:
    """The ablation's optimizer steps: its ``train.steps`` param, else one past the last logged step."""
    if "train.steps" in parent.data.params:
        return int(parent.data.params["train.steps"])
    return 1 + max((s for r in runs for curve in r.curves.values() for s, _ in curve), default=0)


def _figures(rows: list[dict], ok: list[RunData], order: list[str], out: Path, contended: int = 1) -> dict[str, Path]:
    """The comparison plots after the curves (none without a comparable run), keyed as ``_figure_sections``
    titles them; the throughput plot's title says when it was measured under contention."""
    if not ok:
        return {}
    return {
        "memory": plots.memory_bars(rows, ok, order, out / "memory.png"),
        "throughput": plots.throughput_bars(rows, out / "throughput.png", contended_mark(contended)),
        "reconcile": plots.predicted_vs_measured(ok, order, MEM_COMPONENTS, out / "memory_predicted.png"),
        "grad_norm": plots.grad_norm_curves(ok, order, out / "grad_norm.png"),
    }


def _by_seed(runs: list[RunData], name: str, key: str) -> dict[int, list[tuple[int, float]]]:
    return {r.seed: r.curves.get(key, []) for r in runs if r.recipe == name}


def _curves_section(ok: list[RunData], order: list[str], control: str, margin: float, out: Path) -> list[str]:
    """Right after the verdicts: the relative loss error against the control (DeepSeek-V3's metric, paired by
    seed, t-band) and the loss curves (mean over seeds, min-max band), from the comparable runs (template
    ``curves.md.j2``)."""
    if not ok:
        return []
    w = TRAIN_SMOOTH_WINDOW
    names = [n for n in order if n != control]
    ctrl_train, ctrl_val = _by_seed(ok, control, "loss"), _by_seed(ok, control, "val_loss")
    train = {n: relative_loss_error(_by_seed(ok, n, "loss"), ctrl_train, window=w, level=LEVEL) for n in names}
    val = {n: relative_loss_error(_by_seed(ok, n, "val_loss"), ctrl_val, level=LEVEL) for n in names}
    bands = {n: (seed_band(_by_seed(ok, n, "loss"), window=w), seed_band(_by_seed(ok, n, "val_loss"))) for n in order}
    gap_fig, level, no_band = None, None, []
    if any(c is not None for c in [*train.values(), *val.values()]):
        gap_fig = plots.relative_loss_error(train, val, order, control, margin, out / "loss_gap.png").name
        level = next(c.level for d in (train, val) for c in d.values() if c is not None)
        no_band = sorted({n for d in (train, val) for n, c in d.items() if c is not None and c.lo is None})
    loss = plots.loss_curves(bands, order, ok[0].tokens_per_step, out / "loss.png")
    return markdown.lines(
        "curves.md.j2",
        control=control,
        margin=margin,
        window=w,
        gap_fig=gap_fig,
        level=level,
        no_band=no_band,
        loss_fig=loss.name,
    )


def _telemetry_figures(ok: list[RunData], order: list[str], out: Path) -> dict[str, Path]:
    """One FP8 telemetry heatmap per recipe that logged telemetry (its first seed), in ``order``."""
    first = _first_per_recipe([r for r in ok if r.telemetry])
    return {
        name: plots.telemetry_heatmap(first[name], TELEMETRY_PANELS, out / figure_name("telemetry", name))
        for name in order
        if name in first
    }


def _telemetry_left_out(ok: list[RunData]) -> dict[str, tuple[int, ...]]:
    """Recipe -> the steps left out of its heatmap (its first seed with telemetry, the one drawn)."""
    first = _first_per_recipe([r for r in ok if r.telemetry])
    return {name: r.telemetry_left_out for name, r in first.items() if r.telemetry_left_out}


def _header_section(parent: Run, ok: list[RunData], control: str, uri: str) -> list[str]:
    """The setup: experiment, model, steps, seeds, data, device and versions, control, store (template
    ``setup.md.j2``)."""
    ptags = parent.data.tags
    return markdown.lines(
        "setup.md.j2",
        tags=ptags,
        params=parent.data.params,
        tokens_per_step=ok[0].tokens_per_step if ok else "?",
        kernels=sorted({r.kernels for r in ok if r.kernels}),
        control=control,
        uri=uri,
        run_id=parent.info.run_id,
        wall_s=float(ptags.get("wall_s", "nan")),
        workers_note=_workers_note(ptags.get("workers"), ptags.get("runs_per_device") == "1"),
        auto_lines=_auto_note(ok),
    )


def _auto_note(ok: list[RunData]) -> list[str]:
    """The setup line for ``train.compile=auto`` / ``train.ac=auto``: what each recipe resolved to on this device,
    and the recipes that fell back to eager (their throughput is not comparable with compiled runs)."""
    resolved = sorted({(r.recipe, r.train_auto) for r in ok if r.train_auto})
    if not resolved:
        return []
    auto = "; ".join(f"{markdown.code(n)} {markdown.text(v)}" for n, v in resolved)
    lines = [f"- `train.compile`/`train.ac` auto: {auto}"]
    fell = sorted({r.recipe for r in ok if r.compile_fallback})
    if fell:
        names = ", ".join(markdown.code(n) for n in fell)
        lines.append(
            f"- **throughput not comparable**: {names} ran eager (`compile_fallback` "
            "on the run: it cannot compile on this device) while `auto` compiled the others"
        )
    return lines


def _cpu_timing_warning(on_cpu: bool) -> list[str]:
    """A warning that CPU timings say nothing about GPU speed (nothing on a GPU; template ``cpu_warning.md.j2``)."""
    return markdown.lines("cpu_warning.md.j2") if on_cpu else []


SUMMARY_COLUMNS = (
    "recipe",
    "what it is",
    "status",
    "val loss",
    "gap vs control",
    "tokens/s",
    "state B/param",
    "AdamW m error",
    "peak memory",
    "loss spikes",
    "max grad norm",
)


def _summary_section(rows: list[dict], control: str, on_cpu: bool, contended: int = 1) -> list[str]:
    """The summary table (one row per recipe, from ``summarise``) and what its columns mean; the tokens/s column's
    header says when it was measured under contention (template ``summary.md.j2``)."""
    mark = contended_mark(contended)
    columns = [f"tokens/s ({mark})" if c == "tokens/s" and mark else c for c in SUMMARY_COLUMNS]
    rows_ = [_summary_row(row) for row in rows]
    return markdown.lines("summary.md.j2", control=control, on_cpu=on_cpu, head=columns, rows=rows_)


def _summary_row(row: dict) -> list[str]:
    """The cells of a recipe's row of the summary table."""
    std = f" ± {row['val_loss_std']:.4f}" if not math.isnan(row["val_loss_std"]) else ""
    peak = f"{_fmt_bytes(row['peak_bytes'])} (+{_fmt_bytes(row['peak_growth_bytes'])})" if row["n_ok"] else "n/a"
    return [
        markdown.code(row["recipe"]),
        markdown.code(row["short"]),
        row["status"],
        f"{_num(row['val_loss'], '.4f')}{std}",
        f"{_num(row['gap_pct'], '+.2f')}%",
        _num(row["tokens_per_s"], ",.0f"),
        _num(row["bytes_per_param"], ".2f"),
        _num(row["m_rel_err"], ".2%"),
        peak,
        _num(row["spikes"], ".1f"),
        _num(row["max_grad_norm"], ".3f"),
    ]


def _failed_section(runs: list[RunData], skipped: list[tuple[str, str]] = ()) -> list[str]:
    """Runs left out of every comparison, each with the reason recorded in MLflow, and the child runs whose record is
    incomplete (``skipped``: run id, why) (nothing if none; template ``failed.md.j2``)."""
    failed = [r for r in runs if not r.comparable]
    return markdown.lines("failed.md.j2", failed=failed, skipped=list(skipped)) if failed or skipped else []


def _names(text: str | None) -> list[str]:
    """The parent's ``recipes`` tag (a JSON list of names); [] for one that is absent or not such a list."""
    try:
        value = json.loads(text) if text else []
    except ValueError:
        return []
    return [str(n) for n in value] if isinstance(value, list) else []


def figure_name(prefix: str, name: str) -> str:
    """A figure's file name for ``name`` (a recipe name, read from the store): its letters, digits, ``_.-`` kept
    and anything else (a ``/``, a ``..``, a space) replaced, with a short hash of the name when replaced, so the file
    lies in the report folder and its markdown link is one plain word."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name).strip(".") or "_"
    if safe != name:
        safe += "-" + hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{prefix}_{safe}.png"


def _figure_sections(figs: dict[str, Path], contended: int = 1) -> list[str]:
    """One section per comparison plot, in the order they were drawn (the throughput one's title says when it was
    measured under contention; template ``figures.md.j2``)."""
    return markdown.lines("figures.md.j2", figs=figs, contended_mark=contended_mark(contended)) if figs else []


def _telemetry_section(heatmaps: dict[str, Path], left_out: dict[str, tuple[int, ...]] | None = None) -> list[str]:
    """The FP8 numerics heatmaps (recipe -> PNG) and how to read them (nothing without telemetry); ``left_out``:
    recipe -> the steps its heatmap leaves out (``telemetry_warmup``), said under it (template
    ``telemetry.md.j2``)."""
    if not heatmaps:
        return []
    return markdown.lines(
        "telemetry.md.j2", heatmaps=heatmaps, left_out=left_out or {}, warmup_note=TELEMETRY_WARMUP_NOTE
    )


def _reconcile_table(runs: list[RunData], order: list[str]) -> list[str]:
    """Measured vs predicted bytes per component (first seed of each recipe), from the logged metrics (template
    ``reconcile.md.j2``)."""
    first = _first_per_recipe(runs)
    names = [n for n in order if n in first]
    if not names or not any(f"pred_{MEM_COMPONENTS[0]}" in first[n].metrics for n in names):
        return []
    head = ["recipe", "ac", *(c.removeprefix("mem_").removesuffix("_bytes") for c in MEM_COMPONENTS)]
    rows = []
    for n in names:
        m = first[n].metrics
        cells = [_reconcile_cell(m.get(c), m.get(_predicted_name(c), m.get(f"pred_{c}"))) for c in MEM_COMPONENTS]
        rows.append([markdown.code(n), markdown.text(first[n].ac), *cells])
    return markdown.lines("reconcile.md.j2", head=head, rows=rows)


def _predicted_name(component: str) -> str:
    """The metric holding the estimator's figure for ``component``: the run logs the saved-activation estimate
    under its activation checkpointing as ``mem_saved_activations_estimate_bytes`` (older runs: ``pred_*``)."""
    if component == "mem_saved_activations_bytes":
        return "mem_saved_activations_estimate_bytes"
    return f"pred_{component}"


def _reconcile_cell(measured: float | None, predicted: float | None) -> str:
    if measured is None or predicted is None:
        return "n/a"
    if measured == predicted:
        return f"{measured:,.0f} (exact)"
    error_pct = 100 * (predicted / measured - 1) if measured else float("inf")
    return f"{measured:,.0f} / {predicted:,.0f} ({error_pct:+.1f}%)"


COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def _comm_section(runs: list[RunData], order: list[str], out: Path) -> list[str]:
    """Bytes per optimizer step by collective kind and wire dtype, as the communication meter counted them at
    the process-group call on rank 0 (the only evidence of FP8 communication the report accepts), and its bar chart
    (drawn here, only for runs that metered communication; template ``comm.md.j2``)."""
    first = _first_per_recipe(runs)
    names = [n for n in order if n in first and any(k.startswith("comm_") for k in first[n].metrics)]
    if not names:
        return []
    head = ["recipe", "layout", *(k.replace("_", "-") for k in COMM_KINDS), "wire"]
    rows = []
    for n in names:
        cells = [_comm_cell(first[n].metrics, kind) for kind in COMM_KINDS]
        wire = first[n].effective.get("comm") or {}
        wire_text = ", ".join(f"{k}: {v}" for k, v in wire.items()) if isinstance(wire, dict) else str(wire)
        rows.append([markdown.code(n), markdown.text(first[n].layout), *cells, markdown.text(wire_text) or "n/a"])
    fig = plots.comm_bars(runs, order, COMM_KINDS, out / "comm_bytes.png")
    return markdown.lines("comm.md.j2", head=head, rows=rows, fig=fig.name)


def _comm_cell(metrics: dict[str, float], kind: str) -> str:
    """Total bytes of collective ``kind`` per step, then its non-zero parts by wire dtype, largest first."""
    total = metrics.get(f"comm_{kind}_bytes", 0.0)
    prefix = f"comm_{kind}_"
    parts = sorted(
        (
            (k.removeprefix(prefix).removesuffix("_bytes"), v)
            for k, v in metrics.items()
            if k.startswith(prefix) and k != f"comm_{kind}_bytes" and v
        ),
        key=lambda kv: -kv[1],
    )
    if not parts:
        return _fmt_bytes(total)
    return _fmt_bytes(total) + " (" + ", ".join(f"{d} {_fmt_bytes(v)}" for d, v in parts) + ")"


EFFECTIVE_COLUMNS = ("recipe", "params", "grads", "linear outputs", "FP8 linears", "AdamW moments", "optimizer")


def _effective_section(ok: list[RunData], order: list[str]) -> list[str]:
    """What each recipe ran as (first seed): element counts per dtype, FP8 linears, optimizer class (template
    ``effective.md.j2``)."""
    first = _first_per_recipe(ok)
    rows = []
    for name in (n for n in order if n in first):
        e = first[name].effective
        fp8_linears = e.get("fp8_linears") or {}
        fp8 = sum(v for v in fp8_linears.values() if isinstance(v, int)) if isinstance(fp8_linears, dict) else "?"
        rows.append(
            [
                markdown.code(first[name].recipe),
                _dtypes(e.get("param_dtype")),
                _dtypes(e.get("grad_dtype")),
                _dtypes(e.get("linear_output_dtype")),
                markdown.text(f"{fp8}/{e.get('linears')}"),
                _dtypes(e.get("moment_dtype")),
                markdown.code(e.get("optimizer")),
            ]
        )
    return markdown.lines("effective.md.j2", head=list(EFFECTIVE_COLUMNS), rows=rows)


def _dtypes(d: dict | None) -> str:
    """Element counts by dtype (``{dtype: count}``, from the run's ``effective_recipe`` tag), as escaped text."""
    if not isinstance(d, dict):
        return markdown.text(d or "")
    return markdown.text(", ".join(f"{k} ({v:,})" if isinstance(v, int) else f"{k} ({v})" for k, v in d.items()))
