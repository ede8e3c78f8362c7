"""``lowprec recommend``: which catalog recipe (and layout) to pretrain with, and what is known about its loss.

    lowprec recommend model=SIZE hardware=NAME gpus=N tokens=T [max_loss_gap=0.25%] [train.batch_size=N]
                      [train.seq_len=N] [train.ac=none|selective|full] [train.compile=true|false]
                      [parallel.tp=N] [parallel.dp_shard=N] [recipes=[a,b,...]] [ablate_steps=N]
                      [tracking.uri=URI] [any other key of lowprec train] [--json]

The keys are ``lowprec train``'s (lowprec_lab/plan/estimate_config.py composes them with Hydra into a
``RecommendQuery``); those given pin what they name, the others recommend chooses. For its top choice it prints
the ``lowprec train`` and ``lowprec ablate`` command lines that run it (``commands``; across hosts, the torchrun
line to start on each), with the user's other ``lowprec train`` keys carried over.

Which recipes the hardware can run is the question training asks before it builds anything: the recipe's FP8
backend decides from the part's compute capability (``lowprec.estimate.runnable``, ``Float8Backend.
hardware_blocker``); a recipe it refuses (FP8 on an A100, MXFP8/NVFP4 outside sm100) is listed as not runnable with
that reason and never given a step time. For every other recipe, every tensor-parallel degree ``tp`` in 1, 2, 4, 8
that divides ``gpus`` and the head counts (FSDP over the rest, ``dp_shard = gpus / tp``), and every
activation-checkpointing mode (the lightest that fits unless ``train.ac=`` pins one),
``lowprec.estimate.memory_model`` predicts the peak reserved memory and ``lowprec.estimate.cost_model`` the step
time. Each recipe keeps its fastest layout that fits in memory with ``MEMORY_MARGIN`` of it free; recipes are ranked
by predicted time to train ``tokens`` tokens (``train.batch_size`` sequences of ``train.seq_len`` tokens per step,
split over the data-parallel ranks; unpinned, one sequence per rank, so a row's step takes ``dp_shard * seq``
tokens), then by memory headroom. A row whose layout lies
outside every published point of ``published.yaml`` (other TP degree, FSDP degree or hardware) says so: the cost
model's error is known only near them. A DeepSeekMoE model (``model=moe_*``) gets FSDP layouts only (``tp = 1``:
the cost and memory models do not cover tensor or expert parallelism of its experts), its time from the activated
experts and its memory from all of them.

Loss evidence per recipe: the verdicts ``lowprec_lab.report.verdict_table.log_verdicts`` recorded on the parent runs of
the user's own ablations (``tracking.uri``, default the sqlite store under ``runs/``; read only, and a store
that does not exist is read as empty), with their paired intervals and seed counts, marked comparable when the
ablation's model has the same family (dense or MoE: ``model_class``) and size class; otherwise the ablation that
would produce one, as a command that runs as printed (``lowprec_lab.sizing.recommend_plan.ablation_plan``: device,
layout, batch, steps; several nodes get the torchrun line) with its predicted GPU-hours. Published evidence is
cited per recipe kind (``lowprec_lab.sizing.recommend_evidence``), numbered, and each row names the line that supports
it. A recipe with an ``inferior`` verdict in the store is never recommended (it is listed as excluded); the text says
when a predicted speedup over bf16 is below the cost model's held-out error.

A bad argument prints one line on stderr and returns 2; any other exception (a ``KeyError`` from the program's own
tables included) is a bug and keeps its traceback.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from lowprec.estimate.cost_model import AC_MODES, Layout, step_cost
from lowprec.estimate.hardware import get_hardware
from lowprec.estimate.inventory import inventory
from lowprec.estimate.runnable import hardware_blocker
from lowprec.model import MoEArgs, model_args
from lowprec.recipe import Recipe
from lowprec.recipes import CATALOG, get_recipe
from lowprec_lab.plan.estimate_config import RecommendQuery
from lowprec_lab.sizing.estimate import MODEL_ERROR, MOE_NOTE, _value
from lowprec_lab.sizing.recommend_evidence import (
    LOWPREC_GPU_CHECK,
    PUBLISHED_EVIDENCE,  # noqa: F401 (re-exported: the citations live in lowprec_lab.sizing.recommend_evidence)
    outside_published,
    published_evidence,
    published_hardware,
)
from lowprec_lab.sizing.recommend_plan import (
    MEMORY_MARGIN,
    TP_DEGREES,  # noqa: F401 (re-exported)
    AblationPlan,
    ablation_plan,
    layouts,
    memory_limit,
    peak_reserved,
    run_commands,
)
from lowprec_lab.sizing.tables import render_table

USAGE = (
    "usage: lowprec recommend model=SIZE hardware=NAME gpus=N tokens=T [max_loss_gap=0.25%] [train.batch_size=N] "
    "[train.seq_len=N] [train.ac=none|selective|full] [train.compile=true|false] [parallel.tp=N] "
    "[parallel.dp_shard=N] ['recipes=[a,b]'] [ablate_steps=N] [tracking.uri=URI] [any other key of lowprec train] "
    "[--json]"
)
CONTROL = "bf16"


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
    ablation that would give the missing loss evidence (``ablate_command`` is its command), or ``None``;
    ``batch_per_rank``: sequences per data-parallel rank (``train.batch_size / dp_shard``); ``compile``: whether
    the recipe runs compiled there (``train.compile`` resolved on the hardware, ``RecommendQuery.assumed``)."""

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
    batch_per_rank: int = 1
    compile: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def _batch_per_rank(q: RecommendQuery, dp: int) -> int | None:
    """Sequences per data-parallel rank of a layout with ``dp`` of them: the pinned ``train.batch_size`` split over
    them (``None`` when it does not split evenly, as training refuses), else 1."""
    if q.batch_size is None:
        return 1
    return q.batch_size // dp if q.batch_size % dp == 0 else None


