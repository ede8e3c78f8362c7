"""``lowprec_lab.runner.tracked_run.TrackedRun``: how a run's work ends is recorded once, on a real MLflow sqlite
store, without training: a stop signal is KILLED with its reason, Ctrl-C is KILLED and propagates, an exception is
FAILED with its ``failure_kind``, a reopened run keeps its id; each path flushes what the run measured once."""

from __future__ import annotations

import math
import signal

import pytest

from lowprec.errors import ConfigError
from lowprec.measure.spikes import SpikeRule
from lowprec.train.loop import AnomalyError
from lowprec.train.stop import StopSignal
from lowprec_lab.runner.continued_runs import Continuation
from lowprec_lab.runner.tracked_run import TrackedRun
from lowprec_lab.tracking.stability_log import StabilityRecorder
from lowprec_lab.tracking.tracker import Tracker


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    return Tracker(f"sqlite:///{root / 'mlflow.db'}", "tracked-run", root / "runs")


class Counted:
    """Counts the calls of a real object's ``flush`` / ``log_summary`` (the object still does its work)."""

    def __init__(self, obj, name: str):
        self.calls = 0
        real = getattr(obj, name)

        def counted(*a, **k):
            self.calls += 1
            return real(*a, **k)

        setattr(obj, name, counted)


def opened(tracker, tags=None, continuation=None) -> tuple[TrackedRun, Counted, Counted]:
    """A ``TrackedRun`` with a real stability sink, a step logged, its flush and summary counted."""
    run = TrackedRun(tracker, "r/seed0", tags or {"recipe": "r"}, "r", 0, continuation=continuation)
    run.open()
    run.sink = StabilityRecorder(run.buffer, SpikeRule())
    run.sink.log_metrics({"loss": 2.0, "grad_norm": 1.0}, 0)
    return run, Counted(run.buffer, "flush"), Counted(run.sink, "log_summary")


def test_stop_signal_is_killed_with_its_reason_and_one_flush(tracker):
    run, flush, summary = opened(tracker)
    stop = StopSignal(signal.SIGTERM, step=4, checkpoint="/ckpt/step_5")
    with pytest.raises(StopSignal), run:
        raise stop
    r = tracker.client.get_run(run.run_id)
    assert r.info.status == "KILLED"
    assert r.data.tags["failure_reason"] == stop.reason()
    assert r.data.tags["stopped_by"] == "SIGTERM" and r.data.tags["stopped_after_step"] == "4"
    assert r.data.tags["resume_checkpoint"] == "/ckpt/step_5"
    assert stop.run_id == run.run_id and run.outcome is None
    assert (flush.calls, summary.calls) == (1, 1)
    assert r.data.metrics["loss"] == 2.0  # the buffered step reached the store


def test_exception_is_failed_with_its_kind_and_suppressed(tracker):
    run, flush, summary = opened(tracker)
    with run:
        raise RuntimeError("boom")
    r = tracker.client.get_run(run.run_id)
    assert r.info.status == "FAILED"
    assert r.data.tags["failure_reason"] == "RuntimeError: boom"
    assert r.data.tags["failure_kind"] == "crash"
    assert run.outcome.status == "FAILED" and run.outcome.reason == "RuntimeError: boom"
    assert "RuntimeError: boom" in run.outcome.traceback
    assert (flush.calls, summary.calls) == (1, 1)
    names = [f.path for f in tracker.client.list_artifacts(run.run_id)]
    assert "failure_traceback.txt" in names


def test_user_error_is_a_result_without_a_traceback(tracker):
    run, _flush, _summary = opened(tracker)
    with run:
        raise ConfigError("a bad setting")
    assert tracker.client.get_run(run.run_id).data.tags["failure_kind"] == "user_error"
    assert run.outcome.traceback is None


def test_anomaly_records_the_failing_step_before_the_summary(tracker):
    run, flush, _summary = opened(tracker)
    with run:
        raise AnomalyError("non-finite loss at step 1", 1, math.nan, 3.0)
    r = tracker.client.get_run(run.run_id)
    assert r.data.tags["failure_kind"] == "non_finite"
    assert run.sink.loss[-1] != run.sink.loss[-1]  # the NaN step is part of the series
    assert flush.calls == 1


def test_keyboard_interrupt_is_killed_and_propagates(tracker):
    run, flush, summary = opened(tracker)
    with pytest.raises(KeyboardInterrupt), run:
        raise KeyboardInterrupt
    r = tracker.client.get_run(run.run_id)
    assert r.info.status == "KILLED"
    assert r.data.tags["failure_reason"] == "interrupted by the user"
    assert "failure_kind" not in r.data.tags
    assert (flush.calls, summary.calls) == (1, 1)


def test_reopen_keeps_the_run_id(tracker):
    first = TrackedRun(tracker, "r/seed1", {"recipe": "r", "first": "yes"}, "r", 1)
    with pytest.raises(StopSignal), first:
        raise StopSignal(signal.SIGINT, step=2)
    back = Continuation(first.run_id, None, "KILLED: stopped by SIGINT")
    again = TrackedRun(tracker, "r/seed1", {"recipe": "r"}, "r", 1, continuation=back)
    with again:
        assert again.run_id == first.run_id
        assert tracker.client.get_run(first.run_id).info.status == "RUNNING"
        again.finish({"final_val_loss": 1.0})
    r = tracker.client.get_run(first.run_id)
    assert r.info.status == "FINISHED" and r.data.tags["first"] == "yes"
    assert "stopped_by" not in r.data.tags  # the interruption's tags are dropped on reopening
    assert again.outcome.run_id == first.run_id and again.outcome.status == "FINISHED"
    runs = tracker.client.search_runs([tracker.experiment_id], filter_string="tags.mlflow.runName = 'r/seed1'")
    assert len(runs) == 1
