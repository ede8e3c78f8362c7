"""Matplotlib figures for the ablation report (Agg backend; PNG files)."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COMPONENT_LABELS = {
    "mem_params_bytes": "parameters",
    "mem_grads_bytes": "gradients",
    "mem_master_bytes": "master weights",
    "mem_optim_states_bytes": "optimizer states",
}


def _colors(order):
    cmap = plt.get_cmap("tab10")
    return {name: cmap(i % 10) for i, name in enumerate(order)}


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _band(ax, x, c, color, label: str, marker: str = "") -> None:
    """The mean line of a ``SeedCurves`` and, when it has one, its band (shaded)."""
    ax.plot(x, c.mean, marker or "-", color=color, lw=1.5, label=label, ms=4)
    if c.lo is not None:
        ax.fill_between(x, c.lo, c.hi, color=color, alpha=0.2, lw=0)


def loss_curves(curves: dict, order, tokens_per_step: int, path: Path) -> Path:
    """Training (left) and validation (right) loss per recipe: mean over seeds with the min-max band over seeds.

    Args:
        curves: ``{recipe: (train, val)}``, each an ``lowprec_lab.stats.SeedCurves`` (``band="minmax"``; train
            smoothed by its ``window``) or None; loss in nats.
        order: recipe names in legend order (colours follow it).
        tokens_per_step: tokens per optimizer step; the x axis is tokens seen after the step, ``(step + 1) * it``.
        path: the PNG to write.
    """
    col = _colors(order)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    window = None
    for name in (n for n in order if n in curves):
        train, val = curves[name]
        for ax, c, marker in ((a, train, ""), (b, val, "o-")):
            if c is not None:
                _band(ax, (c.steps + 1) * tokens_per_step, c, col[name], f"{name} (n={c.n})", marker)
        window = train.window if train is not None else window
    a.set(title=f"training loss (trailing mean over {window} steps)", xlabel="tokens", ylabel="loss (nats)")
    b.set(title="validation loss", xlabel="tokens", ylabel="loss (nats)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("mean over seeds; band: min-max over seeds (n = seeds)", fontsize=9)
    return _save(fig, path)


def relative_loss_error(train: dict, val: dict, order, control: str, margin: float, path: Path) -> Path:
    """DeepSeek-V3's relative loss error against the control, two panels: smoothed training loss, validation loss.

    Args:
        train, val: ``{recipe: SeedCurves | None}`` from ``lowprec_lab.stats.relative_loss_error`` (dimensionless;
            drawn in percent), one line per non-control recipe: the mean over paired seeds with its paired
            t-band (no band with one seed: the legend says so).
        order: recipe names (colours follow it; the control is skipped).
        control: the control recipe's name (the zero line).
        margin: the relative non-inferiority margin (``report.margin``), drawn at +margin and, dashed, -margin.
        path: the PNG to write.
    """
    col = _colors(order)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.8))
    window, level = None, None
    for ax, curves, marker in ((a, train, ""), (b, val, "o-")):
        for name in (n for n in order if n != control and curves.get(n) is not None):
            c = curves[name]
            band = "" if c.lo is not None else ", no band: 1 seed"
            _band(ax, c.steps, _percent(c), col[name], f"{name} (n={c.n}{band})", marker)
            level = c.level
            window = c.window if ax is a else window
        ax.axhline(0, color="k", lw=0.8)
        ax.axhline(100 * margin, color="tab:red", lw=1, label=f"margin +{100 * margin:.3g}%")
        ax.axhline(-100 * margin, color="tab:red", lw=1, ls="--", label=f"-{100 * margin:.3g}%")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set(xlabel="optimizer step", ylabel="relative loss error (%)")
    a.set_title(f"training loss, trailing mean over {window} steps")
    b.set_title("validation loss")
    fig.suptitle(
        f"(L_recipe - L_control) / L_control against {control}, paired by seed; mean over seeds, band: "
        f"{_level(level)} paired t-interval (none with 1 seed); > 0: recipe worse",
        fontsize=9,
    )
    return _save(fig, path)


def _percent(c):
    """A ``SeedCurves`` in percent (mean, lo, hi times 100) for drawing."""
    return replace(
        c, mean=100 * c.mean, lo=None if c.lo is None else 100 * c.lo, hi=None if c.hi is None else 100 * c.hi
    )


def _level(level) -> str:
    return "95%" if level is None else f"{level:.0%}"


def memory_bars(rows, runs, order, path: Path) -> Path:
    first = {}
    for r in runs:
        first.setdefault(r.recipe, r)
    names = [n for n in order if n in first]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = [0.0] * len(names)
    for key, label in COMPONENT_LABELS.items():
        vals = [first[n].metrics.get(key, 0.0) / 2**20 for n in names]
        a.bar(names, vals, bottom=bottom, label=label)
        bottom = [x + y for x, y in zip(bottom, vals)]
    for i, n in enumerate(names):
        a.text(
            i, bottom[i], f"{first[n].metrics['state_bytes_per_param']:.2f} B/p", ha="center", va="bottom", fontsize=8
        )
    a.set(title="training state by component (exact bytes)", ylabel="MiB")
    a.legend(fontsize=8)
    peak = {row["recipe"]: row["peak_bytes"] / 2**20 for row in rows}
    growth = {row["recipe"]: row["peak_growth_bytes"] / 2**20 for row in rows}
    b.bar(names, [peak[n] - growth[n] for n in names], color="lightgray", label="resident at run start")
    b.bar(
        names,
        [growth[n] for n in names],
        bottom=[peak[n] - growth[n] for n in names],
        color="gray",
        label="growth during the run",
    )
    b.set(title="peak memory of the run", ylabel="MiB")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def throughput_bars(rows, path: Path, mark: str = "") -> Path:
    """Mean tokens/s per recipe; ``mark`` (e.g. "contended: 2 runs at a time") goes in the title."""
    rows = [r for r in rows if r["n_ok"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([r["recipe"] for r in rows], [r["tokens_per_s"] for r in rows], color="tab:blue")
    title = "training throughput (after timing warm-up)" + (f"\n{mark}" if mark else "")
    ax.set(title=title, ylabel="tokens/s")
    ax.tick_params(axis="x", rotation=30)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def comm_bars(runs, order, kinds, path: Path) -> Path:
    """Bytes per step by collective kind (stacked by wire dtype within each kind), first seed per recipe."""
    first = {}
    for r in runs:
        first.setdefault(r.recipe, r)
    names = [n for n in order if n in first and any(k.startswith("comm_") for k in first[n].metrics)]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names) * len(kinds) / 2), 4))
    width = 0.8 / len(kinds)
    dtype_colors = {"fp8": "tab:green", "bfloat16": "tab:orange", "float32": "tab:blue", "float16": "tab:purple"}
    seen = set()
    for ki, kind in enumerate(kinds):
        for ni, n in enumerate(names):
            m = first[n].metrics
            bottom = 0.0
            for dt, color in dtype_colors.items():
                v = m.get(f"comm_{kind}_{dt}_bytes", 0.0) / 2**20
                if v:
                    ax.bar(
                        ni + ki * width,
                        v,
                        width,
                        bottom=bottom,
                        color=color,
                        edgecolor="black",
                        linewidth=0.3,
                        label=dt if dt not in seen else None,
                    )
                    seen.add(dt)
                    bottom += v
    ax.set_xticks([i + width * (len(kinds) - 1) / 2 for i in range(len(names))], names, rotation=30)
    ax.set(title="bytes per step, bars left to right: " + ", ".join(kinds), ylabel="MiB")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def grad_norm_curves(runs, order, path: Path) -> Path:
    col = _colors(order)
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        ax.plot(
            [r.tokens(s) for s, _ in r.curves["grad_norm"]],
            [v for _, v in r.curves["grad_norm"]],
            color=col[r.recipe],
            lw=1,
            label=f"{r.recipe} s{r.seed}",
        )
    ax.set(title="gradient norm before clipping", xlabel="tokens", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def telemetry_heatmap(run, panels, path: Path) -> Path:
    """One heatmap per (role, stat) panel: rows are FP8 linears in model order, columns sampled steps. An infinite
    value is a blank cell and the colour scale spans the finite ones (an infinite value left it no range: matplotlib
    raised OverflowError). Unscaled FP8 gives them: a gradient flushed to zero in both the FP8 and the reference GEMM
    has an SQNR of +inf, which MLflow stores as the largest float (``sys.float_info.max``), read back as such."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 5), squeeze=False)
    for ax, (role, stat) in zip(axes[0], panels):
        keys = [k for k in run.telemetry if k.endswith(f"/{role}/{stat}")]
        layers = sorted({k[len("fp8/") : -len(f"/{role}/{stat}")] for k in keys}, key=_layer_order)
        steps = sorted({s for k in keys for s, _ in run.telemetry[k]})
        grid = [[float("nan")] * len(steps) for _ in layers]
        for i, layer in enumerate(layers):
            for s, v in run.telemetry[f"fp8/{layer}/{role}/{stat}"]:
                grid[i][steps.index(s)] = v
        values = np.asarray(grid, dtype=np.float64)
        blank = ~np.isfinite(values) | (np.abs(values) >= sys.float_info.max)
        # the masked cells hold NaN, not the float maximum: matplotlib scales the data under the mask too, and the
        # maximum overflowed there (a RuntimeWarning printed under every report of unscaled FP8)
        values[blank] = np.nan
        im = ax.imshow(np.ma.masked_array(values, blank), aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set(title=f"{role} {stat}", xlabel="step")
        ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7, rotation=90)
        ax.set_yticks(range(len(layers)), layers, fontsize=6)
        fig.colorbar(im, ax=ax, fraction=0.05)
    fig.suptitle(f"FP8 telemetry: {run.recipe} (seed {run.seed})")
    return _save(fig, path)