def best_option(args, recipe: Recipe, hw, q: RecommendQuery) -> Option | str:
    """The fastest (layout, AC) of ``recipe`` that fits ``hw``'s memory, or why none does; the layouts and AC modes
    are those ``q`` leaves open (``parallel.tp``, ``parallel.dp_shard``, ``train.ac`` pin theirs)."""
    seq = q.seq
    compiled = q.assumed[recipe.name].compile  # train.compile as lowprec train runs this recipe on hw
    modes = AC_MODES if q.ac is None else (q.ac,)
    best = None
    lays = [
        (dp, tp)
        for dp, tp in layouts(args, q.gpus, recipe)
        if (q.tp is None or tp == q.tp) and (q.dp_shard is None or dp == q.dp_shard)
    ]
    if not lays:
        pins = "".join(
            f", {k}={v}" for k, v in (("parallel.tp", q.tp), ("parallel.dp_shard", q.dp_shard)) if v is not None
        )
        return f"no layout of {q.gpus} GPUs{pins} can run it (FP8 communication needs FSDP and, in lowprec, no TP)"
    for dp, tp in lays:
        batch = _batch_per_rank(q, dp)
        if batch is None:
            continue  # train.batch_size does not split over this layout's data-parallel ranks
        for ac in modes:
            reserved = peak_reserved(args, recipe, dp, tp, batch, seq, ac, compiled)
            if reserved > memory_limit(hw):
                continue
            c = step_cost(args, recipe, hw, Layout(dp, tp, batch, seq, ac, compiled))
            days = q.tokens / (c.tokens_per_s_per_gpu * q.gpus) / 86400
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
                batch_per_rank=batch,
                compile=compiled,
            )
            if best is None or (o.days, -o.headroom) < (best.days, -best.headroom):
                best = o
            break  # a heavier AC mode of the same layout is only slower
    if best is None:
        batch = "1 per data-parallel rank" if q.batch_size is None else f"train.batch_size={q.batch_size}"
        return (
            f"no layout of {q.gpus} GPUs leaves {100 * MEMORY_MARGIN:.0f}% of "
            f"{hw.memory_bytes / 2**30:.1f} GiB free at {batch} x train.seq_len={seq}"
        )
    return best


