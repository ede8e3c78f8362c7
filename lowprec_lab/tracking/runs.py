"""An ablation's runs read back from the tracking store: ``load_runs`` gives each child run of a parent run as a
``RunData`` (curves, telemetry, stability, anomalies). The report and the studies both read runs through it, so
a study never imports the report to see the runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from lowprec_lab.stats import StabilityMetrics
from lowprec_lab.tracking.anomaly_log import has_anomalies, read_anomalies
from lowprec_lab.tracking.stability_log import run_stability, stability_rule_of
from lowprec_lab.tracking.tracker import PARENT_TAG, Tracker

#: Metrics whose whole history each run carries (``RunData.curves``).
CURVES = ("loss", "val_loss", "grad_norm")
#: Curves only some runs log (``val_loss_ema``: ``train.eval_ema``; ``z_loss``: ``train.z_loss`` > 0, the term added
#: to the objective beside the plain cross-entropy ``loss``), read only from the runs that did.
OPTIONAL_CURVES = ("val_loss_ema", "z_loss")
#: (role or GEMM, stat) drawn as heatmaps over layers x steps.
TELEMETRY_PANELS = [
    ["output", "sqnr_db"],
    ["grad_input", "sqnr_db"],
    ["grad_output", "underflow"],
    ["input", "overflow"],
]
#: The params a child run logs right after it is created (``lowprec_lab.runner.run.run_one``) and that reading it
#: back needs (its tokens per step); a run without them was killed between its creation and its params.
REQUIRED_PARAMS = ("train.batch_size", "train.grad_accum", "train.seq_len")
#: The summary metrics a FINISHED run logs before it ends and that every comparison reads: a run without one of
#: them is not comparable, whatever its status says.
SUMMARY_METRICS = (
    "final_val_loss",
    "mean_tokens_per_s",
    "state_bytes_per_param",
    "mem_peak_bytes",
    "mem_peak_growth_bytes",
)
#: ``failure_kind`` of a child run whose record is incomplete (``incomplete_record``): not a result of its recipe.
INCOMPLETE_KIND = "incomplete"


@dataclass
class RunData:
    """One child run of an ablation as the store holds it: tags, final metrics (``metrics``), the histories of
    ``CURVES`` (``curves``: ``[(step, value)]``) and of the telemetry panels, its stability and anomaly events.
    ``comparable``: FINISHED with the effective recipe the one requested (no FP8 fallback)."""

    run_id: str
    recipe: str
    seed: int
    status: str
    reason: str
    comparable: bool
    short: str
    effective: dict
    metrics: dict[str, float]
    tokens_per_step: int
    layout: str = "single"
    #: ``train.ac``: the activation checkpointing the run's saved-activation bytes were measured under.
    ac: str = "none"
    #: ``cpu_kernels`` as the run resolved it, with the CPU that decided it (empty on older runs).
    kernels: str = ""
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    telemetry: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    #: ``run_stability``: as the run logged it (``stability/*``), else recomputed from its curves; None: no loss.
    stability: StabilityMetrics | None = None
    #: The spike rule ``stability`` was counted with (the run's ``stability_rule`` tag, or the default's).
    stability_rule: str = ""
    #: The run's anomaly events (``anomalies.json``; ``lowprec_lab.tracking.anomaly_log``), empty when it recorded none.
    anomalies: list[dict] = field(default_factory=list)
    #: Sampled steps left out of ``telemetry`` (``telemetry_warmup``), and why; empty when none.
    telemetry_left_out: tuple[int, ...] = ()
    #: ``train.compile``/``train.ac`` as ``auto`` resolved them (the run's ``train_auto`` tag; empty: not auto).
    train_auto: str = ""
    #: why ``train.compile=auto`` ran this recipe eager (``compile_fallback`` tag): its tokens/s is not comparable.
    compile_fallback: str = ""

    def tokens(self, step: int) -> int:
        return (step + 1) * self.tokens_per_step


def incomplete_record(run) -> str | None:
    """Why the child run ``run`` (an ``mlflow.entities.Run``) cannot be read back as a run of its ablation, in one
    line, or None when it can: a run without its ``recipe``/``seed`` tags or its ``REQUIRED_PARAMS`` (a process
    killed between the run's creation and its params leaves one), or with values that are not what they name."""
    tags, params = run.data.tags, run.data.params
    missing = [f"tag {k}" for k in ("recipe", "seed") if not tags.get(k)]
    missing += [f"param {k}" for k in REQUIRED_PARAMS if k not in params]
    if missing:
        return (
            f"incomplete record: no {', '.join(missing)} (its process died as the run was created); not a result, "
            "left out of the report"
        )
    for key, value in [("tag seed", tags["seed"]), *((f"param {k}", params[k]) for k in REQUIRED_PARAMS)]:
        try:
            int(value)
        except ValueError:
            return f"incomplete record: {key} is {str(value)[:40]!r}, not an integer; left out of the report"
    return None


def _json_dict(text: str | None) -> dict:
    """A JSON object from a tag; {} for a tag that is absent or is not one (a record is data: it never raises)."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def load_runs(tracker: Tracker, parent_id: str, skipped: list[tuple[str, str]] | None = None) -> list[RunData]:
    """Every child run of the parent run ``parent_id`` read back from the store as a ``RunData`` (its curves, its
    telemetry less the warm-up steps, its stability and anomalies), in the store's order.

    A child whose record is incomplete (``incomplete_record``: killed as it was created) is left out, and
    ``(run id, why)`` appended to ``skipped`` when given; a FINISHED run without every ``SUMMARY_METRICS`` is read
    but not comparable, with the missing ones as its reason. Never raises for a partial run."""
    children = tracker.client.search_runs(
        [tracker.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent_id}'", max_results=10000
    )
    out = []
    for r in children:
        why = incomplete_record(r)
        if why is not None:
            if skipped is not None:
                skipped.append((r.info.run_id, why))
            continue
        tags, params = r.data.tags, r.data.params
        tps = int(params["train.batch_size"]) * int(params["train.grad_accum"]) * int(params["train.seq_len"])
        no_summary = [k for k in SUMMARY_METRICS if k not in r.data.metrics]
        rd = RunData(
            run_id=r.info.run_id,
            recipe=tags["recipe"],
            seed=int(tags["seed"]),
            status=r.info.status,
            reason=tags.get("failure_reason", ""),
            # An FP8 fallback changed the recipe during the run: it is not a run of the requested recipe.
            comparable=r.info.status == "FINISHED"
            and tags.get("effective_matches") == "true"
            and "fp8_fallback" not in tags
            and not no_summary,
            short=tags.get("recipe_short", ""),
            effective=_json_dict(tags.get("effective_recipe")),
            metrics=dict(r.data.metrics),
            tokens_per_step=tps,
            layout=tags.get("parallel", "single"),
            ac=params.get("train.ac", "none"),
            kernels=kernels_line(tags),
            train_auto=tags.get("train_auto", ""),
            compile_fallback=tags.get("compile_fallback", ""),
        )
        for key in (*CURVES, *(k for k in OPTIONAL_CURVES if k in r.data.metrics)):
            rd.curves[key] = metric_series(tracker.client.get_metric_history(r.info.run_id, key))
        left_out = telemetry_warmup(tags)
        for key in r.data.metrics:
            if key.startswith("fp8/") and key.rsplit("/", 2)[-2:] in TELEMETRY_PANELS:
                series = metric_series(tracker.client.get_metric_history(r.info.run_id, key))
                rd.telemetry[key] = [(s, v) for s, v in series if s not in left_out]
                if len(rd.telemetry[key]) < len(series):
                    rd.telemetry_left_out = left_out
        rd.stability = run_stability(rd)
        rd.stability_rule = stability_rule_of(rd, tags)
        if has_anomalies(rd.metrics):
            rd.anomalies = read_anomalies(tracker, r.info.run_id)
        if "fp8_fallback" in tags and not rd.reason:
            rd.reason = f"the effective recipe changed during the run: {tags['fp8_fallback']}"
        if rd.status == "FINISHED" and no_summary and not rd.reason:
            rd.reason = f"finished without its summary metrics ({', '.join(no_summary)}): not compared"
        out.append(rd)
    return out


def telemetry_warmup(tags: dict) -> tuple[int, ...]:
    """The sampled steps the telemetry heatmaps leave out of a run with these tags: step 0 of a run whose recipe
    scales FP8 with delayed scaling (its ``recipe_json`` tag), else none.

    Delayed scaling (Transformer Engine's ``DelayedScaling``; ``lowprec.numerics.scaling.DelayedScaler``) casts a step
    with the scale computed from the amaxes of the steps before it; step 0 has none, so it casts with the initial
    scale 1.0: on a real run nearly every grad_output element (~1e-5) flushed to zero (underflow 100%, grad_input
    SQNR 0 dB) on step 0 and none from the first update on. That is the cast that ran (the metrics stay in
    MLflow), but it says nothing about the recipe once scaling has started, and it set the heatmaps' colour range.
    """
    try:
        fp8 = json.loads(tags.get("recipe_json", "{}")).get("fp8") or {}
    except (ValueError, AttributeError):
        return ()
    # a record written before the FP8 fields were grouped has them flat (``lowprec.recipe.FP8_LEGACY``)
    cast = fp8.get("cast") if isinstance(fp8.get("cast"), dict) else fp8
    return (0,) if cast.get("strategy") == "delayed" else ()


def metric_series(history) -> list[tuple[int, float]]:
    """(step, value) pairs of a metric history, one per step: a run continued from a checkpoint after an
    interruption (``resume=`` of an ablation) logs again the steps after it, bit-identical recomputations."""
    return sorted({m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}.items())


def kernels_line(tags: dict) -> str:
    """The run's ``cpu_kernels`` line (resolved kernels and the CPU that decided them); empty for older runs."""
    if "cpu_kernels" not in tags:
        return ""
    bf16, fp8 = tags.get("cpu_kernels_bf16", "?"), tags.get("cpu_kernels_fp8", "?")
    line = f"cpu_kernels={tags['cpu_kernels']} (BF16/FP16: {bf16}, FP8: {fp8})"
    if "cpu_model" in tags:
        line += f" on {tags['cpu_model']} [{tags.get('cpu_isa', '')}]"
    return line
