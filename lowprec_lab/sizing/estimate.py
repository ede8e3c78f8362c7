"""``lowprec estimate``: predicted per-GPU memory by component and step time, without running anything.

    lowprec estimate [model=SIZE] [recipe=NAME|all] [train.batch_size=N] [train.seq_len=N] [train.ac=MODE]
                     [train.compile=BOOL] [parallel.dp_shard=N] [parallel.tp=N] [hardware=NAME] [efficiency=F]
                     [async_tp=BOOL] [model.<field>=V ...] [recipe.<group>.<field>=V ...] [--emulate] [--json]

The keys are ``lowprec train``'s, with its defaults (lowprec_lab/plan/estimate_config.py composes them with Hydra
into an ``EstimateQuery``): the estimate is of the run that ``lowprec train`` with the same keys would make.
``train.batch_size`` is the global batch (``train.batch_size / (dp_replicate x dp_shard)`` sequences per GPU);
``hardware`` defaults to ``h100_sxm``; ``efficiency`` also prints the flat-MFU step time at that MFU; ``train.ac``
ranks ``recipe=all`` and is the AC mode of the step time; ``train.compile`` (default false, as in train) fuses the
elementwise kernels in the cost model and counts the loss compiled. Sizes are printed in GiB (2**30 bytes), as
``lowprec recommend`` and torch's memory statistics print them. A step time is predicted only for a layout that
fits the part's memory with that ``train.ac``: otherwise the output says "does not fit" instead. Whether the part
can run a recipe is the check training makes (``lowprec.estimate.runnable``: the FP8 backend's
``hardware_blocker`` at the part's compute capability): a recipe it refuses (FP8 on an A100, MXFP8/NVFP4 outside
sm100) is refused here unless ``--emulate`` is given (the memory is then estimated and no step time is predicted:
emulated speed is not modelled); under ``recipe=all`` such a recipe gets no step time and a note. A bad argument
prints one line on stderr and returns 2 (lowprec_lab/cli.py). Any other exception is a bug and keeps its
traceback. The figures come from ``lowprec.estimate`` (its module doc states every rule and assumption).
"""

from __future__ import annotations

import dataclasses
import json

from lowprec.errors import ConfigError
from lowprec.estimate.cost_model import Calibration, Layout, step_cost
from lowprec.estimate.estimator import DEFAULT_EFFICIENCY, estimate, predict_state_bytes, rank_estimates
from lowprec.estimate.hardware import get_hardware
from lowprec.estimate.inventory import param_counts
from lowprec.estimate.runnable import hardware_blocker
from lowprec_lab.plan.estimate_config import EstimateQuery
from lowprec_lab.sizing.cost_validation import format_table, load_points, summary, validate
from lowprec_lab.sizing.tables import render_table

USAGE = (
    "usage: lowprec estimate [model=SIZE] [recipe=NAME|all] [train.batch_size=N] [train.seq_len=N] "
    "[train.ac=none|selective|full] [train.compile=true|false] [parallel.dp_shard=N] [parallel.tp=N] "
    "[hardware=NAME] [efficiency=F] [async_tp=true|false] [model.<field>=V] [recipe.<group>.<field>=V] "
    "[any other key of lowprec train] [--emulate] [--json]\n"
    "       lowprec estimate --validate [--json]"
)
#: the flags of ``lowprec estimate`` (everything else is a key=value of its Hydra config)
FLAGS = ("--json", "--emulate", "--validate")


#: The largest held-out throughput error of the shipped calibration (``lowprec estimate --validate``;
#: ``tests/unit/test_cost_model.py`` keeps it equal to the table's).
MODEL_ERROR = 0.128
#: said wherever a MoE model's step time is printed: the held-out error above is that of dense models
MOE_NOTE = (
    "MoE step time NOT validated (no published MoE measurement): routed experts timed as separate GEMMs at "
    "tokens*top_k/n_routed rows each; a GPU grouped GEMM would run them faster"
)


