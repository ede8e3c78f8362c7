"""Prepare tokenized data: corpus -> cached BPE tokenizer -> cached uint16 shards, or user shards."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock

from lowprec.data.corpus import Corpus, build_corpus, read_text, stdlib_corpus
from lowprec.data.errors import DataError
from lowprec.data.progress import BuildProgress
from lowprec.data.shards import META, open_split, read_meta, write_shards
from lowprec.data.tokenizer import EOT, load_tokenizer, train_bpe


@dataclass(frozen=True)
class DataSpec:
    """Where the tokens come from.

    ``source``: ``stdlib`` (default corpus), ``text`` (files under ``path`` matching ``pattern``)
    or ``tokens`` (a folder of pre-tokenized shards with ``meta.json``, as written by ``write_shards`` or
    ``lowprec data prepare``). ``allow_epochs``: a run that would see its training tokens more than once
    (``data_usage``) trains without the warning it otherwise gets.
    """

    source: str = "stdlib"
    path: str | None = None
    pattern: str = "**/*"
    vocab_size: int = 8192
    val_fraction: float = 0.05
    shard_tokens: int = 1 << 26
    cache_dir: str = "~/.cache/lowprec"
    allow_epochs: bool = False


def implied_source(source: str, path: str | None) -> str:
    """The source that reads ``path`` under ``data.source=source``: ``source`` itself when it reads the path (or
    no path is given), ``tokens`` for a folder of token shards (one with ``meta.json``, as ``lowprec data prepare``
    writes) given with the default ``stdlib`` source, which reads no path.

    Raises ``DataError`` (one line) for a path no source would read as asked: any other path with ``stdlib``
    (training would silently read the standard library while the run records the path), and a token shard
    folder with ``text`` (its binary shards would be tokenized as text)."""
    if path is None or str(path) in ("", "???") or source == "tokens":
        return source
    shards = (Path(str(path)).expanduser() / META).is_file()
    if source == "stdlib":
        if shards:
            return "tokens"
        raise DataError(
            f"data.path={path} is not read by data.source=stdlib (the Python standard library): for text files "
            f"add data=text; for token shards point data.path at the folder with {META} that `lowprec data "
            "prepare` wrote"
        )
    if source == "text" and shards:
        raise DataError(
            f"data.path={path} holds token shards ({META}), which data.source=text would read as text: "
            "use data.source=tokens"
        )
    return source


@dataclass
class TokenData:
    """Tokenized train/val splits. Each split is a list of uint16 or uint32 memmaps (shards)."""

    train: list[np.ndarray]
    val: list[np.ndarray]
    vocab_size: int
    fingerprint: str
    description: str
    shard_dir: Path

    @property
    def n_train_tokens(self) -> int:
        return sum(len(s) for s in self.train)

    @property
    def n_val_tokens(self) -> int:
        return sum(len(s) for s in self.val)


def _tokenize_corpus(
    corpus: Corpus, vocab_size: int, out_dir: Path, shard_tokens: int, progress: BuildProgress
) -> None:
    files = {"train": corpus.train_files, "val": corpus.val_files}
    paths = corpus.train_files + corpus.val_files
    size = {p: p.stat().st_size for p in paths}
    progress.start(
        f"first use of corpus {corpus.name} ({len(paths)} files, {corpus.n_bytes / 1e6:.1f} MB): "
        f"building {out_dir} (cached for later runs)"
    )
    read = progress.track(1, f"reading {len(paths)} corpus files", map(read_text, paths), [size[p] for p in paths])
    texts = dict(zip(paths, list(read)))  # list(): runs the generator to its end, which closes the bar

    def training_feed() -> Iterator[str]:
        # The trainer counts words while it takes the texts; then it computes merges, which report no progress.
        what = f"training BPE vocab {vocab_size}"
        train = corpus.train_files
        yield from progress.track(
            2, f"{what}: counting words in {len(train)} files", (texts[p] for p in train), [size[p] for p in train]
        )
        progress.phase(2, f"{what}: computing merges")

    tok = train_bpe(training_feed(), vocab_size)
    progress.done()
    eot = tok.token_to_id(EOT)
    splits = {}
    with progress.bar(3, f"tokenizing {len(paths)} files -> uint16 shards", sum(size[p] for p in paths)) as bar:
        for split, fs in files.items():
            chunks = [np.zeros(0, dtype=np.int64)]
            for start in range(0, len(fs), _ENCODE_CHUNK):
                batch = fs[start : start + _ENCODE_CHUNK]
                ids = [e.ids + [eot] for e in tok.encode_batch([texts[p] for p in batch])]
                chunks.append(np.fromiter((i for doc in ids for i in doc), dtype=np.int64))
                bar.update(sum(size[p] for p in batch))
            splits[split] = np.concatenate(chunks)
    counts = " + ".join(f"{len(t):,} {split}" for split, t in splits.items())
    progress.phase(4, f"writing {counts} tokens")
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".tmp-"))
    try:
        tok.save(str(tmp / "tokenizer.json"))
        write_shards(
            tmp,
            splits,
            tok.get_vocab_size(),
            shard_tokens,
            {"fingerprint": corpus.fingerprint, "corpus": corpus.name, "root": str(corpus.root)},
        )
        os.replace(tmp, out_dir)  # atomic: a crashed build never leaves a half-written cache behind
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress.done()
    progress.finish(f"{corpus.name} ready")


#: Files per ``encode_batch`` call while tokenizing (one progress update each; the ids do not depend on it).
_ENCODE_CHUNK = 64


def prepare(spec: DataSpec, progress: bool = False) -> TokenData:
    """Tokens for training, building and caching the tokenizer and shards on first use.

    The cache key is the corpus fingerprint and the vocab size, so a changed corpus rebuilds.
    With ``progress``, a cold build says on stderr which phase runs, with counts and an ETA where the total
    is known (``lowprec.data.progress``); a warm cache prints nothing either way.
    Raises ``DataError`` for a missing path, an empty corpus or a corrupt cache/shard.
    """
    source = implied_source(spec.source, spec.path)
    if source == "tokens":
        if not spec.path:
            raise DataError("data.source=tokens needs data.path (a folder with meta.json and *.bin shards)")
        shard_dir = Path(spec.path).expanduser()
        if not shard_dir.exists():
            raise DataError(f"data path {str(shard_dir)!r} does not exist")
        meta = read_meta(shard_dir)
        desc = f"pre-tokenized shards at {shard_dir}"
        if meta.get("corpus"):  # written by `lowprec data prepare`: name the source and the tokenizer
            desc = f"{meta['corpus']} tokenized by {meta.get('tokenizer', '?')}: shards at {shard_dir}"
        fingerprint = meta.get("fingerprint") or _digest_of_digests(meta)
    elif source in ("stdlib", "text"):
        if source == "stdlib":
            corpus = stdlib_corpus(spec.val_fraction)
        else:
            if not spec.path:
                raise DataError("data.source=text needs data.path (a file or folder of text files)")
            corpus = build_corpus("text", spec.path, spec.pattern, spec.val_fraction)
        cache = Path(spec.cache_dir).expanduser()
        cache.mkdir(parents=True, exist_ok=True)
        shard_dir = cache / f"{corpus.fingerprint[:16]}-bpe{spec.vocab_size}"
        if not shard_dir.exists():
            # Two processes on a cold cache (parallel test workers, two ablations) would both build and the
            # second rename would fail: the first builds under the lock, the others wait and find it built.
            with FileLock(str(cache / f".{shard_dir.name}.lock")):
                if not shard_dir.exists():
                    _tokenize_corpus(corpus, spec.vocab_size, shard_dir, spec.shard_tokens, BuildProgress(progress))
        load_tokenizer(shard_dir / "tokenizer.json")  # fails loudly if the cached tokenizer is corrupt
        meta = read_meta(shard_dir)
        desc = f"{corpus.name}: {len(corpus.train_files)} train / {len(corpus.val_files)} val files under {corpus.root}"
        fingerprint = corpus.fingerprint
    else:
        raise DataError(f"data.source={spec.source!r} is not one of ['stdlib', 'text', 'tokens']")
    return TokenData(
        train=open_split(shard_dir, "train"),
        val=open_split(shard_dir, "val"),
        vocab_size=int(meta["vocab_size"]),
        fingerprint=fingerprint,
        description=desc,
        shard_dir=shard_dir,
    )


def check_vocab_fits(data: TokenData, model_vocab_size: int) -> None:
    """Raise ``DataError`` if token ids of ``data`` can reach past the model's embedding table."""
    if data.vocab_size > model_vocab_size:
        raise DataError(
            f"tokenizer vocab {data.vocab_size} does not fit model.vocab_size={model_vocab_size}; "
            "raise model.vocab_size or lower data.vocab_size"
        )


