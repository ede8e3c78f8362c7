"""The DeepSeek-V3 FP8 reproduction study: ``reports/<id>/deepseek_v3.md`` beside report.md.

Each section quotes the paper (DeepSeek-V3 technical report, arXiv 2412.19437) with its section number and puts
what this run measured next to it:

1. Accumulation precision (3.3.2): ``deepseek_numerics.accumulation_errors`` on Gaussian operands and on the
   weight-gradient GEMM operands captured from the control's trained model.
2. Granularity under outliers (3.3.2): ``deepseek_numerics.granularity_stats`` per layer and role on the captured
   operands, and on a captured activation with injected per-channel outliers.
3. Training parity (3.3, B.1): ``deepseek_v3`` against ``bf16``, the relative loss error with its paired band and
   the main report's verdict at ``report.margin`` (the experiment sets 0.25%, the paper's figure).
4. Component ablations (3.3, B.2): every ``deepseek_v3_*`` recipe of the ablation against ``deepseek_v3`` with the
   lab's paired verdicts (``lowprec_lab.report.verdict_table.build_table`` with ``deepseek_v3`` as the control).
   The experiment's no-promotion arm is ``deepseek_v3_no_promotion_hopper``: training on the accumulator section 1
   measures (``HOPPER_ACCUMULATOR``, fitted to an H200), so the two sections speak of one accumulator.

Sections 3 and 4 run once per model of the ablation group (``models`` in the experiment: one ablation per model).
The captured operands come from the control's lowest finished seed: its final checkpoint (the experiment sets
``train.checkpoint_every`` to the step count) and the corpus of its ``config.yaml``; without a checkpoint the
captured parts say so. Settings: ``study.deepseek_v3.<field>`` (``Settings``).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from lowprec.data import TokenBatches  # noqa: E402
from lowprec.errors import ConfigError  # noqa: E402
from lowprec.model import build_model  # noqa: E402
from lowprec.train.checkpoint import load_model_weights  # noqa: E402
from lowprec.train.checkpoint_files import step_folders  # noqa: E402
from lowprec_lab.plan.plan import Plan  # noqa: E402
from lowprec_lab.plan.preflight import saved_plan  # noqa: E402
from lowprec_lab.report import plots, verdict_table  # noqa: E402
from lowprec_lab.report.verdict_table import LEVEL  # noqa: E402
from lowprec_lab.runtime.startup import prepare_data  # noqa: E402
from lowprec_lab.stats import relative_loss_error  # noqa: E402
from lowprec_lab.studies import deepseek_numerics as dn  # noqa: E402
from lowprec_lab.studies.registry import StudyContext, group_ablations, register  # noqa: E402
from lowprec_lab.tracking.checkpoint_dirs import own_checkpoint_dir, tagged_checkpoint_dir  # noqa: E402
from lowprec_lab.tracking.runs import load_runs  # noqa: E402

REFERENCE = "deepseek_v3"
#: The no-promotion arm the experiment trains: ``deepseek_v3`` on section 1's accumulator (``HOPPER_ACCUMULATOR``).
HOPPER_ARM = "deepseek_v3_no_promotion_hopper"
CONTROL = "bf16"
PAPER_ACCUM_MAX_REL_ERR = 0.02  # 3.3.2: "the maximum relative error is nearly 2%" (K = 4096, no promotion)
PAPER_LOSS_ERR = 0.0025  # 3.3 / B.1: "relative loss error ... consistently remains below 0.25%"


@dataclass(frozen=True)
class Settings:
    """``study.deepseek_v3``: ``k_max`` largest K of the Gaussian accumulation test (powers of two from 256);
    ``gemm_rows``: M = N of its GEMMs; ``intervals``: the promotion intervals N_C; ``capture_sequences``: sequences
    of the run's length fed to the captured model (its weight-gradient K = their tokens); ``outlier_factors``: the
    injected channel outliers' sizes; ``outlier_channels``: how many channels get them."""

    k_max: int = 16384
    gemm_rows: int = 64
    intervals: tuple[int, ...] = (32, 64, 128, 256)
    capture_sequences: int = 64
    outlier_factors: tuple[float, ...] = (1.0, 10.0, 100.0, 1000.0)
    outlier_channels: int = 4

    @classmethod
    def from_dict(cls, d: dict) -> Settings:
        known = {f.name for f in fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise ConfigError(f"study.deepseek_v3 has unknown field(s) {bad}; known: {sorted(known)}")
        s = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
        if s.k_max < 256 or s.gemm_rows < 1 or s.capture_sequences < 1 or any(n < 1 for n in s.intervals):
            raise ConfigError(
                f"study.deepseek_v3: k_max={s.k_max} must be >= 256, gemm_rows={s.gemm_rows}, capture_sequences="
                f"{s.capture_sequences} and intervals={list(s.intervals)} >= 1"
            )
        return s


def _plan(tracker, run_id: str) -> Plan:
    """The plan run ``run_id`` trained under, from its ``config.yaml`` artifact."""
    with tempfile.TemporaryDirectory() as d:
        return saved_plan(Path(tracker.client.download_artifacts(run_id, "config.yaml", d)).read_text())


# ---- captured operands -------------------------------------------------------------------------------------------


def _capture(ctx: StudyContext, settings: Settings) -> tuple[list[dn.Captured], str]:
    """The captured operands of the control's lowest finished seed, and a line saying where they come from (or
    why there are none: an empty list)."""
    ctrl = sorted((r for r in ctx.runs if r.recipe == ctx.control and r.status == "FINISHED"), key=lambda r: r.seed)
    if not ctrl:
        return [], f"no finished `{ctx.control}` run to capture operands from"
    run = ctrl[0]
    tags = ctx.tracker.client.get_run(run.run_id).data.tags
    # a tag is a record anyone who writes the store can set: read only this store's own folder of the run
    runs_root = ctx.tracker.spool.folder.parent  # paths.runs of this command (the spool lies in it)
    folder, _ = tagged_checkpoint_dir(runs_root, run.run_id, tags.get("checkpoint_dir"))
    if folder is None and tags.get("checkpoint_dir"):
        return [], f"`{ctx.control}` seed {run.seed}: its checkpoint_dir tag lies outside this store's folder: not read"
    own = own_checkpoint_dir(runs_root, run.run_id) if folder is not None else None
    steps = [p for _, p in step_folders(folder) if p.resolve().is_relative_to(own)] if folder is not None else []
    if not steps:
        return [], f"`{ctx.control}` seed {run.seed} left no checkpoint (the experiment sets train.checkpoint_every)"
    plan = _plan(ctx.tracker, run.run_id)
    torch.manual_seed(0)
    model = build_model(plan.model)  # the Llama or the DeepSeekMoE model
    load_model_weights(steps[-1], model)  # a checkpoint is data: tensors only, checked before a byte is read
    data = prepare_data(plan.data, plan.train.progress)
    seq = plan.train.seq_len
    batches = TokenBatches(data.train, data.val, seq, settings.capture_sequences, run.seed)
    tokens, targets = batches.train_batch(0)
    caps = dn.capture_linears(model, tokens, targets)
    where = (
        f"`{ctx.control}` seed {run.seed}, checkpoint `{steps[-1].name}` (model `{plan.model_name}`), one forward "
        f"and backward in FP32 on {tokens.numel()} training tokens ({settings.capture_sequences} x {seq})"
    )
    return caps, where


# ---- sections ----------------------------------------------------------------------------------------------------


def _fmt_nc(nc) -> str:
    return "none" if nc is None else str(nc)


def _accumulation_section(
    caps, where: str, settings: Settings, out: Path, trained: bool = True
) -> tuple[list[str], dict]:
    """Section 1: the accumulation error of e4m3 GEMMs on ``HOPPER_ACCUMULATOR`` against K and the promotion interval,
    on Gaussian operands and on the weight-gradient operands captured in ``caps`` (none: Gaussian only; ``where``
    says where they came from). ``trained``: whether the ablation trained ``HOPPER_ARM`` (section 4 then judges it;
    else the section says how to). Draws ``out/dsv3_accumulation.png``; returns the section's markdown lines and its
    headline numbers for the study's JSON."""
    model = dn.HOPPER_ACCUMULATOR
    rows, sources = _accumulation_rows(caps, settings, model)
    at = {(r.operands, r.scaling, r.promotion): r for r in rows if r.k == (4096 if settings.k_max >= 4096 else None)}
    g4096 = at.get(("gaussian", "rowwise", None))
    headline = {
        "accumulator": {**asdict(model), "describe": model.describe()},
        "k4096_no_promotion_max_rel_err": g4096.max_rel_err if g4096 else None,
        "k4096_promoted_128_max_rel_err": at[("gaussian", "rowwise", 128)].max_rel_err if g4096 else None,
        # Gaussian, rowwise: N_C ("none" or the interval) -> {K: Frobenius relative error}
        "gaussian_rel_err_by_k": {
            _fmt_nc(nc): {
                r.k: r.rel_err for r in rows if (r.operands, r.scaling, r.promotion) == ("gaussian", "rowwise", nc)
            }
            for nc in [None, *settings.intervals]
        },
    }
    _accumulation_figure(rows, sources, settings, model, out / "dsv3_accumulation.png")
    return _accumulation_lines(rows, g4096, headline, where, settings, model, trained), headline


def _accumulation_rows(caps, settings: Settings, model) -> tuple[list, list[str]]:
    """Section 1's measurements: ``deepseek_numerics.accumulation_errors`` rows on Gaussian operands (K up to
    ``k_max``) and, with ``caps``, on the captured weight-gradient operands, on the accumulator ``model``; and the
    operand sources measured."""
    m = settings.gemm_rows
    a, b = dn.gaussian_operands(m, m, settings.k_max)
    rows = dn.accumulation_errors(a, b, dn.ks_up_to(settings.k_max), [None, *settings.intervals], "gaussian", model)
    sources = ["gaussian"]
    if caps:
        ga, gb, fqn = dn.wgrad_operands(caps, m, m)
        k_cap = ga.shape[1]
        ncs = [None, *settings.intervals]
        rows += dn.accumulation_errors(ga, gb, dn.ks_up_to(k_cap), ncs, f"captured {fqn}", model)
        sources.append(f"captured {fqn}")
    return rows, sources


def _accumulation_figure(rows, sources: list[str], settings: Settings, model, path: Path) -> None:
    """Section 1's figure at ``path``: the rowwise relative error against K per promotion interval, one panel per
    operand source; ``model``: the accumulator measured, named in the title."""
    fig, axes = plt.subplots(1, len(sources), figsize=(6 * len(sources), 4.5), squeeze=False)
    for ax, src in zip(axes[0], sources):
        for nc in [None, *settings.intervals]:
            pts = [(r.k, r.rel_err) for r in rows if r.operands == src and r.scaling == "rowwise" and r.promotion == nc]
            ax.loglog(*zip(*pts), "o-" if nc is None else ".-", label=f"N_C = {_fmt_nc(nc)}", lw=2 if nc is None else 1)
        ax.set(xlabel="K", ylabel="||C - C_fp64|| / ||C_fp64||", title=src[:60])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"e4m3 GEMM, {model.describe()}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _accumulation_lines(
    rows, g4096, headline: dict, where: str, settings: Settings, model, trained: bool = True
) -> list[str]:
    """Section 1's markdown: the paper's claim, the setup, the table of ``rows``, the figure and, with the K = 4096
    Gaussian row ``g4096``, the headline against the paper's figure; ``model``: the accumulator measured."""
    m = settings.gemm_rows
    lines = [
        "## 1. Accumulation precision (paper 3.3.2)",
        "",
        '> "the accumulation precision of FP8 GEMM on NVIDIA H800 GPUs is limited to retaining around 14 bits, '
        "which is significantly lower than FP32 accumulation precision. [...] Taking GEMM operations of two random "
        "matrices with K = 4096 for example, in our preliminary test, the limited accumulation precision in Tensor "
        'Cores results in a maximum relative error of nearly 2%." Their fix: promote partial sums to FP32 on CUDA '
        "cores every N_C = 128 elements.",
        "",
        f"Measured: e4m3 operands (rowwise scales; and DeepSeek's 1x128 tiles, promotion 128 or none), M = N = {m}, "
        f"an emulated {model.describe()} (`lowprec.float8.accumulator.HOPPER_ACCUMULATOR`; source: {model.source}), "
        "against the FP64 product of the same e4m3 operands (so only accumulation error counts). Max rel. err.: "
        "over the outputs at least as large as the median (cancelling outputs have no meaningful relative error). "
        f"Captured operands: {where or 'none'}.",
        "",
        "| operands | scaling | K | N_C | rel. error (Frobenius) | max rel. error |",
        "|---|---|---:|---:|---:|---:|",
        *(
            f"| {r.operands} | {r.scaling} | {r.k} | {_fmt_nc(r.promotion)} | {r.rel_err:.2e} | {r.max_rel_err:.2e} |"
            for r in rows
        ),
        "",
        "![accumulation error vs K](dsv3_accumulation.png)",
        "",
    ]
    if g4096:
        p128 = headline["k4096_promoted_128_max_rel_err"]
        size = (
            "The growth with K and its removal by promotion reproduce, and the size is the emulation's estimate for "
            "the GPU it was fitted to (its source above; the paper's H800 may differ)."
            if model.fitted
            else "The growth with K and its removal by promotion reproduce; the size does not: this accumulator is "
            "not fitted to a measurement of the hardware, whose alignment and truncation inside the tensor core are "
            "not public (`benchmarks/hopper_accumulation.py` measures a Hopper GPU and fits it)."
        )
        lines += [
            f"**K = 4096, Gaussian, no promotion: max relative error {100 * g4096.max_rel_err:.3f}% (paper: nearly "
            f"{100 * PAPER_ACCUM_MAX_REL_ERR:.0f}%); with promotion every 128: {100 * p128:.4f}%.** {size}",
            "",
        ]
    if trained:
        what = (
            f"section 4's `{HOPPER_ARM}` trains `{REFERENCE}` without promotion on this same emulated accumulator "
            "(every FP8 GEMM, all of K)."
        )
    else:  # its emulation is elementwise float64 over every product: hours of CPU for one run at this scale
        what = (
            f"`{HOPPER_ARM}` trains `{REFERENCE}` without promotion on this same emulated accumulator (every FP8 "
            "GEMM, all of K); it is not in this ablation, since the emulation aligns every product of every GEMM "
            "one by one (on a 2-core CPU one `tiny` run of 20 steps had not finished after 9 minutes). Add it to "
            "`recipes` to train it."
        )
    lines += [f"What this error does to training: {what}", ""]
    return lines


