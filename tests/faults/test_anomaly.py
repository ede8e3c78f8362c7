"""Health monitor and anomaly policies end to end: a NaN injected into the activations, the
gradients or a weight at step 4 of a real ``lowprec train`` run (``fp8_delayed``: delayed-scaling histories are part
of what a dropped step must not touch), under ``train.on_anomaly=fail|skip|rollback``; and an FP8 linear forced to
saturate under ``train.fp8_fallback=layer``. Each run is checked in MLflow: status and reason, the ``anomaly/*``
counters at the event's step, ``anomalies.json``, the logged losses.

What the policies must equal, reasoned out:

- ``skip``: the dropped step changes nothing but the data position and leaves the LR schedule where it was, so
  step s > 4 of the skip run is step s - 1 of a run that never saw batch 4 (``train.skip_batches=[4]``), bit for bit;
- ``rollback``: the run reloads ``step_3``, replays step 3 and goes on without batch 4, so every step equals that
  same run's.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from fault_env import injected
from mlflow.tracking import MlflowClient
from stop_handlers import restored_stop_handlers
from store_dirs import dirs_under

from lowprec.train.checkpoint import read_trainer_state
from lowprec_lab.cli import main
from lowprec_lab.stats.stability import count_events

RUN = ["model=debug", "model.qk_norm=false"]
RUN += ["train.batch_size=2", "train.seq_len=64", "train.val_every=0", "train.val_batches=1"]
RUN += ["train.warmup_steps=2", "train.timing_warmup_steps=1", "recipe=fp8_delayed", "train.steps=8"]
AT = 4
NAN = f"nan_at_step={AT}"  # LOWPREC_FAULTS
INTO = ["activation", "gradient", "weight"]
ROLLBACK = ["train.on_anomaly=rollback", "train.checkpoint_every=3"]


class Runs:
    """The MLflow store under one root: runs in start order, metric series, artifacts."""

    def __init__(self, root):
        self.root = root
        self.client = MlflowClient(f"sqlite:///{root / 'runs' / 'mlflow.db'}")

    def all(self):
        exp = self.client.get_experiment_by_name("lowprec").experiment_id
        return sorted(self.client.search_runs([exp]), key=lambda r: r.info.start_time)

    def series(self, run, key: str) -> dict[int, float]:
        return {m.step: m.value for m in self.client.get_metric_history(run.info.run_id, key)}

    def json(self, run, name: str) -> dict:
        return json.loads(open(self.client.download_artifacts(run.info.run_id, name, str(self.root))).read())


def _train(root, *overrides, faults: str = "") -> tuple[int, Runs]:
    with injected(faults):
        rc = main(["train", *RUN, *dirs_under(root), *overrides])
    return rc, Runs(root)


@pytest.fixture(scope="module")
def never_saw_batch_4(tmp_path_factory):
    """Losses of the run that never sees batch 4: what skip and rollback must reproduce."""
    rc, runs = _train(tmp_path_factory.mktemp("reference"), f"train.skip_batches=[{AT}]")
    assert rc == 0
    (run,) = runs.all()
    return runs.series(run, "loss")


def _only_event(runs, run) -> dict:
    (event,) = runs.json(run, "anomalies.json")["events"]
    return event


KIND = {"activation": "nonfinite_loss", "gradient": "nonfinite_grad_norm", "weight": "nonfinite_loss"}


@pytest.mark.parametrize("into", INTO)
def test_fail_stops_the_run_at_the_poisoned_step_and_records_it(into, tmp_path):
    rc, runs = _train(tmp_path, faults=f"{NAN},nan_into={into}")
    (run,) = runs.all()
    assert rc == 1 and run.info.status == "FAILED"
    what = "loss is nan" if KIND[into] == "nonfinite_loss" else "grad_norm is nan"
    assert run.data.tags["failure_reason"].startswith(f"NonFiniteError: {what} at step {AT}")
    assert sorted(runs.series(run, "loss")) == [0, 1, 2, 3]  # detected in the poisoned step itself
    assert runs.series(run, f"anomaly/{KIND[into]}") == {AT: 1.0}
    event = _only_event(runs, run)
    assert (event["step"], event["kind"], event["action"], event["value"]) == (AT, KIND[into], "failed", "nan")


@pytest.mark.parametrize("into", ["activation", "gradient"])
def test_skip_drops_the_update_and_goes_on_as_a_run_that_never_saw_the_batch(into, tmp_path, never_saw_batch_4):
    rc, runs = _train(tmp_path, "train.on_anomaly=skip", faults=f"{NAN},nan_into={into}")
    (run,) = runs.all()
    assert rc == 0 and run.info.status == "FINISHED" and run.data.tags["effective_matches"] == "true"
    loss = runs.series(run, "loss")
    assert sorted(loss) == list(range(8))  # the skipped step is logged too, as measured
    assert math.isnan(loss[AT]) == (into == "activation")
    assert all(loss[s] == never_saw_batch_4[s] for s in range(AT))
    assert all(loss[s] == never_saw_batch_4[s - 1] for s in range(AT + 1, 8))  # one schedule position later
    assert runs.series(run, "anomaly/skipped_steps") == {AT: 1.0}
    event = _only_event(runs, run)
    assert (event["step"], event["kind"], event["action"], event["batch"]) == (AT, KIND[into], "skipped", AT)


def test_skip_cannot_fix_a_nan_weight_and_fails_after_the_consecutive_limit(tmp_path):
    rc, runs = _train(
        tmp_path, "train.on_anomaly=skip", "train.max_consecutive_skips=2", faults=f"{NAN},nan_into=weight"
    )
    (run,) = runs.all()
    assert rc == 1 and run.info.status == "FAILED"
    reason = f"NonFiniteError: loss is nan at step {AT + 2}: train.max_consecutive_skips=2 exhausted"
    assert run.data.tags["failure_reason"] == reason
    events = runs.json(run, "anomalies.json")["events"]
    assert [(e["step"], e["action"]) for e in events] == [(AT, "skipped"), (AT + 1, "skipped"), (AT + 2, "failed")]
    assert runs.series(run, "anomaly/skipped_steps") == {AT: 1.0, AT + 1: 2.0}


@pytest.fixture(scope="module")
def rolled_back_activation(tmp_path_factory):
    """A run rolled back once for a NaN in the activations at step 4 (``ROLLBACK``): (exit code, runs, run). The
    rollback test and the resume after it read the same run."""
    rc, runs = _train(tmp_path_factory.mktemp("rolled_back"), *ROLLBACK, faults=f"{NAN},nan_into=activation")
    (run,) = runs.all()
    return rc, runs, run


@pytest.mark.parametrize("into", INTO)
def test_rollback_reloads_the_checkpoint_and_equals_a_run_that_never_saw_the_batch(
    into, tmp_path, never_saw_batch_4, request
):
    if into == "activation":
        rc, runs, run = request.getfixturevalue("rolled_back_activation")
    else:
        rc, runs = _train(tmp_path, *ROLLBACK, faults=f"{NAN},nan_into={into}")
        (run,) = runs.all()
    assert rc == 0 and run.info.status == "FINISHED"
    assert runs.series(run, "loss") == never_saw_batch_4  # every step, bit for bit; the replay is logged once
    assert runs.series(run, "anomaly/rollbacks") == {AT: 1.0}
    event = _only_event(runs, run)
    assert (event["step"], event["action"], event["batch"]) == (AT, "rolled_back", AT)
    assert event["detail"] == f"reload step_3, skip batch {AT} (rollback 1)"


def test_rollback_fails_with_the_reason_once_max_rollbacks_is_exhausted(tmp_path):
    # Steps 4, 5 and 6 are each poisoned the first time they run: two rollbacks recover two of them, the third fails.
    rc, runs = _train(tmp_path, "train.max_rollbacks=2", *ROLLBACK, faults=f"{NAN},nan_into=activation,nan_steps=3")
    (run,) = runs.all()
    assert rc == 1 and run.info.status == "FAILED"
    assert run.data.tags["failure_reason"] == "NonFiniteError: loss is nan at step 6: train.max_rollbacks=2 exhausted"
    events = runs.json(run, "anomalies.json")["events"]
    assert [(e["step"], e["action"], e["batch"]) for e in events] == [
        (4, "rolled_back", 4),
        (5, "rolled_back", 6),  # batch 4 is skipped: step 5 trains on batch 6
        (6, "failed", 8),
    ]
    assert runs.series(run, "anomaly/rollbacks") == {4: 1.0, 5: 2.0}
    assert sorted(runs.series(run, "loss")) == [0, 1, 2, 3, 4, 5]


def test_a_run_resumed_after_a_rollback_keeps_skipping_the_batch(rolled_back_activation):
    rc, runs, rolled = rolled_back_activation
    assert rc == 0
    ckpt = f"{rolled.data.tags['checkpoint_dir']}/step_6"
    health = read_trainer_state(ckpt)["health"]
    assert health["data"]["skipped"] == [AT] and health["rollbacks"] == 1 and health["counts"]["rollbacks"] == 1
    before = {r.info.run_id for r in runs.all()}
    assert main(["train", *RUN, *dirs_under(runs.root), f"resume={ckpt}"]) == 0
    (resumed,) = [r for r in runs.all() if r.info.run_id not in before]
    a, b = runs.series(rolled, "loss"), runs.series(resumed, "loss")
    assert sorted(b) == [6, 7] and all(b[s] == a[s] for s in b)  # without the data position: batch 6, not 7


def test_skip_batches_on_a_resume_must_lie_ahead_of_the_checkpoint(tmp_path, capsys):
    rc, runs = _train(tmp_path, "train.checkpoint_every=3", "train.steps=4")
    (run,) = runs.all()
    ckpt = f"{run.data.tags['checkpoint_dir']}/step_3"
    assert main(["train", *RUN, *dirs_under(tmp_path), f"resume={ckpt}", "train.skip_batches=[2,5]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("lowprec train: error: train.skip_batches holds 2, a batch before checkpoint ")
    assert len(runs.all()) == 1  # refused before any MLflow run
    assert main(["train", *RUN, *dirs_under(tmp_path), f"resume={ckpt}", "train.skip_batches=[5]"]) == 0


FALLBACK = ["train.telemetry_every=1", "train.fp8_fallback=layer", "train.fp8_fallback_samples=2"]
OVERFLOW = "fp8_overflow_at_step=3,fp8_overflow_layer=layers.0.attention.wq"  # LOWPREC_FAULTS
WQ = "layers.0.attention.wq"


@pytest.fixture(scope="module")
def fallen_back(tmp_path_factory):
    """An ablation of fp32 and fp8_delayed under ``FALLBACK`` whose fp8_delayed run saturates ``WQ`` from step 3
    (``OVERFLOW``), checkpointed at step 6: (root, exit code). The fallback test reads its fp8_delayed run (what
    ``lowprec train`` of that recipe and seed would log), the report test its report."""
    root = tmp_path_factory.mktemp("fallen_back")
    args = ["ablate", "controls=false", "recipes=[fp32,fp8_delayed]", "seeds=1", *RUN[:-2], "train.steps=8"]
    args += [*FALLBACK, "train.checkpoint_every=6", *dirs_under(root)]
    with restored_stop_handlers(), injected(f"{OVERFLOW},recipe=fp8_delayed"):
        rc = main(args)
    return root, rc


def _child(runs: Runs, recipe: str):
    """The ablation's run of ``recipe`` (not a run that a ``lowprec train resume=`` continued it in)."""
    (run,) = [r for r in runs.all() if r.data.tags.get("recipe") == recipe and "mlflow.parentRunId" in r.data.tags]
    return run