class EstimateArgError(ConfigError):
    """A bad command-line argument; the message names it (a ``UserError``: one line, exit 2)."""


def _value(text: str):
    """``key=value`` value: null, true/false, int, float, ``[a,b]`` list, else the string."""
    low = text.strip().lower()
    if low in ("null", "none", "~"):
        return None
    if low in ("true", "false"):
        return low == "true"
    if text.startswith("[") and text.endswith("]"):
        return [_value(t) for t in text[1:-1].split(",") if t.strip()]
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def check_fp8_hardware(recipes, hw, emulate: bool) -> None:
    """Refuse a recipe ``hw`` cannot run (``lowprec.estimate.runnable.hardware_blocker``: the FP8 backend's own
    check at the part's compute capability, as training makes it) unless ``emulate`` (``EstimateArgError``)."""
    if emulate:
        return
    for r in recipes:
        why = hardware_blocker(r, hw)
        if why is not None:
            raise EstimateArgError(
                f"recipe {r.name} cannot run on hardware={hw.name}: {why}; pick a part that can "
                "(lowprec estimate ... hardware=b200 for sm100) or pass --emulate for its memory alone"
            )


GIB = 2**30


def _gib(b: float) -> str:
    return f"{b / GIB:,.2f}"


def _row(label: str, nbytes: int, note: str = "") -> str:
    return f"  {label:<40} {nbytes:>19,} {_gib(nbytes):>10}  {note}".rstrip()


def no_fit_reason(e, ac: str) -> str | None:
    """Why no step time is predicted for estimate ``e`` under ``train.ac=ac``: its total does not fit the part's
    memory (one phrase with both sizes in GiB), or ``None`` when it fits or no part is given."""
    if e.hardware is None or e.fits(ac) is not False:
        return None
    return (
        f"does not fit: {e.totals[ac] / GIB:,.1f} GiB with train.ac={ac} on {e.hardware.name} "
        f"({e.hardware.memory_bytes / GIB:,.1f} GiB); no step time (raise parallel.dp_shard or set train.ac=)"
    )


def _activated_line(args) -> list[str]:
    """For a MoE model, one line with its activated parameters per token (``param_counts``); none for a dense one."""
    pc = param_counts(args)
    if pc.activated == pc.total:
        return []
    return [f"MoE: {pc.activated:,} parameters activated per token of {pc.total:,} (every expert is in the state)"]


#: what bounds a step (``StepCost.bound``), in the words of the single-recipe output
_BOUND_WORDS = {
    "communication": "communication-bound (the compute hides under the FSDP communication: the step is its time)",
    "compute": "compute-bound",
}
#: ``StepCost.bound`` in the ``recipe=all`` table's ``bound`` column
_BOUND_SHORT = {"communication": "comm", "compute": "compute"}


def assumed_words(r, hardware: str) -> str:
    """``train.compile`` and ``train.ac`` as the estimate assumed them for a run on ``hardware``: ``r`` is the
    ``lowprec_lab.plan.auto_train.Resolved`` of ``resolve_on_hardware``; ``auto`` is shown with what it resolved to
    there, a given value as given, and an eager fallback with its reason."""

    def one(key, asked, got):
        got = str(got).lower()
        return f"{key}=auto -> {got}" if asked == "auto" else f"{key}={got} (as given)"

    words = f"{one('train.compile', r.requested_compile, r.compile)}, {one('train.ac', r.requested_ac, r.ac)}"
    if "auto" in (r.requested_compile, r.requested_ac):
        words += f" (auto: what lowprec train chooses on {hardware}, a GPU, not on this machine)"
    return words + (f"; {r.fallback}" if r.fallback else "")


def competition_ranks(values: dict[str, str]) -> dict[str, int]:
    """Rank -> 1 for the smallest: ``values`` maps a name to its value as printed (a number string); names whose
    printed values are equal share a rank (1, 2, 2, 4), so a tie never reads as an order."""
    nums = {n: float(v.replace(",", "")) for n, v in values.items()}
    return {n: 1 + sum(1 for w in nums.values() if w < v) for n, v in nums.items()}


