"""``lowprec recommend``: which catalog recipe (and layout) to pretrain with, and what is known about its loss.

    lowprec recommend model=SIZE hardware=NAME gpus=N tokens=T [max_loss_gap=0.25%] [batch=N] [seq=N]
                      [recompute=auto|none|selective|full] [compile=true|false] [recipes=[a,b,...]]
                      [ablate_steps=N] [tracking.uri=URI] [--json]

Which recipes the hardware can run is the question training asks before it builds anything: the recipe's FP8
backend decides from the part's compute capability (``lowprec.estimate.runnable``, ``Float8Backend.
hardware_blocker``); a recipe it refuses (FP8 on an A100, MXFP8/NVFP4 outside sm100) is listed as not runnable with
that reason and never given a step time. For every other recipe, every tensor-parallel degree ``tp`` in 1, 2, 4, 8
that divides ``gpus`` and the head counts (FSDP over the rest, ``dp_shard = gpus / tp``), and every
activation-checkpointing mode (the lightest that fits unless ``recompute=`` pins one),
``lowprec.estimate.memory_model`` predicts the peak reserved memory and ``lowprec.estimate.cost_model`` the step
time. Each recipe keeps its fastest layout that fits in memory with ``MEMORY_MARGIN`` of it free; recipes are ranked
by predicted time to train ``tokens`` tokens (``batch`` sequences of ``seq`` tokens per data-parallel rank and
step, so a row's step takes ``dp_shard * batch * seq`` tokens), then by memory headroom. A row whose layout lies
outside every published point of ``published.yaml`` (other TP degree, FSDP degree or hardware) says so: the cost
model's error is known only near them. A DeepSeekMoE model (``model=moe_*``) gets FSDP layouts only (``tp = 1``:
the cost and memory models do not cover tensor or expert parallelism of its experts), its time from the activated
experts and its memory from all of them.

Loss evidence per recipe: the verdicts ``experiments.report.verdict_table.log_verdicts`` recorded on the parent runs of
the user's own ablations (``tracking.uri``, default the sqlite store under ``runs/``; read only, and a store
that does not exist is read as empty), with their paired intervals and seed counts, marked comparable when the
ablation's model has the same family (dense or MoE: ``model_class``) and size class; otherwise the ablation that
would produce one, as a command that runs as printed (``experiments.planning.recommend_plan.ablation_plan``: device,
layout, batch, steps; several nodes get the torchrun line) with its predicted GPU-hours. Published evidence is
cited per recipe kind (``experiments.planning.recommend_evidence``), numbered, and each row names the line that supports
it. A recipe with an ``inferior`` verdict in the store is never recommended (it is listed as excluded); the text says
when a predicted speedup over bf16 is below the cost model's held-out error.

A bad argument prints one line on stderr and returns 2; any other exception (a ``KeyError`` from the program's own
tables included) is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from experiments.planning.estimate import MODEL_ERROR, MOE_NOTE, EstimateArgError, _value, compile_for, one_line
from experiments.planning.recommend_evidence import (
    LOWPREC_GPU_CHECK,
    PUBLISHED_EVIDENCE,  # noqa: F401 (re-exported: the citations live in experiments.planning.recommend_evidence)
    outside_published,
    published_evidence,
    published_hardware,
)
from experiments.planning.recommend_plan import (
    EVIDENCE_STEPS,
    MEMORY_MARGIN,
    TP_DEGREES,  # noqa: F401 (re-exported)
    AblationPlan,
    ablation_plan,
    layouts,
    memory_limit,
    peak_reserved,
)
from experiments.planning.tables import render_table
from lowprec.estimate.cost_model import AC_MODES, Layout, step_cost
from lowprec.estimate.hardware import get_hardware
from lowprec.estimate.inventory import inventory
from lowprec.estimate.runnable import hardware_blocker
from lowprec.model import MoEArgs, model_args
from lowprec.recipe import Recipe
from recipes import CATALOG, get_recipe

USAGE = (
    "usage: lowprec recommend model=SIZE hardware=NAME gpus=N tokens=T [max_loss_gap=0.25%] [batch=N] [seq=N] "
    "[recompute=auto|none|selective|full] [compile=true|false] [recipes=[a,b]] [ablate_steps=N] [tracking.uri=URI] "
    "[--json]"
)
_KEYS = (
    "model",
    "hardware",
    "gpus",
    "tokens",
    "max_loss_gap",
    "batch",
    "seq",
    "recompute",
    "compile",
    "recipes",
    "ablate_steps",
    "tracking.uri",
)
DEFAULT_URI = "sqlite:///runs/mlflow.db"
DEFAULT_GAP = 0.0025
CONTROL = "bf16"


class RecommendArgError(EstimateArgError):
    """A bad ``lowprec recommend`` argument; the message names it."""


def _gap(text: str) -> float:
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise RecommendArgError(f"max_loss_gap={text!r} is not a number or a percentage like 0.25%") from None
    if not (0.0 < v < 1.0 and math.isfinite(v)):
        raise RecommendArgError(f"max_loss_gap={text!r} must be a relative gap in (0, 100%)")
    return v


def parse_args(argv: list[str]) -> dict:
    """``key=value`` pairs and ``--json`` into a dict with every field checked; raises ``RecommendArgError``."""
    out: dict = {"json": False}
    for a in argv:
        if a == "--json":
            out["json"] = True
            continue
        key, eq, val = a.partition("=")
        if not eq or not key or not val:
            raise RecommendArgError(f"argument {a!r} is not key=value (or --json)")
        if key not in _KEYS:
            raise RecommendArgError(f"unknown key {key!r}; known: {', '.join(_KEYS)}")
        out[key] = val
    for req in ("model", "hardware", "gpus", "tokens"):
        if req not in out:
            raise RecommendArgError(f"{req}= is required")
    for k in ("gpus", "batch", "seq", "ablate_steps"):
        if k in out:
            try:
                out[k] = int(out[k])
            except ValueError:
                raise RecommendArgError(f"{k}={out[k]!r} is not an integer") from None
            if out[k] < 1:
                raise RecommendArgError(f"{k}={out[k]} must be >= 1")
    try:
        out["tokens"] = float(out["tokens"])
    except ValueError:
        raise RecommendArgError(f"tokens={out['tokens']!r} is not a number (e.g. 2e12)") from None
    if not (out["tokens"] > 0 and math.isfinite(out["tokens"])):
        raise RecommendArgError(f"tokens={out['tokens']:g} must be a finite number > 0")
    out["max_loss_gap"] = _gap(out.get("max_loss_gap", str(DEFAULT_GAP)))
    rc = out.get("recompute", "auto")
    if rc not in ("auto", *AC_MODES):
        raise RecommendArgError(f"recompute={rc!r} is not one of auto, {', '.join(AC_MODES)}")
    out["recompute"] = rc
    if "compile" in out:  # unset: experiments.planning.estimate.compile_for decides per model
        c = str(out["compile"]).lower()
        if c not in ("true", "false"):
            raise RecommendArgError(f"compile={out['compile']!r} is not true or false")
        out["compile"] = c == "true"
    if "recipes" in out:
        names = _value(out["recipes"])
        if not isinstance(names, list) or not names:
            raise RecommendArgError(f"recipes={out['recipes']!r} is not a list like [bf16,fp8_rowwise]")
        out["recipes"] = [get_recipe(str(n)).name for n in names]
    return out


# ---- evidence from the user's MLflow store ----------------------------------------------------------------


@dataclass(frozen=True)
class StoredVerdict:
    """One verdict recorded on an ablation's parent run: ``verdict`` (non-inferior, inferior, inconclusive,
    no-interval, no-data), relative ``effect`` and 95% interval ``lo``/``hi`` of the final validation loss
    against ``control`` (0.01 = 1% worse), ``seeds``, ``margin``; ``comparable``: same model family and size
    class as the recommendation."""

    ablation_id: str
    model: str
    control: str
    verdict: str
    effect: float | None
    lo: float | None
    hi: float | None
    seeds: int | None
    margin: float | None
    comparable: bool

    def describe(self) -> str:
        iv = f" {100 * self.effect:+.2f}% [{100 * self.lo:+.2f}%, {100 * self.hi:+.2f}%]" if self.hi is not None else ""
        n = f", {self.seeds} seeds" if self.seeds is not None else ""
        m = f", margin {100 * self.margin:.2f}%" if self.margin is not None else ""
        where = "" if self.comparable else ", other size class or family"
        return f"{self.verdict}{iv} vs {self.control} ({self.ablation_id}, model {self.model}{n}{m}{where})"


def size_class(n_params: int) -> str:
    """``toy`` (< 100M), ``small`` (< 3B), ``medium`` (< 30B), ``large``: ablations compare within a class."""
    return "toy" if n_params < 1e8 else "small" if n_params < 3e9 else "medium" if n_params < 3e10 else "large"


def model_class(args) -> str:
    """``<family> <size class>`` of a model: ``dense`` (Llama) or ``moe`` (DeepSeekMoE, sized by its total
    parameters), e.g. ``moe toy``. Ablations are comparable within a class: a MoE's verdict says little about a
    dense model's and the other way round (the MoE's routed experts see fewer, outlier-heavier tokens)."""
    n = inventory(args, get_recipe(CONTROL).fp8).n_params
    return f"{'moe' if isinstance(args, MoEArgs) else 'dense'} {size_class(n)}"


def _model_class(name: str, params: dict) -> str | None:
    over = {}
    for k, v in params.items():
        if k.startswith("model.") and k != "model.name":
            over[k.removeprefix("model.")] = _value(v)
    try:
        args = model_args(name)
        fields = {f for f in asdict(args)}
        args = model_args(name, **{k: v for k, v in over.items() if k in fields})
        return model_class(args)
    except Exception:  # an ablation of a model this version does not know: not comparable
        return None


def _store_exists(uri: str) -> bool:
    prefix = "sqlite:///"
    if uri.startswith(prefix):
        return Path(uri[len(prefix) :].split("?", 1)[0]).exists()
    return True


def stored_verdicts(uri: str, model: str, family_class: str) -> dict[str, list[StoredVerdict]]:
    """recipe -> the verdicts recorded on every ablation parent run of the store (newest first). A sqlite store
    that does not exist is empty (nothing is created)."""
    if not _store_exists(uri):
        return {}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    if not exps:
        return {}
    out: dict[str, list[StoredVerdict]] = {}
    runs = client.search_runs(exps, "tags.`lowprec.kind` = 'ablation'", order_by=["attributes.start_time DESC"])
    for run in runs:
        tags, metrics, params = run.data.tags, run.data.metrics, run.data.params
        mname = tags.get("model") or params.get("model.name") or "?"
        comparable = _model_class(mname, params) == family_class
        control = tags.get("verdict_control") or tags.get("control") or CONTROL
        for k, v in tags.items():
            if not k.startswith("verdict.") or k.startswith("verdict_"):
                continue
            recipe = k.removeprefix("verdict.")

            def m(key, recipe=recipe):
                x = metrics.get(f"verdict/{key}.{recipe}")
                return None if x is None or not math.isfinite(x) else x

            seeds = m("seeds")
            out.setdefault(recipe, []).append(
                StoredVerdict(
                    tags.get("lowprec.ablation_id", run.info.run_name),
                    mname,
                    control,
                    v,
                    m("effect"),
                    m("lo"),
                    m("hi"),
                    None if seeds is None else int(seeds),
                    metrics.get("verdict/margin"),
                    comparable,
                )
            )
    return out


# ---- ranking -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """A recipe's best layout: ``dp_shard``, ``tp``, ``ac``; predicted ``tokens_per_s_per_gpu``, ``days`` to
    train, ``speedup`` over bf16's best layout (``None`` without a bf16 row), peak ``reserved_gib`` (GiB, 2**30
    bytes) and ``headroom`` (fraction of device memory left); ``tokens_per_step`` (``dp_shard * batch * seq``);
    ``outside_published``: why the layout lies outside every published point, or ``None``; ``ablation``: the
    ablation that would give the missing loss evidence (``ablate_command`` is its command), or ``None``."""

    recipe: str
    dp_shard: int
    tp: int
    ac: str
    tokens_per_s_per_gpu: float
    days: float
    reserved_gib: float
    headroom: float
    tokens_per_step: int = 0
    speedup: float | None = None
    evidence: list[StoredVerdict] = field(default_factory=list)
    ablate_command: str | None = None
    ablation: AblationPlan | None = None
    published: str = ""
    outside_published: str | None = None
    excluded: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def best_option(args, recipe: Recipe, hw, opts: dict) -> Option | str:
    """The fastest (layout, AC) of ``recipe`` that fits ``hw``'s memory, or why none does."""
    batch, seq = opts.get("batch", 1), opts.get("seq", args.max_seq_len)
    modes = AC_MODES if opts["recompute"] == "auto" else (opts["recompute"],)
    best = None
    lays = list(layouts(args, opts["gpus"], recipe))
    if not lays:
        return f"no layout of {opts['gpus']} GPUs can run it (FP8 communication needs FSDP and, in lowprec, no TP)"
    for dp, tp in lays:
        for ac in modes:
            reserved = peak_reserved(args, recipe, dp, tp, batch, seq, ac, opts["compile"])
            if reserved > memory_limit(hw):
                continue
            c = step_cost(args, recipe, hw, Layout(dp, tp, batch, seq, ac, opts["compile"]))
            days = opts["tokens"] / (c.tokens_per_s_per_gpu * opts["gpus"]) / 86400
            o = Option(
                recipe.name,
                dp,
                tp,
                ac,
                c.tokens_per_s_per_gpu,
                days,
                reserved / 2**30,
                1 - reserved / hw.memory_bytes,
                dp * batch * seq,
            )
            if best is None or (o.days, -o.headroom) < (best.days, -best.headroom):
                best = o
            break  # a heavier AC mode of the same layout is only slower
    if best is None:
        return (
            f"no layout of {opts['gpus']} GPUs leaves {100 * MEMORY_MARGIN:.0f}% of "
            f"{hw.memory_bytes / 2**30:.1f} GiB free at batch {batch} x seq {seq}"
        )
    return best


