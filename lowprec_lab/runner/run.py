"""One training run of one recipe and seed, tracked in MLflow; failures are recorded, never lost."""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import torch.distributed as dist

from lowprec.backends import short_str
from lowprec.data import TokenBatches, TokenData, check_vocab_fits
from lowprec.estimate.activations import predict_saved_activations
from lowprec.estimate.estimator import flops_per_token, mfu, predict_state_bytes
from lowprec.estimate.hardware import hardware_from_device_name
from lowprec.parallel import ParallelDims
from lowprec.parallel.runtime import is_rank0
from lowprec.recipe import Recipe
from lowprec.train.build import build, resolve_device
from lowprec.train.effective import EffectiveRecipeError
from lowprec.train.loop import run_training
from lowprec_lab.plan.plan import Plan
from lowprec_lab.runner.continued_runs import Continuation, history_before, supersede
from lowprec_lab.runner.faults import fault_hooks, from_env
from lowprec_lab.runner.tracked_run import RESULT_FAILURES as RESULT_FAILURES
from lowprec_lab.runner.tracked_run import RunOutcome as RunOutcome
from lowprec_lab.runner.tracked_run import TrackedRun, shared_tags
from lowprec_lab.runner.tracked_run import failure_kind as failure_kind
from lowprec_lab.tracking.anomaly_log import AnomalyLog
from lowprec_lab.tracking.stability_log import StabilityRecorder, rule_tag
from lowprec_lab.tracking.tracker import ABLATION_TAG, Tracker, device_name, dumps


def release_memory() -> None:
    """Free the finished run's objects and hand freed heap back to the OS (glibc ``malloc_trim``), so the
    next run's peak-RSS baseline is not inflated by the previous run's allocator cache."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def utilization_metrics(
    args, recipe: Recipe, spec, device, tokens_per_s: float, world_size: int = 1
) -> dict[str, float]:
    """``model_flops_per_token`` (6N + 12·L·dim·seq), ``achieved_tflops`` per device and, on a GPU of the hardware
    table, ``mfu`` against the peak of the dtype that ran (blended by the FP8 share of FLOPs); no MFU on CPU.
    ``tokens_per_s`` is the run's (global) throughput; each of the ``world_size`` devices does 1/world_size of it."""
    hw = hardware_from_device_name(device_name(device)) if device.type == "cuda" else None
    m = mfu(args, recipe, spec.seq_len, tokens_per_s / world_size, hw)
    out = {
        "model_flops_per_token": flops_per_token(args, spec.seq_len, recipe).flops_per_token,
        "achieved_tflops": m.achieved_tflops,
    }
    if m.mfu is not None:
        out["mfu"] = m.mfu
    return out


def predicted_metrics(args, recipe: Recipe, spec, device, dims=None) -> dict[str, float]:
    """The estimator's prediction for this very run (``pred_*``: rank 0's bytes under a parallel layout),
    logged beside the measured ``mem_*``."""
    dims = dims or ParallelDims()
    st = predict_state_bytes(args, recipe, dims.dp_shard, dims.tp)
    act = predict_saved_activations(
        args,
        recipe,
        spec.batch_size // dims.dp,
        spec.seq_len,
        device_type=device.type,
        dp_shard=dims.dp_shard,
        tp=dims.tp,
    )
    return {
        "pred_mem_params_bytes": st.params,
        "pred_mem_grads_bytes": st.grads,
        "pred_mem_master_bytes": st.master,
        "pred_mem_optim_states_bytes": st.optim_states,
        "pred_mem_fp8_scaling_state_bytes": st.fp8_scaling_state,
        # under the run's activation checkpointing (train.ac), as the run measures them
        "pred_mem_saved_activations_bytes": act.recompute_activations[spec.ac],
        "pred_mem_saved_weight_copies_bytes": act.recompute[spec.ac] - act.recompute_activations[spec.ac],
    }


#: Artifacts of every run: the resolved Hydra configuration and the effective recipe (what actually ran).
CONFIG_ARTIFACT = "config.yaml"
EFFECTIVE_ARTIFACT = "effective_recipe.json"


def run_name(recipe: str, seed: int) -> str:
    """The child run's name in the MLflow UI: ``<recipe>/seed<N>``."""
    return f"{recipe}/seed{seed}"


