"""Where ``lowprec data prepare`` reads documents: a folder (or file) of text, local parquet/jsonl/arrow files, a
folder saved with ``datasets.Dataset.save_to_disk``, or a Hugging Face dataset name, streamed through ``datasets``.

Every source yields its documents in one fixed order, each with an id that decides its split (``is_val``: the
relative path of a text file, the row index of a dataset), and has a fingerprint of what it reads.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import itertools
import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lowprec.data.corpus import build_corpus, is_val
from lowprec.data.errors import DataError

#: File endings read through ``datasets`` (its builder name). A folder holding any of them is a table source whose
#: other files (a dataset repository's README.md, .gitattributes) are left out; a folder without is text files. A
#: ``.json`` file is a table only when named itself (a folder of code has its package.json).
TABLE_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".jsonl.gz": "json", ".arrow": "arrow"}


#: A document is read and tokenized in pieces of at most this many bytes (a text file) or characters (a table
#: row), cut after the piece's last newline when it has one: a 20 MB file is never one 20 MB string. A document
#: of at most this size is one piece, read as a whole (so ``tokenizer=bpe`` on a text folder gives the tokens of
#: ``data=text``: the standard library's largest source is 0.76 MB).
PIECE_BYTES = 1 << 20
#: A file is not text, and is skipped, when its first piece holds a NUL byte or more than this share of bytes
#: that are not UTF-8 (a few standard-library sources hold a stray Latin-1 byte; an image or archive is ~50%).
MAX_INVALID_SHARE = 0.01
_ESCAPED = re.compile("[\udc80-\udcff]")  # the bytes ``surrogateescape`` could not decode


@dataclass(frozen=True)
class Document:
    """One piece of a document: its ``text`` and the splits it goes to (``("train",)``, ``("val",)``, or both for a
    single-file source, whose val shares it as for ``data=text``; none for a file ``skipped`` as not text, or an
    empty row). ``last``: the document ends with this piece (it gets the end-of-document token, and a resumed
    preparation counts documents by their last pieces)."""

    text: str
    splits: tuple[str, ...]
    last: bool = True
    skipped: bool = False


def invalid_share(head: bytes) -> float:
    """The share of ``head``'s bytes that are not UTF-8 (a sequence cut at the end of ``head`` counts as
    invalid: at most 3 bytes)."""
    if not head:
        return 0.0
    try:
        head.decode("utf-8")
        return 0.0
    except UnicodeDecodeError:
        return len(_ESCAPED.findall(head.decode("utf-8", errors="surrogateescape"))) / len(head)


def is_text(head: bytes) -> bool:
    """Whether the first bytes of a file (up to ``PIECE_BYTES``) look like text: no NUL byte and at most
    ``MAX_INVALID_SHARE`` of bytes that are not UTF-8."""
    return b"\0" not in head and invalid_share(head) <= MAX_INVALID_SHARE


def _cut(text: str, final: bool) -> tuple[str, str]:
    """``text`` split after its last newline (the rest is carried to the next piece), unless ``final`` or it has
    none."""
    if final:
        return text, ""
    i = text.rfind("\n") + 1
    return (text[:i], text[i:]) if i else (text, "")


def text_pieces(text: str, size: int = PIECE_BYTES) -> Iterator[str]:
    """``text`` in pieces of at most ``size`` characters, each cut after its last newline when it has one; one
    piece when ``text`` is no longer than ``size``."""
    start = 0
    while len(text) - start > size:
        piece, _ = _cut(text[start : start + size], final=False)
        yield piece
        start += len(piece)
    yield text[start:]


def file_pieces(path: Path, size: int = PIECE_BYTES) -> Iterator[str] | None:
    """The text of ``path`` in pieces of about ``size`` bytes (UTF-8; undecodable bytes become U+FFFD, as
    ``lowprec.data.corpus.read_text``), cut after a newline where the piece has one; None when the file is not
    text (``is_text`` of its first ``size`` bytes). At most two pieces' bytes are held at once."""
    f = open(path, "rb")
    try:
        head = f.read(size)
    except BaseException:
        f.close()
        raise
    if not is_text(head):
        f.close()
        return None

    def pieces() -> Iterator[str]:
        with f:
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            raw, carry = head, ""
            while True:
                nxt = f.read(size) if raw else b""
                final = not nxt
                piece, carry = _cut(carry + decoder.decode(raw, final=final), final)
                if piece or final:
                    yield piece
                if final:
                    return
                raw = nxt

    return pieces()


