"""One run per GPU: the slots of ``lowprec_lab.plan.placement`` (pure) and ``train.compile/ac=auto``."""

import json

import pytest

from lowprec.errors import ConfigError
from lowprec_lab.plan.auto_train import resolve_compile_ac
from lowprec_lab.plan.placement import physical_ids, plan_placement


@pytest.mark.parametrize(
    ("gpus", "k", "expected"),
    [
        (8, 1, [(i,) for i in range(8)]),
        (8, 2, [(0, 1), (2, 3), (4, 5), (6, 7)]),
        (8, 8, [tuple(range(8))]),
        (3, 2, [(0, 1)]),  # floor(3 / 2): the third GPU stays idle, never shared
    ],
)
def test_auto_places_floor_g_over_k_runs_on_disjoint_gpus(gpus, k, expected):
    p = plan_placement(gpus, k, "auto", "cuda")
    assert [s.gpus for s in p.slots] == expected
    used = [g for s in p.slots for g in s.gpus]
    assert len(used) == len(set(used))  # no GPU in two slots
    assert p.alone_on_device
    assert json.loads(p.to_json())["workers"] == {str(i): list(g) for i, g in enumerate(expected)}


def test_workers_n_up_to_the_bound_and_one_line_refusals():
    assert plan_placement(8, 2, 3, "cuda").workers == 3
    with pytest.raises(ConfigError, match=r"workers=5 exceeds 4: 8 GPU\(s\) / 2 per run"):
        plan_placement(8, 2, 5, "cuda")
    with pytest.raises(ConfigError, match="workers=9 exceeds 8"):
        plan_placement(8, 1, 9, "cuda")
    with pytest.raises(ConfigError, match="gpus=0"):
        plan_placement(0, 1, "auto", "cuda")
    with pytest.raises(ConfigError, match="needs 4 GPUs per run but the node has 3"):
        plan_placement(3, 4, "auto", "cuda")
    with pytest.raises(ConfigError, match="must be an integer"):
        plan_placement(8, 1, "many", "cuda")
    # the local runner trains a multi-GPU layout under one torchrun: one run at a time until each slot has its own
    assert plan_placement(8, 2, "auto", "cuda", multi_gpu_slots=False).workers == 1
    with pytest.raises(ConfigError, match="a parallel layout trains one run at a time"):
        plan_placement(8, 2, 2, "cuda", multi_gpu_slots=False)


def test_cpu_keeps_its_shared_core_workers():
    p = plan_placement(0, 1, "auto", "cpu", cpu_cores=2)
    assert p.workers == 2 and all(s.gpus == () for s in p.slots) and not p.alone_on_device
    assert plan_placement(0, 2, "auto", "cpu", cpu_cores=2).workers == 1  # a gloo layout: one at a time
    with pytest.raises(ConfigError, match="cannot combine with a parallel layout"):
        plan_placement(0, 2, 2, "cpu")


def test_slot_gpus_map_through_the_parents_visible_devices():
    assert physical_ids((0, 1), None) == "0,1"
    assert physical_ids((1,), "2,3,5") == "3"  # logical 1 of the parent's own view
    assert physical_ids((2, 3), "") == "2,3"


def test_auto_compile_and_ac_per_device():
    cpu = resolve_compile_ac("auto", "auto", "cpu", moe=False)
    assert (cpu.compile, cpu.ac) == (False, "none")  # today's CPU defaults
    gpu = resolve_compile_ac("auto", "auto", "cuda", moe=False)
    assert (gpu.compile, gpu.ac) == (True, "selective")
    assert gpu.tags() == {"train_auto": "compile=auto->True, ac=auto->selective"}
    moe = resolve_compile_ac("auto", "auto", "cuda", moe=True)
    assert (moe.compile, moe.ac) == (False, "none")  # lowprec trains MoE eager
    blocked = resolve_compile_ac("auto", "auto", "cuda", moe=False, blocker="telemetry cannot be traced")
    assert blocked.compile is False and "eager: telemetry cannot be traced" in blocked.tags()["compile_fallback"]
    asked = resolve_compile_ac(True, "full", "cuda", moe=False, blocker="x")  # explicit: no fallback, no tag
    assert (asked.compile, asked.ac, asked.tags()) == (True, "full", {})
    with pytest.raises(ConfigError, match="must be true, false or auto"):
        resolve_compile_ac("yes", "auto", "cpu", moe=False)


@pytest.mark.parametrize(("n_cores", "expected"), [(1, 1), (2, 2), (16, 2), (192, 2)])
def test_cpu_auto_workers_are_at_most_two_whatever_the_core_count(n_cores, expected, monkeypatch):
    """``workers=auto`` on a CPU: the runs share the cores, and more than 2 at once was slower per run; the core
    count comes from the process's affinity (``preflight.cores``), faked here for a large and a one-core machine."""
    from lowprec_lab.cli import compose
    from lowprec_lab.plan.preflight import ablation_placement

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(n_cores)))
    assert plan_placement(0, 1, "auto", "cpu", cpu_cores=n_cores).workers == expected
    cfg = compose("ablate", ["recipes=[fp32,bf16]", "controls=false", "device=cpu", "workers=auto"])
    placement = ablation_placement(cfg)
    assert (placement.device_type, placement.workers) == ("cpu", expected)