@dataclass(frozen=True)
class Recommendation:
    """``options`` ranked (fastest first; excluded ones after, with the reason), ``top`` (first not excluded,
    or ``None``), ``not_runnable`` (recipe -> why it is not runnable there, or why no layout fits: never with a
    step time), ``paragraph`` (the top choice in words)."""

    query: dict
    options: list[Option]
    top: str | None
    not_runnable: dict[str, str]
    paragraph: str

    def to_dict(self) -> dict:
        return {
            "query": self.query,
            "top": self.top,
            "options": [o.to_dict() for o in self.options],
            "not_runnable": self.not_runnable,
            "paragraph": self.paragraph,
            "model_error": MODEL_ERROR,
            "published_refs": published_refs(self.options),
        }


def recommend(opts: dict) -> Recommendation:
    """Rank the candidate recipes for parsed ``opts`` (see the module doc). Raises ``ConfigError`` for an unknown
    model or hardware, or a sequence longer than the model's."""
    args = model_args(opts["model"])
    hw = get_hardware(opts["hardware"])
    seq = opts.get("seq", args.max_seq_len)
    if seq > args.max_seq_len:
        raise RecommendArgError(f"seq={seq} exceeds model.max_seq_len={args.max_seq_len}")
    names = opts.get("recipes") or list(CATALOG)
    opts = {
        **opts,
        "batch": opts.get("batch", 1),
        "seq": seq,
        "ablate_steps": opts.get("ablate_steps", EVIDENCE_STEPS),
        "compile": compile_for(args, opts.get("compile")),
        "moe": isinstance(args, MoEArgs),
    }
    evidence = stored_verdicts(opts.get("tracking.uri", DEFAULT_URI), opts["model"], model_class(args))
    gap = opts["max_loss_gap"]
    control = get_recipe(CONTROL)
    options, not_runnable = [], {}
    for name in dict.fromkeys([*names, CONTROL]):
        r = get_recipe(name)
        why = hardware_blocker(r, hw)  # the check training makes (Float8Backend.check_runtime)
        if why is not None:
            not_runnable[name] = f"on {hw.name}: {why}"
            continue
        o = best_option(args, r, hw, opts)
        if isinstance(o, str):
            not_runnable[name] = o
            continue
        ev = evidence.get(name, [])
        inferior = [e for e in ev if e.verdict == "inferior"]
        excluded = f"measured inferior: {inferior[0].describe()}" if inferior else None
        if name not in names:
            excluded = "the reference (not among recipes=)"
        has_comparable = any(e.comparable and e.verdict != "no-data" for e in ev)
        plan = None
        if not has_comparable and name != CONTROL and excluded is None:
            plan = ablation_plan(
                opts["model"],
                args,
                control,
                r,
                hw,
                gpus=opts["gpus"],
                batch=opts["batch"],
                seq=seq,
                gap=gap,
                steps=opts["ablate_steps"],
            )
        options.append(
            replace(
                o,
                evidence=ev,
                ablation=plan,
                ablate_command=plan.command if plan else None,
                published=published_evidence(r, CONTROL),
                outside_published=outside_published(opts["model"], hw.name, o.dp_shard, o.tp),
                excluded=excluded,
            )
        )
    base = next((o for o in options if o.recipe == CONTROL), None)
    if base is not None:
        options = [replace(o, speedup=base.days / o.days) for o in options]
    options.sort(key=lambda o: (o.excluded is not None, o.days, -o.headroom))
    top = next((o for o in options if o.excluded is None), None)
    query = {k: v for k, v in opts.items() if k != "json"}
    return Recommendation(query, options, top.recipe if top else None, not_runnable, paragraph(top, base, opts, gap))


