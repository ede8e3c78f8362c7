"""Resumable ablations and runs whose process died: ``lowprec ablate ... resume=ABLATION_ID`` keeps
the finished runs, continues the interrupted ones in place from their checkpoints and starts the rest, so that the
ablation ends as an uninterrupted one would: one FINISHED run per (recipe, seed), the same per-step losses bit for
bit (fp32 and fp8_delayed, whose amax history must come back from the checkpoint), the same report tables; and
``lowprec train resume=`` of a run killed with ``os._exit`` closes the dead run. Real signals, real processes
(``LOWPREC_FAULTS=exit_at_step=N`` ends one with ``os._exit``, as kill -9 would), real MLflow, real checkpoints."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from fault_env import env_with, injected
from filelock import FileLock
from mlflow.tracking import MlflowClient
from stop_handlers import restored_stop_handlers
from store_dirs import dirs_under

import lowprec_lab.plan.preflight
import lowprec_lab.runner.scheduler
from lowprec.recipes import CATALOG, get_recipe
from lowprec.train.stop import clear_stop
from lowprec_lab.cli import compose, main
from lowprec_lab.plan.plan import config_yaml
from lowprec_lab.runner.resume import config_difference
from lowprec_lab.tracking.runs import load_runs
from lowprec_lab.tracking.tracker import Tracker

RUN = ["model=debug", "model.qk_norm=false"]
RUN += ["train.batch_size=2", "train.seq_len=64", "train.val_every=0", "train.val_batches=1"]
RUN += ["train.warmup_steps=2", "train.timing_warmup_steps=1", "train.telemetry_every=0", "train.steps=8"]
RECIPES = "recipes=[fp32,fp8_delayed]"
#: seeds=auto with a margin no recipe meets: 3 seeds, then a 4th for fp8_delayed and the control fp32
AUTO = ["seeds=auto", "max_seeds=4", "report.margin=1e-9"]


@pytest.fixture(autouse=True)
def own_handlers(monkeypatch):
    """The commands install their stop handlers in this (pytest) process: put pytest's back afterwards. Workers get
    one intra-op thread, as this process has, on any machine (2 workers on "2 cores"): the same numbers."""
    monkeypatch.setattr(lowprec_lab.runner.scheduler, "cores", lambda: 2)
    monkeypatch.setattr(lowprec_lab.plan.preflight, "cores", lambda: 2)
    with restored_stop_handlers():
        yield


def _client(root: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{root / 'runs' / 'mlflow.db'}")


def _ablation(root: Path, ablation_id: str):
    """The parent run and its children by (recipe, seed); a (recipe, seed) with two children fails the test."""
    client = _client(root)
    exp = client.get_experiment_by_name("lowprec").experiment_id
    (parent,) = client.search_runs(
        [exp], filter_string=f"tags.`lowprec.ablation_id` = '{ablation_id}' and tags.`lowprec.kind` = 'ablation'"
    )
    kids = client.search_runs([exp], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    by_key = {(k.data.tags["recipe"], int(k.data.tags["seed"])): k for k in kids}
    assert len(by_key) == len(kids), "two runs of one (recipe, seed)"
    return parent, by_key


def _losses(client: MlflowClient, run) -> dict[int, float]:
    """The run's per-step loss; a step logged twice (re-logged after a continuation) must hold the same value."""
    out: dict[int, float] = {}
    for m in client.get_metric_history(run.info.run_id, "loss"):
        assert out.setdefault(m.step, m.value) == m.value, f"step {m.step} logged twice with different losses"
    return out


def _id(text: str) -> str:
    return re.search(r"ablation (abl-\d{8}-\d{6}-[0-9a-f]{4})", text).group(1)


