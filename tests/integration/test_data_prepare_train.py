"""``lowprec data prepare`` then ``lowprec train data.source=tokens data.path=...``: from a parquet
file and from a text folder, through the real command line, Hydra composition and a real MLflow sqlite store; the run
records the corpus fingerprint, its token count and the epochs it read. Bad data input: one line, no run."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from lowprec_lab.cli import compose, main

TWO_STEPS = [
    "model=debug",
    "train.steps=2",
    "train.batch_size=2",
    "train.seq_len=64",
    "train.val_every=0",
    "train.val_batches=1",
    "train.warmup_steps=1",
    "train.timing_warmup_steps=1",
]


def _parquet(path: Path, rows: int = 300) -> Path:
    rng = np.random.default_rng(0)
    words = ["tensor", "scale", "amax", "cast", "block", "matmul", "grad", "loss", "step", "norm"]
    texts = [" ".join(rng.choice(words, 60)) + f" {i}." for i in range(rows)]
    pq.write_table(pa.table({"text": texts, "id": list(range(rows))}), path)
    return path


def _text_folder(root: Path, n: int = 40) -> Path:
    root.mkdir()
    for i in range(n):
        (root / f"notes_{i:03d}.txt").write_text(f"entry {i}: the loss went down by {i % 7} percent.\n" * 30)
    return root


def _runs(tmp_path: Path) -> list:
    db = tmp_path / "runs" / "mlflow.db"
    if not db.exists():
        return []
    client = MlflowClient(f"sqlite:///{db}")
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


@pytest.mark.parametrize("kind", ["parquet", "text"])
def test_prepare_then_train_two_steps_on_the_shards(kind, run_dirs, tmp_path, capsys):
    src = _parquet(tmp_path / "corpus.parquet") if kind == "parquet" else _text_folder(tmp_path / "notes")
    out = tmp_path / "shards"
    code = main(["data", "prepare", f"source={src}", f"out={out}", "vocab_size=512", "shard_tokens=4000"])
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert printed.startswith("prepared: ") and f"data.source=tokens data.path={out}" in printed
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["corpus"].startswith(kind) and meta["source_fingerprint"]

    assert main(["train", *run_dirs, *TWO_STEPS, "data.source=tokens", f"data.path={out}"]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err, err  # 256 tokens of ~15,000: no repeated data
    (run,) = _runs(tmp_path)
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    assert tags["corpus_fingerprint"] == meta["fingerprint"]
    assert int(tags["corpus_train_tokens"]) == meta["tokens"]["train"]
    assert float(tags["corpus_epochs"]) == pytest.approx(2 * 2 * 64 / meta["tokens"]["train"], rel=1e-3)
    assert tags["corpus"].startswith(f"{kind} ") and "tokenized by bpe" in tags["corpus"]
    # the same command again: nothing to do
    assert main(["data", "prepare", f"source={src}", f"out={out}", "vocab_size=512", "shard_tokens=4000"]) == 0
    assert capsys.readouterr().out.startswith("already prepared: ")


def test_a_run_that_repeats_data_warns_unless_allowed(tmp_path, capsys):
    from lowprec.data import DataSpec, prepare
    from lowprec.data.shards import write_shards
    from lowprec_lab.plan.config import data_from_cfg, train_from_cfg
    from lowprec_lab.runtime.startup import warn_repeated_data

    ids = np.arange(1000) % 500
    write_shards(tmp_path / "tok", {"train": ids, "val": ids[:200]}, vocab_size=512, shard_tokens=10_000, extra={})
    data = prepare(DataSpec(source="tokens", path=str(tmp_path / "tok")))

    def warn(overrides):
        cfg = compose("train", overrides)
        warn_repeated_data(data_from_cfg(cfg), train_from_cfg(cfg), data, "ablate")

    base = ["data.source=tokens", f"data.path={tmp_path / 'tok'}", "train.batch_size=2", "train.seq_len=64"]
    warn([*base, "train.steps=16"])
    err = capsys.readouterr().err
    assert err == (
        "lowprec ablate: warning: the run reads 2,048 training tokens, 2.05 epochs of the corpus's 1,000: it repeats "
        "data (prepare a larger corpus with `lowprec data prepare`, or set data.allow_epochs=true to train on it "
        "anyway)\n"
    )
    warn([*base, "train.steps=16", "data.allow_epochs=true"])
    warn([*base, "train.steps=7"])  # 896 tokens: under one epoch
    assert capsys.readouterr().err == ""


def _big_vocab_shards(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "<|endoftext|>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    src = tmp_path / "words"
    src.mkdir()
    for i in range(40):
        (src / f"{i}.txt").write_text(" ".join(f"w{(i * 977 + j * 131) % 70_000}" for j in range(200)))
    out = tmp_path / "big"
    assert main(["data", "prepare", f"source={src}", f"out={out}", f"tokenizer={tmp_path / 'tokenizer.json'}"]) == 0
    return out


BAD_DATA = [
    # (command, overrides, what the one line says)
    ("train", ["data.source=tokens", "data.path=/no/such/shards"], "data path '/no/such/shards' does not exist"),
    ("ablate", ["recipes=[fp32]", "data=text", "data.path=/no/such/corpus"], "data path '/no/such/corpus' does not"),
    ("train", ["data.source=tokens", "data.path=BIG"], "tokenizer vocab 70002 does not fit model.vocab_size=8192"),
    ("ablate", ["recipes=[fp32]", "data.source=tokens", "data.path=BIG"], "tokenizer vocab 70002 does not fit"),
    ("data", ["prepare", "source=/no/such/corpus", "out=OUT"], "source='/no/such/corpus': no such file or folder"),
    ("data", ["prepare", "source=/tmp", "out=OUT", "vocab_size=abc"], "vocab_size: Value 'abc' of type 'str'"),
    ("data", ["prepare", "source=/tmp", "out=OUT", "srouce=x"], "unknown key srouce, did you mean source?"),
    ("data", ["prepare", "out=OUT"], "missing mandatory value: source"),
    ("data", ["prepare", "source=/tmp", "out=OUT", "pattern=[a"], "no viable alternative at input '[a'"),
    ("data", ["prepare", "source", "out=OUT"], "'source' is not key=value"),
]


@pytest.mark.parametrize("cmd, args, needle", BAD_DATA, ids=[" ".join([c, *a]) for c, a, _ in BAD_DATA])
def test_bad_data_input_is_one_line_and_no_mlflow_run(cmd, args, needle, run_dirs, tmp_path, capsys):
    if "data.path=BIG" in args:
        big = _big_vocab_shards(tmp_path)
        args = [a.replace("BIG", str(big)) for a in args]
    args = [a.replace("OUT", str(tmp_path / "out")) for a in args]
    capsys.readouterr()
    argv = [cmd, *args] if cmd == "data" else [cmd, *run_dirs, *TWO_STEPS, *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    prog = "data prepare" if cmd == "data" else cmd
    assert err.startswith(f"lowprec {prog}: error: ") and needle in err, err
    assert _runs(tmp_path) == []