def cost_line(c) -> str:
    """One line of a ``lowprec.estimate.cost_model.StepCost``: step, tokens/s/GPU and where the time goes."""
    lo = c.layout
    return (
        f"predicted step {c.step_time_s:.4g} s, {c.tokens_per_s_per_gpu:,.0f} tokens/s/GPU on {c.hardware} "
        f"(cost model, train.ac={lo.ac}, train.compile={str(lo.compile).lower()}): GEMMs {c.gemm:.3g} s, attention "
        f"{c.attention:.3g} s, memory-bound kernels {c.kernels:.3g} s, FP8 casts {c.fp8_casts:.3g} s, "
        f"communication {c.fsdp_comm + c.tp_comm:.3g} s of which {c.exposed_comm:.3g} s exposed; "
        f"{_BOUND_WORDS[c.bound]}; held-out error of the model up to {100 * MODEL_ERROR:.0f}% "
        "(lowprec estimate --validate)"
    )


def format_one(
    e,
    args,
    model_name: str,
    unsharded,
    cost=None,
    flat: bool = False,
    no_time: str | None = None,
    batch: int = 0,
    assumed: str | None = None,
) -> str:
    """The per-GPU table of one ``lowprec.estimate.Estimate`` (``unsharded``: its state at dp_shard=tp=1;
    ``cost``: its ``StepCost`` or ``None``; ``flat``: also print the flat-efficiency time; ``no_time``: why no step
    time is predicted, printed instead of one; ``batch``: the global ``train.batch_size``; ``assumed``: the
    compile/AC settings the estimate assumed, ``assumed_words``)."""
    lines = [
        *_memory_lines(e, args, model_name, unsharded, batch, assumed),
        *_time_lines(e, model_name, cost, flat, no_time),
    ]
    for n in e.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def _memory_lines(e, args, model_name: str, unsharded, batch: int, assumed: str | None) -> list[str]:
    """``format_one``'s header and memory table: the state per component, the activations per recompute mode and
    the totals against the part's memory, ending with a blank line."""
    s, a, hw = e.state, e.activations, e.hardware
    pdt = "fp32" if s.params == 4 * s.n_local_params else "bf16"
    lines = [
        f"model={model_name}: {s.n_params:,} parameters ({s.n_tensors} tensors); recipe={e.recipe} ({e.short})",
        f"layout: parallel.dp_shard={e.dp_shard} parallel.tp={e.tp}; train.batch_size={batch} ({e.batch} per "
        f"data-parallel rank) x train.seq_len={e.seq}; figures are per GPU (rank 0)",
        *([f"assumed: {assumed}"] if assumed else []),
        *_activated_line(args),
        "",
        f"  {'component':<40} {'bytes':>19} {'GiB':>10}",
        _row(f"weights ({pdt})", s.params, "fp32 weights are the master" if pdt == "fp32" else ""),
        _row("master weights", s.master),
        _row(f"gradients ({pdt})", s.grads),
        _row("optimizer states", s.optim_states),
        _row("FP8 scaling state", s.fp8_scaling_state),
        _row("model + optimizer state", s.model_and_optimizer, f"{s.per_param:.2f} bytes/parameter"),
    ]
    if e.dp_shard > 1 or e.tp > 1:
        lines.append(
            _row(
                "  (unsharded, one GPU)",
                unsharded.model_and_optimizer,
                f"{unsharded.model_and_optimizer / GIB:.1f} GiB unsharded; this GPU holds "
                f"{s.model_and_optimizer / unsharded.model_and_optimizer:.4f} of it",
            )
        )
    else:
        lines.append(f"  {'':<40} {'':>19} {'':>10}  = {s.model_and_optimizer / GIB:.1f} GiB unsharded")
    if e.fsdp_buffers:
        lines.append(_row("FSDP2 unsharded params (transient)", e.fsdp_buffers, "root + 2 blocks, compute dtype"))
    for m in ("none", "selective", "full"):
        lines.append(
            _row(
                f"activations, recompute {m}",
                a.recompute[m],
                f"incl. {_gib(a.weight_copies)} GiB weight casts saved by autocast"
                if m == "none" and a.weight_copies >= 5e6
                else "",
            )
        )
    lines.append(_row("loss transient (backward)", a.loss_transient))
    lines.append(_row("reference: Korthikanti no recompute", a.korthikanti, "16-bit, stores s x s scores"))
    lines.append(_row("reference: Korthikanti selective", a.korthikanti_selective))
    lines.append("")
    for m in ("none", "selective", "full"):
        fit = (
            ""
            if hw is None
            else (f"vs {hw.memory_bytes / GIB:.1f} GiB on {hw.name}: " + ("fits" if e.fits(m) else "does NOT fit"))
        )
        lines.append(_row(f"total, recompute {m}", e.totals[m], fit))
    lines.append("")
    return lines


