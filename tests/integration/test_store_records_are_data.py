"""A tracking store's records are data: a ``checkpoint_dir`` tag is read only inside this store's own checkpoint
folder of its run, a resume of a finished ablation changes nothing, and a child run killed as it was created (no
params) is marked FAILED, left out of the report and started again by ``resume=``. Every ablation here is fabricated
in a real MLflow sqlite store (no training) with the ``config.yaml`` a real ablation logs, and read back by the real
resume and report code."""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
from pathlib import Path

import fabricated_ablation as fabricated
import pytest
from mlflow.entities import Metric
from store_dirs import dirs_under

import lowprec_lab.plan.preflight
import lowprec_lab.runner.scheduler
from lowprec.recipes import get_recipe
from lowprec.train.checkpoint_files import write_manifest
from lowprec_lab.cli import compose, main, plan_of
from lowprec_lab.report.build import build_report, report_figures
from lowprec_lab.report.html import ReportFigureError, markdown_to_html
from lowprec_lab.runner.resume import plan_resume, reopen_parent
from lowprec_lab.runner.scheduler import run_jobs
from lowprec_lab.tracking.runs import INCOMPLETE_KIND, load_runs
from lowprec_lab.tracking.tracker import ABLATION_TAG, Tracker

RUN = ["model=debug", "model.qk_norm=false"]
RUN += ["train.batch_size=2", "train.seq_len=16", "train.val_every=0", "train.val_batches=1"]
RUN += ["train.warmup_steps=1", "train.timing_warmup_steps=1", "train.telemetry_every=0", "train.steps=4"]
RECIPES = ["fp32", "bf16"]
SUMMARY = {
    "final_val_loss": 5.0,
    "mean_tokens_per_s": 100.0,
    "state_bytes_per_param": 16.0,
    "mem_peak_bytes": 1e8,
    "mem_peak_growth_bytes": 1e6,
}


@pytest.fixture(autouse=True)
def two_cores(monkeypatch):
    """``workers=2`` passes preflight on any machine (it checks the cores it shares out)."""
    monkeypatch.setattr(lowprec_lab.runner.scheduler, "cores", lambda: 2)
    monkeypatch.setattr(lowprec_lab.plan.preflight, "cores", lambda: 2)


def _args(root: Path, *extra: str) -> list[str]:
    return [
        f"recipes=[{','.join(RECIPES)}]",
        "controls=false",
        "seeds=1",
        "control=fp32",
        *RUN,
        *dirs_under(root),
        *extra,
    ]