def test_fp8_fallback_switches_a_saturating_layer_and_the_effective_recipe_records_it(fallen_back):
    root, rc = fallen_back
    runs = Runs(root)
    run = _child(runs, "fp8_delayed")
    assert rc == 0 and run.info.status == "FINISHED" and run.data.tags["effective_matches"] == "true"
    events = runs.json(run, "anomalies.json")["events"]
    first = events[0]
    assert (first["step"], first["kind"], first["layer"], first["action"]) == (4, "fp8_overflow", WQ, "fp8_fallback")
    assert first["value"] > 0.5 and first["threshold"] == 0.05
    assert "input overflow above the threshold at sampled steps 3, 4" in first["detail"]
    switched = {e["layer"] for e in events if e["action"] == "fp8_fallback"}
    eff = runs.json(run, "effective_recipe.json")["fp8_fallback"]
    assert set(eff["layers"]) == switched and eff["layers"][WQ]["from_step"] == 5
    assert json.loads(run.data.tags["effective_recipe"])["fp8_fallback"] == eff
    assert run.data.tags["fp8_fallback"].startswith(f"{len(switched)} FP8 linear(s) switched to high precision: {WQ}")
    assert runs.series(run, "anomaly/fp8_fallback_layers")[4] == 1.0
    # From step 5 on the layer runs no FP8 cast: its telemetry stops, the other layers' goes on.
    assert sorted(runs.series(run, f"fp8/{WQ}/input/overflow")) == [0, 1, 2, 3, 4]
    assert 7 in runs.series(run, "fp8/layers.1.attention.wq/input/overflow")
    # The checkpoint carries the switch: a resumed run runs the layer in high precision and says so.
    ckpt = f"{run.data.tags['checkpoint_dir']}/step_6"
    assert WQ in read_trainer_state(ckpt)["health"]["fp8"]["switched"]
    before = {r.info.run_id for r in runs.all()}
    assert main(["train", *RUN, *dirs_under(root), *FALLBACK, f"resume={ckpt}"]) == 0
    (resumed,) = [r for r in runs.all() if r.info.run_id not in before]
    a, b = runs.series(run, "loss"), runs.series(resumed, "loss")
    assert sorted(b) == [6, 7] and all(b[s] == a[s] for s in b)
    assert json.loads(resumed.data.tags["effective_recipe"])["fp8_fallback"]["layers"][WQ]["from_step"] == 5