def _layer_order(fqn: str):
    parts = fqn.split(".")
    return [int(p) if p.isdigit() else p for p in parts]


def predicted_vs_measured(runs, order, components, path: Path) -> Path:
    """Grouped bars per component: measured (solid) and predicted (hatched), one colour per recipe."""
    first = {}
    for r in runs:
        first.setdefault(r.recipe, r)
    names = [n for n in order if n in first]
    col = _colors(order)
    fig, ax = plt.subplots(figsize=(13, 4.8))
    width = 0.8 / max(1, 2 * len(names))
    for j, n in enumerate(names):
        m = first[n].metrics
        for k, c in enumerate(components):
            x = k + (2 * j) * width - 0.4
            ax.bar(x, m.get(c, 0) / 2**20, width, color=col[n], label=n if k == 0 else None)
            ax.bar(
                x + width,
                m.get(f"pred_{c}", 0) / 2**20,
                width,
                color=col[n],
                alpha=0.45,
                hatch="//",
                label=f"{n} (predicted)" if k == 0 else None,
            )
    ax.set_xticks(
        range(len(components)),
        [c.removeprefix("mem_").removesuffix("_bytes") for c in components],
        rotation=20,
        fontsize=8,
    )
    ax.set(title="memory by component: measured (solid) vs predicted (hatched)", ylabel="MiB")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=6, ncol=4)
    return _save(fig, path)