class _Payload:
    """Unpickling this object writes ``marker``: the proof that a file was loaded as code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def _fabricate(root: Path, parent_status: str, children: dict[tuple[str, int], str]):
    """An ablation as ``lowprec ablate`` records it (parent tags, its ``config.yaml``; children with their tags,
    params, ``recipe_hash``, losses and summary), children by (recipe, seed) -> status; ``"NOPARAMS"``: a RUNNING
    child created without its params (its process killed right after ``create_run``). Returns (tracker, parent id,
    ablation id, {key: run id})."""
    abl = "abl-20260101-000000-beef"
    plan = plan_of(compose("ablate", _args(root)))
    tracker = Tracker(plan.tracking.uri, plan.tracking.experiment, plan.paths.runs)
    parent = tracker.start_run(
        abl,
        {ABLATION_TAG: abl, "lowprec.kind": "ablation", "recipes": '["fp32", "bf16"]', "control": "fp32"},
    )
    tracker.log_params(parent, {"train.steps": 4, "train.batch_size": 2, "train.seq_len": 16, "train.ac": "none"})
    tracker.log_text(parent, plan.yaml(), "config.yaml")
    ids = {}
    for (recipe, seed), status in children.items():
        tags = {"recipe": recipe, "seed": str(seed), ABLATION_TAG: abl, "recipe_hash": get_recipe(recipe).hash()}
        rid = tracker.start_run(f"{recipe}/seed{seed}", tags, parent)
        ids[recipe, seed] = rid
        if status == "NOPARAMS":
            continue
        tracker.log_params(rid, {"train.batch_size": 2, "train.grad_accum": 1, "train.seq_len": 16})
        ms = [Metric("loss", 6.0 - s, 0, s) for s in range(4 if status == "FINISHED" else 3)]
        if status == "FINISHED":
            ms += [Metric(k, v, 0, 4) for k, v in SUMMARY.items()]
            tracker.set_tags(rid, {"effective_matches": "true"})
        tracker.client.log_batch(rid, metrics=ms)
        tracker.end_run(rid, status, None if status == "FINISHED" else "stopped by SIGTERM after step 2")
    tracker.end_run(parent, parent_status)
    return tracker, parent, abl, ids


def _checkpoint(folder: Path, marker: Path) -> Path:
    """``folder/step_2``: a checkpoint whose manifest verifies, holding a pickle that writes ``marker`` if loaded."""
    step = folder / "step_2"
    step.mkdir(parents=True)
    (step / "trainer_state.pt").write_bytes(pickle.dumps(_Payload(marker)))
    write_manifest(step)
    return step


def test_a_checkpoint_dir_tag_outside_the_stores_own_folder_is_never_read(tmp_path):
    tracker, parent, abl, ids = _fabricate(tmp_path, "KILLED", {("fp32", 0): "FINISHED", ("bf16", 0): "KILLED"})
    killed = ids["bf16", 0]
    marker = tmp_path / "marker"
    outside = tmp_path / "received" / killed
    _checkpoint(outside, marker)
    tracker.set_tags(killed, {"checkpoint_dir": str(outside)})
    plan = plan_of(compose("ablate", _args(tmp_path, f"resume={abl}")))
    resume = plan_resume(plan)
    resume.lock.release()
    (c,) = resume.continued.values()
    assert c.checkpoint is None, "a folder named by a tag outside the store's own folder was chosen to load"
    assert f"its checkpoint_dir tag '{outside}' lies outside this store's folder" in c.was
    assert not marker.exists()

    # a folder inside the run's own folder whose step links out is not read either
    own = tmp_path / "runs" / "checkpoints" / killed
    own.mkdir(parents=True)
    (own / "step_2").symlink_to(outside / "step_2")
    tracker.set_tags(killed, {"checkpoint_dir": str(own)})
    resume = plan_resume(plan)
    resume.lock.release()
    (c,) = resume.continued.values()
    assert c.checkpoint is None and "step_2 (a link out of" in c.was

    # the store's own folder of the run: continued from its newest checkpoint (the rule allows what run.py writes)
    (own / "step_2").unlink()
    _checkpoint(own, marker)
    resume = plan_resume(plan)
    resume.lock.release()
    (c,) = resume.continued.values()
    assert c.checkpoint == str(own / "step_2")
    assert not marker.exists()  # deciding reads the manifest, never the pickle


def test_no_workers_are_started_for_no_runs():
    assert run_jobs(None, [], None, None, "parent", "abl", 2) == []


def test_resuming_a_finished_ablation_with_two_workers_changes_nothing(tmp_path):
    tracker, parent, abl, _ = _fabricate(tmp_path, "FINISHED", {("fp32", 0): "FINISHED", ("bf16", 0): "FINISHED"})
    before = tracker.client.get_run(parent)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["ablate", *_args(tmp_path, "workers=2", f"resume={abl}")]) == 0
    assert out.getvalue().strip() == (
        f"resume={abl}: the ablation already finished (2 run(s), parent run FINISHED); nothing to resume, nothing "
        f"changed; its report: lowprec report {abl}"
    )
    after = tracker.client.get_run(parent)
    assert after.info.status == "FINISHED" and after.info.end_time == before.info.end_time
    assert after.data.tags == before.data.tags


def test_a_child_killed_at_creation_is_marked_failed_left_out_and_started_again(tmp_path):
    tracker, parent, abl, ids = _fabricate(tmp_path, "FAILED", {("fp32", 0): "FINISHED", ("bf16", 0): "NOPARAMS"})
    broken = ids["bf16", 0]
    # the report reads the ablation: the run without params is left out, said once, and nothing raises
    skipped: list = []
    runs = load_runs(tracker, parent, skipped)
    assert [(r.recipe, r.seed) for r in runs] == [("fp32", 0)]
    assert skipped == [(broken, skipped[0][1])] and "no param train.batch_size" in skipped[0][1]
    report = build_report(tracker, abl, tmp_path / "reports")
    text = report.read_text()
    assert broken in text.split("## Failed or excluded runs")[1] and "incomplete record" in text

    # the resume marks it FAILED with the reason and starts its (recipe, seed) again, in a new run
    plan = plan_of(compose("ablate", _args(tmp_path, f"resume={abl}")))
    resume = plan_resume(plan)
    resume.lock.release()
    assert list(resume.incomplete) == [broken] and not resume.finished
    assert ("bf16", 0) not in resume.kept and ("bf16", 0) not in resume.continued
    reopen_parent(tracker, resume)
    run = tracker.client.get_run(broken)
    assert run.info.status == "FAILED" and run.data.tags["failure_kind"] == INCOMPLETE_KIND
    assert run.data.tags["failure_reason"].startswith("incomplete record: no param train.batch_size")
    # marked once: a later resume does not mark it again, and still starts (bf16, 0)
    tracker.end_run(parent, "FAILED", "test: the resume was killed")
    again = plan_resume(plan)
    again.lock.release()
    assert again.incomplete == {} and ("bf16", 0) not in again.kept and ("bf16", 0) not in again.continued


def test_store_strings_reach_the_report_as_literal_text_and_no_file_outside_it_is_inlined(tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"TOPSECRET-bytes-of-a-file-outside-the-report")
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "lowprec", tmp_path)
    abl = "abl-escape"
    parent = fabricated.parent_run(tracker, abl, ["bf16", "fp8_rowwise"])
    for seed in (0, 1):
        fabricated.child_run(tracker, parent, abl, "bf16", seed, 4.0 + seed / 100)
    reason = f"![x]({secret}) ![y](../../secret.png) <script>alert(1)</script>\n# heading | cell"
    fabricated.child_run(tracker, parent, abl, "fp8_rowwise", 0, None, reason)
    fabricated.child_run(tracker, parent, abl, "fp8_rowwise", 1, 4.01)
    kid = [r for r in load_runs(tracker, parent) if r.recipe == "fp8_rowwise" and r.seed == 1][0]
    tracker.set_tags(kid.run_id, {"recipe_short": "`<img src=x onerror=alert(1)>`|"})
    tracker.set_tags(parent, {"corpus": f"![c]({secret})", "device": "<b>cpu</b>"})
    tracker.end_run(parent, "FINISHED")
    report = build_report(tracker, abl, tmp_path / "reports")
    md, page = report.read_text(), (report.parent / "report.html").read_text()
    assert "TOPSECRET" not in page and base64.b64encode(secret.read_bytes()).decode()[:24] not in page
    line = next(x for x in md.splitlines() if "fp8_rowwise` seed 0: FAILED" in x)  # the reason stays on its line
    assert line.endswith(
        "\\!\\[y\\](../../secret.png) \\<script\\>alert(1)\\</script\\> \\# heading \\| cell (run `"
        + line.rsplit("`", 2)[1]
        + "`)"
    )
    assert "\\!\\[x\\](/" in line
    assert "data: \\!\\[c\\](/" in md and "\\<b\\>cpu\\</b\\>" in md
    assert f"![x]({secret})" in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script" not in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page and "<img src=x" not in page
    assert page.count("<img ") == len(report_figures(report))  # only the report's own figures


def test_the_inliner_embeds_only_plain_files_of_the_report_folder(tmp_path):
    folder, outside = tmp_path / "report", tmp_path / "outside.png"
    folder.mkdir()
    outside.write_bytes(b"outside")
    (folder / "loss.png").write_bytes(b"own figure")
    (folder / "link.png").symlink_to(outside)
    (folder / "sub").mkdir()
    (folder / "sub" / "x.png").write_bytes(b"nested")
    page = markdown_to_html("![loss](loss.png)\n", folder, "t")
    assert base64.b64encode(b"own figure").decode() in page
    assert "<img" not in markdown_to_html("![x](file:///etc/passwd)\n", folder, "t")  # markdown-it: no such link
    for src in (str(outside), "../outside.png", "link.png", "sub/x.png", "..", "missing.png"):
        with pytest.raises(ReportFigureError, match="the report names the figure"):
            markdown_to_html(f"![x]({src})\n", folder, "t")