def _uninterrupted(root: Path, seeds: list[str]) -> tuple[Path, str]:
    """An uninterrupted ablation of fp32 and fp8_delayed under ``seeds``, in this process: (root, id). (Two workers
    with one thread each train every run exactly as this process does: tests/integration/test_seeds_and_workers.py.)"""
    mp = pytest.MonkeyPatch()
    mp.setattr(lowprec_lab.runner.scheduler, "cores", lambda: 2)
    mp.setattr(lowprec_lab.plan.preflight, "cores", lambda: 2)
    out = io.StringIO()
    try:
        with restored_stop_handlers(), contextlib.redirect_stdout(out):
            rc = main(["ablate", RECIPES, "controls=false", *seeds, "workers=1", *RUN, *dirs_under(root)])
    finally:
        mp.undo()
    assert rc == 0, out.getvalue()
    return root, _id(out.getvalue())


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """An uninterrupted ``seeds=2`` ablation: every (recipe, seed) the interrupted ablations below train."""
    return _uninterrupted(tmp_path_factory.mktemp("baseline"), ["seeds=2"])


@pytest.fixture(scope="module")
def auto_baseline(tmp_path_factory):
    """An uninterrupted ``seeds=auto`` ablation (``AUTO``: seeds 0-3), for the two-worker resume."""
    return _uninterrupted(tmp_path_factory.mktemp("auto_baseline"), AUTO)


def _assert_same_runs(root: Path, ablation_id: str, baseline, keys) -> None:
    """Every (recipe, seed) of ``keys`` FINISHED exactly once, with the baseline's loss at every step."""
    parent, kids = _ablation(root, ablation_id)
    b_root, b_id = baseline
    _, b_kids = _ablation(b_root, b_id)
    assert parent.info.status == "FINISHED"
    assert sorted(kids) == sorted(keys)
    assert {k: r.info.status for k, r in kids.items()} == dict.fromkeys(keys, "FINISHED")
    client, b_client = _client(root), _client(b_root)
    for key in keys:
        got, want = _losses(client, kids[key]), _losses(b_client, b_kids[key])
        assert got == want and sorted(got) == list(range(8)), key  # every step, bit for bit
        assert kids[key].data.metrics["final_val_loss"] == b_kids[key].data.metrics["final_val_loss"], key


def test_sigterm_then_resume_continues_in_place_and_equals_an_uninterrupted_ablation(baseline, tmp_path, capsys):
    args = ["ablate", RECIPES, "controls=false", "seeds=2", "workers=1", *RUN, *dirs_under(tmp_path)]
    # SIGTERM, for real, to the ablation process during fp8_delayed seed 0 (after fp32 seed 0 finished)
    with injected("recipe=fp8_delayed,signal_at_step=3"):
        assert main(args) == 143
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith("resume it: lowprec ablate "), err
    ablation_id = line.rsplit("resume=", 1)[1]
    parent, kids = _ablation(tmp_path, ablation_id)
    assert parent.info.status == "KILLED" and sorted(kids) == [("fp32", 0), ("fp8_delayed", 0)]
    killed = kids["fp8_delayed", 0]
    assert killed.info.status == "KILLED" and killed.data.tags["resume_checkpoint"].endswith("/step_4")
    stopped_s = float(parent.data.tags["wall_s"])

    clear_stop()
    assert main(shlex.split(line)[3:]) == 0  # the printed command, as a user would paste it
    out = capsys.readouterr().out
    assert "fp32             seed 0: FINISHED before the resume, kept" in out
    assert "fp8_delayed      seed 0: continues from step_4 (KILLED: stopped by SIGTERM after step 3" in out
    keys = [(r, s) for r in ("fp32", "fp8_delayed") for s in (0, 1)]
    _assert_same_runs(tmp_path, ablation_id, baseline, keys)
    parent, kids = _ablation(tmp_path, ablation_id)
    again = kids["fp8_delayed", 0]
    assert again.info.run_id == killed.info.run_id  # reopened, not superseded
    assert again.data.tags["resumed_step"] == "4" and "stopped_by" not in again.data.tags
    assert "failure_reason" not in again.data.tags and "KILLED: stopped by SIGTERM" in again.data.tags["continuations"]
    assert kids["fp32", 0].info.end_time < killed.info.end_time  # kept as it was: not rerun
    assert parent.data.tags["n_failed"] == "0" and "resumed from KILLED" in parent.data.tags["resumes"]
    assert float(parent.data.tags["wall_s"]) > stopped_s > 0  # both sessions' wall time
    # the stability metrics cover all 8 steps of the continued run, as the uninterrupted run's do
    _, b_kids = _ablation(*baseline)
    for k in ("stability/loss_spikes", "stability/loss_max_excursion", "stability/grad_norm_spikes"):
        assert again.data.metrics[k] == b_kids["fp8_delayed", 0].data.metrics[k], k


