"""A token folder and a data source are data: a token folder's ``meta.json`` names shards inside that folder only, with
every field typed; ``lowprec data prepare`` reads documents in bounded pieces, skips files that are not text (counted,
one warning line) and its own ``out=`` inside ``source=``; bad input and a full disk end in one line and leave no
state behind. Real prepared folders, real files, real symlinks; the full disk is a write that raises ``ENOSPC``."""

import errno
import hashlib
import json
import os
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from lowprec.data import DataError, DataSpec, prepare
from lowprec.data import prepare_source as prepare_source_module
from lowprec.data.corpus import read_text
from lowprec.data.prepare_source import STATE, PrepareSpec, prepare_shards
from lowprec.data.shards import MAX_META_BYTES, open_split
from lowprec.data.sources import PIECE_BYTES, file_pieces, is_text
from lowprec_lab.cli import main

TWO_STEPS = ["model=debug", "train.steps=2", "train.batch_size=2", "train.seq_len=64", "train.val_every=0"]


def _text_folder(root: Path, n: int = 30) -> Path:
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"notes_{i:03d}.txt").write_text(f"entry {i}: the loss went down by {i % 7} percent.\n" * 30)
    return root


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A token folder written by ``lowprec data prepare`` (tests copy it before editing)."""
    root = tmp_path_factory.mktemp("prepared")
    src = _text_folder(root / "src")
    prepare_shards(PrepareSpec(source=str(src), out=str(root / "shards"), vocab_size=300, shard_tokens=2000))
    return root / "shards"


def _copy(prepared: Path, tmp_path: Path) -> tuple[Path, dict]:
    folder = tmp_path / "shards"
    shutil.copytree(prepared, folder)
    return folder, json.loads((folder / "meta.json").read_text())


def _edit(folder: Path, meta: dict) -> None:
    (folder / "meta.json").write_text(json.dumps(meta))


def _runs(tmp_path: Path) -> list:
    db = tmp_path / "runs" / "mlflow.db"
    if not db.exists():
        return []
    client = MlflowClient(f"sqlite:///{db}")
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def _secret(tmp_path: Path) -> tuple[Path, dict]:
    """A file outside the token folder and the ``meta.json`` entry that would read it as a valid shard."""
    secret = tmp_path / "secret.bin"
    np.arange(500, dtype=np.uint16).tofile(secret)
    return secret, {"tokens": 500, "sha256": hashlib.sha256(secret.read_bytes()).hexdigest()}


def test_an_unedited_folder_and_a_shard_linked_inside_it_load(prepared, tmp_path):
    folder, meta = _copy(prepared, tmp_path)
    assert prepare(DataSpec(source="tokens", path=str(folder))).n_train_tokens == meta["tokens"]["train"]
    first = meta["splits"]["train"][0]
    (folder / "alias.bin").symlink_to(first["file"])  # a link that stays in the folder is still the folder's file
    meta["splits"]["train"][0] = first | {"file": "alias.bin"}
    _edit(folder, meta)
    assert len(open_split(folder, "train")) == len(meta["splits"]["train"])


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink", "subfolder"])
def test_a_shard_named_outside_its_folder_is_refused(prepared, tmp_path, how):
    folder, meta = _copy(prepared, tmp_path)
    secret, entry = _secret(tmp_path)
    name = {"absolute": str(secret), "dotdot": "../secret.bin", "symlink": "leak.bin", "subfolder": "sub/s.bin"}[how]
    (folder / "leak.bin").symlink_to(secret)
    (folder / "sub").mkdir()
    shutil.copy(secret, folder / "sub" / "s.bin")
    meta["splits"]["train"][0] = {"file": name, **entry}
    _edit(folder, meta)
    needle = "resolves outside" if how == "symlink" else "is not a plain file name inside the folder"
    with pytest.raises(DataError, match=needle):
        prepare(DataSpec(source="tokens", path=str(folder)))


def test_a_shard_that_is_no_regular_file_is_refused_not_read(prepared, tmp_path):
    folder, meta = _copy(prepared, tmp_path)
    os.mkfifo(folder / "pipe.bin")  # reading it for its digest would block for ever
    meta["splits"]["train"][0] = {"file": "pipe.bin", "tokens": 0, "sha256": "0" * 64}
    _edit(folder, meta)
    with pytest.raises(DataError, match="shard 'pipe.bin' is not a regular file"):
        open_split(folder, "train")


BAD_FIELDS = [
    # (where in meta.json, value, what the one line says)
    ("vocab_size", "abc", "vocab_size 'abc' is not a positive integer"),
    ("vocab_size", 300.5, "vocab_size '300.5' is not a positive integer"),
    ("vocab_size", True, "vocab_size 'True' is not a positive integer"),
    ("vocab_size", 0, "vocab_size '0' is not a positive integer"),
    ("dtype", "float64", "dtype 'float64' is not one of"),
    ("dtype", 16, "'dtype' must be a string, not int"),
    ("fingerprint", 5, "'fingerprint' must be a string, not int"),
    ("corpus", ["x"], "'corpus' must be a string, not list"),
    ("tokens", {"train": "9"}, "'tokens' must map each split to an integer count"),
    ("shard.tokens", "500", "has tokens '500', not a non-negative integer"),
    ("shard.tokens", -1, "has tokens '-1', not a non-negative integer"),
    ("shard.tokens", 2.0, "has tokens '2.0', not a non-negative integer"),
    ("shard.sha256", "abc", "has no sha256 hex digest"),
    ("shard.file", 7, "shard file '7' is not a plain file name"),
    ("shard.file", "", "shard file '' is not a plain file name"),
    ("shard.file", "..", "shard file '..' is not a plain file name"),
    ("shard.file", "a\x00b", "is not a plain file name"),
    ("splits", {"train": "x"}, "'splits' must map each split to a list"),
]


@pytest.mark.parametrize("key, value, needle", BAD_FIELDS, ids=[f"{k}={v!r}" for k, v, _ in BAD_FIELDS])
def test_a_field_of_the_wrong_type_is_one_line(prepared, tmp_path, key, value, needle):
    folder, meta = _copy(prepared, tmp_path)
    if key.startswith("shard."):
        meta["splits"]["train"][0][key.removeprefix("shard.")] = value
    else:
        meta[key] = value
    _edit(folder, meta)
    with pytest.raises(DataError, match=f"meta.json'?: .*{needle}" if key != "splits" else needle) as e:
        prepare(DataSpec(source="tokens", path=str(folder)))
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize("bomb", ["5000 digits", "nested 100000 deep", "oversized"])
def test_a_meta_json_bomb_is_one_line(prepared, tmp_path, bomb):
    folder, _ = _copy(prepared, tmp_path)
    path = folder / "meta.json"
    if bomb == "oversized":
        with open(path, "ab") as f:
            f.truncate(MAX_META_BYTES + 1)  # sparse: refused by its size, never read
    else:
        path.write_text('{"vocab_size": ' + "9" * 5000 + "}" if bomb == "5000 digits" else "[" * 100_000)
    needle = "is not a file of at most 64 MiB" if bomb == "oversized" else "is corrupt"
    with pytest.raises(DataError, match=needle):
        prepare(DataSpec(source="tokens", path=str(folder)))


@pytest.mark.parametrize("edit", ["non-integer vocab_size", "shard outside"])
def test_training_on_a_bad_token_folder_is_one_line_and_no_run(prepared, tmp_path, run_dirs, capsys, edit):
    folder, meta = _copy(prepared, tmp_path)
    if edit == "shard outside":
        _, entry = _secret(tmp_path)
        meta["splits"]["train"][0] = {"file": str(tmp_path / "secret.bin"), **entry}
        needle = "is not a plain file name inside the folder"
    else:
        meta["vocab_size"] = "300"
        needle = "vocab_size '300' is not a positive integer"
    _edit(folder, meta)
    capsys.readouterr()
    assert main(["train", *run_dirs, *TWO_STEPS, "data.source=tokens", f"data.path={folder}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lowprec train: error: ") and needle in err, err
    assert _runs(tmp_path) == []


# --- data prepare: the source is data ------------------------------------------------------------------------------


def _mixed_source(root: Path) -> tuple[Path, Path]:
    """``root/src``: text files, a 3 MiB random binary, a Latin-1 file (half its bytes not UTF-8) and a text file
    with one stray byte in 600 (kept: as a few standard-library sources); ``root/clean``: the text files alone."""
    src = _text_folder(root / "src")
    (src / "stray.txt").write_bytes(b"caf\xe9 is where the step went down.\n" + b"the loss went down.\n" * 30)
    (src / "blob.bin").write_bytes(np.random.default_rng(0).bytes(3 << 20))
    (src / "latin1.txt").write_bytes("déjà été là ".encode("latin-1") * 200)
    clean = root / "clean"
    shutil.copytree(src, clean, ignore=shutil.ignore_patterns("blob.bin", "latin1.txt"))
    return src, clean


def _tokens(folder: Path) -> dict[str, np.ndarray]:
    return {s: np.concatenate(open_split(folder, s)) for s in ("train", "val")}


def test_binary_files_and_an_out_inside_the_source_are_left_out(tmp_path, capsys):
    src, clean = _mixed_source(tmp_path)
    ref = prepare_shards(PrepareSpec(source=str(clean), out=str(tmp_path / "ref"), vocab_size=300))
    out = src / "shards"  # inside the source: its shards must not become documents of a later run
    args = ["data", "prepare", f"source={src}", f"out={out}", "vocab_size=300", "progress=false"]
    capsys.readouterr()
    assert main(args) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "lowprec data prepare: warning: skipped 2 files that are not text (a NUL byte, or over 1% of bytes not "
        f"UTF-8) in text {src}"
    ]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["skipped_files"] == 2 and meta["documents"] == ref.meta["documents"] == 31
    ours, theirs = _tokens(out), _tokens(tmp_path / "ref")
    assert all(np.array_equal(ours[s], theirs[s]) for s in ours)  # exactly the text files' tokens
    assert main(args) == 0  # the same command again: its own shards are no new source files
    assert capsys.readouterr().out.startswith("already prepared: ")


def test_a_binary_file_is_skipped_in_bounded_memory(tmp_path):
    """A 3 MiB random file decoded as text took 78 MiB of Python objects (and 1.3 GB of RSS in the BPE trainer);
    skipped after its first piece, the whole preparation stays under 4 MiB."""
    src, _ = _mixed_source(tmp_path)
    tracemalloc.start()
    try:
        prepare_shards(PrepareSpec(source=str(src), out=str(tmp_path / "o"), vocab_size=300))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB"


def test_is_text():
    assert is_text(b"plain\n" * 100) and is_text("déjà".encode() * 100)
    assert is_text(b"x" * 990 + b"\xff" * 9)  # under 1% of bytes not UTF-8
    assert not is_text(b"x" * 980 + b"\xff" * 20)
    assert not is_text(b"text with a NUL\x00 byte")


@pytest.mark.parametrize("newlines", [True, False])
def test_a_large_document_is_read_in_bounded_pieces(tmp_path, newlines):
    path = tmp_path / "big.txt"
    line = "é the loss went down by 3 percent " * 3  # a 2-byte character on every piece boundary sooner or later
    path.write_text((line + "\n" if newlines else line) * 40_000)
    pieces = list(file_pieces(path))
    assert len(pieces) >= 4 and max(map(len, pieces)) <= 2 * PIECE_BYTES
    assert "".join(pieces) == read_text(path)
    if newlines:
        assert all(p.endswith("\n") for p in pieces)
    small = tmp_path / "small.txt"
    small.write_bytes(b"caf\xe9: " + b"the loss went down.\n" * 50)  # one byte in 1,000 not UTF-8: text
    assert list(file_pieces(small)) == [read_text(small)]  # a document under one piece: read whole, as data=text


def test_a_document_in_pieces_is_one_document(tmp_path):
    """A 1.4 MB file tokenized in pieces gives its words in order and one end-of-document token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(10)} | {"[UNK]": 10, "<|endoftext|>": 11}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tok.json"))
    ids = np.random.default_rng(0).integers(0, 10, 450_000)
    text = "\n".join(" ".join(f"w{i}" for i in ids[j : j + 100]) for j in range(0, len(ids), 100))
    (tmp_path / "big.txt").write_text(text)
    spec = PrepareSpec(source=str(tmp_path / "big.txt"), out=str(tmp_path / "o"), tokenizer=str(tmp_path / "tok.json"))
    prepare_shards(spec)
    train = _tokens(tmp_path / "o")["train"]
    assert np.array_equal(train, np.append(ids, 11))