def _time_lines(e, model_name: str, cost, flat: bool, no_time: str | None) -> list[str]:
    """``format_one``'s compute part: FLOPs per token, then the step time (flat-efficiency, the cost model's with
    the published point it can be checked against) or why none is predicted."""
    fl = e.flops
    lines = [
        f"FLOPs/token {fl.flops_per_token / 1e9:,.4g} G = 6*N + 12*L*dim*seq, N = {fl.n_flop_params:,} "
        + (
            f"activated parameters (top-k routed + shared experts + router, all but the token embedding; "
            f"{fl.n_total_params:,} in total)"
            if fl.is_moe
            else "(all but the token embedding)"
        )
        + f"; FP8 share {100 * fl.fp8_fraction:.0f}%"
    ]
    t = e.throughput
    if t is not None and flat and no_time is None:
        lines.append(
            f"flat-efficiency step {t.step_time_s:.4g} s, {t.tokens_per_s_per_gpu:,.0f} tokens/s/GPU at "
            f"{100 * t.efficiency:.0f}% MFU of {t.peak.label} peak {t.peak.tflops:,.0f} TFLOP/s ({t.peak.hardware})"
        )
    if no_time is not None:
        lines.append(f"step time: none: {no_time}")
    if cost is not None:
        lines.append(cost_line(cost))
        if fl.is_moe:
            lines.append(f"note: {MOE_NOTE}")
        pub = published_for(e, model_name, cost)
        if pub is not None:
            lines.append(
                f"published ({pub.url}, {pub.table}): {pub.tokens_per_s_per_gpu:,} tokens/s/GPU, {pub.memory_gib} GiB; "
                f"the cost model is {100 * (cost.tokens_per_s_per_gpu / pub.tokens_per_s_per_gpu - 1):+.1f}% on "
                f"tokens/s ({pub.split.replace('_', '-')} point; measured on a GPU by them, never by lowprec)"
            )
    return lines


def published_for(e, model_name: str, cost):
    """The point of ``published.yaml`` with this model, recipe, hardware and layout, if there is one."""
    lo = cost.layout
    for p in load_points():
        if (
            p.tokens_per_s_per_gpu is not None
            and (p.model, p.recipe, p.hardware) == (model_name, e.recipe, cost.hardware)
            and (p.dp_shard, p.tp, p.batch, p.seq, p.ac, p.compile, p.async_tp)
            == (lo.dp_shard, lo.tp, lo.batch, lo.seq, lo.ac, lo.compile, lo.async_tp)
        ):
            return p
    return None


