"""Token shards: flat little-endian uint16 files (the nanoGPT / llm.c convention) plus ``meta.json``.

``meta.json`` holds, per split, the shard file names, token counts and sha256 digests, and the
vocabulary size, so a truncated or altered shard is detected before training.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from lowprec.data.errors import DataError

TOKEN_DTYPE = np.uint16
META = "meta.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_shards(out_dir: Path, splits: dict[str, np.ndarray], vocab_size: int, shard_tokens: int, extra: dict) -> None:
    """Write each split as shards of at most ``shard_tokens`` tokens and a ``meta.json``.

    ``splits`` maps split name to a 1-D integer array of token ids < ``vocab_size`` <= 65536.
    """
    if vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
        raise DataError(f"vocab_size {vocab_size} does not fit uint16 shards")
    meta: dict = {"vocab_size": vocab_size, "dtype": "uint16", "splits": {}, **extra}
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, tokens in splits.items():
        entries = []
        for i, start in enumerate(range(0, max(len(tokens), 1), shard_tokens)):
            path = out_dir / f"{split}_{i:03d}.bin"
            tokens[start : start + shard_tokens].astype(TOKEN_DTYPE).tofile(path)
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
    """Memory-map every shard of ``split``. With ``verify``, sizes and sha256 digests are checked.

    Raises ``DataError`` for a missing split or shard, a wrong size, or a digest mismatch.
    """
    meta = read_meta(shard_dir)
    if split not in meta.get("splits", {}):
        raise DataError(f"token shards in {str(shard_dir)!r} have no {split!r} split")
    maps = []
    for e in meta["splits"][split]:
        path = shard_dir / e["file"]
        if not path.exists():
            raise DataError(f"token shard {str(path)!r} is missing")
        if path.stat().st_size != 2 * e["tokens"]:
            raise DataError(
                f"token shard {str(path)!r} is corrupt: {path.stat().st_size} bytes, expected {2 * e['tokens']}"
            )
        if verify and _sha256(path) != e["sha256"]:
            raise DataError(f"token shard {str(path)!r} is corrupt: sha256 mismatch")
        if e["tokens"]:
            maps.append(np.memmap(path, dtype=TOKEN_DTYPE, mode="r"))
    if not maps:
        raise DataError(f"the {split!r} split in {str(shard_dir)!r} holds no tokens")
    return maps
