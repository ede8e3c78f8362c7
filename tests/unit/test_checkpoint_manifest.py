"""A checkpoint's ``manifest.json`` is written by whoever sent the checkpoint: verifying it reads only the plain files
of the checkpoint's own folder (``lowprec.train.checkpoint_files.verify``). A manifest that names a file outside the
folder, with that file's true size and sha256, verified before; it made the resume a size-and-hash oracle of any
file on the machine, and hashed a linked file of any size."""

from __future__ import annotations

import json

import pytest

from lowprec.train.checkpoint_files import MANIFEST, CheckpointDamagedError, sha256_of, verify, write_manifest


def _folder(tmp_path):
    folder = tmp_path / "step_3"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"shard")
    (folder / ".metadata").write_bytes(b"meta")
    write_manifest(folder)
    return folder


def _name(folder, rel, target):
    doc = json.loads((folder / MANIFEST).read_text())
    doc["files"][rel] = {"bytes": target.stat().st_size, "sha256": sha256_of(target)}
    (folder / MANIFEST).write_text(json.dumps(doc))


def test_a_complete_folder_verifies(tmp_path):
    assert verify(_folder(tmp_path)) is True


@pytest.mark.parametrize("rel", ["../secret", "SECRET_ABS", "sub/../../secret", "..", "a\\b"])
def test_a_manifest_name_outside_the_folder_is_refused(tmp_path, rel):
    folder = _folder(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text("not the checkpoint's")
    _name(folder, str(secret) if rel == "SECRET_ABS" else rel, secret)
    with pytest.raises(CheckpointDamagedError, match="not a plain file name inside the checkpoint folder"):
        verify(folder)


def test_a_manifest_entry_that_is_a_symlink_is_refused(tmp_path):
    folder = _folder(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text("not the checkpoint's")
    (folder / "linked").symlink_to(secret)
    _name(folder, "linked", secret)
    with pytest.raises(CheckpointDamagedError, match="linked is a symlink"):
        verify(folder)


@pytest.mark.parametrize("files", [[], {"x": 1}, {"x": {"bytes": "5", "sha256": "0"}}, {"x": {"bytes": 5}}])
def test_a_malformed_manifest_is_one_line(tmp_path, files):
    folder = _folder(tmp_path)
    (folder / MANIFEST).write_text(json.dumps({"format": 1, "files": files}))
    with pytest.raises(CheckpointDamagedError, match="is corrupt"):
        verify(folder)
