"""``lowprec estimate``: predicted per-GPU memory by component and step time, without running anything.

    lowprec estimate model=SIZE recipe=NAME|all [parallel.dp_shard=N] [parallel.tp=N] [hardware=NAME]
                     [batch=N] [seq=N] [efficiency=F] [recompute=none|selective|full]
                     [model.<field>=V ...] [recipe.<group>.<field>=V ...] [--json]

``batch`` is sequences per data-parallel rank (default 1); ``seq`` defaults to the model's ``max_seq_len``;
``hardware`` defaults to ``h100_sxm``; ``efficiency`` (default 0.4) is the assumed MFU of the time
prediction; ``recompute`` picks the column that ranks ``recipe=all``. Sizes are printed in decimal GB
(1e9 bytes). A bad argument prints one line on stderr and returns 2. The figures come from
``lowprec.estimate`` (its module doc states every rule and assumption).
"""

from __future__ import annotations

import dataclasses
import json
import sys

from lowprec.estimate.estimator import DEFAULT_EFFICIENCY, estimate, estimate_all, predict_state_bytes
from lowprec.estimate.hardware import get_hardware
from lowprec.estimate.inventory import param_counts
from lowprec.model import model_args
from lowprec.recipe import Recipe, RecipeError
from recipes import CATALOG, get_recipe

USAGE = (
    "usage: lowprec estimate model=SIZE recipe=NAME|all [parallel.dp_shard=N] [parallel.tp=N] "
    "[hardware=NAME] [batch=N] [seq=N] [efficiency=F] [recompute=none|selective|full] "
    "[model.<field>=V] [recipe.<group>.<field>=V] [--json]"
)
_KEYS = ("model", "recipe", "parallel.dp_shard", "parallel.tp", "hardware", "batch", "seq", "efficiency", "recompute")
_INTS = ("parallel.dp_shard", "parallel.tp", "batch", "seq")


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
    out: dict = {"json": False, "model_over": {}, "recipe_over": {}}
    for a in argv:
        if a == "--json":
            out["json"] = True
            continue
        key, eq, val = a.partition("=")
        if not eq or not key or not val:
            raise EstimateArgError(f"argument {a!r} is not key=value (or --json)")
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
    for req in ("model", "recipe"):
        if req not in out:
            raise EstimateArgError(f"{req}= is required")
    return out


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
                raise EstimateArgError(f"unknown recipe group {group!r}; known: weights, compute, fp8, optim")
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


def format_one(e, args, model_name: str, unsharded) -> str:
    """The per-GPU table of one ``lowprec.estimate.Estimate`` (``unsharded``: its state at dp_shard=tp=1)."""
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
        f"(all but the token embedding); FP8 share {100 * fl.fp8_fraction:.0f}%"
    )
    t = e.throughput
    if t is not None:
        lines.append(
            f"predicted step {t.step_time_s:.4g} s, {t.tokens_per_s_per_gpu:,.0f} tokens/s/GPU at "
            f"{100 * t.efficiency:.0f}% MFU of {t.peak.label} peak {t.peak.tflops:,.0f} TFLOP/s "
            f"({t.peak.hardware}); communication not modelled"
        )
    pub = published_for(e, model_name)
    if pub is not None and t is not None:
        lines.append(
            f"published ({pub['source']}): {pub['tokens_per_s_per_gpu']:,} tokens/s/GPU, "
            f"{pub['memory_gib']} GiB; lowprec's prediction is "
            f"{100 * (t.tokens_per_s_per_gpu / pub['tokens_per_s_per_gpu'] - 1):+.0f}% "
            "on tokens/s (measured on a GPU by them, predicted here, never measured by lowprec)"
        )
    for n in e.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