def _granularity_section(caps, where: str, settings: Settings, out: Path) -> list[str]:
    lines = ["## 2. Granularity under outliers (paper 3.3.2)", ""]
    lines += [
        '> "we apply a fine-grained quantization method [...] (1) for activations, we group and scale elements on a '
        "1x128 tile basis (i.e., per token per 128 channels); and (2) for weights, we group and scale elements on a "
        "128x128 block basis [...] our method can better accommodate outliers by adapting the scale according to "
        'smaller groups of elements."',
        "",
    ]
    if not caps:
        return [*lines, f"Not measured: {where}.", ""]
    table = []
    for c in caps:
        for role, t in (("input", c.input), ("weight", c.weight), ("grad_output", c.grad_output)):
            if t is not None:
                table += [(c, role, s) for s in dn.granularity_stats(f"{c.fqn}:{role}", t)]
    lines += [
        f"Every block linear's GEMM operands, e4m3, current scaling along the GEMM's K (rows: tokens for input and "
        f"grad_output, output features for weight). Source: {where}. Mean over layers per role:",
        "",
        "| module | operand | " + " | ".join(f"{g} SQNR dB" for g in dn.GRANULARITIES) + " | flushed (tensorwise) |",
        "|---|---|" + "---:|" * (len(dn.GRANULARITIES) + 1),
    ]
    roles = sorted({(c.role, role) for c, role, _ in table})
    for mod, role in roles:
        sel = [s for c, r, s in table if c.role == mod and r == role]
        cells = [sum(s.sqnr_db for s in sel if s.granularity == g) / max(1, sum(s.granularity == g for s in sel))
                 for g in dn.GRANULARITIES]  # fmt: skip
        flushed = [s.flushed for s in sel if s.granularity == "tensorwise"]
        lines.append(
            f"| {mod} | {role} | " + " | ".join(f"{v:.1f}" for v in cells) + f" | {sum(flushed) / len(flushed):.2e} |"
        )
    lines += ["", "<details><summary>per layer: SQNR dB, saturated share, flushed share</summary>", ""]
    lines += ["| tensor | granularity | SQNR dB | saturated | flushed |", "|---|---|---:|---:|---:|"]
    lines += [f"| {s.tensor} | {s.granularity} | {s.sqnr_db:.1f} | {s.saturated:.1e} | {s.flushed:.1e} |"
              for _, _, s in table]  # fmt: skip
    lines += ["", "</details>", ""]
    # injected outliers in a captured activation: the input of the first block's w2 (the SwiGLU output)
    base = next((c for c in caps if c.role == "feed_forward.w2"), caps[0])
    res = {f: dn.granularity_stats("", dn.with_channel_outliers(base.input, f, settings.outlier_channels))
           for f in settings.outlier_factors}  # fmt: skip
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for g in dn.GRANULARITIES:
        ax.semilogx(list(res), [next(s.sqnr_db for s in res[f] if s.granularity == g) for f in res], "o-", label=g)
    ax.set(xlabel="outlier factor", ylabel="SQNR (dB)", title=f"{base.fqn} input, {settings.outlier_channels} channels")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "dsv3_outliers.png", dpi=110)
    plt.close(fig)
    lines += [
        f"Injected outliers: `{base.fqn}`'s input with {settings.outlier_channels} feature channels multiplied by "
        "the factor (e4m3, current scaling):",
        "",
        "| factor | " + " | ".join(f"{g} SQNR dB / flushed" for g in dn.GRANULARITIES) + " |",
        "|---:|" + "---|" * len(dn.GRANULARITIES),
        *(
            f"| {f:g} | "
            + " | ".join(
                f"{s.sqnr_db:.1f} / {s.flushed:.1e}" for g in dn.GRANULARITIES for s in res[f] if s.granularity == g
            )
            + " |"
            for f in res
        ),
        "",
        "![SQNR under injected channel outliers](dsv3_outliers.png)",
        "",
    ]
    return lines


