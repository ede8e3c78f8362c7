"""``lowprec estimate``: predicted per-GPU memory by component and step time, without running anything.

    lowprec estimate model=SIZE recipe=NAME|all [parallel.dp_shard=N] [parallel.tp=N] [hardware=NAME]
                     [batch=N] [seq=N] [efficiency=F] [recompute=none|selective|full]
                     [model.<field>=V ...] [recipe.<group>.<field>=V ...] [--emulate] [--json]

``batch`` is sequences per data-parallel rank (default 1); ``seq`` defaults to the model's ``max_seq_len``;
``hardware`` defaults to ``h100_sxm``; ``efficiency`` (default 0.4) is the assumed MFU of the time
prediction; ``recompute`` picks the column that ranks ``recipe=all``. Sizes are printed in decimal GB
(1e9 bytes). A bad argument prints one line on stderr and returns 2: every key is checked (``recompute`` also
for a single recipe), and an FP8 recipe on hardware without FP8 tensor cores (A100) is refused unless
``--emulate`` is given (the memory is then estimated and no step time is predicted: emulated FP8 GEMMs run at
FP32 speed, which the model does not cover). The figures come from
``lowprec.estimate`` (its module doc states every rule and assumption).
"""

from __future__ import annotations

import dataclasses
import json
import sys

from experiments.cost_validation import format_table, load_points, summary, validate
from lowprec.estimate.activations import RECOMPUTE_MODES
from lowprec.estimate.cost_model import Calibration, Layout, gemm_dtype, step_cost
from lowprec.estimate.estimator import DEFAULT_EFFICIENCY, estimate, estimate_all, predict_state_bytes
from lowprec.estimate.hardware import get_hardware
from lowprec.estimate.inventory import param_counts
from lowprec.model import ModelArgs, MoEArgs, model_args
from lowprec.recipe import Recipe, RecipeError
from recipes import CATALOG, get_recipe

USAGE = (
    "usage: lowprec estimate model=SIZE recipe=NAME|all [parallel.dp_shard=N] [parallel.tp=N] "
    "[hardware=NAME] [batch=N] [seq=N] [efficiency=F] [recompute=none|selective|full] [compile=true|false] "
    "[async_tp=true|false] [model.<field>=V] [recipe.<group>.<field>=V] [--emulate] [--json]\n"
    "       lowprec estimate --validate [--json]"
)
_KEYS = (
    "model",
    "recipe",
    "parallel.dp_shard",
    "parallel.tp",
    "hardware",
    "batch",
    "seq",
    "efficiency",
    "recompute",
    "compile",
    "async_tp",
)
_BOOLS = ("compile", "async_tp")
_INTS = ("parallel.dp_shard", "parallel.tp", "batch", "seq")


#: The largest held-out throughput error of the shipped calibration (``lowprec estimate --validate``;
#: ``tests/unit/test_cost_model.py`` keeps it equal to the table's).
MODEL_ERROR = 0.128
#: said wherever a MoE model's step time is printed: the held-out error above is that of dense models
MOE_NOTE = (
    "MoE step time NOT validated (no published MoE measurement): routed experts timed as separate GEMMs at "
    "tokens*top_k/n_routed rows each; a GPU grouped GEMM would run them faster"
)


class EstimateArgError(ValueError):
    """A bad command-line argument; the message names it."""


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


