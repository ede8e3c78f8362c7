"""``lowprec recommend`` over every catalog recipe x every hardware entry, and what it must say.

The README's first example failed with ``lowprec recommend: error: mxfp8`` (a ``KeyError`` of the citation table
printed as a user's mistake) on every part but the A100, and recommend timed MXFP8 on an H100, where training
refuses it. Every test of recommend passed ``recipes=[...]``, so the default path (the whole catalog) never ran.
The functions are called on the ``debug`` model (milliseconds per recipe); one test runs the README's command as a
subprocess, as a user types it."""

from __future__ import annotations

import functools
import json
import os
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import lowprec_lab.sizing.recommend as rec_mod
from lowprec.backends import fp8_backends
from lowprec.estimate.hardware import HARDWARE, get_hardware
from lowprec.estimate.runnable import hardware_blocker
from lowprec.recipes import CATALOG, get_recipe
from lowprec_lab.cli import compose, main, planning_query
from lowprec_lab.plan.preflight import preflight
from lowprec_lab.sizing.recommend import format_table, recommend
from lowprec_lab.sizing.recommend_evidence import PUBLISHED_EVIDENCE, published_evidence

ROOT = Path(__file__).resolve().parents[2]
PAIRS = [(r, h) for r in CATALOG for h in HARDWARE]


@pytest.fixture
def no_store(tmp_path):
    return f"tracking.uri=sqlite:///{tmp_path / 'none' / 'mlflow.db'}"


@functools.cache
def _debug_query():
    return planning_query("recommend", ["model=debug", "hardware=h100", "gpus=2", "tokens=1e9", "train.seq_len=256"])


def _rec(no_store, *argv):
    return recommend(planning_query("recommend", [*argv, no_store]))


def test_every_scaling_a_backend_implements_has_a_citation():
    """A scaling added to a backend later cannot break recommend with a KeyError: it needs a citation here."""
    scalings = {s for b in fp8_backends().values() for s in b.scalings}
    assert scalings <= set(PUBLISHED_EVIDENCE), scalings - set(PUBLISHED_EVIDENCE)
    for r in CATALOG.values():
        assert published_evidence(r)


@pytest.mark.parametrize("recipe, hardware", PAIRS, ids=[f"{r}-{h}" for r, h in PAIRS])
def test_recommend_lists_what_the_part_cannot_run_with_the_reason_and_no_time(recipe, hardware, no_store):
    hw = get_hardware(hardware)
    why = hardware_blocker(get_recipe(recipe), hw)
    # one real composition for every pair (Hydra's compose costs ~0.2 s), the pair's keys set on its typed query
    store = no_store.partition("=")[2]
    r = recommend(replace(_debug_query(), hardware=hardware, recipes=(recipe,), tracking_uri=store))
    timed = {o.recipe: o for o in r.options}
    if why is not None:
        assert r.not_runnable[recipe] == f"on {hw.name}: {why}" and recipe not in timed
        text = format_table(r)
        assert f"{recipe} " in text and f"not runnable, no step time: on {hw.name}: {why}" in text
    else:
        assert recipe not in r.not_runnable and timed[recipe].tokens_per_s_per_gpu > 0


@pytest.mark.parametrize("hardware", list(HARDWARE))
def test_the_default_path_covers_the_whole_catalog(hardware, no_store):
    """No ``recipes=``: every catalog recipe is either ranked with a time or listed as not runnable, never both."""
    hw = get_hardware(hardware)
    r = _rec(no_store, "model=debug", f"hardware={hardware}", "gpus=2", "tokens=1e9", "train.seq_len=256")
    timed = {o.recipe for o in r.options}
    assert timed | set(r.not_runnable) == set(CATALOG) and not timed & set(r.not_runnable)
    assert {n for n in CATALOG if hardware_blocker(get_recipe(n), hw)} == set(r.not_runnable)
    json.dumps(r.to_dict())
    format_table(r)