@dataclass(frozen=True)
class Recommendation:
    """``options`` ranked (fastest first; excluded ones after, with the reason), ``top`` (first not excluded,
    or ``None``), ``not_runnable`` (recipe -> why it is not runnable there, or why no layout fits: never with a
    step time), ``paragraph`` (the top choice in words), ``commands``: the ``lowprec train`` and ``lowprec ablate``
    command lines that run the top choice (``recommend_plan.run_commands``; ``None`` without a top choice)."""

    query: dict
    options: list[Option]
    top: str | None
    not_runnable: dict[str, str]
    paragraph: str
    commands: dict[str, str] | None = None

    def to_dict(self) -> dict:
        return {
            "query": self.query,
            "top": self.top,
            "commands": self.commands,
            "options": [o.to_dict() for o in self.options],
            "not_runnable": self.not_runnable,
            "paragraph": self.paragraph,
            "model_error": MODEL_ERROR,
            "published_refs": published_refs(self.options),
        }


def recommend(q: RecommendQuery) -> Recommendation:
    """Rank the candidate recipes for the typed query ``q`` (see the module doc). Raises ``ConfigError`` for an
    unknown hardware or recipe."""
    args = q.args
    hw = get_hardware(q.hardware)
    names = list(q.recipes) or list(CATALOG)
    evidence = stored_verdicts(q.tracking_uri, q.model, model_class(args))
    gap = q.max_loss_gap
    options, not_runnable = [], {}
    for name in dict.fromkeys([*names, CONTROL]):
        o = _candidate(q, name, hw, evidence.get(name, []), listed=name in names)
        if isinstance(o, str):
            not_runnable[name] = o
        else:
            options.append(o)
    base = next((o for o in options if o.recipe == CONTROL), None)
    if base is not None:
        options = [replace(o, speedup=base.days / o.days) for o in options]
    options.sort(key=lambda o: (o.excluded is not None, o.days, -o.headroom))
    top = next((o for o in options if o.excluded is None), None)
    query = _query_record(q, options)
    commands = None
    if top is not None:
        commands = run_commands(
            q.model,
            top.recipe,
            CONTROL,
            hw.name,
            dp_shard=top.dp_shard,
            tp=top.tp,
            batch_per_rank=top.batch_per_rank,
            seq=q.seq,
            ac=top.ac,
            compile=top.compile,
            margin=gap,
            extra=q.passthrough,
        )
    return Recommendation(
        query, options, top.recipe if top else None, not_runnable, paragraph(top, base, query, gap), commands
    )