def record_effective(tracker: Tracker, run_id: str, eff: dict) -> None:
    """The effective recipe as the run's tags (``effective_recipe``, searchable) and as ``effective_recipe.json``."""
    tracker.set_tags(run_id, _effective_tags(eff))
    tracker.log_dict(run_id, eff, EFFECTIVE_ARTIFACT)


def resume_tags(r) -> dict[str, str]:
    """``resumed_checkpoint`` (the folder loaded, after any fallback) and ``resume_note`` (why it is not the one
    asked for: a damaged checkpoint skipped, or one without a manifest loaded unverified)."""
    return {
        "resumed_checkpoint": str(r.loaded),
        "resumed_step": str(r.step),
        **({"resume_note": r.note} if r.note else {}),
    }


def _effective_tags(eff: dict) -> dict[str, str]:
    tags = {"effective_recipe": dumps(eff)}
    if "resume_recipe_change" in eff:
        c = eff["resume_recipe_change"]
        tags["resume_recipe_change"] = (
            f"{c['from']} ({c['from_hash']}) -> {c['to']} ({c['to_hash']}) at step {c['at_step']}"
        )
    if "fp8_fallback" in eff:  # the recipe changed during the run: the report does not compare it as requested
        tags["fp8_fallback"] = fp8_fallback_tag(eff["fp8_fallback"])
    return tags


def fp8_fallback_tag(fallback: dict) -> str:
    """The ``fp8_fallback`` run tag: which FP8 linears run in high precision since which step, and why."""
    layers = "; ".join(
        f"{fqn} from step {v['from_step']} ({v['role']} {v['stat']} {v['share']:.3g})"
        for fqn, v in fallback["layers"].items()
    )
    return f"{len(fallback['layers'])} FP8 linear(s) switched to high precision: {layers}"