def published_refs(options: list[Option]) -> list[dict]:
    """The published citations of ``options`` numbered in table order: ``[{"ref": 1, "text": ..., "recipes":
    [...]}, ...]``; a row's ``pub`` column is its citation's ``ref``."""
    refs: dict[str, list[str]] = {}
    for o in options:
        refs.setdefault(o.published, []).append(o.recipe)
    return [{"ref": i, "text": t, "recipes": rs} for i, (t, rs) in enumerate(refs.items(), 1)]


def _no_evidence_words(o: Option, opts: dict) -> str:
    if o.ablation is None:
        return (
            f"no ablation of {CONTROL} and {o.recipe} fits eager on at most {opts['gpus']} {opts['hardware']} GPUs: "
            "run one on a larger machine"
        )
    a = o.ablation
    return (
        f"run `{a.command}` ({a.seeds} seeds of each recipe, {a.steps:,} steps, on {a.gpus} GPUs: about "
        f"{a.gpu_hours:,.0f} GPU-hours predicted)"
    )


def _verdict_words(o: Option, gap: float, opts: dict) -> str:
    comp = [e for e in o.evidence if e.comparable and e.verdict != "no-data"]
    other = [e for e in o.evidence if not e.comparable and e.verdict != "no-data"]
    if comp:
        e = comp[0]
        meets = e.hi is not None and e.hi <= gap
        return f"Your own ablation {e.ablation_id} found it {e.describe()}" + (
            "; its upper bound is within your max_loss_gap."
            if meets
            else f"; that does not show a gap below {100 * gap:.2f}%."
        )
    words = "Your MLflow store holds no comparable verdict for it"
    if other:
        words += f" (only {other[0].describe()})"
    return words + f": {_no_evidence_words(o, opts)} before committing the GPU hours."


