"""``lowprec checkpoint convert SRC DST``: a checkpoint in the format an older lowprec wrote (DCP given the whole
state dict, so the optimizer's param groups became pickled byte records) is rewritten in the current format
without running code from it. The old checkpoints here are real: ``dcp.save`` of ``get_state_dict`` with
lowprec's own ``trainer_state.pt`` and manifest; the payloads are real pickles that would write a marker file."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.state_dict import get_state_dict

from lowprec.errors import CheckpointError
from lowprec.train.checkpoint import TRAINER_STATE, load_checkpoint, save_checkpoint
from lowprec.train.checkpoint_convert import convert_checkpoint
from lowprec.train.checkpoint_files import MANIFEST, staging_folder, verify, write_manifest
from lowprec.train.checkpoint_metadata import load_metadata
from lowprec.train.checkpoint_reader import VALUES, split_state
from lowprec_lab.cli import main


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.05)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _old_checkpoint(tmp_path: Path, name: str = "old", change=None) -> Path:
    """A checkpoint as an older lowprec wrote it: DCP's save of the whole state (byte records for the param
    groups), the ``trainer_state.pt`` that ``save_checkpoint`` writes for the same model (step 7), a manifest.
    ``change(optim_state)`` plants something in the optimizer's state first."""
    model, opt = _model_and_optimizer()
    save_checkpoint(tmp_path / f"{name}_new", model, opt, step=7)
    msd, osd = get_state_dict(model, opt)
    if change is not None:
        change(osd)
    folder = tmp_path / name
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(folder))
    shutil.copy(tmp_path / f"{name}_new" / TRAINER_STATE, folder / TRAINER_STATE)
    write_manifest(folder)
    return folder


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def _refused(capsys, src: Path, dst: Path) -> str:
    """Run the command expecting a refusal: exit 2, one line on stderr, no dst and no staging folder left."""
    capsys.readouterr()
    assert main(["checkpoint", "convert", str(src), str(dst)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lowprec checkpoint convert: error: ") and "\n" not in err, err
    assert not dst.exists() and not staging_folder(dst).exists()
    return err


def test_an_old_checkpoint_is_refused_naming_the_command_then_converts_and_resumes_identically(tmp_path, capsys):
    old = _old_checkpoint(tmp_path)
    meta = load_metadata((old / ".metadata").read_bytes(), byte_records=True)
    assert "optim.param_groups.0.lr" in meta.state_dict_metadata  # the old format: values as byte records
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(old, *_model_and_optimizer(seed=1))
    assert f"convert it with `lowprec checkpoint convert {old} NEW_FOLDER`" in _one_line(e)
    assert "weights-only unpickler" in str(e.value) and "or start the run anew" in str(e.value)

    dst = tmp_path / "converted"
    capsys.readouterr()
    assert main(["checkpoint", "convert", str(old), str(dst)]) == 0
    out = capsys.readouterr().out
    assert "converted" in out and "trainer_state.pt" in out and f"resume={dst}" in out
    assert verify(dst)  # a fresh manifest of every file
    assert sorted(p.name for p in dst.iterdir()) == sorted(
        [".metadata", "__0_0.distcp", VALUES, TRAINER_STATE, MANIFEST]
    )
    assert (dst / TRAINER_STATE).read_bytes() == (old / TRAINER_STATE).read_bytes()

    model2, opt2 = _model_and_optimizer(seed=1)
    assert load_checkpoint(dst, model2, opt2) == 7
    model, opt = _model_and_optimizer()
    want_t, want_v = split_state(dict(zip(("m", "o"), get_state_dict(model, opt), strict=True)))
    got_t, got_v = split_state(dict(zip(("m", "o"), get_state_dict(model2, opt2), strict=True)))
    assert want_v == got_v and want_t.keys() == got_t.keys()
    for k in want_t:  # weights and both AdamW moments, bit for bit
        assert torch.equal(want_t[k], got_t[k]), k
    group = opt2.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"], group["eps"]) == (1e-2, (0.8, 0.95), 0.05, 1e-8)
    assert "exp_avg_sq" in opt2.state[model2.weight]
    assert main(["checkpoint", "convert", str(old), str(tmp_path / "again")]) == 0  # src is unchanged


def test_a_byte_record_holding_a_payload_is_refused_and_never_runs(tmp_path, capsys):
    marker = tmp_path / "pwned"

    def plant(osd):
        osd["param_groups"][0]["lr"] = _Payload(marker)

    old = _old_checkpoint(tmp_path, change=plant)
    err = _refused(capsys, old, tmp_path / "dst")
    assert "byte record 'optim.param_groups.0.lr' is refused by torch's weights-only unpickler" in err
    assert "posix.system" in err
    assert not marker.exists()


@pytest.mark.parametrize(
    ("value", "said"),
    [(torch.Size([2, 3]), "holds a torch.Size"), ((torch.ones(2),), "holds a torch.Tensor"), ({1, 2}, "holds a")],
)
def test_a_byte_record_holding_a_value_that_is_not_plain_is_refused(tmp_path, capsys, value, said):
    def plant(osd):
        osd["param_groups"][0]["betas"] = value  # a tuple leaf: DCP stores it as one byte record

    old = _old_checkpoint(tmp_path, change=plant)
    err = _refused(capsys, old, tmp_path / "dst")
    assert "'optim.param_groups.0.betas'" in err and said in err


def test_a_byte_record_that_is_a_bare_pickle_is_refused_before_it_is_unpickled(tmp_path, capsys):
    """Not a torch zip: refused from its bytes, before any unpickler sees it."""
    marker = tmp_path / "pwned"
    old = _old_checkpoint(tmp_path)
    payload = pickle.dumps(_Payload(marker))
    data = old / "__0_0.distcp"
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(payload)
    meta = load_metadata((old / ".metadata").read_bytes(), byte_records=True)
    for index in [i for i in meta.storage_data if i.fqn == "optim.param_groups.0.lr"]:
        meta.storage_data[index] = _StorageInfo("__0_0.distcp", offset, len(payload))
    (old / ".metadata").write_bytes(pickle.dumps(meta))
    write_manifest(old)
    err = _refused(capsys, old, tmp_path / "dst")
    assert "'optim.param_groups.0.lr' is not a torch file" in err
    assert not marker.exists()


def test_an_existing_dst_is_refused_and_left_as_it_is(tmp_path, capsys):
    old = _old_checkpoint(tmp_path)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep").write_text("mine")
    capsys.readouterr()
    assert main(["checkpoint", "convert", str(old), str(dst)]) == 2
    err = capsys.readouterr().err.strip()
    assert "already exists" in err and "\n" not in err
    assert [p.name for p in dst.iterdir()] == ["keep"]
    with pytest.raises(CheckpointError, match="already exists"):  # refused before src is read at all
        convert_checkpoint(tmp_path / "missing", dst)


def _move_record(folder: Path, fqn: str, name: str, offset: int | None = None, length: int | None = None) -> None:
    """Rewrite ``folder``'s metadata so that record ``fqn`` lies in file ``name`` (at ``offset`` for ``length``
    bytes when given), and write a fresh manifest (the sender writes it)."""
    meta = load_metadata((folder / ".metadata").read_bytes(), byte_records=True)
    for index, info in list(meta.storage_data.items()):
        if index.fqn == fqn:
            off = info.offset if offset is None else offset
            meta.storage_data[index] = _StorageInfo(name, off, info.length if length is None else length)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    write_manifest(folder)


def test_a_symlinked_data_file_is_refused(tmp_path, capsys):
    old = _old_checkpoint(tmp_path)
    outside = tmp_path / "outside.distcp"
    shutil.move(old / "__0_0.distcp", outside)
    (old / "__0_0.distcp").symlink_to(outside)
    (old / MANIFEST).unlink()  # a checkpoint of a lowprec older than manifests: the data-file checks alone
    err = _refused(capsys, old, tmp_path / "dst")
    assert "'__0_0.distcp' is not a regular file (a symlink?)" in err


def test_a_byte_record_in_a_symlinked_file_is_refused(tmp_path, capsys):
    """The tensors stay in the real data file: only the byte record's own checks stand between it and the link."""
    old = _old_checkpoint(tmp_path)
    shutil.copy(old / "__0_0.distcp", tmp_path / "outside.distcp")
    (old / "__1_0.distcp").symlink_to(tmp_path / "outside.distcp")
    _move_record(old, "optim.param_groups.0.lr", "__1_0.distcp")
    (old / MANIFEST).unlink()
    err = _refused(capsys, old, tmp_path / "dst")
    assert "byte record 'optim.param_groups.0.lr'" in err or "'__1_0.distcp'" in err
    assert "symlink" in err


def test_a_byte_record_beyond_the_end_of_its_file_is_refused(tmp_path, capsys):
    old = _old_checkpoint(tmp_path)
    _move_record(old, "optim.param_groups.0.lr", "__0_0.distcp", length=(old / "__0_0.distcp").stat().st_size + 1)
    assert "lies beyond the end of __0_0.distcp" in _refused(capsys, old, tmp_path / "dst")


def test_a_manifest_naming_a_symlink_or_a_path_outside_is_refused_before_it_is_hashed(tmp_path, capsys):
    old = _old_checkpoint(tmp_path)
    (tmp_path / "secret").write_text("x")
    (old / "link").symlink_to(tmp_path / "secret")
    write_manifest(old)  # hashes through the link: the sender's manifest may name anything
    assert "not a regular file (a symlink?)" in _refused(capsys, old, tmp_path / "dst")
    (old / "link").unlink()
    write_manifest(old)
    doc = (old / MANIFEST).read_text().replace('"__0_0.distcp"', '"../secret"')
    (old / MANIFEST).write_text(doc)
    assert "names '../secret', which is not a plain file name" in _refused(capsys, old, tmp_path / "dst")


def test_a_damaged_source_is_refused_not_rehashed_clean(tmp_path, capsys):
    old = _old_checkpoint(tmp_path)
    data = bytearray((old / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (old / "__0_0.distcp").write_bytes(bytes(data))
    assert "differs from its sha256" in _refused(capsys, old, tmp_path / "dst")


def test_a_record_in_a_file_outside_the_folder_is_refused(tmp_path, capsys):
    old = _old_checkpoint(tmp_path)
    _move_record(old, "optim.param_groups.0.lr", "../outside.distcp")
    assert "not a plain file name inside the checkpoint folder" in _refused(capsys, old, tmp_path / "dst")


def test_chunks_that_do_not_cover_a_tensor_or_a_forged_size_are_refused(tmp_path, capsys):
    old = _old_checkpoint(tmp_path)
    raw = (old / ".metadata").read_bytes()
    meta = load_metadata(raw, byte_records=True)
    meta.state_dict_metadata["model.weight"].chunks[0].sizes = torch.Size([2, 4])  # row 3 of 3 left unread
    (old / ".metadata").write_bytes(pickle.dumps(meta))
    write_manifest(old)
    assert "do not cover exactly" in _refused(capsys, old, tmp_path / "dst")

    meta = load_metadata(raw, byte_records=True)
    meta.state_dict_metadata["model.weight"].chunks[0].offsets = torch.Size([1, 0])  # rows 1-3 of 3
    (old / ".metadata").write_bytes(pickle.dumps(meta))
    write_manifest(old)
    assert "outside its shape [3, 4]" in _refused(capsys, old, tmp_path / "dst")

    meta = load_metadata(raw, byte_records=True)
    md = meta.state_dict_metadata["model.weight"]
    md.size = torch.Size([1 << 20, 1 << 20])  # 4 TiB declared by a folder of a few KiB
    md.chunks[0].sizes = md.size
    (old / ".metadata").write_bytes(pickle.dumps(meta))
    write_manifest(old)
    assert "more than the" in _refused(capsys, old, tmp_path / "dst")


def test_a_checkpoint_in_the_current_format_and_bad_usage_are_refused_in_one_line(tmp_path, capsys):
    model, opt = _model_and_optimizer()
    save_checkpoint(tmp_path / "new", model, opt, step=1)
    assert "nothing to convert" in _refused(capsys, tmp_path / "new", tmp_path / "dst")
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(tmp_path / "missing", tmp_path / "dst")
    assert "no checkpoint at" in _one_line(e)
    for argv in (["checkpoint"], ["checkpoint", "convert", "a"], ["checkpoint", "mend", "a", "b"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("lowprec checkpoint") and "\n" not in err and "convert SRC DST" in err
    assert main(["checkpoint", "convert", "--help"]) == 0
    assert "lowprec checkpoint convert SRC DST" in capsys.readouterr().out


def test_a_byte_record_without_its_storage_entry_is_refused(tmp_path, capsys):
    old = _old_checkpoint(tmp_path)
    meta = load_metadata((old / ".metadata").read_bytes(), byte_records=True)
    for index in [i for i in meta.storage_data if i.fqn == "optim.param_groups.0.lr"]:
        del meta.storage_data[index]
    (old / ".metadata").write_bytes(pickle.dumps(meta))
    write_manifest(old)
    assert "has 0 storage entries in the metadata, not one" in _refused(capsys, old, tmp_path / "dst")


@pytest.mark.parametrize("kind", ["payload", "wrong type", "symlink"])
def test_a_trainer_state_is_checked_before_it_is_copied(tmp_path, capsys, kind):
    old = _old_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    if kind == "payload":
        torch.save({"step": 1, "rng_cpu": _Payload(marker)}, old / TRAINER_STATE)
    elif kind == "wrong type":
        state = torch.load(old / TRAINER_STATE, weights_only=True)
        torch.save({**state, "step": "5"}, old / TRAINER_STATE)
    else:
        shutil.move(old / TRAINER_STATE, tmp_path / "elsewhere.pt")
        (old / TRAINER_STATE).symlink_to(tmp_path / "elsewhere.pt")
    write_manifest(old)
    if kind == "symlink":
        (old / MANIFEST).unlink()  # else the manifest's own check refuses the link first
    err = _refused(capsys, old, tmp_path / "dst")
    said = {"payload": "posix.system", "wrong type": "'step' is of type str", "symlink": "a symlink?"}[kind]
    assert said in err and TRAINER_STATE in err
    assert not marker.exists()
