"""One source for defaults: every config group and node is registered from its Python dataclass
(lowprec_lab/plan/config.py); the yaml files under conf/ name only existing fields and restate no default, and
what Hydra composes is the registered defaults plus exactly what the yaml files set."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from lowprec.build_optim import OptimHParams
from lowprec.data import DataSpec
from lowprec.model import MODEL_CONFIGS, ModelArgs
from lowprec.recipe import Recipe
from lowprec.recipes import CATALOG
from lowprec.train.spec import TrainSpec
from lowprec_lab.plan.config import (
    CONF_DIR,
    DATA_SOURCES,
    GROUPS,
    SCHEMAS,
    AblateConfig,
    RunConfig,
    TrainConfig,
    data_from_cfg,
    leaves,
    model_from_cfg,
    optim_from_cfg,
    parallel_from_cfg,
    recipe_from_cfg,
    register_configs,
    train_from_cfg,
)
from lowprec_lab.plan.estimate_config import EstimateConfig, RecommendConfig

CONF = Path(CONF_DIR)
YAML_FILES = sorted(CONF.rglob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))

#: The root fields typed ``Any`` (model and recipe nodes are stored as dicts; data options carry a required
#: ``path: ???``, see RunConfig) and the dataclass their keys name; a model node also carries the size's ``name``.
ANY_FIELDS = {"model": ModelArgs, "recipe": Recipe, "data": DataSpec}
EXTRA_KEYS = {ModelArgs: {"name"}}
#: Primary configs and the root schema they start from; groups whose yaml files are ``@package _global_``.
PRIMARY = {
    "base.yaml": RunConfig,
    "train.yaml": TrainConfig,
    "ablate.yaml": AblateConfig,
    "estimate.yaml": EstimateConfig,
    "recommend.yaml": RecommendConfig,
}
GLOBAL_GROUPS = {"experiment": AblateConfig}
#: The options of every group registered from Python tables, and those added as yaml files (none today).
REGISTERED = {
    "model": sorted(MODEL_CONFIGS),
    "recipe": sorted(CATALOG),
    "data": sorted(DATA_SOURCES),
    **{g: sorted(opts) for g, opts in GROUPS.items()},
}
YAML_OPTIONS = {g: sorted(p.stem for p in (CONF / g).glob("*.yaml")) for g in REGISTERED}
OPTIONS = {g: sorted({*REGISTERED[g], *YAML_OPTIONS[g]}) for g in REGISTERED}


def _is_global(path: Path) -> bool:
    return any(line.strip().replace(" ", "") == "#@package_global_" for line in path.read_text().splitlines()[:5])


def _field_type(cls: type, name: str):
    """The type of field ``name`` (``Optional[X]`` -> ``X``; ``Any`` -> the dataclass of ``ANY_FIELDS``)."""
    t = typing.get_type_hints(cls)[name]
    if t is typing.Any:
        return ANY_FIELDS.get(name)
    args = [a for a in typing.get_args(t) if a is not type(None)]
    is_union = typing.get_origin(t) is typing.Union or isinstance(t, types.UnionType)
    return args[0] if is_union and len(args) == 1 else t


def schema_of(path: Path) -> tuple[type, str]:
    """The dataclass a yaml file's keys name, and the key prefix they sit under in the composed config."""
    rel = path.relative_to(CONF)
    if len(rel.parts) == 1:
        assert rel.name in PRIMARY, f"{rel}: a primary config this test does not know; add it to PRIMARY"
        return PRIMARY[rel.name], ""
    group = rel.parts[0]
    if _is_global(path):
        assert group in GLOBAL_GROUPS, f"{rel}: a _global_ group this test does not know; add it to GLOBAL_GROUPS"
        return GLOBAL_GROUPS[group], ""
    cls = _field_type(TrainConfig, group) if group in TrainConfig.__dataclass_fields__ else None
    assert dataclasses.is_dataclass(cls), f"{rel}: group {group!r} is no field of the root schema"
    return cls, group + "."


def _body(path: Path) -> dict:
    d = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    d.pop("defaults", None)
    d.pop("hydra", None)
    return d