def test_the_readme_example_runs_as_typed(tmp_path):
    """The README's first command, as a user runs it: exit 0, MXFP8 listed as not runnable on an H100 with the
    reason, and never given a step time (about 10 s: the whole catalog on Llama-3-8B)."""
    cmd = [sys.executable, "-m", "lowprec_lab", "recommend", "model=llama3_8b", "hardware=h100", "gpus=64"]
    cmd += ["tokens=2e12", f"tracking.uri=sqlite:///{tmp_path / 'none.db'}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if " mxfp8 " in f" {line} "]
    assert len(rows) == 1 and "not runnable, no step time: on h100_sxm: " in rows[0] and "sm100" in rows[0], rows
    for name in ("te_mxfp8", "nvfp4", "mxfp4"):
        assert f"   {name} " in p.stdout and not any(
            line.split()[1:2] == [name] for line in p.stdout.splitlines() if line[:2].strip().isdigit()
        )


def test_recommend_says_what_it_assumed_and_which_evidence_supports_each_row(no_store):
    argv = ["model=llama3_8b", "hardware=h100", "gpus=8", "tokens=1e11", "train.batch_size=16", "train.seq_len=4096"]
    r = _rec(no_store, *argv)
    r = replace_options(r, ["fp8_rowwise", "fp8_tensorwise_fsdp8", "bf16_adamw8bit", "bf16"])
    text = format_table(r)
    assert "assumed: train.batch_size=16 sequences split over the data-parallel ranks of train.seq_len=4096" in text
    d = r.to_dict()
    refs = {x["ref"]: x for x in d["published_refs"]}
    for i, o in enumerate(r.options, 1):
        assert o.tokens_per_step == 16 * 4096 and o.batch_per_rank * o.dp_shard == 16
        row = next(line for line in text.splitlines() if line.startswith(f"{i:>2} {o.recipe} "))
        assert f"{o.tokens_per_step:,}" in row
        ref = int(row.split("[")[1].split("]")[0])
        assert refs[ref]["text"] == o.published and o.recipe in refs[ref]["recipes"]
        assert f"  [{ref}] {o.published}" in text
    # the stale claim is gone; what was measured on a GPU is said
    assert "Never measured by lowprec on a GPU" not in text
    assert "measured by their authors on B200, H100, H200, MI300X GPUs" in text
    assert "measured on one H100 (llama3_1b" in text


def replace_options(rec, names):
    """``rec`` with only the rows of ``names`` (a table small enough to read in a test)."""
    from dataclasses import replace

    return replace(rec, options=[o for o in rec.options if o.recipe in names])


def test_a_layout_outside_every_published_point_is_marked(no_store):
    # TP 2 at 8B: the published 8B points are FSDP 8 to 128 at TP 1
    r = _rec(no_store, "model=llama3_8b", "hardware=h100", "gpus=8", "tokens=1e11", "recipes=[fp8_rowwise]")
    o = next(o for o in r.options if o.recipe == "fp8_rowwise")
    assert (o.dp_shard, o.tp) == (4, 2)
    assert o.outside_published.startswith("FSDP 4 x TP 2 at llama3_8b (published: FSDP 8 x TP 1, FSDP 32 x TP 1")
    text = format_table(r)
    assert "4x2 ac=none*" in text and "* layout outside every published point" in text
    # FSDP 256 at 70B: the published 70B points are FSDP 32 x TP 8 only
    r = _rec(no_store, "model=llama3_70b", "hardware=h100", "gpus=256", "tokens=2e12", "recipes=[fp8_tensorwise_fsdp8]")
    o = next(o for o in r.options if o.recipe == "fp8_tensorwise_fsdp8")
    assert (o.dp_shard, o.tp) == (256, 1)
    assert o.outside_published == "FSDP 256 x TP 1 at llama3_70b (published: FSDP 32 x TP 8)"
    assert "Its layout lies outside every published point (FSDP 256 x TP 1 at llama3_70b" in r.paragraph
    # inside: FSDP 64 at 8B on an H100 lies between the published FSDP 8 and 128
    r = _rec(no_store, "model=llama3_8b", "hardware=h100", "gpus=64", "tokens=2e12", "recipes=[fp8_tensorwise_fsdp8]")
    assert next(o for o in r.options if o.recipe == "fp8_tensorwise_fsdp8").outside_published is None


def test_the_70b_evidence_command_runs_as_printed(no_store, monkeypatch):
    """The printed ablation for a 70B run once had no device, layout or steps. It is now the multi-node torchrun
    line; its ``ablate`` arguments compose with Hydra and pass every check ``lowprec ablate`` makes before
    training, on a (stubbed) CUDA device of the part's compute capability."""
    r = _rec(no_store, "model=llama3_70b", "hardware=h100", "gpus=256", "tokens=2e12", "recipes=[fp8_rowwise]")
    o = next(o for o in r.options if o.recipe == "fp8_rowwise")
    a = o.ablation
    assert a.gpus * 1 == a.dp_shard * a.tp and a.nodes * a.nproc_per_node == a.gpus and a.nodes > 1
    words = shlex.split(o.ablate_command)
    assert words[:4] == ["torchrun", f"--nnodes={a.nodes}", "--nproc_per_node=8", "--rdzv_backend=c10d"]
    args = words[words.index("ablate") + 1 :]
    for needle in ("device=cuda", f"parallel.dp_shard={a.dp_shard}", f"parallel.tp={a.tp}", "train.steps=1000"):
        assert needle in args
    cfg = compose("ablate", args)
    for where in ("lowprec_lab.plan.preflight", "lowprec_lab.runner.ablate"):
        monkeypatch.setattr(f"{where}.resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    # as one rank of the printed torchrun line (the ranks are torchrun's, across the nodes)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(a.gpus))
    checked = preflight(cfg)
    assert checked.parallel.world_size == a.gpus and checked.train.batch_size == a.dp_shard * a.batch
    assert a.gpu_hours > 0 and f"about {a.gpu_hours:,.0f} GPU-hours" in r.paragraph


@pytest.mark.parametrize("exc", [KeyError("mxfp8"), IndexError("list index out of range")])
def test_a_bug_in_recommend_keeps_its_traceback(exc, monkeypatch, no_store):
    """The KeyError of a table is a bug, not bad input; it propagates instead of ``error: mxfp8``."""

    def bug(*a, **k):
        raise exc

    monkeypatch.setattr(rec_mod, "published_evidence", bug)
    with pytest.raises(type(exc)):
        main(["recommend", "model=debug", "hardware=h100", "gpus=1", "tokens=1e9", "train.seq_len=256", no_store])


def test_not_runnable_for_memory_says_gib(no_store, capsys):
    assert main(["recommend", "model=llama3_70b", "hardware=h100", "gpus=1", "tokens=1e9", "recipes=[bf16]"]) == 0
    out = capsys.readouterr().out
    assert "no layout of 1 GPUs leaves 7% of 74.5 GiB free at 1 per data-parallel rank x train.seq_len=8192" in out
    assert " GB " not in out
