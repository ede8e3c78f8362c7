"""The grid of training settings (lowprec_lab/plan/grid.py): axes, points, refusals before anything trains."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from lowprec.errors import ConfigError
from lowprec_lab.plan.grid import GRID_ROOTS, apply_point, grid_axes, grid_points, point_text


def _cfg(grid):
    return OmegaConf.create(
        {
            "grid": grid,
            "seed": 0,
            "recipes": ["bf16", "fp32"],
            "optim": {"lr": 0.003},
            "train": {"warmup_steps": 20, "z_loss": 0.0},
            "model": {"dim": 64},
            "stability": {"window": 20},
            "data": {"path": None},
            "paths": {"runs": "runs"},
        }
    )


def test_points_are_the_product_of_the_axes_in_the_order_written():
    cfg = _cfg({"optim": {"lr": [0.001, 0.002, 0.004]}, "train": {"warmup_steps": [10, 40]}})
    assert grid_axes(cfg) == [("optim.lr", [0.001, 0.002, 0.004]), ("train.warmup_steps", [10, 40])]
    points = grid_points(cfg)
    assert len(points) == 6
    assert points[0] == {"optim.lr": 0.001, "train.warmup_steps": 10}
    assert points[1] == {"optim.lr": 0.001, "train.warmup_steps": 40}  # the last axis varies fastest
    assert point_text(points[-1]) == "optim.lr=0.004 train.warmup_steps=40"


def test_no_grid_is_no_point():
    assert grid_points(_cfg({})) == []
    assert grid_points(OmegaConf.create({"recipes": ["bf16"]})) == []


def test_apply_point_sets_the_values_and_clears_the_grid():
    cfg = _cfg({"optim": {"lr": [0.001, 0.002]}})
    apply_point(cfg, {"optim.lr": 0.002, "train.warmup_steps": 5})
    assert cfg.optim.lr == 0.002 and cfg.train.warmup_steps == 5 and not cfg.grid


@pytest.mark.parametrize(
    "grid, words",
    [
        ({"optim": {"lr": [0.003]}}, "at least 2 values; for one value set optim.lr=0.003"),
        ({"optim": {"lr": []}}, "at least 2 values"),
        ({"optim": {"lr": 0.003}}, "a grid axis is a list"),
        ({"optim": {"lr": [0.001, 0.001]}}, "repeats a value"),
        ({"optim": {"lrr": [0.001, 0.002]}}, "the config has no setting optim.lrr"),
        ({"train": [1, 2]}, "only training settings"),
    ],
)
def test_a_bad_axis_is_one_line(grid, words):
    with pytest.raises(ConfigError, match=words) as e:
        grid_axes(_cfg(grid))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["seed", "recipes", "data.path", "paths.runs", "grid"])
def test_only_training_settings_can_be_an_axis(key):
    """The allow-list: a grid over the seeds, the recipes, the data or the store's folders is refused (it would
    change what the verdicts compare, or where a run writes)."""
    root, _, leaf = key.partition(".")
    grid = {root: {leaf: [1, 2]}} if leaf else {root: [1, 2]}
    with pytest.raises(ConfigError, match="only training settings"):
        grid_axes(_cfg(grid))


def test_the_allowed_roots_are_the_training_settings():
    assert GRID_ROOTS == ("model", "optim", "train", "stability")
    for root, leaf in [("model", "dim"), ("optim", "lr"), ("train", "z_loss"), ("stability", "window")]:
        assert grid_axes(_cfg({root: {leaf: [1, 2]}})) == [(f"{root}.{leaf}", [1, 2])]
