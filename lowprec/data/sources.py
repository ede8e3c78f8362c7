"""Where ``lowprec data prepare`` reads documents: a folder (or file) of text, local parquet/jsonl/arrow files, a
folder saved with ``datasets.Dataset.save_to_disk``, or a Hugging Face dataset name, streamed through ``datasets``.

Every source yields its documents in one fixed order, each with an id that decides its split (``is_val``: the
relative path of a text file, the row index of a dataset), and has a fingerprint of what it reads.
"""

from __future__ import annotations

import hashlib
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lowprec.data.corpus import build_corpus, is_val, read_text
from lowprec.data.errors import DataError

#: File endings read through ``datasets`` (its builder name). A folder holding any of them is a table source whose
#: other files (a dataset repository's README.md, .gitattributes) are left out; a folder without is text files. A
#: ``.json`` file is a table only when named itself (a folder of code has its package.json).
TABLE_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".jsonl.gz": "json", ".arrow": "arrow"}


@dataclass(frozen=True)
class Document:
    """One document: its ``text`` and the splits it goes to (``("train",)``, ``("val",)``, or both for a
    single-file source, whose val shares it as for ``data=text``)."""

    text: str
    splits: tuple[str, ...]


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
    fingerprint (``lowprec.data.corpus.build_corpus``)."""

    def __init__(self, path: str, pattern: str, val_fraction: float):
        self.corpus = build_corpus("text", path, pattern, val_fraction)
        self.name = f"text {self.corpus.root}"
        self.fingerprint = self.corpus.fingerprint
        self.n_bytes = self.corpus.n_bytes
        single = self.corpus.train_files == self.corpus.val_files
        val = set(self.corpus.val_files)
        files = sorted(set(self.corpus.train_files) | val, key=lambda p: p.relative_to(self.corpus.root).as_posix())
        self._docs = [(p, ("train", "val") if single else ("val",) if p in val else ("train",)) for p in files]

    def documents(self, skip: int = 0) -> Iterator[Document]:
        for p, splits in self._docs[skip:]:
            yield Document(read_text(p), splits)


class DatasetSource(Source):
    """Rows of a ``datasets`` dataset, streamed, taking the ``text_column``; row ``i`` is in val when
    ``is_val(str(i))``. ``dataset`` is an ``IterableDataset`` in a fixed order."""

    def __init__(self, name: str, dataset, text_column: str, val_fraction: float, fingerprint: str):
        self.name, self.fingerprint = name, fingerprint
        self.dataset, self.text_column, self.val_fraction = dataset, text_column, val_fraction

    def documents(self, skip: int = 0) -> Iterator[Document]:
        for i, row in enumerate(itertools.islice(iter(self.dataset), skip, None), start=skip):
            if self.text_column not in row:
                raise DataError(
                    f"{self.name} has no column {self.text_column!r} (columns: {', '.join(row)}); "
                    "name it with text_column=..."
                )
            text = row[self.text_column]
            if text:  # an empty or null row adds nothing, not even a document separator
                yield Document(str(text), ("val",) if is_val(str(i), self.val_fraction) else ("train",))


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


def _load_local_tables(path: Path, text_column: str, val_fraction: float) -> DatasetSource | None:
    """A ``save_to_disk`` folder, or the parquet/jsonl/arrow files at ``path``; None when ``path`` holds none
    (``datasets``, slow to import, is imported only then)."""
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
    if not tables:
        return None
    formats = sorted({_format_of(p, named=p == path) for p in tables})
    if len(formats) > 1:
        raise DataError(f"source={str(path)!r} mixes {' and '.join(formats)} files; point it at one kind")
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
) -> Source:
    """The documents of ``source``: a local path when it exists (parquet/jsonl/arrow files or a ``save_to_disk``
    folder through ``datasets``; any other file or folder as text files matching ``pattern``), otherwise a Hugging
    Face dataset name (``config``, ``split``), streamed.

    Raises ``DataError`` for a path that does not exist (one that looks like a path: absolute, ``./``, ``~``, or
    with a file ending), a hub name that does not load (no network, unknown), or a folder of mixed table formats.
    """
    path = Path(source).expanduser()
    if path.exists():
        table = _load_local_tables(path, text_column, val_fraction)
        return table if table is not None else TextSource(source, pattern, val_fraction)
    if path.is_absolute() or source.startswith((".", "~")) or _format_of(path, named=True):
        raise DataError(f"source={source!r}: no such file or folder")
    return _load_hub(source, config, split, text_column, val_fraction)
