"""Predicted vs published: the data points of ``published.yaml`` run through the cost model and the memory model.

``load_points()`` reads the file (every point's source, configuration, matching catalog recipe and split);
``predict(point, cal)`` gives the cost model's tokens/s/GPU (or speedup over bf16 for ratio points) and the
predicted peak reserved memory; ``validate(cal)`` tabulates both against the published figures with the
relative error ``predicted / published - 1``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml

from lowprec.estimate.cost_model import Calibration, Layout, step_cost
from lowprec.estimate.hardware import get_hardware
from lowprec.estimate.memory_model import FRAGMENTATION, peak_breakdown
from lowprec.model import model_args
from lowprec.recipes import get_recipe
from lowprec_lab.sizing.tables import render_table

PUBLISHED = Path(__file__).resolve().parents[2] / "lowprec" / "estimate" / "published.yaml"


@dataclass(frozen=True)
class Point:
    """One published measurement (fields as in ``published.yaml``). ``tokens_per_s_per_gpu`` or
    ``speedup_vs_bf16`` is set; ``memory_gib`` may be ``None``."""

    id: str
    source: str
    url: str
    table: str
    model: str
    hardware: str
    gpus: int
    dp_shard: int
    tp: int
    batch: int
    seq: int
    ac: str
    compile: bool
    recipe: str
    published_recipe: str
    split: str
    tokens_per_s_per_gpu: float | None = None
    speedup_vs_bf16: float | None = None
    memory_gib: float | None = None
    async_tp: bool = False
    max_seq_len: int | None = None
    compiled_loss: bool | None = None

    @property
    def layout(self) -> Layout:
        return Layout(
            self.dp_shard, self.tp, self.batch, self.seq, self.ac, self.compile, self.async_tp, self.compiled_loss
        )

    @property
    def published(self) -> float:
        """The published throughput figure (tokens/s/GPU, or the speedup for ratio points)."""
        return self.tokens_per_s_per_gpu if self.tokens_per_s_per_gpu is not None else self.speedup_vs_bf16

    @property
    def kind(self) -> str:
        return "tokens/s/GPU" if self.tokens_per_s_per_gpu is not None else "speedup vs bf16"


def load_points(path: Path = PUBLISHED) -> list[Point]:
    """The points of ``path``; raises ``ValueError`` for a point without a throughput figure, an unknown
    source key or split, or a GPU count that is not ``dp_shard * tp``."""
    doc = yaml.safe_load(Path(path).read_text())
    out = []
    for d in doc["points"]:
        d = dict(d)
        src = d["source"]
        if src not in doc["sources"]:
            raise ValueError(f"point {d['id']}: unknown source {src!r}")
        p = Point(url=doc["sources"][src], **d)
        if (p.tokens_per_s_per_gpu is None) == (p.speedup_vs_bf16 is None):
            raise ValueError(f"point {p.id}: give exactly one of tokens_per_s_per_gpu, speedup_vs_bf16")
        if p.split not in ("fit", "held_out"):
            raise ValueError(f"point {p.id}: split={p.split!r} is not fit or held_out")
        if p.gpus != p.dp_shard * p.tp:
            raise ValueError(f"point {p.id}: gpus={p.gpus} != dp_shard*tp={p.dp_shard * p.tp}")
        out.append(p)
    return out


def _args(p: Point):
    return model_args(p.model, **({"max_seq_len": p.max_seq_len} if p.max_seq_len else {}))


def predict_throughput(p: Point, cal: Calibration) -> float:
    """The cost model's figure for ``p``: tokens/s/GPU, or its speedup over bf16 in the same layout."""
    args, hw = _args(p), get_hardware(p.hardware)
    tps = step_cost(args, get_recipe(p.recipe), hw, p.layout, cal).tokens_per_s_per_gpu
    if p.speedup_vs_bf16 is None:
        return tps
    return tps / step_cost(args, get_recipe("bf16"), hw, p.layout, cal).tokens_per_s_per_gpu


@dataclass(frozen=True)
class Row:
    """One line of the validation table: the point, predicted throughput figure, its error, predicted
    memory (GiB, ``None`` if the point has none) and its error."""

    point: Point
    predicted: float
    error: float
    predicted_memory_gib: float | None
    memory_error: float | None

    def to_dict(self) -> dict:
        return {**asdict(self), "point": asdict(self.point)}


def predict_allocated_gib(p: Point) -> float:
    """``lowprec.estimate.memory_model.peak_breakdown(...).allocated`` for the point, GiB (before fragmentation)."""
    pk = peak_breakdown(
        _args(p),
        get_recipe(p.recipe),
        dp_shard=p.dp_shard,
        tp=p.tp,
        batch=p.batch,
        seq=p.seq,
        ac=p.ac,
        async_tp=p.async_tp,
        compiled_loss=p.layout.loss_compiled,
    )
    return pk.allocated / 2**30


