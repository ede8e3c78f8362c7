"""What a user sees of a lowprec store in MLflow's own UI, on real sqlite stores.

- provenance never stops a run: a library without distribution metadata is recorded as "not installed";
- the experiment's kind is "model training", so MLflow 3 does not open it in its GenAI view;
- MLflow's Source column (``mlflow.source.*``, the git commit) and Datasets column (the corpus as a run input
  whose digest is the corpus fingerprint) are filled, on the parent and on every run;
- the parent run's name starts with what tells ablations apart (experiment, model), the id last.
"""

import importlib.metadata
import json

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from store_dirs import dirs_under, store_uri

from lowprec.data import TokenData
from lowprec_lab.cli import main
from lowprec_lab.tracking.spool import append, replay, spool_path
from lowprec_lab.tracking.tracker import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    NOT_INSTALLED,
    Tracker,
    corpus_dataset,
    git_sha,
    provenance_tags,
)


def _absent(*names):
    """``importlib.metadata.version`` as on a machine where ``names`` have no distribution metadata."""
    real = importlib.metadata.version

    def version(name):
        if name in names:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    return version


def test_a_library_without_metadata_is_recorded_not_installed(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", _absent("bitsandbytes", "torchao"))
    tags = provenance_tags(torch.device("cpu"))
    assert tags["bitsandbytes_version"] == NOT_INSTALLED and tags["torchao_version"] == NOT_INSTALLED
    t = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "e", tmp_path)
    run = t.client.get_run(t.start_run("r", tags))
    assert run.data.tags["bitsandbytes_version"] == "not installed"


@pytest.fixture(scope="module")
def one_run_ablation(tmp_path_factory):
    """One ablation of one bf16 run on a machine where bitsandbytes has no distribution metadata: the parent and
    its child, ``(client, parent, every run)``. Its runs train in this process as ``lowprec train``'s does (the same
    ``runner/run.py``), and the parent is opened by the ablation's main job, whose provenance tags stopped it."""
    root = tmp_path_factory.mktemp("one-run")
    dirs = dirs_under(root)
    args = ["ablate", "model=debug", "controls=false", "recipes=[bf16]", "seeds=1", "train.steps=4"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(importlib.metadata, "version", _absent("bitsandbytes"))
        assert main([*args, "train.val_every=2", "workers=1", *dirs]) == 0
    client = MlflowClient(store_uri(root))
    runs = client.search_runs([client.get_experiment_by_name("lowprec").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("lowprec.kind") == "ablation"]
    return client, parent, runs


def test_a_train_run_goes_on_without_bitsandbytes_metadata(one_run_ablation):
    """The GPU machine's failure: the main job died in ``provenance_tags`` before its first run."""
    _, parent, runs = one_run_ablation
    (run,) = [r for r in runs if r.info.run_id != parent.info.run_id]
    assert run.info.status == "FINISHED" and run.data.tags["bitsandbytes_version"] == NOT_INSTALLED
    assert parent.info.status == "FINISHED" and parent.data.tags["bitsandbytes_version"] == NOT_INSTALLED


def test_the_experiment_is_a_model_training_experiment(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = Tracker(uri, "new", tmp_path)
    assert t.client.get_experiment(t.experiment_id).tags[EXPERIMENT_KIND_TAG] == "custom_model_development"
    # a store written before the tag gets it; a kind a user chose in the UI is kept
    client = MlflowClient(uri)
    old = client.create_experiment("old", artifact_location=(tmp_path / "a").as_uri())
    chosen = client.create_experiment("chosen", artifact_location=(tmp_path / "b").as_uri())
    client.set_experiment_tag(chosen, EXPERIMENT_KIND_TAG, "finetuning")
    Tracker(uri, "old", tmp_path)
    Tracker(uri, "chosen", tmp_path)
    assert client.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "finetuning"


def test_mlflow_source_and_datasets_columns_and_the_parent_name(one_run_ablation):
    client, parent, runs = one_run_ablation
    exp = client.get_experiment(parent.info.experiment_id)
    assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert parent.info.run_name == f"default debug {parent.data.tags['lowprec.ablation_id']}"
    assert len(runs) == 2
    sha = git_sha()
    for r in runs:
        tags = r.data.tags
        assert tags["mlflow.source.name"] == "lowprec" and tags["mlflow.source.type"] == "LOCAL"
        if sha != "unknown":
            assert tags["mlflow.source.git.commit"] == sha.removesuffix("-dirty")
        (used,) = r.inputs.dataset_inputs
        assert used.dataset.digest == tags["corpus_fingerprint"][:16]
        assert used.dataset.name == "python-stdlib" and used.dataset.source_type == "local"
        assert {t.key: t.value for t in used.tags} == {"mlflow.data.context": "training"}
        assert tags["corpus_fingerprint"] in used.dataset.profile


@pytest.mark.parametrize("dirty", [False, True])
def test_the_git_commit_tag_is_the_bare_sha(monkeypatch, dirty):
    import lowprec_lab.tracking.tracker as tracking

    sha = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setattr(tracking, "git_sha", lambda: sha + ("-dirty" if dirty else ""))
    tags = provenance_tags(torch.device("cpu"))
    assert tags["mlflow.source.git.commit"] == sha and tags["git_sha"].startswith(sha)


def test_the_corpus_input_is_spooled_and_replayed_like_every_other_write(tmp_path):
    """On a tracking server that does not answer, the run input waits in the spool with the run's other writes."""
    t = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "e", tmp_path)
    run_id = t.start_run("r", {})
    tokens = np.arange(100, dtype=np.uint16)
    desc = "python-stdlib: 2 train / 1 val files under /x"
    data = TokenData([tokens], [tokens[:10]], 8192, "ab" * 32, desc, tmp_path)
    path = spool_path(tmp_path / "spool", run_id)
    append(path, run_id, "http://down:5000", {"op": "input", "dataset": corpus_dataset(data), "context": "training"})
    replay(t.client, path)
    (used,) = t.client.get_run(run_id).inputs.dataset_inputs
    assert (used.dataset.name, used.dataset.digest) == ("python-stdlib", "ab" * 8)
    assert json.loads(used.dataset.profile)["train_tokens"] == 100
