"""``lowprec data prepare`` as a library (``lowprec.data.prepare_source``): uint32 shards past 65,536 ids, resuming an
interrupted preparation, the source fingerprint, table sources and their errors. No network: every source and
tokenizer is built in the test."""

import json
from pathlib import Path

import numpy as np
import pytest

from lowprec.data import DataError, DataSpec, TokenBatches, prepare
from lowprec.data.prepare_source import STATE, PrepareSpec, _ShardWriter, prepare_shards
from lowprec.data.shards import open_split, write_shards

BIG_VOCAB = 70_000


def text_folder(root: Path, n: int = 40, words: int = 120, seed: int = 0) -> Path:
    """``n`` text files of pseudo-Python, different enough to train a BPE on."""
    rng = np.random.default_rng(seed)
    names = ["alpha", "beta", "gamma", "delta", "theta", "omega", "value", "index", "count", "total"]
    root.mkdir(parents=True)
    for i in range(n):
        lines = [f"def {rng.choice(names)}_{i}(x, y):"]
        for _ in range(words // 8):
            lines.append(f"    {rng.choice(names)} = x * {int(rng.integers(100))} + y  # {rng.choice(names)}")
        (root / f"mod_{i:03d}.py").write_text("\n".join(lines) + "\n")
    return root


def big_vocab_tokenizer(path: Path) -> Path:
    """A ``tokenizers`` WordLevel tokenizer with 70,002 ids (``w0`` .. ``w69999``, ``[UNK]``, ``<|endoftext|>``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(BIG_VOCAB)} | {"[UNK]": BIG_VOCAB, "<|endoftext|>": BIG_VOCAB + 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def big_vocab_folder(root: Path, n: int = 40, words: int = 200) -> Path:
    """Text files of ``w<id>`` words, half of them with ids past 65,535."""
    rng = np.random.default_rng(1)
    root.mkdir(parents=True)
    for i in range(n):
        ids = rng.integers(60_000, BIG_VOCAB, words)
        (root / f"doc_{i:03d}.txt").write_text(" ".join(f"w{j}" for j in ids))
    return root


def test_a_vocabulary_past_65536_writes_uint32_shards_that_read_back_exactly(tmp_path):
    src = big_vocab_folder(tmp_path / "src")
    tok = big_vocab_tokenizer(tmp_path / "tokenizer.json")
    out = tmp_path / "shards"
    done = prepare_shards(PrepareSpec(source=str(src), out=str(out), tokenizer=str(tok), shard_tokens=3000))
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == BIG_VOCAB + 2 and meta["eot_id"] == BIG_VOCAB + 1
    assert done.meta["tokens"]["train"] + done.meta["tokens"]["val"] == 40 * 201  # words + one separator each
    first = out / meta["splits"]["train"][0]["file"]
    assert first.stat().st_size == 4 * meta["splits"]["train"][0]["tokens"]
    # The reader honours the dtype: the ids past 65,535 come back as written (uint16 would wrap them).
    words = (src / "doc_000.txt").read_text().split()
    data = prepare(DataSpec(source="tokens", path=str(out)))
    assert data.vocab_size == BIG_VOCAB + 2 and data.train[0].dtype == np.uint32
    splits = [data.train, data.val]
    head = next(s[0][: len(words)] for s in splits if int(s[0][0]) == int(words[0][1:]))
    assert [int(i) for i in head] == [int(w[1:]) for w in words]
    x, _ = TokenBatches(data.train, data.val, 64, 4, 0).train_batch(0)
    assert int(x.max()) > 65_535


def test_write_shards_takes_a_vocabulary_past_uint16(tmp_path):
    ids = np.array([0, 65_535, 65_536, 69_999] * 50)
    write_shards(tmp_path, {"train": ids, "val": ids}, vocab_size=BIG_VOCAB, shard_tokens=1000, extra={})
    assert json.loads((tmp_path / "meta.json").read_text())["dtype"] == "uint32"
    assert np.array_equal(open_split(tmp_path, "train")[0], ids)


def test_a_narrow_dtype_for_the_vocabulary_is_refused(tmp_path):
    ids = np.arange(100)
    write_shards(tmp_path, {"train": ids, "val": ids}, vocab_size=100, shard_tokens=1000, extra={})
    meta = json.loads((tmp_path / "meta.json").read_text())
    (tmp_path / "meta.json").write_text(json.dumps(meta | {"vocab_size": BIG_VOCAB}))
    with pytest.raises(DataError, match="vocab_size 70000 does not fit dtype uint16"):
        open_split(tmp_path, "train")


@pytest.mark.parametrize(("vocab", "dtype", "width"), [(65_536, "uint16", 2), (65_537, "uint32", 4)])
def test_65536_ids_fit_uint16_shards_and_65537_take_uint32(vocab, dtype, width, tmp_path):
    ids = np.array([0, 1, vocab - 2, vocab - 1] * 25)  # the top id: 65,535 fits 16 bits, 65,536 would wrap to 0
    write_shards(tmp_path, {"train": ids, "val": ids}, vocab_size=vocab, shard_tokens=1000, extra={})
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["dtype"] == dtype
    assert (tmp_path / meta["splits"]["train"][0]["file"]).stat().st_size == width * len(ids)
    assert np.array_equal(open_split(tmp_path, "train")[0], ids)
    if dtype == "uint32":  # a meta.json that says uint16 for 65,537 ids is refused
        (tmp_path / "meta.json").write_text(json.dumps(meta | {"dtype": "uint16"}))
        with pytest.raises(DataError, match=f"vocab_size {vocab} does not fit dtype uint16"):
            open_split(tmp_path, "train")


def test_an_interrupted_preparation_continues_and_ends_as_an_uninterrupted_one(tmp_path, monkeypatch):
    src = text_folder(tmp_path / "src")
    spec = dict(source=str(src), vocab_size=300, shard_tokens=800)
    whole = prepare_shards(PrepareSpec(**spec, out=str(tmp_path / "whole")))
    assert len(whole.meta["splits"]["train"]) >= 4

    commit = _ShardWriter.commit
    calls = []

    def dies_on_the_third(self, docs, complete):
        calls.append(docs)
        if len(calls) == 3:
            (self.out / "train_00099.bin").write_bytes(b"half a shard")  # written, never recorded
            raise KeyboardInterrupt
        commit(self, docs, complete)

    out = tmp_path / "resumed"
    with monkeypatch.context() as m:
        m.setattr(_ShardWriter, "commit", dies_on_the_third)
        with pytest.raises(KeyboardInterrupt):
            prepare_shards(PrepareSpec(**spec, out=str(out)))
    assert (out / STATE).exists() and not (out / "meta.json").exists()
    again = prepare_shards(PrepareSpec(**spec, out=str(out)))
    assert again.resumed_docs == calls[1] > 0 and not again.skipped
    assert not (out / STATE).exists() and not (out / "train_00099.bin").exists()
    assert again.meta["splits"] == whole.meta["splits"] and again.meta["fingerprint"] == whole.meta["fingerprint"]
    # a complete folder: nothing to do; other settings in it: refused
    assert prepare_shards(PrepareSpec(**spec, out=str(out))).skipped
    with pytest.raises(DataError, match="already holds token shards of another source or settings"):
        prepare_shards(PrepareSpec(**{**spec, "vocab_size": 320}, out=str(out)))


def test_an_unfinished_preparation_is_refused_not_wiped_by_other_settings(tmp_path, monkeypatch):
    src = text_folder(tmp_path / "src")
    spec = dict(source=str(src), vocab_size=300, shard_tokens=800)
    out = tmp_path / "out"
    commit = _ShardWriter.commit

    def dies_on_the_second(self, docs, complete):
        if self.state["docs"]:  # one commit recorded: an unfinished preparation worth keeping
            raise KeyboardInterrupt
        commit(self, docs, complete)

    with monkeypatch.context() as m:
        m.setattr(_ShardWriter, "commit", dies_on_the_second)
        with pytest.raises(KeyboardInterrupt):
            prepare_shards(PrepareSpec(**spec, out=str(out)))
    kept = {p.name: p.read_bytes() for p in out.iterdir()}
    assert json.loads(kept[STATE])["docs"] > 0 and any(n.endswith(".bin") for n in kept)
    for other in ({"vocab_size": 320}, {"shard_tokens": 900}):  # a typo in the next command: refused, nothing lost
        with pytest.raises(DataError, match="holds an unfinished preparation of another source or settings") as e:
            prepare_shards(PrepareSpec(**{**spec, **other}, out=str(out)))
        assert "\n" not in str(e.value)
        assert {p.name: p.read_bytes() for p in out.iterdir()} == kept
    done = prepare_shards(PrepareSpec(**spec, out=str(out)))  # the first command still continues
    assert done.resumed_docs == json.loads(kept[STATE])["docs"] and (out / "meta.json").exists()


def test_the_fingerprint_follows_the_files_not_the_path(tmp_path):
    a = text_folder(tmp_path / "a")
    b = text_folder(tmp_path / "b")
    fa = prepare_shards(PrepareSpec(source=str(a), out=str(tmp_path / "oa"), vocab_size=300)).meta
    fb = prepare_shards(PrepareSpec(source=str(b), out=str(tmp_path / "ob"), vocab_size=300)).meta
    assert fa["fingerprint"] == fb["fingerprint"] and fa["source_fingerprint"] == fb["source_fingerprint"]
    with open(b / "mod_000.py", "a") as f:
        f.write("extra = 1\n")
    fc = prepare_shards(PrepareSpec(source=str(b), out=str(tmp_path / "oc"), vocab_size=300)).meta
    assert fc["source_fingerprint"] != fa["source_fingerprint"] and fc["fingerprint"] != fa["fingerprint"]


def test_jsonl_rows_with_a_named_column_and_a_missing_one(tmp_path):
    rows = [{"content": f"print({i} * {i % 13})\n" * 8, "n": i} for i in range(300)]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = prepare_shards(
        PrepareSpec(
            source=str(src),
            out=str(tmp_path / "o"),
            text_column="content",
            vocab_size=300,
            max_tokens=2000,
            val_fraction=0.2,
        )
    ).meta
    assert meta["corpus"] == f"json {src}" and 2000 <= meta["tokens"]["train"] < 2000 + 200
    assert meta["documents"] < 300  # max_tokens stopped it early
    with pytest.raises(DataError, match=r"has no column 'text' \(columns: content, n\); name it with text_column="):
        prepare_shards(PrepareSpec(source=str(src), out=str(tmp_path / "o2"), vocab_size=300))


def test_missing_sources_and_bad_tokenizers_are_one_line_errors(tmp_path):
    src = text_folder(tmp_path / "src", n=40)
    with pytest.raises(DataError, match="source='/no/such/corpus': no such file or folder"):
        prepare_shards(PrepareSpec(source="/no/such/corpus", out=str(tmp_path / "o")))
    with pytest.raises(DataError, match="tokenizer='/no/tok.json': no such file or folder"):
        prepare_shards(PrepareSpec(source=str(src), out=str(tmp_path / "o"), tokenizer="/no/tok.json"))
    tok = big_vocab_tokenizer(tmp_path / "t.json")
    with pytest.raises(DataError, match=r"no end-of-document token \(</w>\); name one with eot_token="):
        prepare_shards(PrepareSpec(source=str(src), out=str(tmp_path / "o2"), tokenizer=str(tok), eot_token="</w>"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="exists and is not a lowprec shard folder"):
        prepare_shards(PrepareSpec(source=str(src), out=str(tmp_path / "full")))


def test_a_name_that_is_no_local_path_streams_from_the_hub(tmp_path, monkeypatch):
    """The hub path with the hub faked (no network in tests): ``datasets.load_dataset`` is asked for the name, its
    config and split, streaming; the tokenizer name goes to ``transformers`` when installed, else ``tokenizers``."""
    import importlib.util
    import types

    import datasets
    import huggingface_hub
    from tokenizers import Tokenizer

    asked = {}
    rows = [{"text": f"row {i} says {i * i}. " * 10, "url": f"u{i}"} for i in range(200)]

    def load_dataset(name, config=None, split=None, streaming=False, **kw):
        asked.update(name=name, config=config, split=split, streaming=streaming)
        return datasets.IterableDataset.from_generator(lambda: iter(rows))

    class Info:
        sha = "0123abcd"

    tok = big_vocab_tokenizer(tmp_path / "t.json")
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda self, name: Info())
    monkeypatch.setattr(Tokenizer, "from_pretrained", staticmethod(lambda name: Tokenizer.from_file(str(tok))))
    if importlib.util.find_spec("transformers"):
        import transformers

        fast = types.SimpleNamespace(is_fast=True, backend_tokenizer=Tokenizer.from_file(str(tok)))
        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda name: fast)
    spec = PrepareSpec(source="someone/web-text", config="sample", out=str(tmp_path / "o"), tokenizer="someone/tok")
    meta = prepare_shards(spec).meta
    assert asked == {"name": "someone/web-text", "config": "sample", "split": "train", "streaming": True}
    assert meta["corpus"] == "hub someone/web-text/sample" and meta["documents"] == 200 and meta["dtype"] == "uint32"
    monkeypatch.setattr(Info, "sha", "4567ef01")  # a new revision of the dataset: another source
    again = prepare_shards(PrepareSpec(**{**spec.__dict__, "out": str(tmp_path / "o2")})).meta
    assert again["source_fingerprint"] != meta["source_fingerprint"]


def test_the_default_bpe_gives_the_tokens_of_the_data_text_cache(tmp_path):
    """``tokenizer=bpe`` on a text folder is the built-in path's tokenizer and split: the same tokens in the same
    order as ``data=text`` on that folder, and the same source fingerprint (measured on the stdlib corpus too:
    8,181,330 + 474,367 tokens either way)."""
    src = text_folder(tmp_path / "src")
    built = prepare(DataSpec(source="text", path=str(src), vocab_size=300, cache_dir=str(tmp_path / "cache")))
    meta = prepare_shards(PrepareSpec(source=str(src), out=str(tmp_path / "o"), vocab_size=300, shard_tokens=500)).meta
    ours = prepare(DataSpec(source="tokens", path=str(tmp_path / "o")))
    for split in ("train", "val"):
        assert np.array_equal(np.concatenate(getattr(ours, split)), np.concatenate(getattr(built, split)))
    assert meta["source_fingerprint"] == built.fingerprint and len(ours.train) > 1
