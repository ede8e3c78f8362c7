"""``lowprec estimate`` / ``lowprec recommend`` predict the run on the part named by ``hardware=``: train's ``auto``
compile and AC are resolved for that part (a GPU), never for the machine the command runs on, and the output says
what it assumed. The ``recipe=all`` table labels its ranks, gives equal values one rank, and says what bounds each
step; the README's example shows the recipes' differences.

Every test makes this machine a CPU-only one (``torch.cuda.is_available`` is false), so a resolution for the
local machine (compile off, no AC) would show on any test machine, GPU or not.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from lowprec.estimate.cost_model import Layout, step_cost
from lowprec.estimate.hardware import get_hardware
from lowprec.model import model_args
from lowprec.recipes import get_recipe
from lowprec_lab.cli import main, planning_query
from lowprec_lab.sizing.estimate import competition_ranks

GIB = 2**30
#: torchtitan's measured peak on 32 H200s (benchmarks/llama3_8b_h200_2025-06_torchtitan.md; compile, selective AC)
TORCHTITAN_H200_GIB = 47.96
H200_32 = [
    "model=llama3_8b",
    "recipe=fp8_tensorwise_fsdp8",
    "hardware=h200",
    "parallel.dp_shard=32",
    "train.batch_size=64",
    "train.seq_len=8192",
]
README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(autouse=True)
def cpu_machine(monkeypatch):
    """This machine has no GPU, whatever the test machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _estimate(capsys, argv: list[str]) -> str:
    assert main(["estimate", *argv]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_estimate_resolves_auto_for_the_named_gpu_and_says_so(capsys):
    """Without train.compile= or train.ac=, the h200 run is compiled with selective AC, as lowprec train runs it on
    an H200: the peak is within 15% of torchtitan's measurement, and the output names what it assumed."""
    d = json.loads(_estimate(capsys, [*H200_32, "--json"]))
    assert (d["assumed"]["compile"], d["assumed"]["ac"]) == (True, "selective")
    assert (d["assumed"]["requested_compile"], d["assumed"]["requested_ac"]) == ("auto", "auto")
    total = d["totals"]["selective"] / GIB
    assert abs(total / TORCHTITAN_H200_GIB - 1) < 0.15, total
    assert d["cost_model"]["layout"]["compile"] is True and d["cost_model"]["layout"]["ac"] == "selective"
    out = _estimate(capsys, H200_32)
    assert "assumed: train.compile=auto -> true, train.ac=auto -> selective" in out
    assert "on h200, a GPU, not on this machine" in out
    assert "does not fit" not in out and "predicted step" in out
    assert "train.ac=selective, train.compile=true" in out  # the cost line times that run


def test_given_compile_and_ac_are_kept_as_given(capsys):
    """Explicit values are not resolved: eager without AC is the 142.7 GiB that does not fit an H200."""
    out = _estimate(capsys, [*H200_32, "train.compile=false", "train.ac=none"])
    assert "assumed: train.compile=false (as given), train.ac=none (as given)" in out
    assert "does not fit: 142.7 GiB with train.ac=none on h200" in out
    d = json.loads(_estimate(capsys, [*H200_32, "train.compile=false", "train.ac=selective", "--json"]))
    assert (d["assumed"]["compile"], d["assumed"]["ac"]) == (False, "selective")
    assert d["totals"]["selective"] / GIB == pytest.approx(64.62, abs=0.01)  # the FP32 loss transient, eager


def test_a_recipe_that_cannot_compile_is_estimated_eager_under_auto(capsys):
    """``auto`` falls back to eager per recipe, as train does: Transformer Engine's linears never compile."""
    argv = ["model=llama3_8b", "parallel.dp_shard=8", "train.batch_size=8", "train.seq_len=8192"]
    te = json.loads(_estimate(capsys, [*argv, "recipe=te_delayed", "--json"]))
    assert te["assumed"]["compile"] is False and "Transformer Engine" in te["assumed"]["fallback"]
    assert te["cost_model"]["layout"]["compile"] is False
    out = _estimate(capsys, [*argv, "recipe=te_delayed"])
    assert "train.compile=auto -> false" in out and "train.compile=auto ran this recipe eager" in out
    d = json.loads(_estimate(capsys, [*argv, "recipe=all", "--json"]))
    assert d["assumed"]["bf16"]["compile"] is True and d["assumed"]["te_delayed"]["compile"] is False
    assert d["cost_model"]["bf16"]["layout"]["compile"] is True
    assert d["cost_model"]["te_delayed"]["layout"]["compile"] is False


def test_a_moe_model_stays_eager_without_ac_under_auto(capsys):
    d = json.loads(_estimate(capsys, ["model=moe_debug", "recipe=bf16", "hardware=h100", "--json"]))
    assert (d["assumed"]["compile"], d["assumed"]["ac"]) == (False, "none")


def test_recommend_resolves_auto_for_the_named_gpu(capsys):
    """recommend times each recipe as train runs it on the part (compiled bf16 on an H100), prints what it assumed,
    and its command line says the compile the prediction assumed."""
    argv = ["model=debug", "hardware=h100", "gpus=1", "tokens=1e9", "train.seq_len=512", "recipes=[bf16_pure]"]
    argv += ["train.ac=auto", "tracking.uri=sqlite:////nonexistent/mlflow.db"]
    assert main(["recommend", *argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    by = {o["recipe"]: o for o in d["options"]}
    assert by["bf16_pure"]["compile"] is True and by["bf16_pure"]["ac"] == "selective"
    assert "train.compile=true" in d["commands"]["train"] and "train.ac=selective" in d["commands"]["train"]
    assert d["query"]["assumed"] == "train.compile=auto -> true on h100, train.ac=auto -> selective on h100"
    assert main(["recommend", *argv]) == 0
    assert "train.compile=auto -> true on h100, train.ac=auto -> selective on h100;" in capsys.readouterr().out


def test_recommend_times_each_recipe_with_its_own_compile():
    q = planning_query("recommend", ["model=llama3_8b", "hardware=h100", "gpus=8", "tokens=1e9"])
    assert q.compile == "auto"
    assert q.assumed["bf16"].compile is True and q.assumed["te_delayed"].compile is False
    q = planning_query("recommend", ["model=llama3_8b", "hardware=h100", "gpus=8", "tokens=1e9", "train.compile=false"])
    assert not any(r.compile for r in q.assumed.values())


def test_competition_ranks_share_equal_printed_values():
    assert competition_ranks({"a": "0.5", "b": "0.1232", "c": "0.1232", "d": "1,234"}) == {
        "a": 3,
        "b": 1,
        "c": 1,
        "d": 4,
    }


def test_step_cost_says_what_bounds_the_step():
    """Eight-way FSDP at one 256-token sequence per GPU: the FSDP communication outlasts the compute (the step is the
    communication's time); at 8192 tokens the compute does."""
    args, hw, bf16 = model_args("llama3_8b"), get_hardware("h100_sxm"), get_recipe("bf16")
    short = step_cost(args, bf16, hw, Layout(8, 1, 1, 256, "selective", True))
    assert short.bound == "communication"
    assert short.step_time_s == pytest.approx(short.fsdp_comm, rel=1e-9)  # compute hides under the communication
    long = step_cost(args, bf16, hw, Layout(8, 1, 1, 8192, "selective", True))
    assert long.bound == "compute" and long.step_time_s > long.fsdp_comm
    assert long.to_dict()["bound"] == "compute"


def _ranking(text: str) -> tuple[list[str], list[dict[str, str]]]:
    """The header cells and the rows (by header) of the ``recipe=all`` table in ``text``."""
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.lstrip().startswith("mem rank "))
    header = re.split(r" {1,}(?=\S)", lines[i].strip())
    # the headers of two words: join them back (a header cell has at most one inner space, a value none)
    cells, words = [], header
    known = {"mem rank", "state GiB", "act GiB", "total GiB", "step s", "time rank"}
    while words:
        two = " ".join(words[:2])
        if two in known:
            cells.append(two)
            words = words[2:]
        else:
            cells.append(words[0])
            words = words[1:]
    rows = []
    for line in lines[i + 1 :]:
        if not line.strip():
            break
        rows.append(dict(zip(cells, line.split(), strict=True)))
    return cells, rows


def test_ranking_labels_ranks_shares_ties_and_says_what_bounds_the_step(capsys):
    """At the default batch (8 x 256 tokens) most recipes' steps are the FSDP communication's: they share one time
    rank (no alphabetical order), the bound column says comm, and a line below the table says why they tie."""
    out = _estimate(capsys, ["model=llama3_8b", "recipe=all", "parallel.dp_shard=8"])
    cells, rows = _ranking(out)
    assert cells[0] == "mem rank" and cells[-1] == "time rank" and "bound" in cells
    timed = [r for r in rows if r["step s"] != "-"]
    comm = [r for r in timed if r["bound"] == "comm"]
    assert len(comm) >= 10
    by_time: dict[str, set[str]] = {}
    for r in timed:
        by_time.setdefault(r["step s"], set()).add(r["time rank"])
    assert all(len(ranks) == 1 for ranks in by_time.values()), by_time  # equal times, one rank
    by_mem: dict[str, set[str]] = {}
    for r in rows:
        by_mem.setdefault(r["total GiB"], set()).add(r["mem rank"])
    assert all(len(ranks) == 1 for ranks in by_mem.values()), by_mem
    assert f"bound=comm: {len(comm)} of {len(timed)} timed recipes are communication-bound" in out
    assert "time rank: 1 = fastest" in out and "mem rank: 1 = least memory" in out
    assert "assumed: train.compile=auto -> true" in out and "train.ac=auto -> selective" in out


def test_the_readme_example_shows_the_recipes_differences(capsys):
    """The README's ``lowprec estimate ... recipe=all`` line, run as printed: no recipe is communication-bound and
    the timed recipes spread over many step times (not 26 of 30 at one)."""
    line = next(x for x in README.read_text().splitlines() if "lowprec estimate " in x and "recipe=all" in x)
    words = shlex.split(line.split("#", 1)[0])
    argv = words[words.index("estimate") + 1 :]
    out = _estimate(capsys, argv)
    _, rows = _ranking(out)
    timed = [r for r in rows if r["step s"] != "-"]
    assert len(timed) >= 20 and not any(r["bound"] == "comm" for r in timed)
    times = [r["step s"] for r in timed]
    assert max(times.count(t) for t in times) <= len(timed) // 2, times
    assert len(set(times)) >= 6, times
