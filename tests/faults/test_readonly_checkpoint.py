"""A checkpoint save that fails on a read-only disk: the one-line error says what happened to the staging folder
(``.step_N.partial``), and it is true: "removed" only when it is gone, else the folder is named as left. Root
ignores file modes, so the read-only disk is simulated at the file-system calls (``EROFS`` from the write and from
``shutil.rmtree``), on a real DCP save of a small model."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch

import lowprec.train.checkpoint as checkpoint
from lowprec.storage import DiskError
from lowprec.train.checkpoint import save_checkpoint
from lowprec.train.checkpoint_files import verify


def _erofs(path) -> OSError:
    return OSError(errno.EROFS, "Read-only file system", str(path))


def _readonly_rmtree(real):
    """``shutil.rmtree`` on a read-only disk for staging folders: nothing is removed; the error is raised, or
    swallowed under ``ignore_errors=True`` as the real one does."""

    def rmtree(path, ignore_errors=False, *a, **k):
        if not Path(path).name.endswith(".partial"):
            return real(path, ignore_errors, *a, **k)
        if not ignore_errors:
            raise _erofs(Path(path) / ".metadata")

    return rmtree


@pytest.fixture
def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.AdamW(model.parameters())


@pytest.fixture
def readonly_trainer_state(monkeypatch):
    """The trainer state's write into a staging folder finds the disk read-only."""
    real = Path.write_bytes

    def write_bytes(self, data):
        if self.parent.name.endswith(".partial") and self.name == "trainer_state.pt":
            raise _erofs(self)
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)


@pytest.mark.parametrize("removable", [True, False], ids=["removed", "left"])
def test_the_message_says_whether_the_partial_save_was_removed(
    removable, model_and_optimizer, readonly_trainer_state, tmp_path, monkeypatch
):
    model, opt = model_and_optimizer
    final, staging = tmp_path / "step_4", tmp_path / ".step_4.partial"
    if not removable:
        monkeypatch.setattr(checkpoint.shutil, "rmtree", _readonly_rmtree(shutil.rmtree))
    with pytest.raises(DiskError) as e:
        save_checkpoint(final, model, opt, step=4)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("Read-only file system (EROFS) writing checkpoint"), msg
    assert not final.exists()
    if removable:
        assert "(partial save removed)" in msg and not staging.exists()
    else:
        assert staging.is_dir() and "removed)" not in msg, msg
        assert f"partial save {str(staging)!r} left: it could not be removed: Read-only file system" in msg


def test_a_partial_save_left_behind_is_cleared_by_the_next_save(
    model_and_optimizer, readonly_trainer_state, tmp_path, monkeypatch
):
    model, opt = model_and_optimizer
    final, staging = tmp_path / "step_4", tmp_path / ".step_4.partial"
    with monkeypatch.context() as m:
        m.setattr(checkpoint.shutil, "rmtree", _readonly_rmtree(shutil.rmtree))
        with pytest.raises(DiskError, match="left: it could not be removed"):
            save_checkpoint(final, model, opt, step=4)
    assert staging.is_dir()
    monkeypatch.undo()  # the disk is writable again
    save_checkpoint(final, model, opt, step=4)
    assert not staging.exists() and verify(final)