def _parity_lines(aid: str, runs, margin: float, steps: int, out: Path) -> tuple[list[str], dict]:
    """bf16 against deepseek_v3 (section 3) and the components against deepseek_v3 (section 4) of one ablation."""
    ok = [r for r in runs if r.comparable]
    names = sorted({r.recipe for r in runs})
    model = aid
    lines: list[str] = []
    headline: dict = {}
    if CONTROL in names and REFERENCE in names:
        t = verdict_table.build_table(runs, [CONTROL, REFERENCE], CONTROL, margin, steps)
        row = t.rows[0]
        curves = {
            REFERENCE: relative_loss_error(_by_seed(ok, REFERENCE, "val_loss"), _by_seed(ok, CONTROL, "val_loss"))
        }
        train = {
            REFERENCE: relative_loss_error(
                _by_seed(ok, REFERENCE, "loss"), _by_seed(ok, CONTROL, "loss"), window=8, level=LEVEL
            )
        }
        fig = plots.relative_loss_error(
            train, curves, [CONTROL, REFERENCE], CONTROL, margin, out / f"dsv3_parity_{model}.png"
        )
        v = row.final
        headline = {
            "final_rel_loss_error": v.effect.mean if v else None,
            "verdict": v.verdict if v else None,
            "lo": v.effect.lo if v else None,
            "hi": v.effect.hi if v else None,
            "n": len(row.paired),
        }
        lines += [
            f"`{REFERENCE}` against `{CONTROL}`, {len(row.paired)} paired seeds, final validation loss: "
            + (_effect(v) if v else "no paired seed")
            + f". Margin {100 * margin:.3g}%.",
            "",
            f"![relative loss error]({fig.name})",
            "",
        ]
    else:
        lines += [f"No parity: the ablation lacks `{CONTROL}` or `{REFERENCE}`.", ""]
    comps = [n for n in names if n.startswith(REFERENCE + "_")]
    comp_rows = []
    if comps and REFERENCE in names:
        t = verdict_table.build_table(runs, [REFERENCE, *comps], REFERENCE, margin, steps)
        comp_rows = [(r.recipe, r.final, len(r.paired)) for r in t.rows]
    return lines, {"parity": headline, "components": comp_rows}


