import dataclasses
import json

import numpy as np
import pytest

from lowprec.data import DataError, DataSpec, TokenBatches, prepare
from lowprec.data.corpus import build_corpus, is_val, stdlib_corpus
from lowprec.data.shards import write_shards


def test_stdlib_corpus_is_sorted_split_and_fingerprinted():
    a, b = stdlib_corpus(0.05), stdlib_corpus(0.05)
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 64
    files = a.train_files + a.val_files
    assert not any("site-packages" in p.parts or "dist-packages" in p.parts for p in files)
    rels = [p.relative_to(a.root).as_posix() for p in a.train_files]
    assert rels == sorted(rels)
    assert 0.02 < len(a.val_files) / len(files) < 0.08
    assert all(is_val(p.relative_to(a.root).as_posix(), 0.05) for p in a.val_files)
    assert a.n_bytes > 10_000_000


@pytest.mark.parametrize("pattern", ["**/*.py", "**/*", "*.py", "sub/*.py", "**/sub/*.py"])
def test_recursive_walk_collects_exactly_what_the_glob_collects(tmp_path, pattern):
    """The fast os.walk path for ``**/<name>`` must select the same files, in the same order, as pathlib's
    glob with the site-/dist-packages exclusion (root-level files, hidden folders, excluded folders)."""
    from lowprec.data.corpus import _EXCLUDED_DIRS, _collect

    for rel in [
        "a.py",
        "b.txt",
        "sub/c.py",
        ".hidden/d.py",
        "sub/deep/e.py",
        "site-packages/f.py",
        "sub/__pycache__/g.py",
        "x/dist-packages/y/h.py",
        "sub/deep/sub/i.py",
    ]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    (tmp_path / "dir.py").mkdir()  # a folder whose name matches is not a file
    want = sorted(
        (
            p
            for p in tmp_path.glob(pattern)
            if p.is_file() and not _EXCLUDED_DIRS.intersection(p.relative_to(tmp_path).parts)
        ),
        key=lambda p: p.relative_to(tmp_path).as_posix(),
    )
    got = _collect(tmp_path, pattern)
    assert got == want and got


def test_default_corpus_tokens(token_data):
    assert token_data.vocab_size == 8192
    assert token_data.n_train_tokens > 5_000_000 and token_data.n_val_tokens > 100_000
    assert max(int(s.max()) for s in token_data.train) < 8192


def test_batches_are_a_pure_function_of_seed_and_step(token_data):
    a = TokenBatches(token_data.train, token_data.val, 64, 4, seed=3)
    b = TokenBatches(token_data.train, token_data.val, 64, 4, seed=3)
    x1, y1 = a.train_batch(10)
    a.train_batch(11)
    x2, y2 = b.train_batch(10)
    assert (x1 == x2).all() and (y1 == y2).all()
    assert (x1[:, 1:] == y1[:, :-1]).all()
    assert not (a.train_batch(12)[0] == x1).all()
    assert not (TokenBatches(token_data.train, token_data.val, 64, 4, seed=4).train_batch(10)[0] == x1).all()
    va, vb = a.val_batches(2), TokenBatches(token_data.train, token_data.val, 64, 4, seed=9).val_batches(2)
    assert all((p[0] == q[0]).all() for p, q in zip(va, vb))


def _text_corpus(tmp_path, n=40):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(n):
        (root / f"doc{i:03d}.txt").write_text(
            f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (20 + i)
        )
    return root


def test_user_text_corpus_and_its_cache(tmp_path):
    root = _text_corpus(tmp_path)
    spec = DataSpec(
        source="text",
        path=str(root),
        pattern="*.txt",
        vocab_size=300,
        val_fraction=0.2,
        cache_dir=str(tmp_path / "cache"),
    )
    d = prepare(spec)
    assert d.vocab_size == 300 and d.n_train_tokens > 1000
    again = prepare(spec)
    assert again.shard_dir == d.shard_dir and again.fingerprint == d.fingerprint
    (root / "doc000.txt").write_text("changed")
    assert prepare(spec).fingerprint != d.fingerprint


def _text_spec(tmp_path, cache: str) -> DataSpec:
    """The small text corpus of ``_text_corpus`` (BPE vocab 300) cached under ``tmp_path / cache``."""
    return DataSpec(
        source="text",
        path=str(_text_corpus(tmp_path)),
        pattern="*.txt",
        vocab_size=300,
        val_fraction=0.2,
        cache_dir=str(tmp_path / cache),
    )