@dataclass(frozen=True)
class DataUsage:
    """How much of the training split a run reads: ``train_tokens`` in the split, ``tokens_seen`` over the run
    (steps x tokens per step) and ``epochs`` = tokens_seen / train_tokens (windows are drawn at random, so an
    epoch is a count of tokens, not a pass in order)."""

    train_tokens: int
    tokens_seen: int

    @property
    def epochs(self) -> float:
        return self.tokens_seen / max(self.train_tokens, 1)

    def warning(self) -> str | None:
        """One line when the run repeats data (more than one epoch), else None."""
        if self.epochs <= 1.0:
            return None
        return (
            f"the run reads {self.tokens_seen:,} training tokens, {self.epochs:.2f} epochs of the corpus's "
            f"{self.train_tokens:,}: it repeats data (prepare a larger corpus with `lowprec data prepare`, or set "
            "data.allow_epochs=true to train on it anyway)"
        )


def data_usage(data: TokenData, steps: int, tokens_per_step: int) -> DataUsage:
    """``DataUsage`` of a run of ``steps`` optimizer steps of ``tokens_per_step`` tokens
    (``batch_size * grad_accum * seq_len``) on ``data``."""
    return DataUsage(train_tokens=data.n_train_tokens, tokens_seen=steps * tokens_per_step)


def _digest_of_digests(meta: dict) -> str:
    h = hashlib.sha256()
    for split in sorted(meta["splits"]):
        for e in meta["splits"][split]:
            h.update(e["sha256"].encode())
    return h.hexdigest()
