"""The named fault points of a checkpoint save (``lowprec.train.fault_points``, ``at_point`` of ``LOWPREC_FAULTS``):
each is reached once per save, in order, with the files on disk that ``POINTS`` describes (a real DCP save of a small
model), so a kill or a full disk injected there lands where the campaign (benchmarks/faults.py) says it does."""

from __future__ import annotations

import pytest
import torch

from lowprec.errors import ConfigError
from lowprec.train import fault_points
from lowprec.train.checkpoint import save_checkpoint
from lowprec.train.checkpoint_files import prune
from lowprec_lab.runner.faults import parse


@pytest.fixture
def armed():
    yield fault_points.arm
    fault_points.disarm()


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def test_each_save_point_is_reached_once_in_order_with_the_files_it_describes(tmp_path, armed):
    model, opt = _trained()
    ckpts = tmp_path / "ckpt"
    save_checkpoint(ckpts / "step_1", model, opt, 1)
    seen: list[tuple[str, dict[str, int], list[str]]] = []

    def look(name: str) -> None:
        staging = ckpts / ".step_2.partial"
        files = {p.name: p.stat().st_size for p in staging.iterdir()} if staging.exists() else {}
        seen.append((name, files, sorted(p.name for p in ckpts.iterdir() if not p.name.startswith("."))))

    for name in fault_points.POINTS:
        armed(name, look)
    save_checkpoint(ckpts / "step_2", model, opt, 2)
    prune(ckpts, keep=1)

    assert [s[0] for s in seen] == [p for p in fault_points.POINTS if p.startswith("save.")]
    by = {name: (files, committed) for name, files, committed in seen}
    assert by["save.start"] == ({}, ["step_1"])
    shards, _ = by["save.shards"]
    whole = (ckpts / "step_2" / "__0_0.distcp").stat().st_size
    assert set(shards) == {"__0_0.distcp"} and 0 < shards["__0_0.distcp"] < whole  # part written
    assert set(by["save.trainer_state"][0]) == {"__0_0.distcp", ".metadata"}
    assert set(by["save.manifest"][0]) == {"__0_0.distcp", ".metadata", "trainer_state.pt", "values.json"}
    files, committed = by["save.rename"]
    assert set(files) == {"__0_0.distcp", ".metadata", "trainer_state.pt", "values.json", "manifest.json"}
    assert files["__0_0.distcp"] == whole and committed == ["step_1"]  # complete, not yet renamed
    assert by["save.prune"] == ({}, ["step_1", "step_2"])  # committed, the old one not yet deleted
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2"]


def test_an_unknown_point_or_action_is_refused_by_name():
    with pytest.raises(ConfigError, match="LOWPREC_FAULTS: at_point=save.middle is not one of save.start"):
        parse("at_point=save.middle")
    with pytest.raises(ConfigError, match="LOWPREC_FAULTS: point_action=explode"):
        parse("at_point=save.shards,point_action=explode")
    with pytest.raises(ConfigError, match="LOWPREC_FAULTS: point_hit=0"):
        parse("at_point=save.shards,point_hit=0")
    with pytest.raises(KeyError, match="no fault point"):
        fault_points.arm("save.middle", print)
