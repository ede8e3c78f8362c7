"""``cpu_kernels`` resolution: the choice per kind, the probe and its cache, what a run records."""

from __future__ import annotations

import json

import pytest
import torch
from mlflow.tracking import MlflowClient

import lowprec.kernels.policy as policy
import lowprec.kernels.probe as probe
from lowprec.errors import ConfigError
from lowprec.kernels import resolve_kernels
from lowprec.kernels.probe import ProbeResult
from lowprec_lab.cli import main

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_unknown_value_is_refused():
    with pytest.raises(ConfigError, match="cpu_kernels='fast' is not one of auto, native, emulated"):
        resolve_kernels("fast", CPU)


@pytest.mark.parametrize("requested", ["auto", "native", "emulated"])
def test_a_gpu_never_emulates(requested):
    p = resolve_kernels(requested, CUDA)  # decided from the device type alone: no CUDA needed
    assert (p.bf16, p.fp8) == ("native", "native") and p.probe == {}


def test_forced_choices_and_the_slow_native_warning(monkeypatch):
    assert (resolve_kernels("emulated", CPU).bf16, resolve_kernels("emulated", CPU).fp8) == ("emulated",) * 2
    monkeypatch.setattr(policy, "has_bf16_instructions", lambda: False)
    native = resolve_kernels("native", CPU)
    assert (native.bf16, native.fp8) == ("native", "native")
    assert "without BF16 instructions" in native.warning and native.tags()["cpu_kernels_warning"] == native.warning
    monkeypatch.setattr(policy, "has_bf16_instructions", lambda: True)
    assert resolve_kernels("native", CPU).warning == ""


@pytest.fixture
def fresh_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWPREC_CACHE", str(tmp_path))
    probe.probe_kernels.cache_clear()
    yield tmp_path / probe.CACHE_FILE
    probe.probe_kernels.cache_clear()


def test_auto_takes_the_faster_kind_by_kind_and_caches_it(fresh_probe, monkeypatch):
    figures = {"bf16_native": 17.0, "bf16_emulated": 1.1, "fp8_native": 0.5, "fp8_emulated": 0.9}
    monkeypatch.setattr(probe, "measure", lambda: ProbeResult(figures))
    p = resolve_kernels("auto", CPU)
    assert (p.bf16, p.fp8) == ("emulated", "native") and p.probe == figures
    assert "bf16_native=17" in p.tags()["cpu_kernels_probe"]
    assert json.loads(fresh_probe.read_text()) == {probe.cache_key(): figures}

    def must_not_measure():
        raise AssertionError("the cached decision should have been used")

    probe.probe_kernels.cache_clear()
    monkeypatch.setattr(probe, "measure", must_not_measure)
    assert resolve_kernels("auto", CPU).bf16 == "emulated"


def test_a_corrupt_cache_is_measured_again(fresh_probe, monkeypatch):
    fresh_probe.write_text("{not json")
    figures = {"bf16_native": 1.0, "bf16_emulated": 2.0, "fp8_native": 3.0, "fp8_emulated": 1.0}
    monkeypatch.setattr(probe, "measure", lambda: ProbeResult(figures))
    assert (resolve_kernels("auto", CPU).bf16, resolve_kernels("auto", CPU).fp8) == ("native", "emulated")


def test_the_real_probe_measures_all_four(fresh_probe):
    ms = probe.measure().ms
    assert set(ms) == {"bf16_native", "bf16_emulated", "fp8_native", "fp8_emulated"}
    assert all(v > 0 for v in ms.values())


def test_a_run_records_its_kernels_and_the_cpu(run_dirs, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(policy, "has_bf16_instructions", lambda: False)
    common = ["model=debug", "train.steps=3", "train.timing_warmup_steps=1", "train.batch_size=2", "train.seq_len=32"]
    # the native run also fuses its FP8 casts (train.fused_casts=on compiles them): the run records that they ran
    assert main(["train", *run_dirs, *common, "recipe=fp8_current", "cpu_kernels=native", "train.fused_casts=on"]) == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warning) == 1 and "cpu_kernels=native" in warning[0], warning
    assert main(["train", *run_dirs, *common, "recipe=fp8_current", "cpu_kernels=emulated"]) == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], order_by=["start_time"])
    native, emulated = (r.data.tags for r in runs)
    assert native["cpu_kernels_bf16"] == "native" and "cpu_kernels_warning" in native
    assert emulated["cpu_kernels_bf16"] == emulated["cpu_kernels_fp8"] == "emulated"
    assert emulated["cpu_model"] and "cpu_isa" in emulated and emulated["effective_matches"] == "true"
    kernels = {k: json.loads(tags["effective_recipe"])["kernels"] for k, tags in (("n", native), ("e", emulated))}
    assert kernels["e"] == {"bf16": "emulated", "fp8": "emulated", "fp8_casts": "eager"}
    assert kernels["n"] == {"bf16": "native", "fp8": "native", "fp8_casts": "fused"}
    assert native["fused_casts"] == "on" and emulated["fused_casts"].startswith("off: train.fused_casts=auto on cpu")
    assert native["effective_matches"] == "true"
