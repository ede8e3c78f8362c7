"""``lowprec recommend``: offline on an empty store, and on a real sqlite MLflow store holding an
ablation whose verdicts are known (the fabricated ablation of ``fabricated_ablation.py``: real MLflow runs with
known per-seed losses, verdicts recorded on the parent run by the real report)."""

from __future__ import annotations

import json

import pytest
from fabricated_ablation import CONTROL, SEEDS, fabricate_ablation
from store_dirs import sqlite_uri

from lowprec_lab.cli import main
from lowprec_lab.report.build import build_report
from lowprec_lab.tracking.tracker import Tracker

BASE = ["model=llama3_8b", "hardware=h100", "gpus=8", "tokens=1e11"]


def test_empty_store_is_offline_published_evidence_only(tmp_path, capsys):
    db = tmp_path / "nothing" / "mlflow.db"
    argv = [*BASE, "recipes=[fp8_rowwise,fp8_tensorwise_fsdp8,fp8_blockwise]", f"tracking.uri=sqlite:///{db}"]
    assert main(["recommend", *argv]) == 0
    out = capsys.readouterr().out
    assert not db.exists()  # read only: an absent store stays absent
    # every row without evidence points at one ablation, printed whole: device, layout, batch, steps
    assert "no evidence: ablation [a1] below" in out
    assert (
        "lowprec ablate 'recipes=[bf16,fp8_tensorwise_fsdp8,fp8_rowwise,fp8_blockwise]' model=llama3_8b "
        "model.qk_norm=false device=cuda parallel.dp_shard=4 parallel.tp=1 train.batch_size=4 train.seq_len=8192 "
        "train.steps=1000 "
        "train.val_every=100 train.ac=selective train.compile=false seeds=3 report.margin=0.0025"
    ) in out
    assert "DeepSeek-V3 technical report" in out and "Crusoe" in out
    assert main(["recommend", *argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    names = [o["recipe"] for o in d["options"]]
    # the cost model's granularity order, the measured one: tensorwise (FP8 all-gather) > rowwise > bf16
    assert names.index("fp8_tensorwise_fsdp8") < names.index("fp8_rowwise") < names.index("bf16")
    assert d["top"] == "fp8_tensorwise_fsdp8" and "Recommended: fp8_tensorwise_fsdp8" in d["paragraph"]
    assert all(o["headroom"] >= 0.07 for o in d["options"])
    bf16 = next(o for o in d["options"] if o["recipe"] == "bf16")
    assert bf16["excluded"] == "the reference (not among recipes=)"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A real sqlite store with one ablation on the ``debug`` model: bf16 (control), bf16_pure about 2% worse
    (inferior at 0.25%) and fp8_rowwise within 0.03% (non-inferior), 4 seeds each; the report records the verdicts."""
    root = tmp_path_factory.mktemp("rec")
    uri = sqlite_uri(root / "runs" / "mlflow.db")
    tracker = Tracker(uri, "lowprec", root / "runs")
    ctrl = [4.00, 4.05, 3.98, 4.02]
    runs = {
        CONTROL: dict(zip(SEEDS, ctrl, strict=True)),
        "bf16_pure": {s: ctrl[s] * (1 + d) for s, d in zip(SEEDS, [0.020, 0.022, 0.019, 0.021], strict=True)},
        "fp8_rowwise": {s: ctrl[s] * (1 + d) for s, d in zip(SEEDS, [0.0001, -0.0002, 0.0003, 0.0], strict=True)},
    }
    fabricate_ablation(tracker, "abl-rec", runs, margin=0.0025)
    build_report(tracker, "abl-rec", root / "reports")
    return uri


def test_stored_verdicts_are_cited_and_an_inferior_recipe_is_never_recommended(store, capsys):
    argv = ["model=debug", "hardware=h100", "gpus=1", "tokens=1e9", "train.seq_len=512", f"tracking.uri={store}"]
    assert main(["recommend", *argv, "recipes=[bf16_pure,fp8_rowwise]", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    by = {o["recipe"]: o for o in d["options"]}
    assert by["bf16_pure"]["excluded"].startswith("measured inferior: inferior")
    (ev,) = by["fp8_rowwise"]["evidence"]
    assert ev["verdict"] == "non-inferior" and ev["seeds"] == 4 and ev["comparable"] and ev["ablation_id"] == "abl-rec"
    assert ev["lo"] < ev["effect"] < ev["hi"] < 0.0025 and ev["margin"] == pytest.approx(0.0025)
    assert by["fp8_rowwise"]["ablate_command"] is None
    assert d["top"] == "fp8_rowwise" and "abl-rec" in d["paragraph"] and "non-inferior" in d["paragraph"]
    # the only candidate is inferior: nothing is recommended, whatever its speed
    assert main(["recommend", *argv, "recipes=[bf16_pure]"]) == 0
    out = capsys.readouterr().out
    assert "EXCLUDED: measured inferior" in out and "No recipe fits and is not excluded" in out
    # on a tiny model every FP8 speedup is predicted below the model's error, and the text says so (both eager:
    # under train.compile=auto on an H100 bf16 compiles and fp8_rowwise, with FP8 telemetry on, cannot)
    assert main(["recommend", *argv, "recipes=[fp8_rowwise]", "train.compile=false"]) == 0
    assert "below the cost model's held-out error" in capsys.readouterr().out


def test_a_different_size_class_is_evidence_but_not_comparable(store, capsys):
    argv = [*BASE, "recipes=[fp8_rowwise]", f"tracking.uri={store}", "--json"]
    assert main(["recommend", *argv]) == 0
    d = json.loads(capsys.readouterr().out)
    o = next(o for o in d["options"] if o["recipe"] == "fp8_rowwise")
    assert o["evidence"][0]["comparable"] is False and o["ablate_command"].startswith("lowprec ablate")
    assert "other size class" in d["paragraph"]


def test_moe_model_gets_fsdp_layouts_and_dense_evidence_is_not_comparable(store, capsys):
    """A MoE model: FSDP only (tp = 1), time from the activated experts (faster per token than counting every
    expert), and the dense ``debug`` ablation of the store is cited but not comparable (other family)."""
    argv = [
        "model=moe_debug",
        "hardware=h100",
        "gpus=4",
        "tokens=1e9",
        "train.seq_len=512",
        f"tracking.uri={store}",
        "--json",
    ]
    assert main(["recommend", *argv, "recipes=[fp8_rowwise,bf16_pure]"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["options"] and all(o["tp"] == 1 and o["dp_shard"] == 4 for o in d["options"])
    assert d["query"]["compile"] == "auto" and d["query"]["moe"]
    assert all(o["compile"] is False for o in d["options"])  # auto on a GPU: lowprec trains MoE models eager
    by = {o["recipe"]: o for o in d["options"]}
    (ev,) = by["fp8_rowwise"]["evidence"]
    assert ev["model"] == "debug" and ev["comparable"] is False
    assert by["fp8_rowwise"]["ablate_command"] == (
        "lowprec ablate 'recipes=[bf16,fp8_rowwise]' model=moe_debug model.qk_norm=false device=cuda "
        "parallel.dp_shard=1 parallel.tp=1 train.batch_size=1 train.seq_len=512 train.steps=1000 train.val_every=100 "
        "train.ac=none train.compile=false "
        "seeds=3 report.margin=0.0025"
    )
    # an inferior verdict is still never recommended, whatever the model family
    assert by["bf16_pure"]["excluded"].startswith("measured inferior")
    assert main(["recommend", *argv[:-1], "recipes=[fp8_rowwise]"]) == 0
    out = capsys.readouterr().out
    assert "other size class or family" in out and "MoE step time NOT validated" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["hardware=h100", "gpus=8", "tokens=1e9"], "model= is required"),
        (["model=llama3_8b", "gpus=8", "tokens=1e9"], "hardware= is required"),
        ([*BASE[:3], "tokens=lots"], "tokens: Value 'lots'"),
        ([*BASE[:3], "tokens=-5"], "tokens=-5 must be"),
        ([*BASE[:2], "gpus=0", "tokens=1e9"], "gpus=0 must be >= 1"),
        ([*BASE, "max_loss_gap=150%"], "max_loss_gap='150%' must be a relative gap"),
        ([*BASE, "max_loss_gap=abc"], "max_loss_gap='abc' is not a number"),
        ([*BASE, "train.ac=sometimes"], "train.ac='sometimes' is not one of none"),
        ([*BASE, "train.compile=maybe"], "train.compile='maybe' must be true, false or auto"),
        ([*BASE, "recipes=[fp9]"], "unknown recipe 'fp9'"),
        ([*BASE, "hardwre=h100"], "unknown key hardwre, did you mean hardware?"),
        ([*BASE, "recipe=bf16"], "config group 'recipe'"),  # recommend ranks recipes=, as ablate takes them
        (["model=nope", "hardware=h100", "gpus=8", "tokens=1e9"], "unknown model 'nope'; known: "),
        (["model=llama3_8b", "hardware=tpu", "gpus=8", "tokens=1e9"], "unknown hardware 'tpu'"),
        ([*BASE, "train.seq_len=100000"], "train.seq_len=100000 exceeds model.max_seq_len=8192"),
        ([*BASE, "parallel.dp_replicate=2"], "HSDP replicas are not modelled"),
        ([*BASE, "--fast"], "unknown flag '--fast'"),
        # the keys recommend took before it shared train's: one line naming the new one
        ([*BASE, "batch=2"], "batch= is gone: lowprec recommend takes lowprec train's keys, train.batch_size=N"),
        ([*BASE, "seq=512"], "seq= is gone: lowprec recommend takes lowprec train's keys, train.seq_len=N"),
        ([*BASE, "recompute=auto"], "recompute= is gone: lowprec recommend takes lowprec train's keys, train.ac="),
        ([*BASE, "compile=true"], "compile= is gone: lowprec recommend takes lowprec train's keys, train.compile="),
        (
            ["model=moe_debug", "hardware=h100", "gpus=2", "tokens=1e9", "train.compile=true"],
            "train.compile=true is not supported for MoE models",
        ),
    ],
)
def test_bad_recommend_input_is_one_line(argv, needle, capsys):
    assert main(["recommend", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lowprec recommend: error: ") and needle in err, err
