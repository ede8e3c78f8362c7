"""``lowprec data prepare``: any text source -> token shards (``data.source=tokens``), resumably.

The source (``lowprec.data.sources``: a text folder, parquet/jsonl/arrow files, a hub dataset) is streamed once
through the tokenizer (the project's byte-level BPE trained on the start of the source, as for the built-in
corpus, or any Hugging Face tokenizer); each document ends with the end-of-document token. Tokens go to shards of
about ``shard_tokens`` train tokens (a shard ends on a document boundary), each train shard written with the val
tokens gathered meanwhile, uint16 or uint32 by the vocabulary (``lowprec.data.shards.token_dtype``).

Resuming: after every shard, ``.prepare-state.json`` records the shards written and how many documents they
hold. A re-run with the same settings skips those documents and continues; a shard written but not yet recorded
(the process died in between) is written again. ``meta.json`` appears last, when every shard is written: a folder
with it is complete, and a re-run of a complete folder does nothing. A preparation that fails (a bad row, a full
disk) before its first shard is recorded leaves nothing behind; one that fails later keeps its state, and the same
command continues it.

The source is data: a document is read and tokenized in pieces of at most ``PIECE_BYTES`` (a 20 MB file never
becomes one string); a file that is not text (a NUL byte, or over 1% of bytes that are not UTF-8, in its first
piece) is skipped, counted, and named in one warning line; an ``out=`` inside ``source=`` is no part of the source.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from lowprec.data.errors import DataError
from lowprec.data.shards import META, read_meta, token_dtype
from lowprec.data.sources import PIECE_BYTES, Document, Source, open_source
from lowprec.data.tokenizer import (
    Tokenizer,
    eot_id,
    load_pretrained_tokenizer,
    load_tokenizer,
    train_bpe,
    vocab_size_of,
)
from lowprec.storage import disk_error

STATE = ".prepare-state.json"
TOKENIZER = "tokenizer.json"
SPLITS = ("train", "val")
#: The most text (characters) in one tokenizer call: with ``PIECE_BYTES`` pieces, what bounds the memory of a
#: batch of large documents whatever ``encode_batch`` says.
BATCH_CHARS = 4 * PIECE_BYTES


@dataclass(frozen=True)
class PrepareSpec:
    """What ``prepare_shards`` reads, how it tokenizes and where it writes.

    ``source``: a local path or a Hugging Face dataset name (``config``, ``split``; ``lowprec.data.sources``);
    ``text_column``: the column of a table source; ``pattern``: the files of a text folder. ``tokenizer``: ``bpe``
    (lowprec's byte-level BPE with ``vocab_size`` ids, trained on the first ``bpe_train_bytes`` bytes of train
    documents) or a Hugging Face tokenizer (a ``tokenizer.json``, a folder with one, or a hub name);
    ``eot_token``: the end-of-document token (found among the usual names when null). ``val_fraction``: the share
    of documents in val; ``shard_tokens``: train tokens per shard; ``max_tokens``: stop after this many train
    tokens (0: the whole source). ``encode_batch``: documents per tokenizer call (speed only; not in the
    fingerprint).
    """

    source: str
    out: str
    tokenizer: str = "bpe"
    vocab_size: int = 8192
    bpe_train_bytes: int = 500_000_000
    text_column: str = "text"
    config: str | None = None
    split: str = "train"
    pattern: str = "**/*"
    eot_token: str | None = None
    val_fraction: float = 0.05
    shard_tokens: int = 1 << 26
    max_tokens: int = 0
    encode_batch: int = 256

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise DataError(f"val_fraction={self.val_fraction} must be in (0, 1)")
        for name in ("shard_tokens", "encode_batch", "bpe_train_bytes"):
            if getattr(self, name) < 1:
                raise DataError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_tokens < 0:
            raise DataError(f"max_tokens={self.max_tokens} must be >= 0 (0: the whole source)")
        if self.tokenizer == "bpe" and self.vocab_size < 258:  # 256 bytes, the end-of-document token, one merge
            raise DataError(f"vocab_size={self.vocab_size} must be >= 258 for tokenizer=bpe")

    def settings(self) -> dict:
        """Every field that decides the tokens and their shards (all but ``out`` and ``encode_batch``)."""
        d = dataclasses.asdict(self)
        for k in ("out", "encode_batch"):
            d.pop(k)
        if self.tokenizer != "bpe":
            d.pop("vocab_size"), d.pop("bpe_train_bytes")
        return d


@dataclass(frozen=True)
class Prepared:
    """The result: ``out`` (the shard folder), its ``meta`` (``meta.json``), ``skipped`` (it was complete before
    this call) and ``resumed_docs`` (documents a resumed call found done)."""

    out: Path
    meta: dict
    skipped: bool = False
    resumed_docs: int = 0


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def _bar(enabled: bool, desc: str, total: int | None, unit: str, initial: int = 0) -> tqdm:
    return tqdm(
        total=total,
        initial=initial,
        desc=f"lowprec data: {desc}",
        unit=unit,
        unit_scale=True,
        file=sys.stderr,
        disable=not enabled,
        dynamic_ncols=True,
        mininterval=0.5 if sys.stderr.isatty() else 15.0,
    )


def _train_source_bpe(source: Source, spec: PrepareSpec, progress: bool) -> Tokenizer:
    def feed() -> Iterator[str]:
        # A table or hub source's size is unknown: a count and a rate, not a bar whose total is the training cap.
        total = min(spec.bpe_train_bytes, source.n_bytes) if source.n_bytes else None
        with _bar(progress, f"training BPE vocab {spec.vocab_size} on train documents", total, "B") as b:
            seen = 0
            for doc in source.documents():
                if "train" in doc.splits:
                    yield doc.text
                    n = len(doc.text.encode())
                    seen += n
                    b.update(n)
                    if seen >= spec.bpe_train_bytes:
                        return

    return train_bpe(feed(), spec.vocab_size)


def _tokenizer(
    spec: PrepareSpec, source: Source, out: Path, state: dict, progress: bool, pretrained: Tokenizer | None
) -> Tokenizer:
    """The tokenizer of this preparation (``pretrained``, or the BPE trained here), saved as ``out/tokenizer.json``;
    a resumed BPE preparation loads the one it trained (training again would cost minutes), a pretrained one must be
    the same as before."""
    saved = out / TOKENIZER
    if pretrained is not None:
        tok = pretrained
    elif state.get("tokenizer_sha256") and saved.exists():
        return load_tokenizer(saved)
    else:
        tok = _train_source_bpe(source, spec, progress)
    sha = _sha256(tok.to_str())
    if state.get("tokenizer_sha256") not in (None, sha):
        raise DataError(f"tokenizer={spec.tokenizer!r} changed since {str(out)!r} was begun; delete it to start over")
    tok.save(str(saved))
    state["tokenizer_sha256"] = sha
    _write_json(out / STATE, state)
    return tok


def _check_out(out: Path) -> None:
    """Raise ``DataError`` when ``out`` exists and is no folder (a file, or a link to one)."""
    if out.exists() and not out.is_dir():
        raise DataError(f"out={str(out)!r} is a file, not a folder; choose a new or empty folder")


def _begin(spec: PrepareSpec, source: Source, out: Path) -> dict | None:
    """The state to continue from (a fresh one for a new folder); None when ``out`` is already complete.
    Raises ``DataError`` when ``out`` holds something else or cannot be created."""
    key = {"settings": spec.settings(), "source_fingerprint": source.fingerprint}
    if (out / META).exists():
        meta = read_meta(out)
        if {k: meta.get(k) for k in key} == key:
            return None
        raise DataError(
            f"out={str(out)!r} already holds token shards of another source or settings; choose another out= or "
            "delete it"
        )
    state = json.loads((out / STATE).read_text()) if (out / STATE).exists() else None
    if state is not None and {k: state.get(k) for k in key} == key:
        return state
    if state is not None and state["docs"] == 0:  # begun with other settings (a typo), no shard recorded: anew
        for p in [out / STATE, out / TOKENIZER, *out.glob("*.bin*")]:
            p.unlink(missing_ok=True)
    elif state is not None:
        raise DataError(
            f"out={str(out)!r} holds an unfinished preparation of another source or settings; rerun that command "
            "to finish it, or delete the folder"
        )
    if out.exists() and any(out.iterdir()):
        raise DataError(f"out={str(out)!r} exists and is not a lowprec shard folder; choose an empty or new folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError, PermissionError) as e:  # a file on the way, a folder not ours
        raise DataError(f"out={str(out)!r} cannot be created: {e.strerror}") from e
    state = {**key, "docs": 0, "complete": False, "shards": {s: [] for s in SPLITS}, "tokens": dict.fromkeys(SPLITS, 0)}
    _write_json(out / STATE, state)
    return state


def _batched(docs: Iterable[Document], n: int, max_chars: int = BATCH_CHARS) -> Iterator[list[Document]]:
    """``docs`` in lists of at most ``n`` documents and, past the first, ``max_chars`` characters."""
    batch, chars = [], 0
    for d in docs:
        if batch and chars + len(d.text) > max_chars:
            yield batch
            batch, chars = [], 0
        batch.append(d)
        chars += len(d.text)
        if len(batch) >= n:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _write_tokens(tokens: np.ndarray, path: Path) -> None:
    """Write ``tokens`` raw to ``path`` (one function, so a test can fail the write as a full disk does)."""
    tokens.tofile(path)


class _ShardWriter:
    """Buffers each split's tokens and writes them as the next shards, recording each commit in the state."""

    def __init__(self, out: Path, state: dict, dtype):
        self.out, self.state, self.dtype = out, state, dtype
        self.buf: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
        self.n = dict.fromkeys(SPLITS, 0)
        self.skipped = state.get("skipped_files", 0)
        known = {e["file"] for es in state["shards"].values() for e in es}
        for p in out.glob("*.bin*"):  # written after the last commit by a process that died: written again
            if p.name not in known:
                p.unlink()

    def add(self, ids: np.ndarray, splits: tuple[str, ...]) -> None:
        for s in splits:
            self.buf[s].append(ids)
            self.n[s] += len(ids)

    def commit(self, docs: int, complete: bool) -> None:
        """Write the buffered tokens as the next shard of each split and record them with ``docs`` (documents
        consumed, the resume point), ``complete`` and ``self.skipped`` (files that were not text, so far)."""
        for split in SPLITS:
            if not self.n[split]:
                continue
            tokens = np.concatenate(self.buf[split])
            entries = self.state["shards"][split]
            name = f"{split}_{len(entries):05d}.bin"
            tmp = self.out / f"{name}.tmp"
            _write_tokens(tokens, tmp)
            os.replace(tmp, self.out / name)
            entries.append({"file": name, "tokens": len(tokens), "sha256": hashlib.sha256(tokens.data).hexdigest()})
            self.state["tokens"][split] += len(tokens)
            self.buf[split], self.n[split] = [], 0
        self.state["docs"], self.state["complete"], self.state["skipped_files"] = docs, complete, self.skipped
        _write_json(self.out / STATE, self.state)