def parse_args(argv: list[str]) -> dict:
    """``key=value`` pairs and ``--json`` into a dict; raises ``EstimateArgError`` for anything else."""
    out: dict = {"json": False, "emulate": False, "validate": False, "model_over": {}, "recipe_over": {}}
    for a in argv:
        if a in ("--json", "--emulate", "--validate"):
            out[a[2:]] = True
            continue
        key, eq, val = a.partition("=")
        if not eq or not key or not val:
            raise EstimateArgError(f"argument {a!r} is not key=value (or --json, --emulate, --validate)")
        if key.startswith("model."):
            out["model_over"][key.removeprefix("model.")] = _value(val)
        elif key.startswith("recipe."):
            group, dot, name = key.removeprefix("recipe.").partition(".")
            if not dot:
                raise EstimateArgError(f"recipe override {key!r} must be recipe.<group>.<field>")
            out["recipe_over"].setdefault(group, {})[name] = _value(val)
        elif key in _KEYS:
            if key in _INTS:
                try:
                    out[key] = int(val)
                except ValueError:
                    raise EstimateArgError(f"{key}={val!r} is not an integer") from None
            elif key in _BOOLS:
                if val.lower() not in ("true", "false"):
                    raise EstimateArgError(f"{key}={val!r} is not true or false")
                out[key] = val.lower() == "true"
            elif key == "efficiency":
                try:
                    out[key] = float(val)
                except ValueError:
                    raise EstimateArgError(f"efficiency={val!r} is not a number") from None
            else:
                out[key] = val
        else:
            raise EstimateArgError(
                f"unknown key {key!r}; known: {', '.join(_KEYS)}, model.<field>, recipe.<group>.<field>"
            )
    if out["validate"]:
        extra = [k for k in out if k in _KEYS]
        if extra:
            raise EstimateArgError(f"--validate takes no other key (got {extra[0]}=): it predicts the published points")
        return out
    for req in ("model", "recipe"):
        if req not in out:
            raise EstimateArgError(f"{req}= is required")
    if out.get("recompute", "none") not in RECOMPUTE_MODES:
        raise EstimateArgError(f"recompute={out['recompute']!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if "efficiency" in out and not 0.0 < out["efficiency"] <= 1.0:
        raise EstimateArgError(f"efficiency={out['efficiency']} must be in (0, 1]")
    if out.get("async_tp") and out.get("parallel.tp", 1) == 1:
        raise EstimateArgError("async_tp=true needs parallel.tp > 1")
    return out


def compile_for(args, asked: bool | None) -> bool:
    """Whether the cost model times the elementwise kernels fused and the memory model counts the loss compiled
    (``compile``, what ``train.compile`` does): as asked, by default ``true``
    for a dense model and ``false`` for a DeepSeekMoE model, which lowprec trains eager
    (``lowprec.train.moe_balance`` refuses ``train.compile`` there). ``compile=true`` on a MoE model raises
    ``EstimateArgError`` (one line)."""
    moe = isinstance(args, MoEArgs)
    if asked and moe:
        raise EstimateArgError(
            "compile=true: lowprec trains MoE models eager (train.compile is refused for their per-expert loop); "
            "drop it or set compile=false"
        )
    return (not moe) if asked is None else asked


def check_model_overrides(over: dict) -> dict:
    """``model.<field>=V`` overrides checked against ``ModelArgs``'s fields: known name, and an integer for the
    integer fields, a number for the float ones (``None`` allowed where the default is). Raises
    ``EstimateArgError``; the values themselves are checked by ``ModelArgs``."""
    fields = {f.name: f for f in dataclasses.fields(ModelArgs)}
    for k, v in over.items():
        if k not in fields:
            raise EstimateArgError(f"unknown model field model.{k}; known: {', '.join(fields)}")
        default = fields[k].default
        ok = (
            (isinstance(v, int) and not isinstance(v, bool))
            if isinstance(default, int)
            else (v is None or (isinstance(v, int | float) and not isinstance(v, bool)))
        )
        if not ok:
            kind = "an integer" if isinstance(default, int) else "a number"
            raise EstimateArgError(f"model.{k}={v!r} is not {kind}")
    return over


def check_fp8_hardware(recipes, hw, emulate: bool) -> None:
    """Refuse FP8 recipes on hardware without FP8 tensor cores, and E2M1 (MXFP4 / NVFP4) recipes on hardware without
    FP4 tensor cores, unless ``emulate`` (``EstimateArgError``)."""
    if emulate:
        return
    fp4 = [r.name for r in recipes if r.fp8.enabled and gemm_dtype(r) == "fp4"]
    if fp4 and hw.fp4_tflops is None:
        raise EstimateArgError(
            f"recipe {fp4[0]} runs FP4 (E2M1) GEMMs and hardware={hw.name} has no FP4 tensor cores; "
            "pick a Blackwell part (b200, gb200) or pass --emulate"
        )
    if hw.fp8_tflops is not None:
        return
    fp8 = [r.name for r in recipes if r.fp8.enabled]
    if fp8:
        raise EstimateArgError(
            f"recipe {fp8[0]} runs FP8 GEMMs and hardware={hw.name} has no FP8 tensor cores; "
            "pick an FP8 part (h100, h200, b200, mi300x) or pass --emulate"
        )


def _recipes(name: str, overrides: dict):
    if name == "all":
        if overrides:
            raise EstimateArgError("recipe.<group>.<field> overrides need a single recipe, not recipe=all")
        return list(CATALOG.values())
    r = get_recipe(name)
    if overrides:
        d = r.to_dict()
        for group, fields in overrides.items():
            if group not in d or not isinstance(d[group], dict):
                known = ", ".join(k for k, v in d.items() if isinstance(v, dict))
                raise EstimateArgError(f"unknown recipe group {group!r}; known: {known}")
            d[group].update(fields)
        r = Recipe.from_dict(d)
    return [r]


def _gb(b: float) -> str:
    return f"{b / 1e9:,.2f}"


def _row(label: str, nbytes: int, note: str = "") -> str:
    return f"  {label:<40} {nbytes:>19,} {_gb(nbytes):>10}  {note}".rstrip()


def _activated_line(args) -> list[str]:
    """For a MoE model, one line with its activated parameters per token (``param_counts``); none for a dense one."""
    pc = param_counts(args)
    if pc.activated == pc.total:
        return []
    return [f"MoE: {pc.activated:,} parameters activated per token of {pc.total:,} (every expert is in the state)"]


def cost_line(c) -> str:
    """One line of a ``lowprec.estimate.cost_model.StepCost``: step, tokens/s/GPU and where the time goes."""
    lo = c.layout
    return (
        f"predicted step {c.step_time_s:.4g} s, {c.tokens_per_s_per_gpu:,.0f} tokens/s/GPU on {c.hardware} "
        f"(cost model, ac={lo.ac}, compile={str(lo.compile).lower()}): GEMMs {c.gemm:.3g} s, attention "
        f"{c.attention:.3g} s, memory-bound kernels {c.kernels:.3g} s, FP8 casts {c.fp8_casts:.3g} s, "
        f"communication {c.fsdp_comm + c.tp_comm:.3g} s of which {c.exposed_comm:.3g} s exposed; "
        f"held-out error of the model up to {100 * MODEL_ERROR:.0f}% (lowprec estimate --validate)"
    )


def format_one(e, args, model_name: str, unsharded, cost=None, flat: bool = False) -> str:
    """The per-GPU table of one ``lowprec.estimate.Estimate`` (``unsharded``: its state at dp_shard=tp=1;
    ``cost``: its ``StepCost`` or ``None``; ``flat``: also print the flat-efficiency time)."""
    s, a, hw = e.state, e.activations, e.hardware
    pdt = "fp32" if s.params == 4 * s.n_local_params else "bf16"
    lines = [
        f"model={model_name}: {s.n_params:,} parameters ({s.n_tensors} tensors); recipe={e.recipe} ({e.short})",
        f"layout: parallel.dp_shard={e.dp_shard} parallel.tp={e.tp}; batch={e.batch} x seq={e.seq} per "
        f"data-parallel rank; figures are per GPU (rank 0)",
        *_activated_line(args),
        "",
        f"  {'component':<40} {'bytes':>19} {'GB':>10}",
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
                f"{unsharded.model_and_optimizer / 1e9:.1f} GB unsharded; this GPU holds "
                f"{s.model_and_optimizer / unsharded.model_and_optimizer:.4f} of it",
            )
        )
    else:
        lines.append(f"  {'':<40} {'':>19} {'':>10}  = {s.model_and_optimizer / 1e9:.1f} GB unsharded")
    if e.fsdp_buffers:
        lines.append(_row("FSDP2 unsharded params (transient)", e.fsdp_buffers, "root + 2 blocks, compute dtype"))
    for m in ("none", "selective", "full"):
        lines.append(
            _row(
                f"activations, recompute {m}",
                a.recompute[m],
                f"incl. {_gb(a.weight_copies)} GB weight casts saved by autocast"
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
            else (f"vs {hw.memory_bytes / 1e9:.0f} GB on {hw.name}: " + ("fits" if e.fits(m) else "does NOT fit"))
        )
        lines.append(_row(f"total, recompute {m}", e.totals[m], fit))
    lines.append("")
    fl = e.flops
    lines.append(
        f"FLOPs/token {fl.flops_per_token / 1e9:,.4g} G = 6*N + 12*L*dim*seq, N = {fl.n_flop_params:,} "
        + (
            f"activated parameters (top-k routed + shared experts + router, all but the token embedding; "
            f"{fl.n_total_params:,} in total)"
            if fl.is_moe
            else "(all but the token embedding)"
        )
        + f"; FP8 share {100 * fl.fp8_fraction:.0f}%"
    )
    t = e.throughput
    if t is not None and flat:
        lines.append(
            f"flat-efficiency step {t.step_time_s:.4g} s, {t.tokens_per_s_per_gpu:,.0f} tokens/s/GPU at "
            f"{100 * t.efficiency:.0f}% MFU of {t.peak.label} peak {t.peak.tflops:,.0f} TFLOP/s ({t.peak.hardware})"
        )
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
    for n in e.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


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


def format_ranking(r, model_name: str, costs: dict) -> str:
    """The ``recipe=all`` table of a ``lowprec.estimate.Ranking``; ``costs``: recipe -> ``StepCost`` or an
    error string (why no time is predicted)."""
    e0 = r.rows[0]
    hw = e0.hardware
    head = (
        f"model={model_name}, parallel.dp_shard={e0.dp_shard} parallel.tp={e0.tp}, batch={e0.batch} x "
        f"seq={e0.seq}, hardware={hw.name if hw else 'none'}; per GPU, ranked by total with recompute={r.recompute}"
    )
    cols = (
        f"{'mem':>3} {'recipe':<21} {'state GB':>9} {'act GB':>8} {'total GB':>9} {'fits':>4} "
        f"{'step s':>8} {'tok/s/GPU':>10} {'time':>4}"
    )
    lines = [head, "", cols]
    timed = sorted((c.step_time_s, n) for n, c in costs.items() if not isinstance(c, str))
    rank_time = {n: i + 1 for i, (_, n) in enumerate(timed)}
    for e in r.rows:
        c = costs.get(e.recipe)
        ok = c is not None and not isinstance(c, str)
        fits = {True: "yes", False: "no", None: "-"}[e.fits(r.recompute)]
        lines.append(
            f"{r.rank_memory[e.recipe]:>3} {e.recipe:<21} {_gb(e.state.total):>9} "
            f"{_gb(e.activations.recompute[r.recompute]):>8} {_gb(e.totals[r.recompute]):>9} {fits:>4} "
            f"{(f'{c.step_time_s:.4g}' if ok else '-'):>8} {(f'{c.tokens_per_s_per_gpu:,.0f}' if ok else '-'):>10} "
            f"{rank_time.get(e.recipe, '-'):>4}"
        )
    if timed:
        lines.append(
            f"\nstep time from the per-op cost model (ac={r.recompute}); its held-out error reaches "
            f"{100 * MODEL_ERROR:.0f}% (lowprec estimate --validate)"
            + (f"\n{MOE_NOTE}" if r.rows[0].flops.is_moe else "")
        )
    notes = [f"note: {e.recipe}: {n}" for e in r.rows for n in e.notes]
    notes += [
        f"note: {e.recipe}: no step time: {c}"
        for e in r.rows
        if isinstance(c := costs.get(e.recipe), str) and c not in e.notes
    ]
    return "\n".join(lines + ([""] + notes if notes else []))


def _costs(args, recipes, hw, lo) -> dict:
    out = {}
    for r in recipes:
        try:
            out[r.name] = step_cost(args, r, hw, lo)
        except ValueError as e:
            out[r.name] = str(e)
    return out


def run(opts: dict) -> str:
    """Compute and format (text or JSON) the estimate for parsed ``opts``; raises on bad values."""
    if opts["validate"]:
        rows = validate()
        if opts["json"]:
            return json.dumps({"rows": [r.to_dict() for r in rows], **summary(rows)}, indent=1)
        return format_table(rows, Calibration())
    args = model_args(opts["model"], **check_model_overrides(opts["model_over"]))
    hw = get_hardware(opts.get("hardware", "h100_sxm"))
    compiled = compile_for(args, opts.get("compile"))  # lowprec compiles the loss with the blocks
    kw = dict(
        dp_shard=opts.get("parallel.dp_shard", 1),
        tp=opts.get("parallel.tp", 1),
        batch=opts.get("batch", 1),
        seq=opts.get("seq"),
        hardware=hw,
        efficiency=opts.get("efficiency", DEFAULT_EFFICIENCY),
        compiled_loss=compiled,
    )
    recipes = _recipes(opts["recipe"], opts["recipe_over"])
    check_fp8_hardware(recipes if opts["recipe"] != "all" else [], hw, opts["emulate"])
    model_info = {"name": opts["model"], **dataclasses.asdict(args)}
    ac = opts.get("recompute", "none")
    if opts["recipe"] == "all":
        r = estimate_all(args, recipes, recompute=ac, **kw)
        lo = Layout(
            kw["dp_shard"],
            kw["tp"],
            kw["batch"],
            r.rows[0].seq,
            ac,
            compiled,
            opts.get("async_tp", False),
        )
        costs = _costs(args, recipes, hw, lo)
        if opts["json"]:
            return json.dumps(
                {
                    "model": model_info,
                    **r.to_dict(),
                    "cost_model": {n: (c if isinstance(c, str) else c.to_dict()) for n, c in costs.items()},
                },
                indent=1,
            )
        return format_ranking(r, opts["model"], costs)
    e = estimate(args, recipes[0], **kw)
    lo = Layout(
        kw["dp_shard"],
        kw["tp"],
        kw["batch"],
        e.seq,
        ac,
        compiled,
        opts.get("async_tp", False),
    )
    cost = _costs(args, recipes, hw, lo)[recipes[0].name]
    if isinstance(cost, str):  # FP8 under --emulate on a part without FP8 tensor cores
        e = dataclasses.replace(e, notes=(*e.notes, f"no step time: {cost} (emulated FP8 speed is not modelled)"))
        cost = None
    unsharded = predict_state_bytes(args, recipes[0])
    if opts["json"]:
        return json.dumps(
            {
                "model": model_info,
                "unsharded_state": unsharded.to_dict(),
                **e.to_dict(),
                "cost_model": cost.to_dict() if cost else None,
            },
            indent=1,
        )
    return format_one(e, args, opts["model"], unsharded, cost, flat="efficiency" in opts)


def estimate_main(argv: list[str]) -> int:
    """Entry point of ``lowprec estimate``; returns the exit status (0, or 2 for bad input)."""
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        out = run(parse_args(argv))
    except (EstimateArgError, RecipeError, ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"lowprec estimate: error: {str(msg).splitlines()[0]}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(estimate_main(sys.argv[1:]))