def _verdict_json(v, n: int) -> dict:
    if v is None:
        return {"n": n, "verdict": None}
    return {"n": n, "mean": v.effect.mean, "lo": v.effect.lo, "hi": v.effect.hi, "verdict": v.verdict}


def _effect(v) -> str:
    ci = "" if v.effect.lo is None else f", {v.level:.0%} CI [{100 * v.effect.lo:+.3f}%, {100 * v.effect.hi:+.3f}%]"
    return f"relative difference {100 * v.effect.mean:+.3f}%{ci}, verdict **{v.label}**"


def _by_seed(runs, name: str, key: str) -> dict[int, list[tuple[int, float]]]:
    return {r.seed: r.curves.get(key, []) for r in runs if r.recipe == name}


def _headline_table(head: dict, margin: float) -> list[str]:
    """Measured against the paper, one row per claim (the README quotes this table)."""
    acc = head["accumulation"]
    rows = ["## Headline: measured against the paper", "", "| claim (section) | paper | measured |", "|---|---|---|"]
    if acc.get("k4096_no_promotion_max_rel_err") is not None:
        # the paper's figure is H800's ~14-bit accumulator; the measured one is the emulation the section ran
        emulated = acc.get("accumulator", {}).get("describe", "emulated accumulator")
        rows.append(
            f"| max rel. error, K = 4096, no promotion (3.3.2; paper: H800, ~14 bits; measured: {emulated}) | ~2% | "
            f"{100 * acc['k4096_no_promotion_max_rel_err']:.3f}% (promotion every 128: "
            f"{100 * acc['k4096_promoted_128_max_rel_err']:.4f}%) |"
        )
    for model, m in head["models"].items():
        p = m["parity"]
        if p.get("final_rel_loss_error") is not None:
            ci = "" if p["lo"] is None else f", CI [{100 * p['lo']:+.3f}%, {100 * p['hi']:+.3f}%]"
            rows.append(
                f"| relative loss error vs BF16, `{model}` (3.3, B.1) | < 0.25% | "
                f"{100 * p['final_rel_loss_error']:+.3f}%{ci}, {p['n']} seeds: **{p['verdict']}** at "
                f"{100 * margin:.3g}% |"
            )
        for name, v in m["components"].items():
            if v.get("verdict") is not None:
                where, _, claim = COMPONENT_CLAIMS.get(name, ": ").partition(": ")
                rows.append(
                    f"| `{name}` vs `deepseek_v3`, `{model}` ({where}) | {claim} | "
                    f"{100 * v['mean']:+.3f}%: **{v['verdict']}** |"
                )
    return [*rows, ""]


