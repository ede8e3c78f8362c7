"""``data.path=DIR`` given without ``data.source``: a folder of token shards (``meta.json``) is read as
``data.source=tokens`` by ``lowprec train`` and by the ablation's dry run, and MLflow records the source the run
read beside the corpus it read; a path the source would not read is refused in one line, before any run exists."""

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lowprec_lab.cli import main

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


def _text_folder(root: Path, n: int = 30) -> Path:
    root.mkdir()
    for i in range(n):
        (root / f"notes_{i:03d}.txt").write_text(f"entry {i}: the loss went down by {i % 7} percent.\n" * 30)
    return root


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, Path]:
    """A text folder and the token shards ``lowprec data prepare`` made of it."""
    root = tmp_path_factory.mktemp("corpus")
    src, out = _text_folder(root / "notes"), root / "shards"
    assert main(["data", "prepare", f"source={src}", f"out={out}", "vocab_size=512", "shard_tokens=4000"]) == 0
    return src, out


def _runs(tmp_path: Path) -> list:
    db = tmp_path / "runs" / "mlflow.db"
    if not db.exists():
        return []
    client = MlflowClient(f"sqlite:///{db}")
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def test_train_with_only_data_path_reads_the_shards_and_records_it(shards, run_dirs, tmp_path, capsys):
    _, out = shards
    capsys.readouterr()
    assert main(["train", *run_dirs, *TWO_STEPS, f"data.path={out}"]) == 0
    assert f"data.path={out} holds token shards: data.source=tokens" in capsys.readouterr().err
    (run,) = _runs(tmp_path)
    meta = json.loads((out / "meta.json").read_text())
    params, tags = run.data.params, run.data.tags
    assert params["data.path"] == str(out) and params["data.source"] == "tokens"
    assert tags["corpus"].startswith("text ") and "python-stdlib" not in tags["corpus"], tags["corpus"]
    assert tags["corpus_fingerprint"] == meta["fingerprint"]


def test_ablate_dry_run_with_only_data_path_plans_on_the_shards(shards, run_dirs, tmp_path, capsys):
    _, out = shards
    capsys.readouterr()
    assert main(["ablate", *run_dirs, "experiment=smoke", f"data.path={out}", "dry_run=true"]) == 0
    printed = capsys.readouterr().out
    corpus = [line for line in printed.splitlines() if "corpus" in line.lower()]
    assert corpus and "python-stdlib" not in printed, printed
    assert any(f"shards at {out}" in line for line in corpus), corpus
    assert _runs(tmp_path) == []


@pytest.mark.parametrize(
    "cmd, extra, needle",
    [
        ("train", [], "is not read by data.source=stdlib"),
        ("ablate", ["experiment=smoke", "dry_run=true"], "is not read by data.source=stdlib"),
        ("train", ["data=text", "data.path=SHARDS"], "holds token shards (meta.json), which data.source=text would"),
    ],
)
def test_a_path_its_source_would_not_read_is_refused(shards, cmd, extra, needle, run_dirs, tmp_path, capsys):
    src, out = shards
    extra = [a.replace("SHARDS", str(out)) for a in extra]
    path = [] if any(a.startswith("data.path=") for a in extra) else [f"data.path={src}"]
    capsys.readouterr()
    assert main([cmd, *run_dirs, *TWO_STEPS, *path, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"lowprec {cmd}: error: ") and needle in err, err
    assert _runs(tmp_path) == []