def paragraph(top: Option | None, base: Option | None, opts: dict, gap: float) -> str:
    """The top choice in plain words: why it ranks first, what it assumed, its loss evidence, and the model's
    error (and that its layout lies outside every published point, where it does)."""
    if top is None:
        return "No recipe fits and is not excluded; see the table."
    lay = f"FSDP over {top.dp_shard} GPUs" + (f" with tensor parallel {top.tp}" if top.tp > 1 else "")
    s = (
        f"Recommended: {top.recipe}, {lay}, activation checkpointing {top.ac}: predicted "
        f"{top.tokens_per_s_per_gpu:,.0f} tokens/s per GPU at batch {opts['batch']} x seq {opts['seq']} per "
        f"data-parallel rank ({top.tokens_per_step:,} tokens per step), {top.days:,.1f} days for "
        f"{opts['tokens']:.3g} tokens on {opts['gpus']} {opts['hardware']} GPUs, with {100 * top.headroom:.0f}% of "
        "memory to spare. "
    )
    if base is not None and top.recipe != base.recipe and top.speedup is not None:
        pct = top.speedup - 1
        s += f"That is {100 * pct:+.0f}% over bf16 ({base.days:,.1f} days). "
        if abs(pct) < MODEL_ERROR:
            s += (
                f"The predicted speedup is below the cost model's held-out error ({100 * MODEL_ERROR:.0f}%, "
                "lowprec estimate --validate): measure both on a few steps of your own hardware before choosing. "
            )
    if top.outside_published:
        s += (
            f"Its layout lies outside every published point ({top.outside_published}): the cost model's error "
            "there is not known. "
        )
    s += _verdict_words(top, gap, opts) + f" Published evidence: {top.published}."
    return s


