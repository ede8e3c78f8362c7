"""A checkpoint someone sent is data: DCP's ``.metadata`` is a pickle, and a planted
``__reduce__`` ran a shell command on ``lowprec train resume=<folder>``. The payload here writes a marker file; it
must be refused in one line before anything runs, with a manifest that matches (the sender writes it), and every
checkpoint the project writes must still load."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mlflow.tracking import MlflowClient
from store_dirs import dirs_under, store_uri

from lowprec.errors import CheckpointError
from lowprec.train.checkpoint import load_checkpoint
from lowprec.train.checkpoint_files import write_manifest
from lowprec.train.checkpoint_metadata import load_metadata
from lowprec.train.checkpoint_reader import CheckpointReader, SafeLoadPlanner
from lowprec_lab.cli import main

ARGS = ["train", "recipe=fp8_delayed", "model=debug", "train.steps=4", "train.batch_size=2", "train.seq_len=64"]
ARGS += ["train.val_every=0", "train.val_batches=1", "train.warmup_steps=1", "train.timing_warmup_steps=1"]


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(folder: Path, marker: Path) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    write_manifest(folder)  # integrity is no proof of origin: the sender writes the manifest too


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One ``ARGS`` run checkpointed at steps 2 and 4, for the tests that send a doctored copy of its step 4 (each
    copies it first): ``(its run dirs, client, experiment id, its run id, its step_4 folder)``. Every resume they
    try is refused before a run is created, so the store keeps this one run."""
    root = tmp_path_factory.mktemp("trained")
    dirs = dirs_under(root)
    assert main(ARGS + dirs + ["train.checkpoint_every=2"]) == 0
    client = MlflowClient(store_uri(root))
    exp = client.get_experiment_by_name("lowprec").experiment_id
    (first,) = client.search_runs([exp])
    return dirs, client, exp, first.info.run_id, Path(first.data.tags["checkpoint_dir"]) / "step_4"


def test_a_planted_metadata_payload_is_refused_and_never_runs(trained, tmp_path, capsys):
    run_dirs, client, exp, first, step_4 = trained
    sent = tmp_path / "sent"
    shutil.copytree(step_4, sent)
    marker = tmp_path / "pwned"
    _plant(sent, marker)
    capsys.readouterr()
    assert main(ARGS + run_dirs + [f"resume={sent}"]) != 0
    err = capsys.readouterr().err
    assert not marker.exists()
    assert err.startswith("lowprec train: error: checkpoint metadata") and "\n" not in err.strip()
    assert "refers to posix.system" in err and "never runs code" in err
    # refused at preflight, before any MLflow run exists
    assert [r.info.run_id for r in client.search_runs([exp])] == [first]
    # and if a run loads it anyway (the checkpoint swapped after preflight), the load itself refuses it
    with pytest.raises(CheckpointError, match="refers to posix.system"):
        load_checkpoint(sent, torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters()))
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps(print),  # builtins.print: any callable outside the allow-list
        b"\x80\x04\x95\x1c\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94\x8c\x06getcwd\x94\x93\x94)R\x94.",
        b"not a pickle at all",
        pickle.dumps({"a": 1}),  # harmless, but not DCP metadata
    ],
)
def test_load_metadata_refuses_anything_but_dcp_metadata(payload):
    with pytest.raises(CheckpointError, match="refers to|corrupt|not DCP Metadata"):
        load_metadata(payload, "x/.metadata")


def test_every_tensor_kind_a_checkpoint_holds_reads_through_the_checkpoint_reader(tmp_path):
    # dtypes (fp8 included), layouts, sizes: what lowprec's checkpoints hold (non-tensor items go to values.json)
    state = {
        "w": torch.randn(4, 8),
        "fp8": torch.randn(16).to(torch.float8_e4m3fn),
        "bf16": torch.randn(3).bfloat16(),
        "i": torch.arange(5),
    }
    dcp.save(state, checkpoint_id=str(tmp_path))
    load_metadata((tmp_path / ".metadata").read_bytes())
    back = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=CheckpointReader(tmp_path), planner=SafeLoadPlanner(str(tmp_path)))
    for k in ("w", "bf16", "i"):
        assert torch.equal(back[k], state[k])
    assert torch.equal(back["fp8"].view(torch.uint8), state["fp8"].view(torch.uint8))


def test_a_trainer_state_of_the_wrong_type_is_refused_at_preflight(trained, tmp_path, capsys):
    run_dirs, client, exp, first, step_4 = trained
    sent = tmp_path / "sent"
    shutil.copytree(step_4, sent)
    trainer = torch.load(sent / "trainer_state.pt", weights_only=True)
    trainer["step"] = "4"
    torch.save(trainer, sent / "trainer_state.pt")
    write_manifest(sent)
    capsys.readouterr()
    assert main(ARGS + run_dirs + [f"resume={sent}"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "trainer state 'step' is of type str, not an int: refusing it" in err
    assert [r.info.run_id for r in client.search_runs([exp])] == [first]  # no run was created
