"""The executor registry (``lowprec_lab.runner.executors``) and the one scheduling loop every launcher runs under,
driven by a fake executor: no training, no worker process, no MLflow."""

from __future__ import annotations

import signal
import sys
import types

import pytest

from lowprec.errors import ConfigError
from lowprec.train import stop as stop_mod
from lowprec.train.stop import StopSignal
from lowprec_lab.plan.launcher import LAUNCHERS, LauncherKind, LauncherSpec, check_launcher
from lowprec_lab.plan.placement import Slot
from lowprec_lab.runner import executors
from lowprec_lab.runner.executors import Launch, SlotLost, executor_class, launch, schedule
from lowprec_lab.runner.run import RunOutcome


class _Recipe:
    def __init__(self, name: str):
        self.name = name


def _jobs(n: int) -> list:
    return [(_Recipe(f"r{i}"), 0) for i in range(n)]


class FakeExecutor:
    """Jobs in flight for one poll each; ``fail``: names whose job ends FAILED; ``stop_after``: a stop signal
    arrives once that many jobs have been started; ``lose``: slots lost on their first start."""

    no_slot_reason = "not started: no slot left"

    def __init__(self, fail=(), stop_after=None, lose=()):
        self.fail, self.stop_after, self.lose = set(fail), stop_after, set(lose)
        self.started_jobs: list[tuple[int, str]] = []
        self.max_in_flight = 0
        self.flight: dict = {}
        self.stops = 0
        self.closed = None

    @classmethod
    def create(cls, launch: Launch, n_jobs: int):
        return cls(), [Slot(0), Slot(1)]

    def open(self, slots):
        self.opened = list(slots)

    def start(self, slot, job):
        if slot.index in self.lose:
            self.lose.discard(slot.index)
            raise SlotLost
        recipe, seed = job
        handle = object()
        self.flight[handle] = job
        self.started_jobs.append((slot.index, recipe.name))
        self.max_in_flight = max(self.max_in_flight, len(self.flight))
        if self.stop_after is not None and len(self.started_jobs) == self.stop_after:
            stop_mod.request_stop(signal.SIGTERM)
        return handle

    def poll(self, handles):
        out = []
        for h in handles:
            recipe, seed = self.flight.pop(h)
            status = "FAILED" if recipe.name in self.fail else "FINISHED"
            if stop_mod.local_stop() and status == "FINISHED":
                status = "KILLED"
            out.append((h, RunOutcome(f"id-{recipe.name}", recipe.name, seed, status, reason="")))
        return out

    def release(self, slot):
        return True

    def stop(self, handles):
        self.stops += 1

    def interrupt(self, handles):
        pass

    def close(self, results):
        self.closed = dict(results)

    def started(self, outcome):
        return True


@pytest.fixture(autouse=True)
def _no_stop_left():
    stop_mod._requested.clear()
    yield
    stop_mod._requested.clear()


def test_unknown_launcher_name_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        executor_class("slurmm")
    assert str(e.value) == "launcher.name=slurmm is not one of local, slurm, submitit_local"
    with pytest.raises(ConfigError, match="is not one of"):
        check_launcher(LauncherSpec(name="slurmm"), 1)


def test_registered_launchers_declare_their_traits():
    # the spec's properties read the registry entry: a trait changed there changes what the plan sees
    assert [LauncherSpec(name=n).submitit for n in LAUNCHERS] == [False, True, True]
    names = ["LocalExecutor", "SlurmExecutor", "SubmititLocalExecutor"]
    assert [executor_class(n).__name__ for n in LAUNCHERS] == names
    assert LauncherSpec(name="slurm").cluster and LauncherSpec(name="slurm").needs_sbatch
    assert not LauncherSpec(name="submitit_local").cluster and LauncherSpec(name="submitit_local").local_jobs
    assert not LauncherSpec().submitit and not LauncherSpec().local_jobs
    assert LauncherSpec(name="slurm").job_id_tag == "slurm_job_id"
    assert LauncherSpec(name="submitit_local").job_id_tag == "submitit_job_id"