def validate(
    cal: Calibration | None = None,
    points: list[Point] | None = None,
    memory=None,
    fragmentation: float = FRAGMENTATION,
) -> list[Row]:
    """Predict every point. ``memory(point) -> GiB`` gives the memory column (default: the allocated peak
    of ``predict_allocated_gib`` times ``fragmentation``)."""
    cal = cal or Calibration()
    points = load_points() if points is None else points
    if memory is None:

        def memory(p):
            return predict_allocated_gib(p) * fragmentation

    rows = []
    for p in points:
        pred = predict_throughput(p, cal)
        mem = memory(p) if p.memory_gib is not None else None
        rows.append(Row(p, pred, pred / p.published - 1.0, mem, None if mem is None else mem / p.memory_gib - 1.0))
    return rows


def recipe_ranking(rows: list[Row], key: str = "predicted") -> dict[str, list[str]]:
    """Per (source, hardware, layout) group holding more than one recipe of ``bf16``/tensorwise/rowwise
    with an absolute throughput: recipes ordered fastest first by ``key`` (``predicted`` or ``published``)."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        p = r.point
        if p.tokens_per_s_per_gpu is None:
            continue
        groups.setdefault((p.source, p.hardware, replace(p.layout)), []).append(r)
    out = {}
    for (src, hw, lo), rs in groups.items():
        if len(rs) < 2:
            continue
        val = (lambda r: r.predicted) if key == "predicted" else (lambda r: r.point.published)
        out[f"{src}/{hw}/dp{lo.dp_shard}xtp{lo.tp}/b{lo.batch}/{'compile' if lo.compile else 'eager'}"] = [
            r.point.recipe for r in sorted(rs, key=val, reverse=True)
        ]
    return out


FITTED = ("gemm_eff_bf16", "gemm_eff_fp8", "rowwise_gemm", "eager_factor", "overlap", "rocm_attention")
BOUNDS = {
    "gemm_eff_bf16": (0.2, 1.0),
    "gemm_eff_fp8": (0.1, 1.0),
    "rowwise_gemm": (0.3, 1.0),
    "eager_factor": (1.0, 6.0),
    "overlap": (0.0, 1.0),
    "rocm_attention": (0.2, 1.5),
}


def fit_calibration(points: list[Point] | None = None, start: Calibration | None = None) -> Calibration:
    """Least-squares fit (``scipy.optimize.least_squares``, residual ``log(predicted / published)``) of the
    ``FITTED`` parameters on the points with ``split: fit``. Raises ``ValueError`` if there are fewer fit
    points than parameters."""
    from scipy.optimize import least_squares

    points = load_points() if points is None else points
    fit = [p for p in points if p.split == "fit"]
    if len(fit) < len(FITTED):
        raise ValueError(f"{len(fit)} fit points for {len(FITTED)} parameters")
    start = start or Calibration()

    def cal_of(x) -> Calibration:
        return replace(start, **dict(zip(FITTED, (float(v) for v in x), strict=True)))

    def resid(x):
        c = cal_of(x)
        return [math.log(predict_throughput(p, c) / p.published) for p in fit]

    x0 = [min(max(getattr(start, k), BOUNDS[k][0] + 1e-6), BOUNDS[k][1] - 1e-6) for k in FITTED]
    lo, hi = zip(*(BOUNDS[k] for k in FITTED), strict=True)
    res = least_squares(resid, x0, bounds=(lo, hi), x_scale="jac")
    return cal_of(res.x)


def fit_fragmentation(points: list[Point] | None = None) -> float:
    """The allocator factor (reserved / allocated, at least 1) that best fits the memory of the ``fit``
    points: ``exp(mean(log(published / allocated)))``, the least-squares fit in log space."""
    points = load_points() if points is None else points
    fit = [p for p in points if p.split == "fit" and p.memory_gib is not None]
    logs = [math.log(p.memory_gib / predict_allocated_gib(p)) for p in fit]
    return max(1.0, math.exp(sum(logs) / len(logs)))


def summary(rows: list[Row]) -> dict:
    """Largest absolute throughput error on fit and held-out points, the held-out memory error, and
    whether the predicted recipe ranking equals the published one in every group."""

    def worst(split, attr):
        vals = [abs(getattr(r, attr)) for r in rows if r.point.split == split and getattr(r, attr) is not None]
        return max(vals) if vals else None

    return {
        "fit_max_abs_error": worst("fit", "error"),
        "held_out_max_abs_error": worst("held_out", "error"),
        "held_out_max_abs_memory_error": worst("held_out", "memory_error"),
        "fit_max_abs_memory_error": worst("fit", "memory_error"),
        "ranking_matches": recipe_ranking(rows, "predicted") == recipe_ranking(rows, "published"),
        "ranking_predicted": recipe_ranking(rows, "predicted"),
        "ranking_published": recipe_ranking(rows, "published"),
    }


def format_table(rows: list[Row], cal: Calibration) -> str:
    """The ``lowprec estimate --validate`` table: one line per point, fitted ones marked, errors in %."""
    cols = [(h, "left") for h in ("point", "split", "hardware", "layout", "recipe", "figure")]
    cols += [(h, "right") for h in ("published", "predicted", "error", "mem pub", "mem pred", "error")]
    cells = []
    for r in rows:
        p = r.point
        lay = f"{p.dp_shard}x{p.tp} b{p.batch} s{p.seq // 1024}k {p.ac[:3]}{'' if p.compile else ' eager'}"
        fig = "tok/s/GPU" if p.tokens_per_s_per_gpu is not None else "speedup/bf16"
        fmt = (lambda v: f"{v:,.0f}") if p.tokens_per_s_per_gpu is not None else (lambda v: f"{v:.3f}")
        mem = (
            (f"{p.memory_gib:.1f}", f"{r.predicted_memory_gib:.1f}", f"{100 * r.memory_error:+.1f}%")
            if r.memory_error is not None
            else ("-", "-", "-")
        )
        err = f"{100 * r.error:+.1f}%"
        cells.append((p.id, p.split, p.hardware, lay, p.recipe, fig, fmt(p.published), fmt(r.predicted), err, *mem))
    lines = [render_table(cols, cells)]
    s = summary(rows)
    lines += [
        "",
        "calibration: " + ", ".join(f"{k}={getattr(cal, k):.3f}" for k in FITTED),
        f"throughput error: fit points max {100 * s['fit_max_abs_error']:.1f}%, "
        f"held-out points max {100 * s['held_out_max_abs_error']:.1f}%",
    ]
    if s["held_out_max_abs_memory_error"] is not None:
        lines.append(
            f"memory error: fit points max {100 * s['fit_max_abs_memory_error']:.1f}%, "
            f"held-out points max {100 * s['held_out_max_abs_memory_error']:.1f}%"
        )
    lines.append(
        "recipe ranking (fastest first) "
        + ("matches the published one in every group" if s["ranking_matches"] else "DIFFERS from the published one")
        + ": "
        + "; ".join(f"{g}: {' > '.join(v)}" for g, v in s["ranking_published"].items())
    )
    return "\n".join(lines)


#: The generated table's markers in ``docs/estimator.md`` (``fit_cost_model --docs`` rewrites what lies between).
TABLE_BEGIN = "<!-- estimate-validate-table:begin (generated by fit_cost_model --docs from published.yaml) -->"
TABLE_END = "<!-- estimate-validate-table:end -->"


def markdown_table(rows: list[Row]) -> str:
    """The estimator page's predicted-vs-published table (Markdown, ``docs/estimator.md``), generated from
    ``published.yaml``."""
    out = [
        "| point | source | hardware | layout | catalog recipe (theirs) | published | predicted | error "
        "| memory published / predicted GiB | split |",
        "|---|---|---|---|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        p = r.point
        lay = (
            f"FSDP {p.dp_shard}"
            + (f" x TP {p.tp}" + (" async" if p.async_tp else "") if p.tp > 1 else "")
            + f", batch {p.batch}, seq {p.seq}, AC {p.ac}, {'compile' if p.compile else 'eager'}"
        )
        if p.tokens_per_s_per_gpu is not None:
            pub, pred = f"{p.published:,.0f} tok/s/GPU", f"{r.predicted:,.0f}"
        else:
            pub, pred = f"{p.published:.3f}x bf16", f"{r.predicted:.3f}x"
        mem = (
            f"{p.memory_gib:g} / {r.predicted_memory_gib:.1f} ({100 * r.memory_error:+.0f}%)"
            if r.memory_error is not None
            else "-"
        )
        out.append(
            f"| `{p.id}` | [{p.source}]({p.url}) {p.table} | {p.hardware} | {lay} "
            f"| `{p.recipe}` ({p.published_recipe}) | {pub} | {pred} | {100 * r.error:+.1f}% | {mem} "
            f"| {p.split.replace('_', '-')} |"
        )
    return "\n".join(out)


def replace_table_block(text: str, table: str) -> str:
    """``text`` with the block between ``TABLE_BEGIN`` and ``TABLE_END`` replaced by ``table``; raises
    ``ValueError`` if the markers are missing."""
    a, b = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if a < 0 or b < a:
        raise ValueError("the page has no estimate-validate-table markers")
    return text[: a + len(TABLE_BEGIN)] + "\n" + table + "\n" + text[b:]