def ablation_groups(options: list[Option]) -> list[tuple[AblationPlan, list[Option]]]:
    """The rows that need an ablation, grouped by layout (``AblationPlan.layout_key``): one ``lowprec ablate`` per
    group runs the control once and every recipe of the group, in table order."""
    groups: dict[tuple, list[Option]] = {}
    for o in options:
        if o.ablation is not None:
            groups.setdefault(o.ablation.layout_key(), []).append(o)
    return [(rows[0].ablation, rows) for rows in groups.values()]


def format_table(rec: Recommendation) -> str:
    """The text output: the query and what it assumed, the ranked table (each row's published citation in ``pub``
    and its ablation in ``loss evidence``), the recipes that are not runnable with the reason, layouts outside every
    published point, the numbered citations, the ablations that would give the missing evidence, and the
    paragraph."""
    q = rec.query
    refs = published_refs(rec.options)
    ref_of = {r: x["ref"] for x in refs for r in x["recipes"]}
    groups = ablation_groups(rec.options)
    group_of = {o.recipe: k for k, (_, rows) in enumerate(groups, 1) for o in rows}
    lines = [
        f"model={q['model']} hardware={q['hardware']} gpus={q['gpus']} tokens={q['tokens']:.3g} "
        f"max_loss_gap={100 * q['max_loss_gap']:.2f}%; ranked by predicted time to train, then memory headroom",
        f"assumed: batch={q['batch']} sequence(s) of seq={q['seq']} tokens per data-parallel rank and step "
        f"(batch=, seq= change it), so a row's step takes its FSDP degree x {q['batch'] * q['seq']:,} tokens "
        f"(tok/step); compile={str(q['compile']).lower()}; memory in GiB (2**30 bytes)",
        "",
    ]
    cols = [("#", "right"), ("recipe", "left"), ("layout", "left"), ("tok/step", "right"), ("tok/s/GPU", "right")]
    cols += [("days", "right"), ("vs bf16", "right"), ("peak GiB", "right"), ("free", "right"), ("pub", "right")]
    cols += [("loss evidence", "left")]
    rows = []
    for i, o in enumerate(rec.options, 1):
        lay = f"{o.dp_shard}x{o.tp} ac={o.ac}" + ("*" if o.outside_published else "")
        sp = f"{100 * (o.speedup - 1):+.0f}%" if o.speedup is not None else "-"
        if o.excluded:
            ev = f"EXCLUDED: {o.excluded}"
        elif o.evidence:
            ev = o.evidence[0].describe()
        elif o.recipe == CONTROL:
            ev = "the reference of every verdict"
        elif o.recipe in group_of:
            ev = f"no evidence: ablation [a{group_of[o.recipe]}] below"
        else:
            ev = f"no evidence, and no ablation with {CONTROL} fits eager on these GPUs"
        rows.append(
            (i, o.recipe, lay, f"{o.tokens_per_step:,}", f"{o.tokens_per_s_per_gpu:,.0f}", f"{o.days:,.1f}", sp)
            + (f"{o.reserved_gib:.1f}", f"{100 * o.headroom:.0f}%", f"[{ref_of[o.recipe]}]", ev)
        )
    # A recipe with no step time: an unnumbered row, its reason in the last column.
    rows += [("", n, *[""] * 8, f"not runnable, no step time: {why}") for n, why in rec.not_runnable.items()]
    lines.append(render_table(cols, rows, min_width={0: 2}))
    outside = [o for o in rec.options if o.outside_published]
    if outside:
        lines += ["", "* layout outside every published point (the cost model's error there is not known):"]
        lines += [f"   {o.recipe} {o.dp_shard}x{o.tp}: {o.outside_published}" for o in outside]
    lines += ["", "Published evidence (the pub column):"]
    lines += [f"  [{x['ref']}] {x['text']}" for x in refs]
    if groups:
        lines += [
            "",
            f"Ablations that would give the missing loss evidence ({CONTROL} and the recipes, "
            f"{groups[0][0].seeds} seeds each, eager, on the fewest GPUs where all fit; GPU-hours predicted by the "
            "cost model):",
        ]
        for k, (a, rows) in enumerate(groups, 1):
            names = [o.recipe for o in rows]
            hours = a.control_gpu_hours + sum(o.ablation.recipe_gpu_hours for o in rows)
            where = f", {a.nodes} hosts: start it on each with HEAD_NODE set to the first" if a.nodes > 1 else ""
            lines.append(
                f"  [a{k}] {len(names)} recipe(s) on {a.gpus} GPUs ({a.dp_shard}x{a.tp} ac={a.ac}{where}), "
                f"{a.steps:,} steps, about {hours:,.0f} GPU-hours:"
            )
            lines.append(f"       {a.command_for(names)}")
    lines += [
        "",
        f"Times are predictions of the per-op cost model: held-out error up to {100 * MODEL_ERROR:.0f}% on the "
        f"published points, measured by their authors on {published_hardware()} GPUs (lowprec estimate --validate); "
        f"{LOWPREC_GPU_CHECK}. Memory: lowprec.estimate.memory_model.",
        *([MOE_NOTE + "."] if rec.query.get("moe") else []),
        "",
        rec.paragraph,
    ]
    return "\n".join(lines)


def recommend_main(argv: list[str]) -> int:
    """Entry point of ``lowprec recommend``; returns the exit status (0, or 2 for bad input). Only a
    ``lowprec.errors.UserError`` is bad input; anything else (a ``KeyError`` or ``IndexError`` from the program's
    own tables) is a bug and propagates with its traceback."""
    from lowprec.errors import UserError

    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        opts = parse_args(argv)
        rec = recommend(opts)
    except UserError as e:
        print(f"lowprec recommend: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(json.dumps(rec.to_dict(), indent=1) if opts["json"] else format_table(rec))
    return 0


if __name__ == "__main__":
    sys.exit(recommend_main(sys.argv[1:]))