def format_ranking(r, model_name: str, costs: dict, batch: int = 0, assumed: dict | None = None) -> str:
    """The ``recipe=all`` table of a ``lowprec.estimate.Ranking``; ``costs``: recipe -> ``StepCost`` or an
    error string (why no time is predicted); ``batch``: the global ``train.batch_size``; ``assumed``: recipe ->
    its ``Resolved`` compile/AC on the part (``EstimateQuery.assumed``). Ranks are labelled (``mem rank``: 1 = least
    memory; ``time rank``: 1 = fastest), equal printed values share a rank, and the ``bound`` column with a line
    below says when the step is set by communication (recipes that then tie, whatever their compute)."""
    e0 = r.rows[0]
    hw = e0.hardware
    hw_name = hw.name if hw else "none"
    head = (
        f"model={model_name}, parallel.dp_shard={e0.dp_shard} parallel.tp={e0.tp}, train.batch_size={batch} "
        f"({e0.batch} per data-parallel rank) x train.seq_len={e0.seq}, hardware={hw_name}; "
        f"per GPU, ranked by total with train.ac={r.recompute}"
    )
    timed = {n: c for n, c in costs.items() if not isinstance(c, str)}
    rank_time = competition_ranks({n: f"{c.step_time_s:.4g}" for n, c in timed.items()})
    rank_mem = competition_ranks({e.recipe: _gib(e.totals[r.recompute]) for e in r.rows})
    cols = [("mem rank", "right"), ("recipe", "left"), ("state GiB", "right"), ("act GiB", "right")]
    cols += [("total GiB", "right"), ("fits", "right"), ("compiled", "right"), ("step s", "right")]
    cols += [("tok/s/GPU", "right"), ("bound", "left"), ("time rank", "right")]
    assumed = assumed or {}
    rows = []
    for e in r.rows:
        c = timed.get(e.recipe)
        fits = {True: "yes", False: "no", None: "-"}[e.fits(r.recompute)]
        res = assumed.get(e.recipe)
        rows.append(
            (
                rank_mem[e.recipe],
                e.recipe,
                _gib(e.state.total),
                _gib(e.activations.recompute[r.recompute]),
                _gib(e.totals[r.recompute]),
                fits,
                "-" if res is None else ("yes" if res.compile else "no"),
                f"{c.step_time_s:.4g}" if c else "-",
                f"{c.tokens_per_s_per_gpu:,.0f}" if c else "-",
                _BOUND_SHORT[c.bound] if c else "-",
                rank_time.get(e.recipe, "-"),
            )
        )
    lines = [head]
    if assumed:
        first = next(iter(assumed.values()))
        asked_c = first.requested_compile
        compiled = any(x.compile or x.fallback for x in assumed.values())  # auto's choice before a fallback
        words = f"train.compile=auto -> {str(compiled).lower()}" if asked_c == "auto" else f"train.compile={asked_c}"
        if any(x.fallback for x in assumed.values()):
            words += " (compiled=no: the recipe cannot compile, lowprec train runs it eager)"
        ac = f"train.ac=auto -> {r.recompute}" if first.requested_ac == "auto" else f"train.ac={r.recompute}"
        auto = " (auto: what lowprec train chooses on that part, not on this machine)"
        lines.append(f"assumed: {words}, {ac}" + (auto if "auto" in (asked_c, first.requested_ac) else ""))
    lines += ["", render_table(cols, rows)]
    if timed:
        lines.append(
            f"\nmem rank: 1 = least memory; time rank: 1 = fastest; equal printed values share a rank. Step time "
            f"from the per-op cost model (train.ac={r.recompute}); its held-out error reaches "
            f"{100 * MODEL_ERROR:.0f}% (lowprec estimate --validate)"
            + (f"\n{MOE_NOTE}" if r.rows[0].flops.is_moe else "")
        )
        comm = sorted(n for n, c in timed.items() if c.bound == "communication")
        if comm:
            lines.append(
                f"bound=comm: {len(comm)} of {len(timed)} timed recipes are communication-bound here: their compute "
                "hides under the FSDP communication, so the step is the communication's time and they tie whatever "
                "their compute; a larger batch per GPU (train.batch_size or train.seq_len) shows their compute "
                "differences"
            )
    notes = [f"note: {e.recipe}: {n}" for e in r.rows for n in e.notes]
    notes += [
        f"note: {e.recipe}: no step time: {c}"
        for e in r.rows
        if isinstance(c := costs.get(e.recipe), str) and c not in e.notes
    ]
    return "\n".join(lines + ([""] + notes if notes else []))