def _rank0_value(value: str) -> str:
    """``value`` as rank 0 holds it (run ids exist only on rank 0, which talks to MLflow)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_one(
    plan: Plan,
    recipe: Recipe,
    seed: int,
    data: TokenData,
    tracker: Tracker,
    parent_id: str | None = None,
    ablation_id: str | None = None,
    continuation: Continuation | None = None,
    extra_tags: dict[str, str] | None = None,
) -> RunOutcome:
    """Train ``recipe`` with ``seed`` on ``data`` under ``plan`` and record it as an MLflow run.
    ``extra_tags``: more tags for the run, set as it starts or reopens (the submitit job that trains it).

    Any exception after the run is created (build error, effective-recipe mismatch, NaN loss, crash)
    marks the run FAILED with ``failure_reason`` and ``failure_kind`` (``RESULT_FAILURES``) and returns; metrics
    logged before it are kept. ``KeyboardInterrupt`` and ``StopSignal`` (a stop signal, after the step it arrived
    in and its checkpoint) mark the run KILLED with the reason and propagate (``TrackedRun``).

    ``continuation`` (an ablation's resume): instead of a new run, reopen ``continuation.run_id`` and continue it
    from ``continuation.checkpoint`` (from step 0 when None), in the same checkpoint folder; its params and
    ``config.yaml`` stay those of the first session, its stability metrics start from the series it logged before
    the checkpoint. Without it, ``plan.resume`` (``lowprec train`` only; an ablation's ``resume`` is its id) is the
    checkpoint to start from, and the run it belongs to is tagged and, if its process died, closed
    (``lowprec_lab.runner.continued_runs.supersede``).
    """
    device = resolve_device(plan.device)
    hooks = fault_hooks(from_env(), recipe.name)  # armed before the run exists: a point may be its creation
    run, resume = open_run(plan, recipe, seed, data, tracker, device, parent_id, ablation_id, continuation, extra_tags)
    release_memory()
    with run:
        train_run(run, plan, recipe, seed, data, device, resume, hooks)
    return run.outcome


def open_run(
    plan: Plan,
    recipe: Recipe,
    seed: int,
    data: TokenData,
    tracker: Tracker,
    device,
    parent_id: str | None,
    ablation_id: str | None,
    continuation: Continuation | None,
    extra_tags: dict[str, str] | None,
) -> tuple[TrackedRun, str | Path | None]:
    """``run_one``'s run, opened: a new run with its tags, params, corpus and ``config.yaml`` (superseding the run
    of ``plan.resume``), or ``continuation``'s reopened; ``extra_tags`` and the stability rule set, its stability
    sink ready. Returns the ``TrackedRun`` and the checkpoint to resume from (None: from step 0)."""
    tags = {
        "recipe": recipe.name,
        "recipe_short": short_str(recipe),
        "recipe_hash": recipe.hash(),
        "recipe_json": dumps(recipe.to_dict()),
        "seed": str(seed),
        **shared_tags(plan, data, device),
    }
    if ablation_id:
        tags[ABLATION_TAG] = ablation_id
    run = TrackedRun(tracker, run_name(recipe.name, seed), tags, recipe.name, seed, parent_id, continuation)
    run_id = run.open()
    if continuation is None:
        tracker.log_params(run_id, plan.params(recipe) | {"seed": str(seed)})
        tracker.log_corpus(run_id, data)
        tracker.log_text(run_id, plan.yaml(seed), CONFIG_ARTIFACT)
        resume = None if ablation_id else plan.resume
        if resume and is_rank0():
            supersede(tracker, resume, run_id)
    else:
        resume = continuation.checkpoint
    if extra_tags:
        tracker.set_tags(run_id, extra_tags)
    tracker.set_tags(run_id, {"stability_rule": rule_tag(plan.stability)})
    run.sink = StabilityRecorder(run.buffer, plan.stability)  # the loop flushes it after every checkpoint
    return run, resume


def train_run(run: TrackedRun, plan: Plan, recipe: Recipe, seed: int, data: TokenData, device, resume, hooks) -> None:
    """``run_one``'s training inside the open ``run``: build, train (checkpoints, resume from ``resume``), log the
    summary, predicted and utilization metrics, and end the run FINISHED (``run.finish``). Raises what the build or
    the loop raises (``TrackedRun`` records it)."""
    tracker, run_id, buffer, sink = run.tracker, run.run_id, run.buffer, run.sink
    rule, dims, args = plan.stability, plan.parallel, plan.model

    def on_resume(r) -> None:
        tracker.set_tags(run_id, resume_tags(r))
        if run.continuation is not None and is_rank0():
            sink.carry(*history_before(tracker.client, run_id, r.step))

    check_vocab_fits(data, args.vocab_size)
    spec = plan.train_for(recipe)
    tracker.set_tags(run_id, plan.train_tags(recipe))  # train.compile/ac=auto: resolved, fallback
    built = build(recipe, args, spec, plan.optim, seed, device, dims, plan.cpu_kernels)
    tracker.set_tags(run_id, built.kernels.tags())
    if built.parallel is not None:
        tracker.set_tags(run_id, {"parallel_mechanisms": dumps(built.parallel.mechanisms)})
    batches = TokenBatches(data.train, data.val, spec.seq_len, spec.batch_size, seed)
    ckpt_dir = (
        Path(plan.paths.runs).resolve() / "checkpoints" / _rank0_value(run_id)
        if spec.checkpoint_every > 0 or spec.checkpoint_on_signal
        else None
    )
    if ckpt_dir or resume:
        tracker.set_tags(run_id, {k: str(v) for k, v in (("checkpoint_dir", ckpt_dir), ("resumed_from", resume)) if v})
    result = run_training(
        built,
        batches,
        spec,
        sink,
        before_step=hooks,
        on_effective=lambda eff: record_effective(tracker, run_id, eff),
        checkpoint_dir=ckpt_dir,
        resume_from=resume,
        on_resume=on_resume,
        spike_rule=rule,
        on_anomaly=AnomalyLog(tracker, run_id).record,
    )
    sink.log_summary()
    buffer.flush()
    if not result.effective_checked:  # a loop that skipped the check must not produce a comparable run
        raise EffectiveRecipeError("the effective recipe was never inspected and checked")
    tokens_per_s = result.summary["mean_tokens_per_s"]
    buffer.log_metrics(
        {
            **result.summary,
            **predicted_metrics(args, recipe, spec, device, dims),
            **utilization_metrics(args, recipe, spec, device, tokens_per_s, dims.world_size),
        },
        spec.steps,
    )
    buffer.flush()
    run.finish(result.summary, {"effective_matches": "true", "mem_peak_kind": result.peak_kind})
