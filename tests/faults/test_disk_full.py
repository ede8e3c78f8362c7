"""A disk that fills during a checkpoint save (issue 33, item 5), on real ``lowprec train`` runs of the ``debug``
model with a real MLflow sqlite store: ``ENOSPC`` is injected at the file-system layer (the write of DCP's
``FileSystemWriter``, or ``torch.save`` of the trainer state). The run ends FAILED (``failure_kind`` ``disk``) with
one line naming the error and the disk, every step before the save is in the store, the ``.partial`` folder is
gone and the checkpoint before is intact."""

from __future__ import annotations

import errno

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
from mlflow.tracking import MlflowClient

from experiments.cli import main
from lowprec.train.checkpoint_files import verify

RUN = ["train", "model=debug", "train.batch_size=2", "train.seq_len=32", "train.val_every=0", "train.val_batches=1"]
RUN += ["train.warmup_steps=1", "train.timing_warmup_steps=1", "train.steps=6", "train.checkpoint_every=2"]


def _enospc(path="") -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def _fail_dcp_write(monkeypatch):
    """The second checkpoint's shard write (DCP's FileSystemWriter) finds the disk full."""
    real = dcp_fs._write_item
    calls = {"n": 0}

    def write_item(transforms, stream, *a, **k):
        if "step_4.partial" in str(getattr(stream, "name", "")):
            calls["n"] += 1
            raise _enospc(stream.name)
        return real(transforms, stream, *a, **k)

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    return calls


def _fail_trainer_state(monkeypatch):
    """The second checkpoint's ``trainer_state.pt`` (``torch.save`` to a path) finds the disk full."""
    real = torch.save
    calls = {"n": 0}

    def save(obj, f, *a, **k):
        if "step_4.partial" in str(f):
            calls["n"] += 1
            raise _enospc(f)
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    return calls


@pytest.mark.parametrize("inject", [_fail_dcp_write, _fail_trainer_state], ids=["dcp_shards", "trainer_state"])
def test_a_full_disk_during_a_save_fails_the_run_in_one_line_and_loses_nothing(
    inject, run_dirs, tmp_path, capsys, monkeypatch
):
    calls = inject(monkeypatch)
    main([*RUN, *run_dirs])  # returns, never raises: the run is recorded
    assert calls["n"] >= 1  # the fault was hit
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    failed = [ln for ln in out.out.splitlines() if ln.startswith("FAILED run")]
    assert len(failed) == 1 and "No space left on device (ENOSPC)" in failed[0] and "step_4" in failed[0]

    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lowprec").experiment_id
    (run,) = client.search_runs([exp])
    assert run.info.status == "FAILED"
    assert run.data.tags["failure_kind"] == "disk"  # an ablation's resume continues it once space is back
    assert "ENOSPC" in run.data.tags["failure_reason"] and "disk '" in run.data.tags["failure_reason"]
    # the metrics buffered since the last flush (steps 2 and 3, before the failed save after step 3) are stored
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [0, 1, 2, 3]

    ckpts = tmp_path / "runs" / "checkpoints" / run.info.run_id
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2"]  # no .step_4.partial left behind
    assert verify(ckpts / "step_2")  # the checkpoint before is intact (its sha256 manifest holds)
