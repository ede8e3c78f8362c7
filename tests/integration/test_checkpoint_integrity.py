"""Checkpoints that cannot be half-written, on real training runs of the ``debug`` model: a save
is staged and committed by rename with a sha256 manifest; a save killed midway leaves no checkpoint; a truncated or
altered file is refused by name and the resume falls back to the previous complete checkpoint with a warning naming
both, continuing bit for bit as an uninterrupted run; ``train.keep_checkpoints`` prunes; a checkpoint written
before manifests existed loads with a warning that it cannot be verified. The manifest is checked here with
hashlib, not with lowprec's own hashing."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

import lowprec.train.checkpoint as checkpoint_module
from lowprec.build_optim import OptimHParams
from lowprec.data import TokenBatches
from lowprec.model import model_args
from lowprec.recipes import CATALOG
from lowprec.train.build import build
from lowprec.train.checkpoint_files import (
    CheckpointDamagedError,
    CheckpointFallbackWarning,
    UnverifiedCheckpointWarning,
    verify,
)
from lowprec.train.loop import run_training
from lowprec.train.spec import TrainSpec
from lowprec_lab.cli import main

RECIPE = CATALOG["fp8_delayed"]  # amax histories and scales in the model state: the richest one-process state
SPEC = dict(steps=8, batch_size=2, seq_len=64, warmup_steps=2, val_every=0, val_batches=1)
SPEC |= dict(timing_warmup_steps=1, telemetry_every=0, checkpoint_every=3, progress=False)


class Sink:
    def __init__(self):
        self.losses = {}

    def log_metrics(self, m, step):
        self.losses[step] = m["loss"]


def _run(token_data, rng_seed=0, **kw) -> dict[int, float]:
    spec = TrainSpec(**{**SPEC, **kw.pop("spec", {})})
    b = build(RECIPE, model_args("debug"), spec, OptimHParams(lr=3e-3), 0, torch.device("cpu"))
    sink = Sink()
    torch.manual_seed(rng_seed)
    batches = TokenBatches(token_data.train, token_data.val, spec.seq_len, spec.batch_size, 0)
    run_training(b, batches, spec, sink, **kw)
    return sink.losses


@pytest.fixture(scope="module")
def reference(token_data, tmp_path_factory):
    """An uninterrupted run's losses, its checkpoint directory (step_3 and step_6), copied per test, and the
    messages of the warnings its saves raised."""
    d = tmp_path_factory.mktemp("reference")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        losses = _run(token_data, checkpoint_dir=d)
    return losses, d, [str(w.message) for w in seen]


@pytest.fixture
def ckpts(reference, tmp_path):
    d = tmp_path / "ckpts"
    shutil.copytree(reference[1], d)
    return d


def test_a_checkpoint_is_committed_whole_with_a_sha256_manifest(ckpts):
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_3", "step_6"]  # no staging folder left behind
    for step in ("step_3", "step_6"):
        folder = ckpts / step
        files = json.loads((folder / "manifest.json").read_text())["files"]
        assert {"__0_0.distcp", ".metadata", "trainer_state.pt"} <= set(files)
        on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {"manifest.json"}
        assert set(files) == on_disk
        for rel, want in files.items():
            data = (folder / rel).read_bytes()
            assert want == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _flip_middle_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def test_a_one_process_save_does_not_warn_that_it_is_one_process(reference):
    # DCP's "assuming the intent is to save in a single process" is every one-process run's intent
    assert not [m for m in reference[2] if "torch.distributed is disabled" in m], reference[2]


@pytest.mark.parametrize("damage, words", [(_flip_middle_byte, "differs from its sha256"), (_truncate, "truncated")])
def test_a_damaged_checkpoint_is_refused_by_name_and_the_previous_one_resumes_bit_identically(
    damage, words, reference, ckpts, token_data
):
    damage(ckpts / "step_6" / "__0_0.distcp")
    with pytest.raises(CheckpointDamagedError, match=rf"step_6'.*__0_0\.distcp .*{words}"):
        verify(ckpts / "step_6")
    with pytest.warns(CheckpointFallbackWarning) as caught:
        resumed = _run(token_data, rng_seed=99, resume_from=ckpts / "step_6")
    msg = str(caught[0].message)
    assert "step_6" in msg and "__0_0.distcp" in msg and f"{ckpts / 'step_3'}" in msg
    full = reference[0]
    assert sorted(resumed) == list(range(3, 8)) and [resumed[s] for s in range(3, 8)] == [full[s] for s in range(3, 8)]


def test_a_damaged_checkpoint_without_an_earlier_complete_one_is_an_error(ckpts, token_data):
    _truncate(ckpts / "step_3" / "trainer_state.pt")
    _flip_middle_byte(ckpts / "step_6" / ".metadata")
    with pytest.raises(CheckpointDamagedError, match=r"\.metadata differs .*no earlier complete checkpoint"):
        _run(token_data, resume_from=ckpts)


def test_a_save_killed_midway_leaves_no_checkpoint_and_the_run_folder_resumes_from_the_last_complete_one(
    reference, token_data, tmp_path, monkeypatch
):
    real_commit, calls = checkpoint_module.commit, []

    def dies_at_the_second_commit(staging, final):
        calls.append(final)
        if len(calls) == 2:  # every file of step_6 is written (DCP shards, trainer state), the commit is not done
            raise KeyboardInterrupt("killed while saving")
        return real_commit(staging, final)

    monkeypatch.setattr(checkpoint_module, "commit", dies_at_the_second_commit)
    d = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        _run(token_data, checkpoint_dir=d)
    monkeypatch.undo()
    assert sorted(p.name for p in d.iterdir()) == [".step_6.partial", "step_3"]
    resumed = _run(token_data, rng_seed=5, resume_from=d)  # the run's folder: its newest complete checkpoint
    full = reference[0]
    assert min(resumed) == 3 and [resumed[s] for s in range(3, 8)] == [full[s] for s in range(3, 8)]


def test_keep_checkpoints_prunes_the_older_ones(token_data, tmp_path):
    _run(token_data, checkpoint_dir=tmp_path, spec=dict(checkpoint_every=2, keep_checkpoints=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_6", "step_8"]


def test_a_checkpoint_without_a_manifest_loads_with_a_warning_that_it_cannot_be_verified(ckpts, reference, token_data):
    (ckpts / "step_6" / "manifest.json").unlink()  # as written before manifests existed
    with pytest.warns(UnverifiedCheckpointWarning, match="step_6.* has no manifest.json .* cannot be verified"):
        resumed = _run(token_data, resume_from=ckpts / "step_6")
    assert [resumed[s] for s in (6, 7)] == [reference[0][s] for s in (6, 7)]


def test_the_cli_run_records_which_checkpoint_it_resumed_from_and_why(run_dirs, tmp_path):
    args = ["train", "recipe=fp32", "model=debug", "train.steps=7", "train.batch_size=2", "train.seq_len=64"]
    args += ["train.val_every=0", "train.val_batches=1", "train.warmup_steps=2", "train.timing_warmup_steps=1"]
    assert main(args + run_dirs + ["train.checkpoint_every=3"]) == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lowprec").experiment_id
    (first,) = client.search_runs([exp])
    ckpt_dir = Path(first.data.tags["checkpoint_dir"])
    _flip_middle_byte(ckpt_dir / "step_6" / "__0_0.distcp")
    with pytest.warns(CheckpointFallbackWarning):
        assert main(args + run_dirs + [f"resume={ckpt_dir}"]) == 0  # the run's folder: its newest complete one
    second = next(r for r in client.search_runs([exp]) if r.info.run_id != first.info.run_id)
    tags = second.data.tags
    assert second.info.status == "FINISHED" and tags["resumed_from"] == str(ckpt_dir)
    assert tags["resumed_checkpoint"] == str(ckpt_dir / "step_3") and tags["resumed_step"] == "3"
    assert "step_6" in tags["resume_note"] and "__0_0.distcp differs from its sha256" in tags["resume_note"]