def test_the_report_lists_each_runs_anomalies_and_leaves_a_fallen_back_run_out(fallen_back):
    root, rc = fallen_back
    assert rc == 0
    runs = Runs(root)
    fp8 = _child(runs, "fp8_delayed")
    assert fp8.info.status == "FINISHED" and "fp8_fallback" in fp8.data.tags
    (report,) = (root / "reports").glob("*/report.md")
    text = report.read_text()
    assert "## Anomalies" in text
    # the kind is a store string, escaped for markdown
    assert "| `fp8_delayed` seed 0 | 4 | fp8\\_overflow | " in text and f"`{WQ}` input overflow" in text
    excluded = text.split("## Failed or excluded runs")[1].split("\n## ")[0]
    assert "`fp8_delayed` seed 0: FINISHED: the effective recipe changed during the run: " in excluded
    assert "`fp32`" not in excluded and torch.isfinite(torch.tensor(fp8.data.metrics["final_loss"]))


def _fsdp_run(rank: int, ws: int, extra: dict, checkpoint_dir: str) -> dict:
    """fp8_delayed under FSDP2 (2 ranks, gloo); the faults hit rank 0 only, as a bad value on one GPU would."""
    import os

    from lowprec.build_optim import OptimHParams
    from lowprec.data import DataSpec, TokenBatches, prepare
    from lowprec.model import model_args
    from lowprec.parallel import ParallelDims
    from lowprec.recipes import get_recipe
    from lowprec.train.build import build
    from lowprec.train.loop import run_training
    from lowprec.train.spec import TrainSpec
    from lowprec_lab.runner.faults import fp8_overflow_hook, nan_hook

    data = prepare(DataSpec(cache_dir=os.environ.get("LOWPREC_CACHE", "~/.cache/lowprec")))
    spec = TrainSpec(
        steps=8, batch_size=4, seq_len=64, warmup_steps=2, val_every=0, val_batches=1, timing_warmup_steps=1,
        progress=False, **extra,
    )  # fmt: skip
    built = build(get_recipe("fp8_delayed"), model_args("debug"), spec, OptimHParams(), 0, torch.device("cpu"),
                  ParallelDims(dp_shard=ws))  # fmt: skip
    hooks = [nan_hook(AT, 1, "activation"), fp8_overflow_hook(2, 3, WQ, 1000.0)] if rank == 0 else []
    rows, events = [], []

    class Sink:
        def log_metrics(self, metrics, step):
            rows.append((step, dict(metrics)))

    res = run_training(
        built, TokenBatches(data.train, data.val, 64, 4, 0), spec, Sink(), before_step=hooks,
        checkpoint_dir=checkpoint_dir, on_anomaly=events.append,
    )  # fmt: skip
    return {
        "losses": {s: m["loss"] for s, m in rows if "loss" in m},
        "events": [(e.step, e.kind, e.action, e.layer) for e in events],
        "fallback": res.effective.get("fp8_fallback"),
    }