class Source(ABC):
    """A document stream: ``name`` (what the run's ``corpus`` tag shows), ``fingerprint`` (sha256 hex of what is
    read: names and sizes of local files, the dataset's name, revision, split and column for the hub) and
    ``documents(skip)``, the documents after the first ``skip`` (a resumed preparation skips what it has);
    ``n_bytes`` the size of the files when known (for progress only)."""

    name: str
    fingerprint: str
    n_bytes: int | None = None

    @abstractmethod
    def documents(self, skip: int = 0) -> Iterator[Document]:
        """The documents after the first ``skip``, in the source's fixed order."""


class TextSource(Source):
    """Text files under a folder matching ``pattern`` (or one file), in ``data=text``'s order and split, with its
    fingerprint (``lowprec.data.corpus.build_corpus``), leaving out the folders in ``exclude``.

    Each file is one document read in pieces (``file_pieces``); a file that is not text (``is_text``) is one
    ``skipped`` document with no split, so that it is counted and a resumed preparation still skips files by
    their index."""

    def __init__(self, path: str, pattern: str, val_fraction: float, exclude: tuple[str | Path, ...] = ()):
        self.corpus = build_corpus("text", path, pattern, val_fraction, exclude)
        self.name = f"text {self.corpus.root}"
        self.fingerprint = self.corpus.fingerprint
        self.n_bytes = self.corpus.n_bytes
        single = self.corpus.train_files == self.corpus.val_files
        val = set(self.corpus.val_files)
        files = sorted(set(self.corpus.train_files) | val, key=lambda p: p.relative_to(self.corpus.root).as_posix())
        self._docs = [(p, ("train", "val") if single else ("val",) if p in val else ("train",)) for p in files]

    def documents(self, skip: int = 0) -> Iterator[Document]:
        for p, splits in self._docs[skip:]:
            pieces = file_pieces(p)
            if pieces is None:
                yield Document("", (), skipped=True)
                continue
            prev = None
            for piece in pieces:
                if prev is not None:
                    yield Document(prev, splits, last=False)
                prev = piece
            yield Document(prev or "", splits)


class _ReadErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.name.startswith("datasets.packaged_modules"))


@contextlib.contextmanager
def _quiet_read_errors() -> Iterator[None]:
    """``datasets`` logs a file it cannot parse (on its own stderr handler) before raising; the raise becomes the
    one line the user sees, so that log record is dropped meanwhile (its other records are kept)."""
    handlers, quiet = logging.getLogger("datasets").handlers, _ReadErrors()
    for h in handlers:
        h.addFilter(quiet)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(quiet)


class DatasetSource(Source):
    """Rows of a ``datasets`` dataset, streamed, taking the ``text_column``; row ``i`` is in val when
    ``is_val(str(i))``. ``dataset`` is an ``IterableDataset`` in a fixed order."""

    def __init__(self, name: str, dataset, text_column: str, val_fraction: float, fingerprint: str):
        self.name, self.fingerprint = name, fingerprint
        self.dataset, self.text_column, self.val_fraction = dataset, text_column, val_fraction

    def documents(self, skip: int = 0) -> Iterator[Document]:
        rows = itertools.islice(iter(self.dataset), skip, None)
        for i in itertools.count(skip):
            try:
                with _quiet_read_errors():
                    row = next(rows)
            except StopIteration:
                return
            except Exception as e:  # datasets and pyarrow raise their own errors for a row they cannot read or cast
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise DataError(f"{self.name}: the rows after row {i} could not be read: {first}") from e
            if self.text_column not in row:
                raise DataError(
                    f"{self.name} has no column {self.text_column!r} (columns: {', '.join(row)}); "
                    "name it with text_column=..."
                )
            text = row[self.text_column]
            if not text:  # an empty or null row adds no tokens, not even a separator; counted, so a resume skips it
                yield Document("", ())
                continue
            splits = ("val",) if is_val(str(i), self.val_fraction) else ("train",)
            *head, tail = text_pieces(str(text))
            for piece in head:
                yield Document(piece, splits, last=False)
            yield Document(tail, splits)


def _format_of(path: Path, named: bool = False) -> str | None:
    name = path.name.lower()
    if named and name.endswith(".json"):
        return "json"
    return next((f for ext, f in TABLE_FORMATS.items() if name.endswith(ext)), None)


def _files_fingerprint(files: list[Path], root: Path, what: str) -> str:
    # As corpus.build_corpus: names and sizes (reading every byte of a 100 GB corpus twice would cost minutes),
    # after what is read from them (the format, the column).
    h = hashlib.sha256(f"{what}\n".encode())
    for p in files:
        h.update(f"{p.relative_to(root).as_posix()}\t{p.stat().st_size}\n".encode())
    return h.hexdigest()