def test_a_launcher_registered_in_a_test_is_used_by_launch(monkeypatch):
    module = types.ModuleType("fake_launchers")
    module.FakeExecutor = FakeExecutor
    monkeypatch.setitem(sys.modules, "fake_launchers", module)
    kind = LauncherKind("fake_launchers:FakeExecutor", submitit=True, job_id_tag="fake_job_id")
    monkeypatch.setitem(LAUNCHERS, "fake", kind)
    spec = LauncherSpec(name="fake")
    assert spec.submitit and spec.job_id_tag == "fake_job_id"
    plan = types.SimpleNamespace(launcher=spec)
    seen = []
    out = launch(Launch(plan, None, "parent", "abl"), _jobs(3), seen.append)
    assert [o.recipe for o in out] == ["r0", "r1", "r2"] and [o.status for o in out] == ["FINISHED"] * 3
    assert sorted(o.recipe for o in seen) == ["r0", "r1", "r2"]


def test_schedule_fills_every_slot_and_returns_outcomes_in_job_order():
    ex = FakeExecutor()
    seen = []
    out = schedule(_jobs(5), ex, [Slot(0), Slot(1)], seen.append)
    assert ex.max_in_flight == 2  # both slots busy, never more
    assert [s for s, _ in ex.started_jobs[:2]] == [0, 1]
    assert [o.recipe for o in out] == [f"r{i}" for i in range(5)]
    assert len(seen) == 5 and ex.closed is not None and len(ex.closed) == 5


def test_a_failed_job_is_recorded_and_the_rest_continue():
    ex = FakeExecutor(fail={"r1"})
    out = schedule(_jobs(4), ex, [Slot(0)])
    assert [o.status for o in out] == ["FINISHED", "FAILED", "FINISHED", "FINISHED"]
    assert [name for _, name in ex.started_jobs] == ["r0", "r1", "r2", "r3"]


def test_a_stop_signal_starts_no_other_job_and_raises_once_the_jobs_in_flight_end():
    ex = FakeExecutor(stop_after=2)
    seen = []
    with pytest.raises(StopSignal) as e:
        schedule(_jobs(6), ex, [Slot(0), Slot(1)], seen.append)
    assert [name for _, name in ex.started_jobs] == ["r0", "r1"]  # none after the stop
    assert ex.stops >= 1  # passed on to the jobs in flight
    assert [o.status for o in seen] == ["KILLED", "KILLED"]  # the jobs in flight ended and were recorded
    assert "2 run(s) stopped after their current step" in e.value.reason() and "4 not started" in e.value.reason()


def test_a_stop_before_the_batch_starts_nothing():
    stop_mod.request_stop(signal.SIGTERM)
    ex = FakeExecutor()
    with pytest.raises(StopSignal, match="0 run"):
        schedule(_jobs(2), ex, [Slot(0)])
    assert ex.started_jobs == [] and not hasattr(ex, "opened")


def test_a_lost_slot_takes_no_job_and_its_job_goes_to_another():
    ex = FakeExecutor(lose={0})
    out = schedule(_jobs(3), ex, [Slot(0), Slot(1)])
    assert [o.status for o in out] == ["FINISHED"] * 3
    assert {s for s, _ in ex.started_jobs} == {1}


def test_jobs_left_when_every_slot_is_lost_fail_with_the_executors_reason():
    ex = FakeExecutor(lose={0})
    out = schedule(_jobs(2), ex, [Slot(0)])
    assert [(o.status, o.reason) for o in out] == [("FAILED", "not started: no slot left")] * 2


def test_no_launcher_name_is_compared_outside_the_registry():
    import pathlib
    import re

    root = pathlib.Path(executors.__file__).parents[1]
    pattern = re.compile(r"""(==|!=|\bin)\s*\(?["'](local|slurm|submitit_local)["']""")
    hits = [
        f"{p.relative_to(root)}:{i}"
        for p in root.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line) or re.search(r"""["'](slurm|submitit_local)["']\s*(==|!=)""", line)
    ]
    assert hits == []
