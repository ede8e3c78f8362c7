"""A checkpoint's data files are data: DCP reads a record declared as bytes with ``torch.load(weights_only=False)``
and a record's file name as any path, so a received checkpoint with a fresh manifest ran a sender's code and read
files outside its folder. Here every payload is real (a pickle whose ``__reduce__`` writes a marker file, a path
outside the folder, a symlink, an int8 record, a nested-path bomb, a deflated zip): each is first shown to work
against DCP's own reader where that is safe to do, then refused by lowprec's load in one line, with nothing run and
nothing outside the folder opened."""

from __future__ import annotations

import builtins
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.state_dict import get_state_dict

from lowprec.errors import CheckpointError
from lowprec.train.checkpoint import load_checkpoint, load_model_weights, read_trainer_state, save_checkpoint
from lowprec.train.checkpoint_files import write_manifest
from lowprec.train.checkpoint_metadata import load_metadata
from lowprec.train.checkpoint_reader import VALUES, split_state


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture
def saved(tmp_path) -> Path:
    """A checkpoint written by lowprec (``save_checkpoint``) of a Linear layer and its AdamW state."""
    model, opt = _model_and_optimizer()
    save_checkpoint(tmp_path / "ckpt", model, opt, step=1)
    return tmp_path / "ckpt"


def _rewrite_metadata(folder: Path, change) -> None:
    meta = load_metadata((folder / ".metadata").read_bytes(), byte_records=True)
    change(meta)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    write_manifest(folder)  # the sender writes a fresh manifest: integrity is no proof of origin


def _load(folder: Path):
    model, opt = _model_and_optimizer(seed=1)
    return load_checkpoint(folder, model, opt)


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_lowprec_checkpoint_holds_tensors_only_and_round_trips_bit_identically(saved):
    meta = load_metadata((saved / ".metadata").read_bytes())
    assert not [k for k, md in meta.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)]
    values = json.loads((saved / VALUES).read_text())["values"]
    assert values["optim.param_groups.0.lr"] == 1e-2 and values["optim.param_groups.0.betas"] == [0.9, 0.999]
    assert VALUES in json.loads((saved / "manifest.json").read_text())["files"]
    model, opt = _model_and_optimizer()
    want_m, want_o = get_state_dict(model, opt)
    model2, opt2 = _model_and_optimizer(seed=1)
    assert load_checkpoint(saved, model2, opt2) == 1
    got_m, got_o = get_state_dict(model2, opt2)
    want_t, want_v = split_state({"m": want_m, "o": want_o})
    got_t, got_v = split_state({"m": got_m, "o": got_o})
    assert want_t.keys() == got_t.keys() and want_v == got_v
    for k in want_t:
        assert torch.equal(want_t[k], got_t[k]), k
    assert opt2.param_groups[0]["betas"] == (0.9, 0.999)  # a tuple again, as the optimizer holds it
    alone = torch.nn.Linear(4, 3)
    load_model_weights(saved, alone)  # the model part only (the DeepSeek-V3 study's operand capture)
    assert torch.equal(alone.weight, model.weight) and torch.equal(alone.bias, model.bias)


def test_a_byte_record_holding_a_payload_is_refused_and_never_runs(tmp_path):
    """The format lowprec wrote before: DCP's byte records for the optimizer's values, one of them a payload."""
    model, opt = _model_and_optimizer()
    msd, osd = get_state_dict(model, opt)
    marker = tmp_path / "pwned"
    osd["param_groups"][0]["lr"] = _Payload(marker)
    sent = tmp_path / "sent"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(sent))
    write_manifest(sent)
    victim = tmp_path / "victim"
    shutil.copytree(sent, victim)
    with pytest.raises(CheckpointError) as e:
        _load(victim)
    msg = _one_line(e)
    assert "records stored as pickled bytes" in msg and "start the run anew" in msg
    assert f"convert it with `lowprec checkpoint convert {victim} NEW_FOLDER`" in msg
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="stored as pickled bytes"):
        load_model_weights(victim, torch.nn.Linear(4, 3))
    assert not marker.exists()
    # DCP's own load runs it (what lowprec did before): the payload is live
    m2, o2 = _model_and_optimizer(seed=1)
    state = dict(zip(("model", "optim"), get_state_dict(m2, o2), strict=True))
    dcp.load(state, storage_reader=dcp.FileSystemReader(sent))
    assert marker.exists()


def test_metadata_that_declares_a_tensor_a_byte_record_is_refused_and_never_runs(saved, tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))
    data = saved / "__0_0.distcp"
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(payload)

    def declare(meta):
        meta.state_dict_metadata["model.weight"] = BytesStorageMetadata()
        for index in [i for i in meta.storage_data if i.fqn == "model.weight"]:
            del meta.storage_data[index]
        meta.storage_data[MetadataIndex("model.weight")] = _StorageInfo("__0_0.distcp", offset, len(payload))

    _rewrite_metadata(saved, declare)
    with pytest.raises(CheckpointError) as e:
        _load(saved)
    assert "(first: 'model.weight')" in _one_line(e)
    assert not marker.exists()
    # DCP's own planner reads the key as bytes, whatever the loading state holds: the payload runs
    state = {"model": torch.nn.Linear(4, 3).state_dict()}
    with pytest.raises(BaseException):  # noqa: B017 - the load fails only after the payload ran
        dcp.load(state, storage_reader=dcp.FileSystemReader(saved))
    assert marker.exists()