def _prepare_in_process(spec: DataSpec, out) -> None:
    out.put(str(prepare(spec).shard_dir))


def test_two_processes_on_a_cold_cache_build_it_once_and_both_succeed(tmp_path):
    """Parallel test workers or two ablations started together: without the build lock the second process's
    rename onto the finished cache folder failed."""
    import multiprocessing as mp

    spec = _text_spec(tmp_path, "cache")
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_prepare_in_process, args=(spec, out)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    dirs = {out.get(timeout=5), out.get(timeout=5)}
    assert len(dirs) == 1 and prepare(spec).vocab_size == 300
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp-")]


PHASES = (
    "[1/4] reading 40 corpus files",
    "[2/4] training BPE vocab 300: counting words",
    "[2/4] training BPE vocab 300: computing merges",
    "[3/4] tokenizing 40 files -> uint16 shards",
    "[4/4] writing",
)


def test_cold_build_shows_each_phase_and_a_warm_cache_nothing(tmp_path, capfd):
    spec = _text_spec(tmp_path, "on")
    on = prepare(spec, progress=True)
    out, err = capfd.readouterr()
    assert out == ""
    for phase in PHASES:
        assert f"lowprec data {phase}" in err, err
    assert "100%|" in err and "ready in" in err  # tqdm's count line for the phases with a total
    prepare(spec, progress=True)  # warm cache
    assert capfd.readouterr() == ("", "")
    off = prepare(dataclasses.replace(spec, cache_dir=str(tmp_path / "off")))  # cold, progress off (the default)
    assert capfd.readouterr() == ("", "")
    for f in ("meta.json", "tokenizer.json", "train_000.bin", "val_000.bin"):  # the same cache either way
        assert (on.shard_dir / f).read_bytes() == (off.shard_dir / f).read_bytes()


def test_prepare_data_follows_train_progress(tmp_path, capfd):
    from lowprec_lab.runtime.startup import prepare_data

    root = _text_corpus(tmp_path)
    for progress in (False, True):
        data = dict(source="text", path=str(root), pattern="*.txt", vocab_size=300, val_fraction=0.2)
        prepare_data(DataSpec(**data, cache_dir=str(tmp_path / str(progress))), progress)
        err = capfd.readouterr().err
        assert all(f"lowprec data {phase}" in err for phase in PHASES) if progress else err == "", err


def test_missing_and_empty_corpus_raise(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        prepare(DataSpec(source="text", path=str(tmp_path / "nope"), cache_dir=str(tmp_path)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty corpus"):
        build_corpus("text", tmp_path / "empty", "**/*", 0.1)
    with pytest.raises(DataError, match="data.path"):
        prepare(DataSpec(source="text", path=None))


def test_corrupt_shard_is_detected(tmp_path):
    spec = DataSpec(
        source="text",
        path=str(_text_corpus(tmp_path)),
        pattern="*.txt",
        vocab_size=300,
        val_fraction=0.2,
        cache_dir=str(tmp_path / "cache"),
    )
    d = prepare(spec)
    shard = d.shard_dir / "train_000.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="sha256"):
        prepare(spec)
    shard.write_bytes(bytes(raw[:-2]))
    with pytest.raises(DataError, match="corrupt"):
        prepare(spec)


def test_pretokenized_shards(tmp_path):
    rng = np.random.default_rng(0)
    write_shards(
        tmp_path / "tok",
        {"train": rng.integers(0, 500, 5000), "val": rng.integers(0, 500, 1000)},
        vocab_size=512,
        shard_tokens=2000,
        extra={},
    )
    d = prepare(DataSpec(source="tokens", path=str(tmp_path / "tok")))
    assert d.vocab_size == 512 and d.n_train_tokens == 5000 and len(d.train) == 3
    x, y = TokenBatches(d.train, d.val, 100, 8, 0).train_batch(0)
    assert x.shape == (8, 100) and int(x.max()) < 500
    meta = json.loads((tmp_path / "tok" / "meta.json").read_text())
    meta["splits"].pop("val")
    (tmp_path / "tok" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="'val'"):
        prepare(DataSpec(source="tokens", path=str(tmp_path / "tok")))
