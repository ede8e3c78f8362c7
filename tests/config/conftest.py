"""Hydra composition without its per-compose copy of the whole ConfigStore, for this directory's few hundred
compositions (each test composes once or more through ``lowprec_lab.cli.main``)."""

from __future__ import annotations

import copy

import pytest


def _deepcopy_sharing_the_store(self, memo):
    """``copy.deepcopy`` of a Hydra ``StructuredConfigSource`` that keeps the process's ``ConfigStore`` singleton
    instead of copying it. Every compose deep-copies its config repository (so that re-initialising the copy's
    sources leaves the original alone), and with it every structured config lowprec registers: 0.25 s of CPU per
    compose, 0.11 s with the store shared (measured on the 2-core machine). Sharing changes nothing the tests
    read: ``ConfigStore.load`` hands out a deep copy of each node it returns, and nothing registers configs while a
    command composes."""
    new = type(self).__new__(type(self))
    new.__dict__.update({k: v if k == "store" else copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
    return new


@pytest.fixture(scope="module", autouse=True)
def _hydra_shares_its_config_store():
    """The patch for this directory's modules only, undone after each (tests elsewhere compose as shipped)."""
    from hydra._internal.core_plugins.structured_config_source import StructuredConfigSource

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StructuredConfigSource, "__deepcopy__", _deepcopy_sharing_the_store, raising=False)
        yield