@pytest.mark.parametrize("where", ["../outside.distcp", "ABSOLUTE", "sub/inner.distcp", "link.distcp"])
def test_a_record_in_a_file_outside_the_folder_is_refused_and_that_file_never_opened(
    saved, tmp_path, where, monkeypatch
):
    outside = tmp_path / "outside.distcp"
    shutil.copy(saved / "__0_0.distcp", outside)
    if where == "ABSOLUTE":
        where = str(outside)
    elif where == "sub/inner.distcp":
        (saved / "sub").mkdir()
        shutil.copy(outside, saved / "sub" / "inner.distcp")
    elif where == "link.distcp":
        (saved / "link.distcp").symlink_to(outside)

    def move(meta):
        for index, info in meta.storage_data.items():
            if index.fqn == "model.weight":
                meta.storage_data[index] = _StorageInfo(where, info.offset, info.length)

    _rewrite_metadata(saved, move)
    opened: list[str] = []
    real_open, real_os_open = builtins.open, os.open
    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: opened.append(str(p)) or real_open(p, *a, **k))
    monkeypatch.setattr(os, "open", lambda p, *a, **k: opened.append(str(p)) or real_os_open(p, *a, **k))
    with pytest.raises(CheckpointError) as e:
        _load(saved)
    msg = _one_line(e)
    assert "not a plain file name inside the checkpoint folder" in msg or "is not a regular file" in msg
    assert not [p for p in opened if Path(p).name in ("outside.distcp", "inner.distcp", "link.distcp")]
    assert not [p for p in opened if p.endswith(".distcp")]  # refused before any data file is read


def test_a_record_of_another_dtype_is_refused(saved):
    model, opt = _model_and_optimizer()
    tensors, _ = split_state(dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True)))
    tensors["model.weight"] = (tensors["model.weight"] * 10).to(torch.int8)
    dcp.save(tensors, checkpoint_id=str(saved))  # the metadata says int8, and so does the record
    write_manifest(saved)
    with pytest.raises(CheckpointError) as e:
        _load(saved)
    assert "model.weight is stored as torch.int8, this model holds torch.float32" in _one_line(e)

    def lie(meta):  # the metadata says float32, the record holds int8
        meta.state_dict_metadata["model.weight"].properties.dtype = torch.float32

    _rewrite_metadata(saved, lie)
    with pytest.raises(CheckpointError) as e:
        _load(saved)
    assert "model.weight holds torch.int8, its metadata says torch.float32" in _one_line(e)


def test_a_record_of_another_shape_is_refused(saved):
    def reshape(meta):
        meta.state_dict_metadata["model.weight"].size = torch.Size([3, 5])

    _rewrite_metadata(saved, reshape)
    with pytest.raises(CheckpointError) as e:
        _load(saved)
    assert "stored with shape [3, 5], this model's is [3, 4]" in _one_line(e)


def _nested_paths(levels: int) -> bytes:
    """``PurePosixPath(p, p)`` nested ``levels`` deep from ``PurePosixPath("aaaa")``: each level doubles the string
    and costs 8 bytes of pickle (the 29 levels below would build a 2 GiB string)."""
    out = b"\x80\x04\x8c\x07pathlib\x8c\x0dPurePosixPath\x93\x94h\x00\x8c\x04aaaa\x85R\x94"
    for i in range(levels):
        out += b"h\x00h" + bytes([i + 1]) + b"h" + bytes([i + 1]) + b"\x86R\x94"
    return out + b"."


