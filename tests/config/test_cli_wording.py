"""What a user reads when a key or a name is wrong, and each command's help page: one line in lowprec's words (no
Hydra class or defaults-list wording), the nearest names, the same words from every command, no MLflow store; and
the help pages' keys kept equal to the composed configs' keys."""

import pytest
from omegaconf import OmegaConf

from lowprec_lab.cli import compose, main
from lowprec_lab.plan import argcheck
from lowprec_lab.plan import help as pages

#: Hydra's and OmegaConf's wording, which names their internals rather than the user's mistake
INTERNALS = (
    "TrainNode",
    "AblateConfig",
    "MoEArgs",
    "Float8Spec",
    "defaults list",
    "Could not find",
    "Could not override",
    "Ambiguous value",
)

WRONG = [
    # (command and arguments, what the one line must contain)
    (["train", "train.step=3"], "unknown key train.step, did you mean train.steps? (lowprec train --help lists"),
    (["ablate", "report.marign=0.01"], "unknown key report.marign, did you mean report.margin?"),
    (["ablate", "seed=1", "wokers=2"], "unknown key wokers, did you mean workers?"),
    (
        ["train", "model=nonexistent"],
        "unknown model 'nonexistent'; known: debug, tiny, small, 125m, llama3_1b, llama3_8b, llama3_70b, moe_debug",
    ),
    (["train", "model=tinny"], "unknown model 'tinny', did you mean tiny? known: debug, tiny"),
    (["ablate", "recipe=bf16"], "recipe=: lowprec ablate runs a list of recipes, given as 'recipes=[bf16]'"),
    (
        ["ablate", "recipes=bf16,fp8_rowwise"],
        "recipes=bf16,fp8_rowwise: recipes= takes a list, in brackets: 'recipes=[bf16,fp8_rowwise]'",
    ),
    (["ablate", "recipes=bf16"], "recipes=bf16: recipes= takes a list, in brackets: 'recipes=[bf16]'"),
    (["train", "recipes=[bf16]"], "recipes= is a key of lowprec ablate; lowprec train runs one recipe=NAME"),
    (["train", "recipe=fp8_rowwse"], "unknown recipe 'fp8_rowwse', did you mean fp8_rowwise? known: fp32, "),
    # an FP8 field by its path from before the fields were grouped by role: the path it has now
    (
        ["train", "recipe=fp8_current", "recipe.fp8.strategy=delayed"],
        "unknown key recipe.fp8.strategy: the FP8 fields are grouped by role now; use recipe.fp8.cast.strategy",
    ),
    (
        ["train", "recipe=deepseek_v3", "recipe.fp8.hp_last_blocks=1"],
        "unknown key recipe.fp8.hp_last_blocks: the FP8 fields are grouped by role now; use "
        "recipe.fp8.layers.hp_last_blocks",
    ),
    (["ablate", "recipes=[bf16,fp8_rowwse]"], "unknown recipe 'fp8_rowwse', did you mean fp8_rowwise? known: fp32, "),
    (["ablate", "experiment=smok"], "unknown experiment 'smok', did you mean smoke? known: "),
    (["train", "data=txt"], "unknown data source 'txt', did you mean text? known: stdlib, text, tokens"),
    (["ablate", "launcher=slrum"], "unknown launcher 'slrum', did you mean slurm?"),
]


def _check_one_line(err: str, cmd: str, needle: str) -> None:
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"lowprec {cmd}: error: ") and needle in err, err
    assert not any(word in err for word in INTERNALS), err


@pytest.mark.parametrize("args, needle", WRONG, ids=[" ".join(a) for a, _ in WRONG])
def test_a_wrong_key_or_name_is_one_line_with_the_nearest_names(args, needle, run_dirs, tmp_path, capsys):
    assert main([*args[:1], *run_dirs, *args[1:]]) == 2
    _check_one_line(capsys.readouterr().err.strip(), args[0], needle)
    assert not (tmp_path / "runs").exists()  # refused before anything is written, the store included


def test_train_and_ablate_word_an_unknown_recipe_alike(run_dirs, capsys):
    assert main(["train", *run_dirs, "recipe=fp8_rowwse"]) == 2
    train = capsys.readouterr().err.split("error: ", 1)[1]
    assert main(["ablate", *run_dirs, "recipes=[bf16,fp8_rowwse]"]) == 2
    ablate = capsys.readouterr().err.split("error: ", 1)[1]
    assert train == ablate


#: the same mistakes where Hydra itself refuses them (keys of an open node, the commands that compose the ablate
#: config for the store, the planning commands): said in lowprec's words too
HYDRA_REFUSED = [
    (["train", "model.n_layer=2"], "unknown key model.n_layer, did you mean model.n_layers?"),
    (["train", "model=moe_debug", "+model.n_experts=4"], "unknown key model.n_experts: the model size has no field"),
    (["train", "recipe=fp8_rowwise", "+recipe.fp8.scalingg=1"], "unknown key recipe.fp8.scalingg: recipe.fp8 has no"),
    (["ui", "tracking.urx=3"], "unknown key tracking.urx, did you mean tracking.uri?"),
    (["report", "abl-x", "recipes=bf16,fp8_rowwise"], "put a list in brackets, 'recipes=[bf16,fp8_rowwise]'"),
    (["report", "abl-x", "report.marign=1"], "unknown key report.marign, did you mean report.margin?"),
    (["estimate", "model=llama3_8b", "recipe=fp8_rowwse"], "unknown recipe 'fp8_rowwse', did you mean fp8_rowwise?"),
    (["estimate", "model=nonexistent"], "unknown model 'nonexistent'; known: "),
]