@dataclass(frozen=True)
class ForestRow:
    """One recipe's row of the forest plot: the paired relative difference of its final validation loss to the
    control (dimensionless, > 0 = worse; drawn in percent) and its interval (``lo``/``hi`` None: one paired seed, a
    point alone; ``mean`` None: no paired seed, the row says ``label`` only); ``label``: the verdict as the table
    prints it; ``kind``: ``non-inferior`` (green), ``inferior`` (red), ``open`` (inconclusive, no interval: grey) or
    ``diverged`` (dark red, a cross)."""

    name: str
    mean: float | None
    lo: float | None
    hi: float | None
    label: str
    kind: str = "open"


_FOREST_COLORS = {"non-inferior": "tab:green", "inferior": "tab:red", "open": "tab:gray", "diverged": "darkred"}
#: Control characters and ``$`` (matplotlib reads ``$...$`` as mathtext): a recipe name is a string from the store.
_PLOT_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def plot_text(x, limit: int = 48) -> str:
    """``x`` as literal text on a figure: one line, ``$`` escaped so matplotlib draws it as typed (no mathtext),
    cut to ``limit`` characters."""
    s = _PLOT_UNSAFE.sub(" ", str(x))
    s = s if len(s) <= limit else s[: limit - 3] + "..."
    return s.replace("$", r"\$")


def verdict_forest(rows: list[ForestRow], margin: float, control: str, level: str, path: Path) -> Path:
    """The verdicts at a glance: one line per recipe (top to bottom in ``rows`` order) with its paired relative
    difference of the final validation loss to ``control`` and its ``level`` interval (e.g. ``"95%"``), a shaded
    band for +-``margin`` (relative, 0.0025 = 0.25%), a line at 0, and the verdict printed at the right.

    Args:
        rows: ``ForestRow`` per recipe (the control is the zero line, not a row).
        margin: the relative non-inferiority margin (``report.margin``).
        control: the control recipe's name (axis label).
        level: the intervals' level as printed (``"95%"``, or "the look's level" under ``seeds=auto``).
        path: the PNG to write.
    """
    n = max(1, len(rows))
    fig, ax = plt.subplots(figsize=(9.5, 1.3 + 0.42 * n))
    m = 100 * margin
    ax.axvspan(-m, m, color="tab:green", alpha=0.12, lw=0)
    ax.axvline(m, color="tab:green", lw=0.8, alpha=0.6)
    ax.axvline(0, color="black", lw=0.9)
    ys = list(range(n - 1, -1, -1))
    xs = [m, -m]
    for y, r in zip(ys, rows):
        color = _FOREST_COLORS.get(r.kind, "tab:gray")
        if r.mean is not None:
            x = 100 * r.mean
            xs.append(x)
            if r.lo is not None and r.hi is not None:
                xs += [100 * r.lo, 100 * r.hi]
                ax.plot([100 * r.lo, 100 * r.hi], [y, y], color=color, lw=2.2, solid_capstyle="butt")
            ax.plot([x], [y], "D" if r.kind != "diverged" else "X", color=color, ms=7)
    lo, hi = min(xs), max(xs)
    pad = 0.08 * (hi - lo or 1.0)
    ax.set_xlim(lo - pad, hi + pad)
    ax.set_ylim(-0.7, n - 0.3)
    ax.set_yticks(ys, [plot_text(r.name) for r in rows[:n]] if rows else [])
    for y, r in zip(ys, rows):
        shown = r.label if r.mean is not None else f"{r.label} (no paired seed)"
        ax.annotate(
            plot_text(shown, 60),
            (1.01, y),
            xycoords=("axes fraction", "data"),
            va="center",
            fontsize=9,
            color=_FOREST_COLORS.get(r.kind, "tab:gray"),
        )
    ax.set_xlabel(f"final validation loss vs {plot_text(control)}: paired relative difference (%), > 0 = worse")
    ax.set_title(
        f"mean over paired seeds with its {plot_text(level)} interval; shaded: the margin ±{m:.3g}%", fontsize=9
    )
    ax.grid(alpha=0.3, axis="x")
    return _save(fig, path)
