"""``lowprec recommend`` prints the ``lowprec train`` and ``lowprec ablate`` lines of its top choice,
and they run: each printed line, with ``train.steps=2 model=debug`` appended, composes with the real Hydra config of
its command and passes ``lowprec``'s preflight (every check before data, MLflow or torchrun; no training). The
estimator and recommend take ``lowprec train``'s keys with its defaults."""

from __future__ import annotations

import json
import shlex

import pytest

from lowprec.train.spec import TrainSpec
from lowprec_lab.cli import compose, main, planning_query
from lowprec_lab.plan.estimate_config import register_planning_configs
from lowprec_lab.plan.preflight import preflight

#: appended to each printed line: the acceptance's ``train.steps=2 model=debug``, and the timing warmup below 2 steps
#: (``TrainSpec`` refuses ``train.timing_warmup_steps=3`` >= ``train.steps``, for every ``lowprec train`` line)
SMALL = ["train.steps=2", "model=debug"]  # the smallest run: these two overrides, nothing else


def _printed(capsys, argv: list[str]) -> dict:
    assert main(["recommend", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _subcommand_args(line: str, subcommand: str) -> list[str]:
    """The overrides of a printed line: the words after ``lowprec <subcommand>`` or ``-m lowprec_lab <subcommand>``
    (the torchrun line of several hosts), as the shell splits them."""
    words = shlex.split(line)
    start = next(i for i, w in enumerate(words) if w == subcommand and words[i - 1] in ("lowprec", "lowprec_lab"))
    return words[start + 1 :]


CASES = {
    # one host: `lowprec train ...` (it starts torchrun itself); the user's optim.lr is carried over
    "one host": ["model=llama3_8b", "hardware=h100", "gpus=8", "tokens=1e11", "train.seq_len=512", "optim.lr=1e-4"],
    # 32 GPUs of 8 per host: the torchrun line to start on each host; a pinned global batch and AC
    "four hosts": [
        "model=llama3_8b",
        "hardware=h100",
        "gpus=32",
        "tokens=2e12",
        "train.seq_len=256",
        "train.batch_size=64",
        "train.ac=full",
        "parallel.tp=1",
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_printed_train_and_ablate_lines_pass_preflight(case, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # preflight creates paths.runs and paths.reports (relative: runs/, reports/)
    store = f"tracking.uri=sqlite:///{tmp_path / 'none' / 'mlflow.db'}"
    d = _printed(capsys, [*CASES[case], store])
    top = next(o for o in d["options"] if o["recipe"] == d["top"])
    train, ablate = d["commands"]["train"], d["commands"]["ablate"]
    assert train.startswith("lowprec train " if case == "one host" else "torchrun --nnodes=4 --nproc_per_node=8 ")
    # the command lines are in the text output too
    assert main(["recommend", *CASES[case], store]) == 0
    text = capsys.readouterr().out
    assert f"  {train}\n" in text and text.rstrip().endswith(ablate)

    args = _subcommand_args(train, "train")
    cfg = compose("train", [*args, *SMALL])
    checked = preflight(cfg)  # the Plan
    assert cfg.recipe.name == d["top"] and checked.train.steps == 2
    assert (checked.parallel.dp_shard, checked.parallel.tp) == (top["dp_shard"], top["tp"])
    assert checked.train.batch_size == top["dp_shard"] * top["batch_per_rank"] and checked.train.ac == top["ac"]
    assert checked.train.seq_len == d["query"]["seq"] and checked.train.compile is top["compile"]
    if case == "one host":
        assert cfg.optim.lr == 1e-4
    else:
        assert (checked.train.batch_size, checked.train.ac, checked.parallel.tp) == (64, "full", 1)

    cfg = compose("ablate", [*_subcommand_args(ablate, "ablate"), *SMALL])
    checked = preflight(cfg)
    # the default experiment's controls ride along; the model keeps its own architecture (no QK-norm)
    assert [r.name for r in checked.recipes] == ["bf16", d["top"], "bf16_reordered", "fp8_unscaled"]
    assert cfg.report.margin == 0.0025 and not checked.model.qk_norm
    assert (checked.parallel.dp_shard, checked.parallel.tp) == (top["dp_shard"], top["tp"])


def test_estimate_and_recommend_default_to_trains_settings():
    """The estimate is of the run ``lowprec train`` with the same keys makes on the part named: the same ``train``
    node, with train's ``auto`` compile and AC resolved as train resolves them on that part (a GPU: compile on,
    selective AC), and recommend keeps ``train.compile`` as given and times each recipe as train runs it there."""
    register_planning_configs()
    train = compose("train", ["model=llama3_8b"]).train
    assert compose("estimate", ["model=llama3_8b"]).train == train
    assert compose("recommend", ["model=llama3_8b"]).train == train
    assert (train.compile, train.ac) == ("auto", "auto")
    q = planning_query("estimate", ["model=llama3_8b", "parallel.dp_shard=8"])
    assert (q.train.compile, q.train.ac, q.train.batch_size, q.train.seq_len) == (
        True,
        "selective",
        TrainSpec().batch_size,
        TrainSpec().seq_len,
    )
    assert q.batch_per_rank == TrainSpec().batch_size // 8
    r = planning_query("recommend", ["model=llama3_8b", "hardware=h100", "gpus=8", "tokens=1e9"])
    assert r.compile == "auto" and (r.ac, r.batch_size, r.tp) == (None, None, None)  # chosen
    assert r.assumed["bf16"].compile is True and r.assumed["te_delayed"].compile is False  # TE cannot compile


def test_the_multi_node_line_works_as_pasted_and_refuses_an_unset_head_node(tmp_path):
    """The printed torchrun line, pasted into bash on a host: with ``HEAD_NODE`` exported the rendezvous endpoint is
    that host; unset (or set inline on the same line, which the shell expands after the line's words), it stops
    with one line saying to export it, instead of torch's 25-line traceback for an empty host."""
    import os
    import subprocess

    from lowprec_lab.sizing.recommend_plan import launch_line

    line = launch_line("train", ["recipe=bf16", "parallel.dp_shard=16"], 2, 8)
    fake = tmp_path / "torchrun"  # prints the arguments it was started with
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}"}
    ok = subprocess.run(["bash", "-c", line], env={**env, "HEAD_NODE": "node001"}, capture_output=True, text=True)
    assert ok.returncode == 0 and "--rdzv_endpoint=node001:29500" in ok.stdout.splitlines(), ok
    for pasted in (line, f"HEAD_NODE=node001 {line}"):
        bad = subprocess.run(["bash", "-c", pasted], env=env, capture_output=True, text=True)
        assert bad.returncode != 0 and bad.stdout == "", bad
        assert len(bad.stderr.strip().splitlines()) == 1 and "export HEAD_NODE=" in bad.stderr, bad.stderr
