"""Token shards: flat little-endian uint16 files (the nanoGPT / llm.c convention), uint32 for a vocabulary past
65,536 ids (Llama 3's 128,256), plus ``meta.json``.

``meta.json`` holds, per split, the shard file names, token counts and sha256 digests, the vocabulary size and the
shards' ``dtype`` (``uint16`` when absent, as in folders written before uint32 existed), so a truncated or altered
shard is detected before training and every reader maps the files with the width they were written in.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from lowprec.data.errors import DataError
from lowprec.storage import is_plain_name

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
META = "meta.json"


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """``np.uint16`` if every id below ``vocab_size`` fits 16 bits, else ``np.uint32``.

    Raises ``DataError`` past 2**32 ids (no tokenizer has that many)."""
    if vocab_size <= np.iinfo(np.uint16).max + 1:
        return np.uint16
    if vocab_size <= np.iinfo(np.uint32).max + 1:
        return np.uint32
    raise DataError(f"vocab_size {vocab_size} does not fit uint32 token shards")


def shard_dtype(meta: dict, where: str = "meta.json") -> type[np.unsignedinteger]:
    """The dtype ``meta`` (a ``meta.json``) says its shards hold: ``uint16`` when absent.

    Raises ``DataError`` for an unknown dtype, or one too narrow for ``meta['vocab_size']`` ids."""
    name = meta.get("dtype", "uint16")
    if name not in DTYPES:
        raise DataError(f"{where}: dtype {name!r} is not one of {sorted(DTYPES)}")
    dtype = DTYPES[name]
    if meta["vocab_size"] > np.iinfo(dtype).max + 1:
        raise DataError(f"{where}: vocab_size {meta['vocab_size']} does not fit dtype {name}")
    return dtype


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_shards(out_dir: Path, splits: dict[str, np.ndarray], vocab_size: int, shard_tokens: int, extra: dict) -> None:
    """Write each split as shards of at most ``shard_tokens`` tokens and a ``meta.json``.

    ``splits`` maps split name to a 1-D integer array of token ids < ``vocab_size``; the shards are uint16 up to
    65,536 ids and uint32 above (``token_dtype``), recorded as ``dtype`` in ``meta.json``.
    """
    dtype = token_dtype(vocab_size)
    meta: dict = {"vocab_size": vocab_size, "dtype": np.dtype(dtype).name, "splits": {}, **extra}
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, tokens in splits.items():
        entries = []
        for i, start in enumerate(range(0, max(len(tokens), 1), shard_tokens)):
            path = out_dir / f"{split}_{i:03d}.bin"
            tokens[start : start + shard_tokens].astype(dtype).tofile(path)
            entries.append(
                {"file": path.name, "tokens": int(min(shard_tokens, len(tokens) - start)), "sha256": _sha256(path)}
            )
        meta["splits"][split] = entries
    (out_dir / META).write_text(json.dumps(meta, indent=1))


#: The largest ``meta.json`` read: its index of a 400,000-shard corpus fits; a larger file is refused unread.
MAX_META_BYTES = 64 << 20
_FIX = "rewrite it with lowprec.data.shards.write_shards or lowprec data prepare"
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: Optional keys written by ``lowprec data prepare`` that lowprec reads back, with the type each must have.
_OPTIONAL = {
    "dtype": str,
    "fingerprint": str,
    "source_fingerprint": str,
    "corpus": str,
    "source": str,
    "tokenizer": str,
    "tokenizer_sha256": str,
    "eot_id": int,
    "documents": int,
    "tokens": dict,
    "skipped_files": int,
}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def shard_file_name(name, where: str) -> str:
    """``name`` when it is a plain file name (a shard of the folder it is listed in), else ``DataError``: no
    separator, no ``.``/``..``, no absolute path, no NUL, not empty."""
    if not is_plain_name(name) or Path(name).name != name:
        raise DataError(f"{where}: shard file {str(name)[:80]!r} is not a plain file name inside the folder; {_FIX}")
    return name


def check_meta(meta, where: str) -> dict:
    """``meta`` (a parsed ``meta.json``) when every field lowprec reads has its type: ``vocab_size`` a positive int,
    ``dtype`` one of ``DTYPES``, ``splits`` a map of split name to a list of ``{file, tokens, sha256}`` with a plain
    file name, a non-negative int count and a sha256 hex digest, and the optional keys ``lowprec data prepare``
    writes (``fingerprint``, ``corpus``, ``tokens`` ...) of their types. Raises ``DataError`` (one line naming
    ``where`` and the field) otherwise."""
    if not isinstance(meta, dict):
        raise DataError(f"{where} is not a JSON object; {_FIX}")
    missing = [k for k in ("vocab_size", "splits") if k not in meta]
    if missing:
        raise DataError(f"{where} has no {missing[0]!r} key; {_FIX}")
    vocab = meta["vocab_size"]
    if not _is_int(vocab) or vocab < 1:
        raise DataError(f"{where}: vocab_size {str(vocab)[:40]!r} is not a positive integer; {_FIX}")
    for key, kind in _OPTIONAL.items():
        if key in meta and not (_is_int(meta[key]) if kind is int else isinstance(meta[key], kind)):
            what = {str: "a string", int: "an integer", dict: "an object"}[kind]
            raise DataError(f"{where}: {key!r} must be {what}, not {type(meta[key]).__name__}; {_FIX}")
    if "dtype" in meta and meta["dtype"] not in DTYPES:
        raise DataError(f"{where}: dtype {meta['dtype'][:40]!r} is not one of {sorted(DTYPES)}")
    if "tokens" in meta and not all(isinstance(k, str) and _is_int(v) for k, v in meta["tokens"].items()):
        raise DataError(f"{where}: 'tokens' must map each split to an integer count; {_FIX}")
    splits = meta["splits"]
    if not isinstance(splits, dict) or not all(
        isinstance(es, list) and all(isinstance(e, dict) and {"file", "tokens", "sha256"} <= set(e) for e in es)
        for es in splits.values()
    ):
        raise DataError(f"{where}: 'splits' must map each split to a list of {{file, tokens, sha256}}; {_FIX}")
    for split, entries in splits.items():
        for e in entries:
            shard_file_name(e["file"], where)
            if not _is_int(e["tokens"]) or e["tokens"] < 0:
                raise DataError(
                    f"{where}: shard {e['file']!r} of {split!r} has tokens {str(e['tokens'])[:40]!r}, not a "
                    f"non-negative integer; {_FIX}"
                )
            if not isinstance(e["sha256"], str) or not _SHA256.fullmatch(e["sha256"]):
                raise DataError(f"{where}: shard {e['file']!r} of {split!r} has no sha256 hex digest; {_FIX}")
    return meta


def read_meta(shard_dir: Path) -> dict:
    """``meta.json`` of a shard folder, checked by ``check_meta`` (every field lowprec reads has its type, every
    shard is a plain file name in the folder). A received folder is data: its ``meta.json`` is read only when at
    most ``MAX_META_BYTES`` and never names a file outside ``shard_dir``.

    Raises ``DataError`` (one line naming the file and what is wrong) for a missing, oversized, unparsable or
    ill-typed ``meta.json``."""
    path = shard_dir / META
    if not path.exists():
        raise DataError(f"token shard folder {str(shard_dir)!r} has no {META}")
    if not path.is_file() or path.stat().st_size > MAX_META_BYTES:
        raise DataError(f"{str(path)!r} is not a file of at most {MAX_META_BYTES >> 20} MiB; {_FIX}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, a 5,000-digit int, deep nesting
        raise DataError(f"{str(path)!r} is corrupt: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    return check_meta(meta, repr(str(path)))


def shard_path(shard_dir: Path, name: str, where: str) -> Path:
    """``shard_dir / name`` for a shard named in ``meta.json``, refused (``DataError``) unless it is a plain file
    name whose real path (symlinks resolved) is a regular file inside the real ``shard_dir``."""
    path = shard_dir / shard_file_name(name, where)
    real, root = os.path.realpath(path), os.path.realpath(shard_dir)
    if real == root or os.path.commonpath([real, root]) != root:
        raise DataError(f"{where}: shard {name!r} resolves outside {str(shard_dir)!r}; {_FIX}")
    if os.path.lexists(path) and not os.path.isfile(real):  # a FIFO or device would block or never end
        raise DataError(f"{where}: shard {name!r} is not a regular file; {_FIX}")
    return path


def open_split(shard_dir: Path, split: str, verify: bool = True) -> list[np.memmap]:
    """Memory-map every shard of ``split`` with the dtype ``meta.json`` names (``shard_dtype``). With ``verify``,
    sizes and sha256 digests are checked.

    Raises ``DataError`` for a missing split or shard, a wrong size, a digest mismatch or an unknown dtype.
    """
    meta = read_meta(shard_dir)  # every shard name a plain file name, every field typed
    dtype = shard_dtype(meta, str(shard_dir / META))
    width = np.dtype(dtype).itemsize
    if split not in meta.get("splits", {}):
        raise DataError(f"token shards in {str(shard_dir)!r} have no {split!r} split")
    maps = []
    for e in meta["splits"][split]:
        path = shard_path(shard_dir, e["file"], str(shard_dir / META))
        if not path.exists():
            raise DataError(f"token shard {str(path)!r} is missing")
        if path.stat().st_size != width * e["tokens"]:
            raise DataError(
                f"token shard {str(path)!r} is corrupt: {path.stat().st_size} bytes, expected {width * e['tokens']}"
            )
        if verify and _sha256(path) != e["sha256"]:
            raise DataError(f"token shard {str(path)!r} is corrupt: sha256 mismatch")
        if e["tokens"]:
            maps.append(np.memmap(path, dtype=dtype, mode="r"))
    if not maps:
        raise DataError(f"the {split!r} split in {str(shard_dir)!r} holds no tokens")
    return maps