def _clean_unstarted(out: Path, created: bool) -> None:
    """After a failed preparation: when no shard was recorded (nothing to continue), remove what it wrote (state,
    tokenizer, shards being written) and ``out`` itself when this call ``created`` it; otherwise keep it all, for
    the same command to continue."""
    if not out.is_dir():  # never created (a file on the way to it)
        return
    try:
        state = json.loads((out / STATE).read_text()) if (out / STATE).exists() else None
    except ValueError:  # cut short by the failure itself (a full disk): nothing recorded in it counts
        state = None
    if state is not None and state.get("docs"):
        return
    for p in [out / STATE, out / f"{STATE}.tmp", out / TOKENIZER, *out.glob("*.bin"), *out.glob("*.bin.tmp")]:
        p.unlink(missing_ok=True)
    if created and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


def _warn_skipped(n: int, source: Source) -> None:
    """One line on stderr counting the files of ``source`` skipped as not text; nothing when ``n`` is 0."""
    if n:
        files = "1 file that is" if n == 1 else f"{n:,} files that are"
        print(
            f"lowprec data prepare: warning: skipped {files} not text (a NUL byte, or over 1% of bytes not UTF-8) "
            f"in {source.name}",
            file=sys.stderr,
        )


def prepare_shards(spec: PrepareSpec, progress: bool = False) -> Prepared:
    """Tokenize ``spec.source`` into token shards and ``meta.json`` under ``spec.out`` (see the module docstring).

    ``meta.json`` records the usual shard index (``vocab_size``, ``dtype``, ``splits``) and: ``fingerprint``
    (sha256 of the source's fingerprint, the tokenizer's JSON and the settings: what a run records as its corpus),
    ``source_fingerprint``, ``corpus`` (the source's name), ``tokenizer``, ``tokenizer_sha256``, ``eot_id``,
    ``documents``, ``skipped_files`` (files that were not text), ``tokens`` per split and ``settings``. With
    ``progress``, tqdm bars on stderr (bytes while training the BPE, tokens while tokenizing). Files skipped as not
    text are counted in one warning line on stderr.

    Raises ``DataError`` (one line) for a missing source or tokenizer, a tokenizer with no end-of-document token,
    a text column that is not there, a row that cannot be read, parquet files of two schemas, an ``out`` that is a
    file or a folder holding something else, or a split left empty; ``DiskError`` (one line) for a full disk or
    quota or a read-only one. A failure before the first shard is recorded leaves nothing in ``out``.
    """
    out = Path(spec.out).expanduser()
    _check_out(out)
    source = open_source(
        spec.source, spec.text_column, spec.pattern, spec.val_fraction, spec.config, spec.split, exclude=(out,)
    )
    pretrained = None if spec.tokenizer == "bpe" else load_pretrained_tokenizer(spec.tokenizer)
    if pretrained is not None:
        eot_id(pretrained, spec.eot_token)  # a tokenizer that cannot separate documents: refused before any write
    created, state = not out.exists(), None
    try:
        state = _begin(spec, source, out)
        if state is None:
            return Prepared(out, read_meta(out), skipped=True)
        return _prepare(spec, out, source, state, pretrained, progress)
    except Exception as e:  # not KeyboardInterrupt: Ctrl-C keeps everything for the same command to continue
        if created or state is not None:  # a folder of this preparation; another one's files are never touched
            _clean_unstarted(out, created)
        err = disk_error(f"writing token shards to {str(out)!r}", out, e)
        if err is not None:
            raise err from e
        raise