def _candidate(q: RecommendQuery, name: str, hw, ev: list, listed: bool) -> Option | str:
    """Recipe ``name``'s ``Option`` for ``recommend``: its fastest layout on ``hw`` with its stored verdicts ``ev``,
    the ablation that would measure it (when nothing comparable is stored), its published evidence and why it is
    excluded (measured inferior, or the reference when not ``listed`` among ``recipes=``); or, as a string, why it
    does not run there (the part lacks what it needs, or no layout fits)."""
    r = get_recipe(name)
    why = hardware_blocker(r, hw)  # the check training makes (Float8Backend.check_runtime)
    if why is not None:
        return f"on {hw.name}: {why}"
    o = best_option(q.args, r, hw, q)
    if isinstance(o, str):
        return o
    inferior = [e for e in ev if e.verdict == "inferior"]
    excluded = f"measured inferior: {inferior[0].describe()}" if inferior else None
    if not listed:
        excluded = "the reference (not among recipes=)"
    has_comparable = any(e.comparable and e.verdict != "no-data" for e in ev)
    plan = None
    if not has_comparable and name != CONTROL and excluded is None:
        # the evidence ablation keeps the pinned batch per GPU (one sequence per data-parallel rank otherwise)
        evidence_batch = max(1, q.batch_size // q.gpus) if q.batch_size is not None else 1
        plan = ablation_plan(
            q.model,
            q.args,
            get_recipe(CONTROL),
            r,
            hw,
            gpus=q.gpus,
            batch=evidence_batch,
            seq=q.seq,
            gap=q.max_loss_gap,
            steps=q.ablate_steps,
        )
    return replace(
        o,
        evidence=ev,
        ablation=plan,
        ablate_command=plan.command if plan else None,
        published=published_evidence(r, CONTROL),
        outside_published=outside_published(q.model, hw.name, o.dp_shard, o.tp),
        excluded=excluded,
    )


def _query_record(q: RecommendQuery, options: list[Option]) -> dict:
    """The query as ``Recommendation.query`` records it (the settings asked, what was assumed of compile and AC)."""
    return {
        "model": q.model,
        "hardware": q.hardware,
        "gpus": q.gpus,
        "tokens": q.tokens,
        "max_loss_gap": q.max_loss_gap,
        "batch_size": q.batch_size,
        "seq": q.seq,
        "ac": q.ac,
        "compile": q.compile,
        "assumed": assumed_settings(q, options),
        "tp": q.tp,
        "dp_shard": q.dp_shard,
        "recipes": list(q.recipes) or None,
        "ablate_steps": q.ablate_steps,
        "tracking_uri": q.tracking_uri,
        "moe": isinstance(q.args, MoEArgs),
    }


def _word(v) -> str:
    return str(v).lower()


def assumed_settings(q: RecommendQuery, options: list[Option]) -> str:
    """What recommend assumed of ``train.compile`` and ``train.ac`` for a run on ``q.hardware``, in one phrase:
    ``auto`` resolved there as ``lowprec train`` resolves it on that part (``RecommendQuery.assumed``; the ranked
    ``options`` that it runs eager because they cannot compile are named), and the AC rule."""
    if q.compile == "auto":
        default = any(r.compile or r.fallback for r in q.assumed.values())  # auto's choice before any fallback
        words = f"train.compile=auto -> {_word(default)} on {q.hardware}"
        if any(q.assumed[o.recipe].fallback for o in options):
            words += " (a layout marked eager: the recipe cannot compile there, and lowprec train runs it eager)"
    else:
        words = f"train.compile={_word(q.compile)}"
    if q.ac is None:
        return words + ", train.ac: the lightest that fits"
    asked = next(iter(q.assumed.values())).requested_ac
    return words + (f", train.ac=auto -> {q.ac} on {q.hardware}" if asked == "auto" else f", train.ac={q.ac}")


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
        f"{top.tokens_per_s_per_gpu:,.0f} tokens/s per GPU at train.batch_size={top.dp_shard * top.batch_per_rank} "
        f"({top.batch_per_rank} per data-parallel rank) x train.seq_len={opts['seq']} ({top.tokens_per_step:,} "
        f"tokens per step), {top.days:,.1f} days for "
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
        f"assumed: {_assumed_batch(q)} of train.seq_len={q['seq']} tokens per step (train.batch_size=, "
        f"train.seq_len= pin them); {q['assumed']}; memory in GiB (2**30 bytes)",
        "",
    ]
    cols = [("#", "right"), ("recipe", "left"), ("layout", "left"), ("tok/step", "right"), ("tok/s/GPU", "right")]
    cols += [("days", "right"), ("vs bf16", "right"), ("peak GiB", "right"), ("free", "right"), ("pub", "right")]
    cols += [("loss evidence", "left")]
    rows = []
    for i, o in enumerate(rec.options, 1):
        lay = f"{o.dp_shard}x{o.tp} ac={o.ac}" + (" eager" if q["compile"] == "auto" and not o.compile else "")
        lay += "*" if o.outside_published else ""
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
    if rec.commands:
        lines += ["", f"Run {rec.top} (add train.steps=N and your data):"]
        lines += [f"  {rec.commands['train']}", f"Ablate it against {CONTROL} in this layout:"]
        lines += [f"  {rec.commands['ablate']}"]
    return "\n".join(lines)


def _assumed_batch(q: dict) -> str:
    if q["batch_size"] is None:
        return "1 sequence per data-parallel rank (train.batch_size = its FSDP degree)"
    return f"train.batch_size={q['batch_size']} sequences split over the data-parallel ranks"