# --- data prepare: one line, nothing left behind ----------------------------------------------------------------


def _prepare_fails(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(["data", "prepare", *argv, "progress=false"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lowprec data prepare: error: "), err
    return err


def test_out_that_is_a_file_is_one_line_and_the_file_is_kept(tmp_path, capsys):
    src = _text_folder(tmp_path / "src")
    (tmp_path / "notes.md").write_text("mine")
    err = _prepare_fails([f"source={src}", f"out={tmp_path / 'notes.md'}"], capsys)
    assert f"out='{tmp_path / 'notes.md'}' is a file, not a folder" in err
    assert (tmp_path / "notes.md").read_text() == "mine"
    err = _prepare_fails([f"source={src}", f"out={tmp_path / 'notes.md' / 'shards'}"], capsys)
    assert "cannot be created: Not a directory" in err


def test_parquet_files_of_two_schemas_are_one_line_and_leave_nothing(tmp_path, capsys):
    src = tmp_path / "tables"
    src.mkdir()
    pq.write_table(pa.table({"text": [f"row {i} of words" for i in range(100)]}), src / "a.parquet")
    pq.write_table(pa.table({"text": list(range(100)), "id": list(range(100))}), src / "b.parquet")
    err = _prepare_fails([f"source={src}", f"out={tmp_path / 'o'}", "vocab_size=300"], capsys)
    assert "mixes parquet schemas: 'a.parquet' has (text: string) and 'b.parquet' has (text: int64" in err
    assert not (tmp_path / "o").exists()


def test_a_row_that_cannot_be_read_is_one_line_and_leaves_nothing(tmp_path, capsys):
    src = tmp_path / "rows"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"row {i} " * 20}) + "\n" for i in range(100)))
    (src / "b.jsonl").write_text('{"text": "fine"}\n{broken\n')
    err = _prepare_fails([f"source={src}", f"out={tmp_path / 'o'}", "vocab_size=300"], capsys)
    assert f"json {src}: the rows after row 100 could not be read: JSON parse error" in err
    assert not (tmp_path / "o").exists()