def test_under_fsdp_every_rank_takes_the_same_decisions(tmp_path):
    """Rank 0 alone sees the NaN and the saturating layer: the loss is all-reduced and the FP8 shares max-reduced,
    so both ranks roll back and switch the same layer with the same record (a rank that switched alone would skip
    its FP8 amax all-reduce and hang the other)."""
    from lowprec.parallel.spawn import run_ranks

    policy = {"on_anomaly": "rollback", "checkpoint_every": 3, "telemetry_every": 1}
    policy |= {"fp8_fallback": "layer", "fp8_fallback_samples": 2}
    ranks = run_ranks(_fsdp_run, 2, policy, str(tmp_path))
    assert ranks[0] == ranks[1]  # same losses, same events, same switched layers on both ranks
    out = ranks[0]
    assert (AT, "nonfinite_loss", "rolled_back", None) in out["events"]
    assert (3, "fp8_overflow", "fp8_fallback", WQ) in out["events"]
    assert out["fallback"]["layers"][WQ]["from_step"] == 4


def test_spike_events_are_the_stability_metrics_spikes_counted_online(tmp_path):
    """One spike rule: the monitor's online events equal the ``stability/*`` counts computed over the logged series
    at the end (a rule tight enough to fire on the debug model's noisy first steps; spikes are recorded under fail)."""
    rule = ["stability.ema_window=2", "stability.k=0.5", "stability.sd_window=4", "stability.min_history=3"]
    rc, runs = _train(tmp_path, *rule, "train.steps=12")
    (run,) = runs.all()
    assert rc == 0 and run.info.status == "FINISHED"
    m = run.data.metrics
    events = runs.json(run, "anomalies.json")["events"]
    loss = [e["step"] for e in events if e["kind"] == "loss_spike"]
    grad = [e["step"] for e in events if e["kind"] == "grad_norm_spike"]
    assert loss and grad and {e["action"] for e in events} == {"recorded"}
    # the monitor records every spike step; the stability metrics count events (runs of consecutive spike steps)
    assert len(loss) == m["anomaly/loss_spike"] and count_events(np.isin(range(12), loss)) == m["stability/loss_spikes"]
    assert len(grad) == m["anomaly/grad_norm_spike"]
    assert count_events(np.isin(range(12), grad)) == m["stability/grad_norm_spikes"]
    assert all(e["value"] > e["threshold"] for e in events)