COMPONENT_CLAIMS = {
    "deepseek_v3_no_promotion": "3.3.2: without promotion the 14-bit accumulation error grows with K",
    HOPPER_ARM: "3.3.2: without promotion the accumulation error grows with K (section 1's fitted Hopper accumulator)",
    "deepseek_v3_tensorwise": "3.3.2: per-tensor scaling makes quantization sensitive to activation outliers",
    "deepseek_v3_fp32_moments": "3.3.3: BF16 moments 'without incurring observable performance degradation'",
    "deepseek_v3_no_fp8_cache": "3.3.3: FP8 (and E5M6) activation caching to save memory, at no stated loss",
    "deepseek_v3_grad_blocks": "B.2: block-wise (128x128) activation-gradient quantization diverged on a 16B MoE",
}


@register("deepseek_v3", check_settings=lambda d: Settings.from_dict(d))
def deepseek_v3_study(ctx: StudyContext) -> Path:
    """Write ``<ctx.out>/deepseek_v3.md`` and its figures (module doc); returns the markdown path. A
    ``deepseek_v3.json`` beside it holds the headline numbers. Raises ``ConfigError`` for unknown settings."""
    settings = Settings.from_dict(_plan(ctx.tracker, ctx.parent.info.run_id).study.get("deepseek_v3") or {})
    caps, where = _capture(ctx, settings)
    trained = HOPPER_ARM in json.loads(ctx.parent.data.tags.get("recipes", "[]"))
    acc_lines, acc_head = _accumulation_section(caps, where, settings, ctx.out, trained)
    lines = [
        f"# DeepSeek-V3 FP8 at small scale: `{ctx.ablation_id}`",
        "",
        "Each section: the paper's claim (DeepSeek-V3 technical report, arXiv 2412.19437) beside what this run "
        "measured. Recipes: `deepseek_v3` (`lowprec recipes`) and its one-choice-undone variants.",
        "",
        *acc_lines,
        *_granularity_section(caps, where, settings, ctx.out),
        "## 3. Training parity (paper 3.3, appendix B.1)",
        "",
        '> "Compared with the BF16 baseline, the relative loss error of our FP8-training model remains consistently '
        'below 0.25%, a level well within the acceptable range of training randomness." (3.3; B.1 shows it on '
        "16B and 230B MoE models.)",
        "",
    ]
    comp_lines = [
        "## 4. Component ablations (paper 3.3, appendix B.2)",
        "",
        f"`{REFERENCE}` with one choice undone, each against `{REFERENCE}` (the control here), paired by seed, "
        f"final validation loss, {LEVEL:.0%} paired t-interval, Holm across the components, margin "
        f"{100 * ctx.margin:.3g}% (the lab's verdicts, `lowprec_lab.report.verdict_table`). > 0: the variant is worse.",
        "",
    ]
    headline = {"accumulation": acc_head, "models": {}}
    for aid, parent in group_ablations(ctx):
        runs = ctx.runs if aid == ctx.ablation_id else load_runs(ctx.tracker, parent.info.run_id)
        model = parent.data.tags.get("model", "?")
        steps = int(parent.data.params.get("train.steps", 0))
        p_lines, head = _parity_lines(aid, runs, ctx.margin, steps, ctx.out)
        headline["models"][model] = {
            "ablation": aid,
            "parity": head["parity"],
            "components": {n: _verdict_json(v, k) for n, v, k in head["components"]},
        }
        lines += [f"### model `{model}` (ablation `{aid}`, {steps} steps)", "", *p_lines]
        comp_lines += [f"### model `{model}`", ""]
        if head["components"]:
            comp_lines += ["| variant | paper | paired seeds | vs deepseek_v3 |", "|---|---|---:|---|"]
            comp_lines += [
                f"| `{n}` | {COMPONENT_CLAIMS.get(n, '')} | {k} | {_effect(v) if v else 'no paired seed'} |"
                for n, v, k in head["components"]
            ]
        else:
            comp_lines += ["No component recipe in this ablation.", ""]
        comp_lines.append("")
    lines += comp_lines
    lines[4:4] = _headline_table(headline, ctx.margin)
    path = ctx.out / "deepseek_v3.md"
    path.write_text("\n".join(lines) + "\n")
    (ctx.out / "deepseek_v3.json").write_text(json.dumps(headline, indent=1, default=str))
    return path