def _default_of(cls: type):
    """An instance holding ``cls``'s defaults (fields without a default read ``'???'``)."""
    kw = {
        f.name: "???"
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    return cls(**kw)


def check_yaml(cls: type, node: dict, prefix: str = "", default=None) -> tuple[list[str], list[str]]:
    """(keys naming no field of ``cls``, leaves equal to the dataclass default they would override).

    ``default``: the instance holding the defaults (``cls``'s own when None). Under a field typed ``Any``
    (``model``, ``recipe``: each option has its own values) no default is checked."""
    if default is None:
        default = _default_of(cls)
    names = {f.name for f in dataclasses.fields(cls)} | EXTRA_KEYS.get(cls, set())
    unknown, restated = [], []
    for key, value in node.items():
        path = f"{prefix}{key}"
        if key not in names:
            unknown.append(f"{path} (no field {key!r} in {cls.__name__})")
            continue
        if key not in cls.__dataclass_fields__:  # EXTRA_KEYS
            continue
        sub = _field_type(cls, key)
        if isinstance(value, dict) and dataclasses.is_dataclass(sub):
            d = getattr(default, key) if default is not False else False
            if d is not False and not dataclasses.is_dataclass(d):  # a group field: MISSING in the root schema
                d = False if typing.get_type_hints(cls)[key] is typing.Any else _default_of(sub)
            u, r = check_yaml(sub, value, path + ".", d)
            unknown += u
            restated += r
        elif default is not False and not isinstance(value, dict) and getattr(default, key) == value and value != "???":
            restated.append(f"{path}: {value!r}")
    return unknown, restated


@pytest.mark.parametrize("path", YAML_FILES, ids=[str(p.relative_to(CONF)) for p in YAML_FILES])
def test_every_yaml_key_names_a_field_and_restates_no_default(path):
    cls, prefix = schema_of(path)
    unknown, restated = check_yaml(cls, _body(path), prefix)
    assert not unknown, f"{path.relative_to(CONF)}: keys that name no dataclass field: {unknown}"
    assert not restated, f"{path.relative_to(CONF)} restates dataclass defaults (one source: the dataclass): {restated}"


def test_the_checker_sees_unknown_and_restated_keys():
    unknown, restated = check_yaml(
        AblateConfig,
        {
            "seeds": 1,
            "train": {"stepz": 3, "steps": 200, "seq_len": 64},
            "optim": {"lr": OptimHParams().lr},
            "model": {"name": "x", "dimm": 1},
            "recipe": {"fp8": {"scalingg": "rowwise"}},
        },
    )
    assert sorted(unknown) == [
        "model.dimm (no field 'dimm' in ModelArgs)",
        "recipe (no field 'recipe' in AblateConfig)",
        "train.stepz (no field 'stepz' in TrainNode)",
    ]
    assert sorted(restated) == ["optim.lr: 0.003", "seeds: 1", "train.steps: 200"]
    assert check_yaml(TrainConfig, {"recipe": {"fp8": {"scalingg": 1}}})[0] == [
        "recipe.fp8.scalingg (no field 'scalingg' in Float8Spec)"
    ]


def _hydra(fn):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return fn()


def compose(config_name: str, overrides: list[str]):
    """Hydra's composition of conf/ (as ``lowprec_lab.cli.compose``, without the command line around it)."""
    return _hydra(lambda: hydra_compose(config_name=config_name, overrides=overrides))


def test_hydra_sees_every_registered_option_and_no_yaml_shadows_one():
    for group in REGISTERED:  # a yaml of the same name would shadow the registered node (or be matched to it)
        clash = set(YAML_OPTIONS[group]) & set(REGISTERED[group])
        assert not clash, f"conf/{group}/ has yaml files named like options registered from Python: {sorted(clash)}"
    assert not {p.stem for p in CONF.glob("*.yaml")} & set(SCHEMAS)
    loader = lambda: GlobalHydra.instance().config_loader()  # noqa: E731
    seen = _hydra(lambda: {g: loader().get_group_options(g) for g in [*OPTIONS, "experiment"]})
    assert seen == {**OPTIONS, "experiment": EXPERIMENTS}


def option_node(group: str, option: str):
    """What the option ``group/option`` holds: the registered node, or a yaml option over its dataclass."""
    if option in YAML_OPTIONS[group]:
        return OmegaConf.merge(
            OmegaConf.structured(_field_type(TrainConfig, group)), _body(CONF / group / f"{option}.yaml")
        )
    if group == "model":
        return OmegaConf.create({"name": option, **dataclasses.asdict(MODEL_CONFIGS[option])})
    if group == "recipe":
        return OmegaConf.create(CATALOG[option].to_dict())
    return OmegaConf.structured(GROUPS[group][option])


def _row(i: int) -> dict[str, str]:
    return {g: opts[i % len(opts)] for g, opts in OPTIONS.items()}


ROWS = max(map(len, OPTIONS.values()))


@pytest.mark.parametrize("i", range(ROWS), ids=lambda i: ",".join(_row(i).values()))
def test_every_group_option_composes_into_its_objects(i, tmp_path):
    """Rows of options that together cover every option of every group (model, recipe, data, optim, parallel,
    tracking): each composes to exactly the option's node and converts into lowprec's objects."""
    row = _row(i)
    cfg = compose("train", [f"{g}={o}" for g, o in row.items()])
    for group, option in row.items():
        got, want = (OmegaConf.to_container(n, resolve=False) for n in (cfg[group], option_node(group, option)))
        assert got == want, f"{group}={option}"
    if OmegaConf.is_missing(cfg.data, "path"):  # a value the user must give (data=text|tokens)
        cfg = OmegaConf.merge(cfg, {"data": {"path": str(tmp_path)}})
    plain = OmegaConf.to_container(cfg, resolve=True)
    args_cls = type(MODEL_CONFIGS[row["model"]]) if row["model"] in MODEL_CONFIGS else ModelArgs
    assert model_from_cfg(cfg.model) == args_cls(**{k: v for k, v in plain["model"].items() if k != "name"})
    assert recipe_from_cfg(cfg.recipe) == Recipe.from_dict(plain["recipe"])
    assert dataclasses.asdict(optim_from_cfg(cfg)) == plain["optim"]
    assert dataclasses.asdict(parallel_from_cfg(cfg)) == plain["parallel"]
    assert (
        dataclasses.asdict(data_from_cfg(cfg)) == plain["data"]
        and plain["data"]["cache_dir"] == plain["paths"]["cache"]
    )
    assert train_from_cfg(cfg) == TrainSpec()
    if row["model"] in MODEL_CONFIGS and row["recipe"] in CATALOG:
        assert model_from_cfg(cfg.model) == MODEL_CONFIGS[row["model"]]
        assert recipe_from_cfg(cfg.recipe) == CATALOG[row["recipe"]]


def _expected(schema: type, choices: dict, files: list[Path]) -> dict:
    """The registered defaults (root schema, and the chosen option of every group) with the leaves the yaml
    files set, in composition order."""
    exp = OmegaConf.to_container(OmegaConf.structured(schema), resolve=False)
    for group in exp:
        if group in OPTIONS:
            exp[group] = OmegaConf.to_container(option_node(group, choices[group]), resolve=False)
    for path in files:
        _, prefix = schema_of(path)
        for key, value in leaves(_body(path), prefix).items():
            node = exp
            *parents, last = key.split(".")
            for p in parents:
                if not isinstance(node.get(p), dict):  # a yaml mapping in place of a scalar default (seeds)
                    node[p] = {}
                node = node[p]
            node[last] = value
    return exp


@pytest.mark.parametrize("config_name, experiment", [("train", None), *[("ablate", e) for e in EXPERIMENTS]])
def test_composed_config_is_the_registered_defaults_plus_the_yaml(config_name, experiment):
    over = [f"experiment={experiment}"] if experiment else []
    cfg = _hydra(lambda: hydra_compose(config_name=config_name, overrides=over, return_hydra_config=True))
    choices = dict(cfg.hydra.runtime.choices)
    files = [CONF / "base.yaml", CONF / f"{config_name}.yaml"]
    if experiment:
        files.append(CONF / "experiment" / f"{experiment}.yaml")
    expected = _expected(TrainConfig if config_name == "train" else AblateConfig, choices, files)
    got = OmegaConf.to_container(cfg, resolve=False)
    got.pop("hydra")
    assert list(got) == list(expected)  # same keys, in the order of the root schema: none added or lost
    want = leaves(expected)
    diff = {k: (v, want.get(k, "<absent>")) for k, v in leaves(got).items() if want.get(k, object()) != v}
    diff.update({k: ("<absent>", v) for k, v in want.items() if k not in leaves(got)})
    assert not diff, f"composed value != registered default or yaml value: {diff}"
    if experiment:
        assert cfg.name == experiment and set(cfg.recipes) <= set(CATALOG)


def test_defaults_come_from_the_dataclasses():
    cfg = compose("train", [])
    assert optim_from_cfg(cfg) == OptimHParams() and OptimHParams().lr == 3e-3  # the LR the runs have always used
    # the train node's defaults, with train.compile/ac=auto resolved for this CPU (lowprec_lab.plan.auto_train) and
    # train.timing_warmup_steps=auto to min(3, steps - 1)
    node = dataclasses.asdict(_default_of(TrainConfig).train)
    want = {**node, "compile": False, "ac": "none", "timing_warmup_steps": min(3, node["steps"] - 1)}
    assert train_from_cfg(cfg) == TrainSpec(**want) and TrainSpec().timing_warmup_steps == 3
    raw = OmegaConf.to_container(cfg, resolve=False)
    assert (
        raw["paths"]["cache"] == "${oc.env:LOWPREC_CACHE,'~/.cache/lowprec'}"
        and raw["data"]["cache_dir"] == "${paths.cache}"
    )
    assert raw["tracking"]["uri"] == "sqlite:///${paths.runs}/mlflow.db"
    ablate = compose("ablate", [])
    assert ablate.control == AblateConfig.control and ablate.name == "default"
    assert AblateConfig.seeds == 1 and ablate.seeds.others == 3  # one seed unless an experiment asks for more
