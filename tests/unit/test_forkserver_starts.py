"""Processes forked from the forkserver (``lowprec.parallel.spawn.forkserver_context``) start as spawned ones did:
with the parent's environment as it is when they start, not as it was when the forkserver started."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import signal

import pytest

from lowprec.parallel.spawn import SERVER_BLOCKED, forkserver_context, run_ranks
from lowprec.train.stop import STOP_SIGNALS

MARK = "LOWPREC_TEST_FORKSERVER_MARK"


def _env_and_mask(rank: int, world_size: int) -> list:
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    return [os.environ.get(MARK), os.environ["RANK"], sorted(int(s) for s in mask)]


def _fails(rank: int, world_size: int) -> None:
    raise ValueError(f"bad input on rank {rank}")


@pytest.fixture
def forkserver_started(monkeypatch):
    """The forkserver running before the test changes the environment (it keeps the environment of its start)."""
    monkeypatch.delenv(MARK, raising=False)
    forkserver_context()
    multiprocessing.forkserver.ensure_running()


def test_a_rank_sees_the_environment_and_signal_mask_of_the_call_not_of_the_forkserver_start(
    forkserver_started, monkeypatch
):
    monkeypatch.setenv(MARK, "set after the server started")
    old = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    try:
        out = run_ranks(_env_and_mask, 2)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    assert [o[:2] for o in out] == [["set after the server started", "0"], ["set after the server started", "1"]]
    assert all(int(signal.SIGUSR2) in o[2] for o in out)


def test_a_failing_rank_raises_its_own_error_in_the_caller():
    with pytest.raises(RuntimeError, match=r"rank 0: ValueError: bad input on rank 0"):
        run_ranks(_fails, 2)


def _mark() -> str | None:
    return os.environ.get(MARK)


def test_a_slot_worker_sees_the_environment_of_its_start_not_of_the_forkserver_start(forkserver_started, monkeypatch):
    from lowprec_lab.plan.placement import Slot
    from lowprec_lab.runner.scheduler import close_pool, pool_internals, start_slot_pool

    monkeypatch.setenv(MARK, "set after the server started")
    pool = start_slot_pool(Slot(0))
    try:
        assert pool.submit(_mark).result(timeout=60) == "set after the server started"
    finally:
        close_pool(pool, *pool_internals(pool))


def test_the_forkserver_blocks_exactly_the_stop_signals():
    # named twice because the spawn helper sits below lowprec.train: a stop signal added there must be blocked here
    assert set(SERVER_BLOCKED) == set(STOP_SIGNALS)