@pytest.mark.parametrize("args, needle", HYDRA_REFUSED, ids=[" ".join(a) for a, _ in HYDRA_REFUSED])
def test_what_hydra_refuses_is_said_in_lowprecs_words(args, needle, run_dirs, tmp_path, capsys):
    assert main([*args, *(run_dirs if args[0] != "estimate" else [])]) == 2
    _check_one_line(capsys.readouterr().err.strip(), args[0], needle)
    assert not (tmp_path / "runs" / "mlflow.db").exists()


def test_a_valid_command_line_passes_the_precheck():
    """Every kind of argument the precheck reads, valid: nothing is refused (a false refusal would stop a run)."""
    argcheck.precheck(
        "ablate",
        [
            "experiment=smoke",
            "recipes=[bf16,fp8_rowwise]",
            "models=[debug,125m]",
            "model=moe_debug",
            "model.n_layers=2",
            "data=tokens",
            "data.path=/x",
            "launcher=slurm",
            "launcher.partition=gpu",
            "seeds=auto",
            "report.margin=0.01",
            "study.deepseek_v3.k_max=256",
            "+study.deepseek_v3.kmax=1",
            "hydra.run.dir=.",
            "paths.runs=${oc.env:HOME}/runs",
        ],
    )
    argcheck.precheck("train", ["recipe=fp8_comm8", "recipe.fp8.cast.margin=1", "train.eval_ema=0.99", "seed=3"])


@pytest.mark.parametrize("cmd", ["train", "ablate"])
def test_the_schema_read_from_source_is_the_composed_config(cmd):
    """``argcheck.schema`` (read from the dataclasses' source) against Hydra's composition: the same keys at every
    level, the open nodes apart. A field added to a dataclass shows up in both."""
    cfg = OmegaConf.to_container(compose(cmd, []), resolve=False)

    def check(node: dict, tree: dict, where: str) -> None:
        assert set(node) - {"recipe"} == set(tree) - {"hydra", "recipe"}, where
        for k, sub in tree.items():
            if isinstance(sub, dict):
                check(node[k], sub, f"{where}{k}.")

    check(cfg, argcheck.schema(cmd), "")


def test_group_options_read_from_source_are_the_registered_ones():
    from lowprec.model import MODEL_CONFIGS
    from lowprec.recipes import CATALOG
    from lowprec_lab.plan.config import DATA_SOURCES
    from lowprec_lab.plan.launcher import LAUNCHERS

    assert argcheck.group_options("recipe") == list(CATALOG)
    assert argcheck.group_options("model") == list(MODEL_CONFIGS)
    assert argcheck.group_options("data") == list(DATA_SOURCES)
    assert argcheck.group_options("launcher") == list(LAUNCHERS)
    assert "smoke" in argcheck.group_options("experiment")


@pytest.mark.parametrize("cmd", ["train", "ablate"])
def test_every_key_has_a_one_line_meaning(cmd):
    """``pages.DOCS`` covers every key of the composed config; add a line there for a new field."""
    from lowprec_lab.plan.config import leaves

    cfg = OmegaConf.to_container(compose(cmd, []), resolve=False)
    for k in ("model", "recipe", "study", "hydra", "seeds"):  # seeds: an int, or a mapping per recipe
        cfg.pop(k, None)
    composed = set(leaves(cfg)) | ({"model", "recipe"} if cmd == "train" else {"model", "study", "seeds"})
    assert set(pages.keys(cmd)) == composed
    assert composed <= set(pages.DOCS), sorted(composed - set(pages.DOCS))


MEANINGS = {
    "seeds": "seeds per recipe: N (seed .. seed+N-1, paired across recipes); auto",
    "workers": "runs trained at once, each in its own process",
    "control": "the reference recipe of the loss gaps and verdicts",
    "report.margin": "non-inferiority margin, relative, on the validation loss (0.0025 = 0.25%)",
}


@pytest.mark.parametrize("cmd", ["train", "ablate", "report", "sync", "estimate", "recommend", "data"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_each_command_has_a_help_page(cmd, flag, capsys):
    argv = [cmd, "prepare", flag] if cmd == "data" else [cmd, flag]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: lowprec {cmd}")
    assert "powered by Hydra" not in out and "faults" not in out
    if cmd == "ablate":
        flat = " ".join(out.split())  # a meaning may wrap onto the next line
        for key, meaning in MEANINGS.items():
            assert f"{key} {meaning}" in flat, key
    if cmd == "train":
        assert "train.steps" in out and "recipe=" in out and "\n  seeds " not in out


def test_help_command_names_a_page(capsys):
    assert main(["help", "ablate"]) == 0
    assert capsys.readouterr().out == pages.help_page("ablate") + "\n"


def test_hydras_own_help_is_still_there(capsys):
    with pytest.raises(SystemExit) as done:  # Hydra's help ends the process itself, with status 0
        main(["train", "--hydra-help"])
    assert done.value.code == 0
    assert "powered by Hydra" in capsys.readouterr().out
