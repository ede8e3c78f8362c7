"""``ablate seeds={others: N, NAME: M}``: a recipe's own seed count. The control trains the most seeds any recipe
trains, every other recipe a prefix of them, so each pairs with the control on all of its own seeds; the plan's
jobs, its words and the dry run's run count follow; a mapping on the command line replaces the experiment's whole.
(The refusals are rows of tests/config/test_bad_inputs.py; an ablation that trains them is
tests/integration/test_seeds_and_workers.py.)"""

from __future__ import annotations

from lowprec_lab.cli import compose, main
from lowprec_lab.plan.preflight import preflight

DEBUG = ["model=debug", "train.steps=4", "train.batch_size=2", "train.seq_len=64", "device=cpu", "workers=1"]


def _plan(run_dirs, *overrides: str):
    return preflight(compose("ablate", [*DEBUG, "dry_run=true", *run_dirs, *overrides]))


def test_the_control_trains_the_most_seeds_and_every_recipe_a_prefix_of_them(run_dirs):
    plan = _plan(
        run_dirs, "recipes=[fp32,bf16,fp8_rowwise]", "controls=false", "seed=10",
        "seeds={others:3,fp32:5,fp8_rowwise:1}",
    )  # fmt: skip
    assert plan.control == "bf16"
    assert plan.seeds == (10, 11, 12, 13, 14)  # the control's: the largest count
    assert [plan.seeds_of(n) for n in ("fp32", "bf16", "fp8_rowwise")] == [(10, 11, 12, 13, 14)] * 2 + [(10,)]
    # seed-major, recipes in order within a seed: a stopped ablation still has whole seeds
    assert [(r.name, s) for r, s in plan.jobs()] == [
        ("fp32", 10), ("bf16", 10), ("fp8_rowwise", 10),
        ("fp32", 11), ("bf16", 11), ("fp32", 12), ("bf16", 12),
        ("fp32", 13), ("bf16", 13), ("fp32", 14), ("bf16", 14),
    ]  # fmt: skip
    assert plan.seeds_text() == "5 seeds of fp32, bf16; 1 of fp8_rowwise"


def test_an_unnamed_recipe_keeps_seeds_and_the_control_rises_to_the_largest(run_dirs):
    plan = _plan(run_dirs, "recipes=[bf16,fp32]", "controls=true", "seeds={others:2,bf16_reordered:4}")
    assert [r.name for r in plan.recipes] == ["bf16", "fp32", "bf16_reordered", "fp8_unscaled"]
    assert {r.name: len(plan.seeds_of(r.name)) for r in plan.recipes} == {
        "bf16": 4, "fp32": 2, "bf16_reordered": 4, "fp8_unscaled": 2,
    }  # fmt: skip
    assert len(plan.jobs()) == 12


def test_the_controls_own_entry_raises_it_and_an_entry_for_an_untrained_recipe_does_nothing(run_dirs):
    plan = _plan(
        run_dirs, "recipes=[bf16,fp32]", "controls=false", "seeds={others:2,bf16:4,fp8_rowwise:5}",
    )  # fmt: skip
    assert [(r.name, len(plan.seeds_of(r.name))) for r in plan.recipes] == [("bf16", 4), ("fp32", 2)]


def test_without_recipe_seeds_every_recipe_trains_seeds(run_dirs):
    plan = _plan(run_dirs, "recipes=[bf16,fp32]", "controls=false", "seeds=3")
    assert plan.recipe_seeds == () and plan.seeds_of("fp32") == plan.seeds == (0, 1, 2)
    assert len(plan.jobs()) == 6 and plan.seeds_text() == "3 seeds"


def test_the_dry_run_counts_each_recipes_own_seeds(run_dirs, capsys):
    args = ["ablate", *DEBUG, *run_dirs, "dry_run=true", "recipes=[bf16,fp32]", "controls=false"]
    assert main([*args, "seeds={others:2,fp32:1}"]) == 0
    out = capsys.readouterr().out
    assert "dry run: 2 recipe(s) x 1-2 seeds = 3 runs on model=debug" in out
    assert "\nseeds per recipe: 2 of bf16; 1 of fp32\n" in out
    assert main([*args, "seeds=2"]) == 0
    out = capsys.readouterr().out
    assert "dry run: 2 recipe(s) x 2 seed(s) = 4 runs on model=debug" in out and "seeds per recipe" not in out


def test_a_mapping_on_the_command_line_replaces_the_experiments_and_a_dotted_key_changes_one_entry():
    default = compose("ablate", []).seeds  # the default experiment sizes each recipe
    assert default.others == 3 and default.bf16_reordered == 7
    assert dict(compose("ablate", ["seeds={others:2,fp32:1}"]).seeds) == {"others": 2, "fp32": 1}
    one = compose("ablate", ["seeds.bf16_reordered=10"]).seeds
    assert dict(one) == {**default, "bf16_reordered": 10}
    assert compose("ablate", ["seeds=3"]).seeds == 3


def test_hydras_own_flags_replace_the_mapping_too(capsys):
    # --cfg (and -m) hand the command line to hydra.main: the same replacement applies there
    assert main(["ablate", "--cfg", "job", "seeds={others:2,fp32:1}"]) == 0
    out = capsys.readouterr().out
    assert "seeds:\n  others: 2\n  fp32: 1\n" in out and "bf16_reordered: 7" not in out


def test_a_resume_reads_seeds_as_one_value_whatever_its_form():
    from lowprec_lab.runner.resume import config_difference

    said = config_difference({"seeds": 4, "name": "x"}, {"seeds": {"others": 4}, "name": "x"})
    assert said is not None and said.startswith("seeds=") and said.endswith("differs from the ablation's 4"), said
    same = {"seeds": {"others": 3, "fp8_tensorwise": 4}}
    assert config_difference(same, {"seeds": {"fp8_tensorwise": 4, "others": 3}}) is None