def _tables(report: Path) -> list[list[list[str]]]:
    """The report's markdown tables, without what legitimately differs between two ablations: measured throughput
    and process peak memory (the exact state-bytes ratio stays)."""
    tables, current = [], None
    for line in report.read_text().splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if current is None:
            current = []
            tables.append(current)
        current.append(cells)
    out = []
    for t in tables:
        head = t[0]
        drop = {i for i, h in enumerate(head) if "tokens/s" in h or "(measured)" in h or h == "peak memory"}
        peak = {i for i, h in enumerate(head) if h == "memory ratio: state (peak)"}
        rows = [
            [re.sub(r" \(.*\)$", "", c) if i in peak else c for i, c in enumerate(row) if i not in drop] for row in t
        ]
        out.append(rows)
    return out


@pytest.mark.slow  # ~50 s; the suite keeps the one-worker form above and test_signals' two-worker stop
def test_sigterm_to_an_ablation_with_two_workers_and_auto_seeds_then_resume(auto_baseline, tmp_path, capsys):
    db = tmp_path / "runs" / "mlflow.db"
    args = ["ablate", RECIPES, "controls=false", *AUTO, "workers=2", *RUN, *dirs_under(tmp_path)]

    over = threading.Event()

    def sigterm_once_two_runs_train() -> None:  # from outside the training code, as a scheduler would
        while not over.wait(0.2):
            try:
                client = MlflowClient(f"sqlite:///{db}")
                exp = client.get_experiment_by_name("lowprec")
                if exp and len(client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'")) >= 3:
                    os.kill(os.getpid(), signal.SIGTERM)  # the parent and two children are running
                    return
            except Exception:  # the store is being created
                pass

    t = threading.Thread(target=sigterm_once_two_runs_train, daemon=True)
    t.start()
    try:
        rc = main(args)
    finally:
        over.set()
        t.join()
    assert rc == 143
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    ablation_id = line.rsplit("resume=", 1)[1]
    _, kids = _ablation(tmp_path, ablation_id)
    # the runs in flight stopped after a step, with a checkpoint; the others (one queued to a worker too) never started
    killed = [k for k in kids.values() if k.info.status == "KILLED"]
    assert killed and all(k.data.tags["resume_checkpoint"] for k in killed) and len(kids) < 8

    clear_stop()
    assert main(shlex.split(line)[3:]) == 0
    out = capsys.readouterr().out
    assert "seeds=auto: seed 3 for fp8_delayed (still inconclusive)" in out
    keys = [(r, s) for r in ("fp32", "fp8_delayed") for s in range(4)]  # seed 3 pairs the control with it
    _assert_same_runs(tmp_path, ablation_id, auto_baseline, keys)
    b_root, b_id = auto_baseline
    assert _tables(tmp_path / "reports" / ablation_id / "report.md") == _tables(b_root / "reports" / b_id / "report.md")
    # no leftovers: nothing RUNNING anywhere in the store
    client = _client(tmp_path)
    exp = client.get_experiment_by_name("lowprec").experiment_id
    assert client.search_runs([exp], "attributes.status = 'RUNNING'") == []


def _subprocess(args: list[str], faults: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lowprec_lab", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env_with(faults))


def test_an_ablation_killed_mid_run_continues_its_orphaned_run_from_its_checkpoint(baseline, tmp_path, capsys):
    args = [
        "ablate",
        RECIPES,
        "controls=false",
        "seeds=2",
        "train.checkpoint_every=2",
        *RUN,
        *dirs_under(tmp_path),
    ]
    # the ablation process itself dies before step 5 of fp8_delayed seed 0: no handler, no MLflow update
    p = _subprocess([*args, "workers=1"], "recipe=fp8_delayed,exit_at_step=5")
    assert p.returncode == 13, p.stderr[-3000:]
    ablation_id = _id(p.stdout)
    parent, kids = _ablation(tmp_path, ablation_id)
    orphan = kids["fp8_delayed", 0]
    assert parent.info.status == "RUNNING" and orphan.info.status == "RUNNING"  # what kill -9 leaves behind
    # the metrics of every step up to the last checkpoint (step_4) reached MLflow before the process died
    assert sorted(_losses(_client(tmp_path), orphan)) == [0, 1, 2, 3]

    assert main([*args, "workers=2", f"resume={ablation_id}"]) == 0  # continued in a worker process
    assert "fp8_delayed      seed 0: continues from step_4 (RUNNING: its process died)" in capsys.readouterr().out
    _assert_same_runs(tmp_path, ablation_id, baseline, [(r, s) for r in ("fp32", "fp8_delayed") for s in (0, 1)])
    _, kids = _ablation(tmp_path, ablation_id)
    assert kids["fp8_delayed", 0].info.run_id == orphan.info.run_id
    assert kids["fp8_delayed", 0].data.tags["resumed_step"] == "4"


def test_a_resume_that_is_not_the_same_ablation_is_one_line_and_writes_nothing(baseline, capsys, monkeypatch):
    root, ablation_id = baseline
    args = ["ablate", RECIPES, "controls=false", "seeds=2", "workers=1", *RUN, *dirs_under(root)]
    client = _client(root)
    exp = client.get_experiment_by_name("lowprec").experiment_id
    before = {r.info.run_id: (r.info.status, r.data.tags) for r in client.search_runs([exp])}

    def one_line(extra: list[str]) -> str:
        assert main([*args, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        return err

    assert one_line(["train.steps=9", f"resume={ablation_id}"]) == (
        f"lowprec ablate: error: resume={ablation_id}: train.steps=9 differs from the ablation's 8"
    )
    assert one_line(["recipes=[fp32,bf16]", f"resume={ablation_id}"]).endswith(
        "recipes=[fp32, bf16] differs from the ablation's [fp32, fp8_delayed]"
    )
    assert "no ablation abl-20000101-000000-0000 in sqlite:///" in one_line(["resume=abl-20000101-000000-0000"])
    # a recipe whose definition changed since the ablation ran (here: another amax history length)
    changed = CATALOG["fp8_delayed"].with_fields("fp8.cast", amax_history_len=8)
    monkeypatch.setattr(
        lowprec_lab.plan.preflight, "get_recipe", lambda n: changed if n == "fp8_delayed" else CATALOG[n]
    )
    assert f"recipe fp8_delayed hashes to {changed.hash()} here but ran as {CATALOG['fp8_delayed'].hash()}" in one_line(
        [f"resume={ablation_id}"]
    )
    monkeypatch.setattr(lowprec_lab.plan.preflight, "get_recipe", get_recipe)
    # an ablation still running holds its lock (another process here: an OS file lock taken by this one)
    with FileLock(str(root / "runs" / "locks" / f"{ablation_id}.lock")):
        assert "the ablation is still running in another process" in one_line([f"resume={ablation_id}"])
    after = {r.info.run_id: (r.info.status, r.data.tags) for r in client.search_runs([exp])}
    assert after == before


def test_keys_that_may_differ_on_a_resume():
    def plain(over):
        return yaml.safe_load(config_yaml(compose("ablate", [RECIPES, "controls=false", *RUN, *over])))

    original = plain([])
    same = plain(["resume=abl-20261125-101500-ab12", "workers=2", "train.progress=false"])
    assert config_difference(original, same) is None
    assert config_difference(original, plain(["seed=1"])) == "seed=1 differs from the ablation's 0"
    assert config_difference(original, plain(["train.checkpoint_every=5"])) == (
        "train.checkpoint_every=5 differs from the ablation's 0"
    )


def test_train_resume_of_a_killed_run_closes_it_and_continues_bit_identically(baseline, tmp_path):
    args = ["train", "recipe=fp8_delayed", "seed=0", "train.checkpoint_every=2", *RUN, *dirs_under(tmp_path)]
    p = _subprocess(args, "exit_at_step=5")
    assert p.returncode == 13, p.stderr[-3000:]
    client = _client(tmp_path)
    exp = client.get_experiment_by_name("lowprec").experiment_id
    (dead,) = client.search_runs([exp])
    assert dead.info.status == "RUNNING"
    folder = tmp_path / "runs" / "checkpoints" / dead.info.run_id
    assert main([*args, f"resume={folder}"]) == 0
    old, new = sorted(client.search_runs([exp]), key=lambda r: r.info.start_time)
    assert old.info.run_id == dead.info.run_id and old.info.status == "FAILED"
    assert old.data.tags["failure_reason"] == f"its process died after step 3; continued in run {new.info.run_id}"
    assert new.info.status == "FINISHED" and new.data.tags["resumed_run_id"] == old.info.run_id
    assert old.data.tags["continued_in_run"] == new.info.run_id
    _, b_kids = _ablation(*baseline)
    want = _losses(_client(baseline[0]), b_kids["fp8_delayed", 0])
    a, b = _losses(client, old), _losses(client, new)
    assert sorted(a) == [0, 1, 2, 3] and sorted(b) == [4, 5, 6, 7]
    assert {**a, **b} == want


def test_a_crashed_run_continues_and_a_diverged_one_is_kept_as_a_result(baseline, tmp_path, capsys):
    args = [
        "ablate",
        "controls=false",
        "recipes=[fp32]",
        "seeds=1",
        "workers=1",
        "train.checkpoint_every=2",
        *RUN,
        *dirs_under(tmp_path),
    ]
    # a crash (a bug) before step 5: the run is FAILED, its metrics up to step 4 flushed, its newest checkpoint step_4
    with injected("crash_at_step=5"):
        assert main(args) == 0
    crashed_id = _id(capsys.readouterr().out)
    (crashed,) = _ablation(tmp_path, crashed_id)[1].values()
    assert crashed.info.status == "FAILED" and crashed.data.tags["failure_kind"] == "crash"
    assert main([*args, f"resume={crashed_id}"]) == 0
    assert "continues from step_4 (FAILED: InjectedCrash: injected crash before step 5" in capsys.readouterr().out
    _assert_same_runs(tmp_path, crashed_id, baseline, [("fp32", 0)])  # step 4, logged twice, holds one value
    parent, _ = _ablation(tmp_path, crashed_id)
    tracker = Tracker(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}", "lowprec", tmp_path / "runs")
    (rd,) = load_runs(tracker, parent.info.run_id)
    assert [s for s, _ in rd.curves["loss"]] == list(range(8))  # the report reads one value per step

    # a NaN loss is the recipe's result: a resume keeps it FAILED, as it was; with nothing else to run, the finished
    # ablation is not reopened (one line, its parent stays FINISHED as it ended)
    with injected("nan_at_step=3"):
        assert main(args) == 0
    nan_id = _id(capsys.readouterr().out)
    parent, (diverged,) = _ablation(tmp_path, nan_id)[0], _ablation(tmp_path, nan_id)[1].values()
    assert diverged.info.status == "FAILED" and diverged.data.tags["failure_kind"] == "non_finite"
    assert main([*args, f"resume={nan_id}"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"resume={nan_id}: the ablation already finished (1 run(s), parent run FINISHED); nothing to resume, nothing "
        f"changed; its report: lowprec report {nan_id}"
    )
    again_parent, (again,) = _ablation(tmp_path, nan_id)[0], _ablation(tmp_path, nan_id)[1].values()
    assert (again.info.status, again.info.end_time) == ("FAILED", diverged.info.end_time)
    assert (again_parent.info.status, again_parent.info.end_time) == ("FINISHED", parent.info.end_time)