def _in_bounded_process(code: str, headroom_mib: int = 512) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter whose address space is capped at its size after imports plus
    ``headroom_mib`` (so a payload that escapes its guard fails with MemoryError instead of taking the machine)."""
    prelude = textwrap.dedent(f"""
        import resource, time
        import lowprec.train.checkpoint_metadata, lowprec_lab.runner.job_ranks
        size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        limit = size + {headroom_mib} * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    """)
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_a_nested_path_bomb_in_metadata_is_refused_in_milliseconds_within_the_memory_bound(tmp_path):
    bomb = _nested_paths(29)
    assert len(bomb) < 320
    assert str(pickle.loads(_nested_paths(3))) == "/".join(["aaaa"] * 8)  # the payload is real
    (tmp_path / ".metadata").write_bytes(bomb)
    r = _in_bounded_process(f"""
        from lowprec.train.checkpoint_metadata import load_metadata
        t = time.perf_counter()
        try:
            load_metadata(open({str(tmp_path / ".metadata")!r}, "rb").read(), "sent/.metadata")
        except Exception as e:
            print(type(e).__name__, e)
        print("seconds", time.perf_counter() - t)
    """)
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stderr[-2000:]
    assert lines[0].startswith("CheckpointError checkpoint metadata 'sent/.metadata' is refused: it would build more")
    assert float(lines[1].split()[1]) < 0.5


def test_a_job_arguments_bomb_and_arguments_of_the_wrong_type_are_refused(tmp_path):
    from lowprec_lab.runner.job_ranks import ARGS, load_args

    job = tmp_path / "job"
    job.mkdir()
    bomb = _nested_paths(29).replace(b"\x0dPurePosixPath", b"\x09PosixPath")
    (job / ARGS).write_bytes(bomb)
    r = _in_bounded_process(f"""
        from pathlib import Path
        from lowprec_lab.runner.job_ranks import load_args
        t = time.perf_counter()
        try:
            load_args(Path({str(job)!r}))
        except Exception as e:
            print(type(e).__name__, e)
        print("seconds", time.perf_counter() - t)
    """)
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stderr[-2000:]
    assert lines[0].startswith(f"UnpicklingError {ARGS} in {str(job)!r} is refused: it would build more")
    assert float(lines[1].split()[1]) < 0.5
    for wrong, said in [
        (Path("/x"), "holds a PosixPath, not the job's arguments"),
        ({"plan": Path("/x"), "recipe": None, "seed": 1}, "'plan' is a PosixPath"),
        ({"plan": None, "recipe": None, "seed": 1, "shell": "x"}, "holds 'shell'"),
    ]:
        (job / ARGS).write_bytes(pickle.dumps(wrong))
        with pytest.raises(pickle.UnpicklingError) as e:
            load_args(job)
        assert said in _one_line(e)


def _deflated_trainer_state(folder: Path) -> None:
    """``trainer_state.pt`` with a 64 MiB tensor beside its items, its entries deflated (about 1000:1)."""
    state = torch.load(folder / "trainer_state.pt", weights_only=True)
    state["health"] = {"pad": torch.zeros(16 << 20)}
    buf = io.BytesIO()
    torch.save(state, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    (folder / "trainer_state.pt").write_bytes(out.getvalue())


def test_a_zip_bomb_trainer_state_is_refused_before_it_is_loaded(saved, monkeypatch):
    _deflated_trainer_state(saved)
    assert (saved / "trainer_state.pt").stat().st_size < 200_000
    assert torch.load(saved / "trainer_state.pt", weights_only=True)["health"]["pad"].numel() == 16 << 20  # live
    loads = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or real(*a, **k))
    with pytest.raises(CheckpointError) as e:
        read_trainer_state(saved)
    assert "holds compressed entries" in _one_line(e) and "which torch.save never writes" in str(e.value)
    assert not loads  # refused from the zip's directory, before torch.load


def test_a_trainer_state_over_its_cap_is_refused(saved, monkeypatch):
    import lowprec.train.checkpoint_reader as reader

    state = torch.load(saved / "trainer_state.pt", weights_only=True)
    state["health"] = {"pad": torch.zeros(1 << 20)}  # 4 MiB, stored
    torch.save(state, saved / "trainer_state.pt")
    monkeypatch.setattr(reader, "TRAINER_STATE_BASE", 1 << 20)
    with pytest.raises(CheckpointError) as e:
        read_trainer_state(saved)
    assert "is over its cap of" in _one_line(e)


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("step", "5", "'step' is of type str, not an int"),
        ("step", 10**30, "outside [0, 2**62]"),
        ("step", -1, "outside [0, 2**62]"),
        ("rng_cpu", torch.zeros(8), "'rng_cpu' is a torch.float32 tensor, not a 1-D uint8 tensor"),
        ("rng_cuda", [torch.zeros(2, 2, dtype=torch.uint8)], "'rng_cuda'"),
        ("scheduler", [1, 2], "'scheduler' is of type list, not a dict of names or None"),
        ("recipe_hash", 7, "'recipe_hash' is of type int, not a string or None"),
    ],
)
def test_a_trainer_state_of_the_wrong_types_is_refused(saved, key, value, said):
    state = torch.load(saved / "trainer_state.pt", weights_only=True)
    state[key] = value
    torch.save(state, saved / "trainer_state.pt")
    with pytest.raises(CheckpointError) as e:
        read_trainer_state(saved)
    assert said in _one_line(e)


def test_values_of_the_wrong_kind_or_names_are_refused(saved):
    doc = json.loads((saved / VALUES).read_text())
    doc["values"]["optim.param_groups.0.lr"] = "0.1"
    (saved / VALUES).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError) as e:
        _load(saved)
    assert "optim.param_groups.0.lr is a string in values.json, this run's state holds a number" in _one_line(e)
    doc["values"]["optim.param_groups.0.lr"] = 0.1
    doc["values"]["optim.param_groups.0.extra"] = 1
    (saved / VALUES).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="holds 'optim.param_groups.0.extra', which this run's state has not"):
        _load(saved)
    (saved / VALUES).write_text("[" * 100_000)
    with pytest.raises(CheckpointError, match="values.json is corrupt"):
        _load(saved)