def _costs(args, estimates, hw, layouts: dict) -> dict:
    """recipe -> its ``StepCost`` under its ``layouts[name]``, or why none is predicted: ``hw`` cannot run it
    (``hardware_blocker``), or its estimate does not fit ``hw``'s memory under the layout's AC (``no_fit_reason``)."""
    out = {}
    for r, e in estimates:
        why = hardware_blocker(r, hw)
        if why is not None:
            out[r.name] = f"not runnable on {hw.name}: {why}"
            continue
        lo = layouts[r.name]
        out[r.name] = no_fit_reason(e, lo.ac) or step_cost(args, r, hw, lo)
    return out


def validation(as_json: bool) -> str:
    """``lowprec estimate --validate``: the cost model against every published point (text or JSON)."""
    rows = validate()
    if as_json:
        return json.dumps({"rows": [r.to_dict() for r in rows], **summary(rows)}, indent=1)
    return format_table(rows, Calibration())


def run(q: EstimateQuery, as_json: bool = False) -> str:
    """Compute and format (text or JSON) the estimate of the typed query ``q``; raises ``UserError`` subclasses
    for what the part cannot run (``check_fp8_hardware``) or an unknown ``hardware``. Each recipe is estimated with
    the compile/AC ``q.assumed`` resolved for it on the part (``auto`` as lowprec train resolves it there)."""
    args, hw = q.args, get_hardware(q.hardware)
    seq, ac = q.train.seq_len, q.train.ac
    kw = dict(
        dp_shard=q.dims.dp_shard,
        tp=q.dims.tp,
        batch=q.batch_per_rank,
        seq=seq,
        hardware=hw,
        efficiency=q.efficiency if q.efficiency is not None else DEFAULT_EFFICIENCY,
    )
    recipes = list(q.recipes)
    check_fp8_hardware([] if q.all_recipes else recipes, hw, q.emulate)
    model_info = {"name": q.model, **dataclasses.asdict(args)}
    compiled = {r.name: q.assumed[r.name].compile if r.name in q.assumed else q.train.compile for r in recipes}
    layouts = {
        n: Layout(q.dims.dp_shard, q.dims.tp, q.batch_per_rank, seq, ac, c, q.async_tp) for n, c in compiled.items()
    }
    # lowprec compiles the loss with the blocks: the FP32 loss transient follows each recipe's compile
    ests = [(x, estimate(args, x, compiled_loss=compiled[x.name], **kw)) for x in recipes]
    costs = _costs(args, ests, hw, layouts)
    assumed_json = {n: dataclasses.asdict(r) for n, r in q.assumed.items()}
    if q.all_recipes:
        r = rank_estimates([e for _, e in ests], ac)
        if as_json:
            return json.dumps(
                {
                    "model": model_info,
                    "assumed": assumed_json,
                    **r.to_dict(),
                    "cost_model": {n: (c if isinstance(c, str) else c.to_dict()) for n, c in costs.items()},
                },
                indent=1,
            )
        return format_ranking(r, q.model, costs, q.train.batch_size, q.assumed)
    e = ests[0][1]
    cost = costs[recipes[0].name]
    no_time = None
    if isinstance(cost, str):  # not runnable there (--emulate), or it does not fit
        no_time = cost if cost.startswith("does not fit") else f"{cost} (emulated speed is not modelled)"
        cost = None
    unsharded = predict_state_bytes(args, recipes[0])
    res = q.assumed.get(recipes[0].name)
    if as_json:
        return json.dumps(
            {
                "model": model_info,
                "assumed": assumed_json.get(recipes[0].name),
                "unsharded_state": unsharded.to_dict(),
                **e.to_dict(),
                "cost_model": cost.to_dict() if cost else None,
                "no_step_time": no_time,
            },
            indent=1,
        )
    return format_one(
        e,
        args,
        q.model,
        unsharded,
        cost,
        flat=q.efficiency is not None,
        no_time=no_time,
        batch=q.train.batch_size,
        assumed=assumed_words(res, hw.name) if res is not None else None,
    )