#: Published measurements to print beside a matching estimate (torchtitan and torchao benchmark tables).
PUBLISHED = {
    ("llama3_8b", "bf16", 8): {
        "source": "torchtitan, Llama-3.1-8B, 8xH100, FSDP2 + compile",
        "tokens_per_s_per_gpu": 6667,
        "memory_gib": 77.0,
    },
    ("llama3_8b", "fp8_tensorwise", 8): {
        "source": "torchtitan, Llama-3.1-8B, 8xH100, FSDP2 + compile, float8 tensorwise + FP8 all-gather",
        "tokens_per_s_per_gpu": 8532,
        "memory_gib": 76.8,
    },
}


def published_for(e, model_name: str) -> dict | None:
    """The published measurement matching (model, recipe, dp_shard) on an H100, if there is one."""
    hw = e.hardware
    if hw is None or not hw.name.startswith("h100"):
        return None
    return PUBLISHED.get((model_name, e.recipe, e.dp_shard))


def format_ranking(r, model_name: str) -> str:
    """The ``recipe=all`` table of a ``lowprec.estimate.Ranking``."""
    e0 = r.rows[0]
    hw = e0.hardware
    head = (
        f"model={model_name}, parallel.dp_shard={e0.dp_shard} parallel.tp={e0.tp}, batch={e0.batch} x "
        f"seq={e0.seq}, hardware={hw.name if hw else 'none'}; per GPU, ranked by total with recompute={r.recompute}"
    )
    eff = next((x.throughput.efficiency for x in r.rows if x.throughput), None)
    cols = (
        f"{'mem':>3} {'recipe':<15} {'state GB':>9} {'act GB':>8} {'total GB':>9} {'fits':>4} "
        f"{'step s':>8} {'tok/s/GPU':>10} {'time':>4}  peak"
    )
    lines = [head, "", cols]
    for e in r.rows:
        t = e.throughput
        fits = {True: "yes", False: "no", None: "-"}[e.fits(r.recompute)]
        lines.append(
            f"{r.rank_memory[e.recipe]:>3} {e.recipe:<15} {_gb(e.state.total):>9} "
            f"{_gb(e.activations.recompute[r.recompute]):>8} {_gb(e.totals[r.recompute]):>9} {fits:>4} "
            f"{(f'{t.step_time_s:.4g}' if t else '-'):>8} {(f'{t.tokens_per_s_per_gpu:,.0f}' if t else '-'):>10} "
            f"{r.rank_time[e.recipe]:>4}  {t.peak.label if t else 'no prediction (see notes)'}"
        )
    if eff is not None:
        lines.append(f"\nstep time at {100 * eff:.0f}% MFU of each recipe's peak; communication not modelled")
    notes = [f"note: {e.recipe}: {n}" for e in r.rows for n in e.notes]
    return "\n".join(lines + ([""] + notes if notes else []))


def run(opts: dict) -> str:
    """Compute and format (text or JSON) the estimate for parsed ``opts``; raises on bad values."""
    try:
        args = model_args(opts["model"], **opts["model_over"])
    except TypeError as e:
        raise EstimateArgError(f"bad model.<field> override: {e}") from None
    hw = get_hardware(opts.get("hardware", "h100_sxm"))
    kw = dict(
        dp_shard=opts.get("parallel.dp_shard", 1),
        tp=opts.get("parallel.tp", 1),
        batch=opts.get("batch", 1),
        seq=opts.get("seq"),
        hardware=hw,
        efficiency=opts.get("efficiency", DEFAULT_EFFICIENCY),
    )
    recipes = _recipes(opts["recipe"], opts["recipe_over"])
    model_info = {"name": opts["model"], **dataclasses.asdict(args)}
    if opts["recipe"] == "all":
        r = estimate_all(args, recipes, recompute=opts.get("recompute", "none"), **kw)
        if opts["json"]:
            return json.dumps({"model": model_info, **r.to_dict()}, indent=1)
        return format_ranking(r, opts["model"])
    e = estimate(args, recipes[0], **kw)
    unsharded = predict_state_bytes(args, recipes[0])
    if opts["json"]:
        return json.dumps({"model": model_info, "unsharded_state": unsharded.to_dict(), **e.to_dict()}, indent=1)
    return format_one(e, args, opts["model"], unsharded)


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