def _prepare(
    spec: PrepareSpec, out: Path, source: Source, state: dict, pretrained: Tokenizer | None, progress: bool
) -> Prepared:
    resumed = state["docs"]
    tok = _tokenizer(spec, source, out, state, progress, pretrained)
    eot = eot_id(tok, spec.eot_token)
    vocab = vocab_size_of(tok)
    dtype = token_dtype(vocab)
    writer = _ShardWriter(out, state, dtype)
    docs = state["docs"]
    if not state["complete"]:
        total = spec.max_tokens or None
        desc = f"tokenizing -> {np.dtype(dtype).name} shards (train tokens)"
        with _bar(progress, desc, total, "tok", initial=state["tokens"]["train"]) as bar:
            done = False
            for batch in _batched(source.documents(skip=docs), spec.encode_batch):
                encoded = tok.encode_batch([d.text for d in batch], add_special_tokens=False)
                for doc, enc in zip(batch, encoded):
                    # A document's pieces are tokenized apart and joined; only its last piece gets the separator.
                    ids = np.array([*enc.ids, eot] if doc.last else enc.ids, dtype=dtype)
                    writer.add(ids, doc.splits)
                    if "train" in doc.splits:
                        bar.update(len(ids))
                    if not doc.last:  # a shard ends on a document boundary: the resume point counts documents
                        continue
                    docs += 1
                    writer.skipped += doc.skipped
                    train = state["tokens"]["train"] + writer.n["train"]
                    done = bool(spec.max_tokens) and train >= spec.max_tokens
                    if done or writer.n["train"] >= spec.shard_tokens:
                        writer.commit(docs, complete=done)
                    if done:
                        break
                if done:
                    break
            writer.commit(docs, complete=True)
    skipped = writer.skipped
    _warn_skipped(skipped, source)
    empty = [s for s in SPLITS if not state["tokens"][s]]
    if empty:
        raise DataError(
            f"{source.name}: {docs} documents left the {empty[0]} split empty (val_fraction={spec.val_fraction}); "
            f"give more documents or another val_fraction, and delete {str(out)!r}"
        )
    settings = spec.settings()
    # Not the source's spelling (a path moved, the same files): its fingerprint says what was read.
    what = {"source": source.fingerprint, "tokenizer": state["tokenizer_sha256"], "settings": settings | {"source": ""}}
    fingerprint = _sha256(json.dumps(what, sort_keys=True))
    meta = {
        "vocab_size": vocab,
        "dtype": np.dtype(dtype).name,
        "splits": state["shards"],
        "fingerprint": fingerprint,
        "source_fingerprint": source.fingerprint,
        "corpus": source.name,
        "source": spec.source,
        "tokenizer": spec.tokenizer,
        "tokenizer_sha256": state["tokenizer_sha256"],
        "eot_id": eot,
        "documents": docs - skipped,
        "skipped_files": skipped,
        "tokens": state["tokens"],
        "settings": settings,
    }
    _write_json(out / META, meta)
    (out / STATE).unlink()
    return Prepared(out, read_meta(out), resumed_docs=resumed)