def _full_disk_on_write(monkeypatch, n: int) -> list:
    """Shard writes from the ``n``-th on raise ``ENOSPC``, as a full disk does."""
    real, calls = prepare_source_module._write_tokens, []

    def write(tokens, path):
        calls.append(path.name)
        if len(calls) >= n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(tokens, path)

    monkeypatch.setattr(prepare_source_module, "_write_tokens", write)
    return calls


def test_a_full_disk_before_the_first_shard_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    src = _text_folder(tmp_path / "src")
    _full_disk_on_write(monkeypatch, 1)
    err = _prepare_fails([f"source={src}", f"out={tmp_path / 'o'}", "vocab_size=300"], capsys)
    assert f"No space left on device (ENOSPC) writing token shards to '{tmp_path / 'o'}': disk '" in err
    assert not (tmp_path / "o").exists()


def test_a_full_disk_after_a_shard_keeps_the_state_and_the_same_command_continues(tmp_path, capsys, monkeypatch):
    src = _text_folder(tmp_path / "src", n=60)
    whole = prepare_shards(PrepareSpec(source=str(src), out=str(tmp_path / "whole"), vocab_size=300, shard_tokens=800))
    assert len(whole.meta["splits"]["train"]) >= 4
    args = [f"source={src}", f"out={tmp_path / 'o'}", "vocab_size=300", "shard_tokens=800"]
    with monkeypatch.context() as m:
        _full_disk_on_write(m, 3)
        assert "No space left on device (ENOSPC)" in _prepare_fails(args, capsys)
    assert (tmp_path / "o" / STATE).exists() and not (tmp_path / "o" / "meta.json").exists()
    assert main(["data", "prepare", *args, "progress=false"]) == 0
    assert json.loads((tmp_path / "o" / "meta.json").read_text())["splits"] == whole.meta["splits"]


def test_a_tokenizer_call_takes_at_most_batch_chars():
    from lowprec.data.prepare_source import BATCH_CHARS, _batched
    from lowprec.data.sources import Document

    docs = [Document("x" * (PIECE_BYTES if i % 3 else 10), ("train",)) for i in range(40)]
    batches = list(_batched(docs, 256))
    assert sum(map(len, batches)) == 40 and len(batches) > 1
    assert all(sum(len(d.text) for d in b) <= BATCH_CHARS for b in batches)
    assert [len(b) for b in _batched(docs[:5], 2)] == [2, 2, 1]  # the count still bounds a batch of small ones
