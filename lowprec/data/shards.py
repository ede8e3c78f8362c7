"""Token shards: flat little-endian uint16 files (the nanoGPT / llm.c convention), uint32 for a vocabulary past
65,536 ids (Llama 3's 128,256), plus ``meta.json``.

``meta.json`` holds, per split, the shard file names, token counts and sha256 digests, the vocabulary size and the
shards' ``dtype`` (``uint16`` when absent, as in folders written before uint32 existed), so a truncated or altered
shard is detected before training and every reader maps the files with the width they were written in.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from lowprec.data.errors import DataError

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
    if int(meta["vocab_size"]) > np.iinfo(dtype).max + 1:
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


def read_meta(shard_dir: Path) -> dict:
    """``meta.json`` of a shard folder, checked for the keys lowprec reads (``vocab_size``, ``splits``: split
    name -> list of ``{file, tokens, sha256}``). Raises ``DataError`` naming the file and what is missing."""
    path = shard_dir / META
    if not path.exists():
        raise DataError(f"token shard folder {str(shard_dir)!r} has no {META}")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{str(path)!r} is corrupt: {e}") from e
    fix = "rewrite it with lowprec.data.shards.write_shards"
    if not isinstance(meta, dict):
        raise DataError(f"{str(path)!r} is not a JSON object; {fix}")
    missing = [k for k in ("vocab_size", "splits") if k not in meta]
    if missing:
        raise DataError(f"{str(path)!r} has no {missing[0]!r} key; {fix}")
    if not isinstance(meta["splits"], dict) or not all(
        isinstance(es, list) and all(isinstance(e, dict) and {"file", "tokens", "sha256"} <= set(e) for e in es)
        for es in meta["splits"].values()
    ):
        raise DataError(f"{str(path)!r}: 'splits' must map each split to a list of {{file, tokens, sha256}}; {fix}")
    return meta


def open_split(shard_dir: Path, split: str, verify: bool = True) -> list[np.memmap]:
    """Memory-map every shard of ``split`` with the dtype ``meta.json`` names (``shard_dtype``). With ``verify``,
    sizes and sha256 digests are checked.

    Raises ``DataError`` for a missing split or shard, a wrong size, a digest mismatch or an unknown dtype.
    """
    meta = read_meta(shard_dir)
    dtype = shard_dtype(meta, str(shard_dir / META))
    width = np.dtype(dtype).itemsize
    if split not in meta.get("splits", {}):
        raise DataError(f"token shards in {str(shard_dir)!r} have no {split!r} split")
    maps = []
    for e in meta["splits"][split]:
        path = shard_dir / e["file"]
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