def _check_parquet_schemas(path: Path, tables: list[Path]) -> None:
    """Raise ``DataError`` when the parquet ``tables`` do not share one schema (read from each file's footer, before
    a row is read or a file written: ``datasets`` would fail on the first row of the second schema)."""
    import pyarrow.parquet as pq

    first = None
    for p in tables:
        try:
            schema = pq.read_schema(p).remove_metadata()
        except Exception as e:  # pyarrow's ArrowInvalid/OSError for a file that is no parquet
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise DataError(f"source={str(path)!r}: {str(p)!r} is not a readable parquet file: {first_line}") from e
        if first is None:
            first = (p, schema)
        elif not schema.equals(first[1]):
            a, b = (", ".join(f"{f.name}: {f.type}" for f in s)[:200] for s in (first[1], schema))
            raise DataError(
                f"source={str(path)!r} mixes parquet schemas: {first[0].name!r} has ({a}) and {p.name!r} has ({b}); "
                "point it at files of one schema"
            )


def _load_local_tables(
    path: Path, text_column: str, val_fraction: float, exclude: tuple[str | Path, ...] = ()
) -> DatasetSource | None:
    """A ``save_to_disk`` folder, or the parquet/jsonl/arrow files at ``path`` (less those under ``exclude``); None
    when ``path`` holds none (``datasets``, slow to import, is imported only then). Parquet files of two schemas are
    refused here, before anything is written."""
    if path.is_dir() and (path / "dataset_info.json").exists() and (path / "state.json").exists():
        import datasets

        files = sorted(p for p in path.rglob("*") if p.is_file())
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        fp = _files_fingerprint(files, path, f"save_to_disk\t{text_column}")
        return DatasetSource(f"dataset {path}", ds.to_iterable_dataset(), text_column, val_fraction, fp)
    root = path if path.is_dir() else path.parent
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    tables = [p for p in files if _format_of(p, named=p == path) and not p.name.startswith(".")]
    ex = tuple(os.path.realpath(Path(x).expanduser()) for x in exclude)
    tables = [p for p in tables if not any(os.path.realpath(p).startswith(x.rstrip(os.sep) + os.sep) for x in ex)]
    if not tables:
        return None
    formats = sorted({_format_of(p, named=p == path) for p in tables})
    if len(formats) > 1:
        raise DataError(f"source={str(path)!r} mixes {' and '.join(formats)} files; point it at one kind")
    if formats == ["parquet"]:
        _check_parquet_schemas(path, tables)
    import datasets

    try:
        ds = datasets.load_dataset(formats[0], data_files=[str(p) for p in tables], split="train", streaming=True)
    except Exception as e:  # datasets raises its own and pyarrow's errors for an unreadable file
        raise DataError(f"source={str(path)!r}: datasets could not read it: {str(e).splitlines()[0]}") from e
    fp = _files_fingerprint(tables, root, f"{formats[0]}\t{text_column}")
    return DatasetSource(f"{formats[0]} {path}", ds, text_column, val_fraction, fp)


def _load_hub(name: str, config: str | None, split: str, text_column: str, val_fraction: float) -> DatasetSource:
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:  # no network, unknown dataset, gated: one line, the hub's own words
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"source={name!r} is no local path and did not load from the Hugging Face hub: {first}") from e
    revision = "unknown"
    try:
        from huggingface_hub import HfApi

        revision = HfApi().dataset_info(name).sha or revision
    except Exception:  # the revision only sharpens the fingerprint; the data loaded
        pass
    fp = hashlib.sha256(f"hub\t{name}\t{config}\t{split}\t{revision}\t{text_column}\n".encode()).hexdigest()
    return DatasetSource(f"hub {name}" + (f"/{config}" if config else ""), ds, text_column, val_fraction, fp)


def open_source(
    source: str,
    text_column: str = "text",
    pattern: str = "**/*",
    val_fraction: float = 0.05,
    config: str | None = None,
    split: str = "train",
    exclude: tuple[str | Path, ...] = (),
) -> Source:
    """The documents of ``source``: a local path when it exists (parquet/jsonl/arrow files or a ``save_to_disk``
    folder through ``datasets``; any other file or folder as text files matching ``pattern``), otherwise a Hugging
    Face dataset name (``config``, ``split``), streamed. Files under the folders in ``exclude`` (the preparation's
    own ``out=``) are no part of a local source.

    Raises ``DataError`` for a path that does not exist (one that looks like a path: absolute, ``./``, ``~``, or
    with a file ending), a hub name that does not load (no network, unknown), a folder of mixed table formats or
    of parquet files of two schemas.
    """
    path = Path(source).expanduser()
    if path.exists():
        table = _load_local_tables(path, text_column, val_fraction, exclude)
        return table if table is not None else TextSource(source, pattern, val_fraction, exclude)
    if path.is_absolute() or source.startswith((".", "~")) or _format_of(path, named=True):
        raise DataError(f"source={source!r}: no such file or folder")
    return _load_hub(source, config, split, text_column, val_fraction)
