"""The ``lowprec`` command: ``train``, ``ablate``, ``report``, ``recipes``, ``estimate``, ``recommend``,
``selfcheck``, ``ui``, ``sync``, ``data``.

``train`` and ``ablate`` take Hydra overrides (``key=value``). A plain call composes the config with
Hydra's compose API so that a bad override or an invalid recipe ends in one clear line (exit 2);
``-m``/``--multirun`` (and Hydra's other ``--`` flags) hand the call to ``hydra.main`` unchanged.
``--version`` prints the installed versions; ``--shell-completion install=bash`` (``-sc``, also after ``train`` or
``ablate``) prints the completion script for ``lowprec`` (``lowprec_lab.commands.completion``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lowprec.errors import UserError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from lowprec_lab.plan.plan import Plan

# Every other import is in the function that needs it: torch, MLflow and the catalog cost ~10 s together, which
# `lowprec --help`, `--version` and shell completion must not pay (tests/unit/test_cli_startup.py).

USAGE = """usage: lowprec {train,ablate,report,recipes,estimate,recommend,selfcheck,ui,sync,data} ...
       lowprec --version | --help | --shell-completion install=bash

  lowprec train recipe=NAME model=SIZE [key=value ...]   one run (add -m to sweep with Hydra multirun)
  lowprec ablate [experiment=NAME] ['recipes=[a,b]'] [seeds=N|auto [max_seeds=8]] [workers=N] [key=value ...]
                 [resume=ABLATION_ID]                   continue an interrupted ablation (same overrides)
  lowprec report ABLATION_ID [tracking.uri=...] [paths.reports=...] [report.margin=X]
  lowprec recipes [--json]
  lowprec estimate [model=SIZE] [recipe=NAME|all] [hardware=NAME] [train.batch_size=N] [train.seq_len=N]
                   [train.ac=MODE] [train.compile=BOOL] [parallel.dp_shard=N] [parallel.tp=N] [key=value ...]
                   [--emulate] [--json]                   the run `lowprec train` would make with the same keys
  lowprec estimate --validate [--json]                   the cost model against published measurements
  lowprec recommend model=SIZE hardware=NAME gpus=N tokens=T [max_loss_gap=0.25%] [train.batch_size=N]
                    [train.seq_len=N] [train.ac=MODE] [train.compile=BOOL] [key=value ...] [--json]
                                                         prints the train and ablate lines of its top choice
  lowprec selfcheck [--quick]                            known-answer checks of the verdicts (exit 1 on a miss)
  lowprec ui [--port 5000] [tracking.uri=...]            the MLflow UI on the store (Ctrl-C stops it)
  lowprec sync PATH [tracking.uri=...]                   replay what runs spooled while their server was down
  lowprec data prepare source=PATH|HF_DATASET out=DIR [tokenizer=bpe|FILE|HF_NAME] [key=value ...]
                                                         token shards for data.source=tokens (resumable)
  lowprec checkpoint convert SRC DST                     an older lowprec's checkpoint (pickled byte records) to
                                                         the current format, without running code from it

  lowprec COMMAND --help (or lowprec help COMMAND): that command's forms and every key it takes, one line each
"""


# Errors a user can cause with a bad value print as one line (exit 2). Anything else is a bug and keeps its
# traceback: a ValueError or KeyError raised inside lowprec is not taken for a user's mistake.
def _user_errors():
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return (UserError, HydraException, OmegaConfBaseException)


def _in_our_words(e: BaseException) -> str | None:
    """Hydra's refusals that name its internals (``Key 'step' not in 'TrainNode'``, ``Could not find
    'model/x'``, ``No match in the defaults list``, ``Ambiguous value``) in lowprec's words, with the nearest
    names (``lowprec_lab.plan.argcheck``); None for any other exception."""
    import re

    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    from lowprec.recipe import moved_fp8_key
    from lowprec_lab.plan.argcheck import did_you_mean, unknown_option

    if isinstance(e, UserError):
        # ``config.typed``'s refusal of a field the model size or recipe group lacks keeps OmegaConf's words
        m = re.match(r"([\w.]+): Key '(\w+)' (?:is )?not in '?\w+'?", str(e))
        if not m:
            return None
        if moved_fp8_key(m[1]):
            return f"unknown key {m[1]}: the FP8 fields are grouped by role now; use {moved_fp8_key(m[1])}"
        owner = "the model size" if m[1].startswith("model.") else f"{m[1].rpartition('.')[0]}"
        return f"unknown key {m[1]}: {owner} has no field {m[2]!r}"
    chain = []
    while e is not None:
        chain.append(e)
        e = e.__cause__
    for x in chain:
        unknown_key = isinstance(x, ConfigKeyError | ConfigAttributeError) and " not in " in str(x)
        if unknown_key and getattr(x, "full_key", None):
            moved = moved_fp8_key(x.full_key)
            if moved:
                return f"unknown key {x.full_key}: the FP8 fields are grouped by role now; use {moved}"
            parent, _, _ = x.full_key.rpartition(".")
            node = getattr(x, "parent_node", None)
            names = [f"{parent}.{k}" if parent else str(k) for k in (node.keys() if node is not None else ())]
            return f"unknown key {x.full_key}{did_you_mean(x.full_key, names)}"
        if isinstance(x, MissingConfigException):
            m = re.search(r"Could not find '(\w+)/([^']+)'", str(x))
            if m and getattr(x, "options", None):
                return unknown_option(m[1], m[2], list(x.options))
        if isinstance(x, ConfigCompositionException):
            msg = str(x)
            m = re.match(r"Could not override '([^']+)'\. No match in the defaults list", msg)
            if m:
                also = "; it takes a list, 'recipes=[a,b]'" if m[1] == "recipe" else ""
                return f"unknown key or config group {m[1]!r} (this command has no {m[1]}=){also}"
            m = re.match(r"Ambiguous value for argument '([^=']+)=([^']*)'", msg)
            if m:
                return (
                    f"{m[1]}={m[2]}: put a list in brackets, '{m[1]}=[{m[2]}]' (quoted for the shell; a bare comma "
                    "list is a Hydra sweep, for -m)"
                )
    return None


def one_line(e: BaseException) -> str:
    """First non-empty message along the exception's cause chain (Hydra wraps the useful one); for a config
    group option that does not exist (``recipe=fp9``), the valid options are appended. Hydra's refusals that
    name its internals are said in lowprec's words (``_in_our_words``)."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    ours = _in_our_words(e)
    if ours:
        return ours
    parts = []
    while e is not None:
        msg = str(e).strip()
        if msg:
            line = msg.splitlines()[0]
            if isinstance(e, MissingConfigException) and getattr(e, "options", None):
                line += f"; known: {', '.join(e.options)}"
            elif (
                isinstance(e, OmegaConfBaseException)
                and getattr(e, "full_key", None)
                and not line.startswith(f"{e.full_key}:")
            ):
                line = f"{e.full_key}: {line}"  # OmegaConf names the key on a later line, which one line drops
            parts.append(line)
        e = e.__cause__
    return "; ".join(dict.fromkeys(parts)) or "unknown error"


def compose(config_name: str, overrides: Sequence[str]) -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with ``overrides`` (real Hydra composition)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from lowprec_lab.plan.config import CONF_DIR, register_configs

    register_configs()
    for o in overrides:
        _check_ascii(o)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=_whole_seeds(overrides))


def _whole_seeds(overrides: Sequence[str]) -> list[str]:
    """``seeds={others: 2, fp32: 1}`` replaces the experiment's seeds whole: Hydra merges a mapping into a mapping
    (``conf/experiment/default.yaml``'s seeds per recipe), which would keep the entries the command left out. An
    int in between makes it a replacement; ``seeds.NAME=N`` still changes one entry."""
    out: list[str] = []
    for o in overrides:
        if o.replace(" ", "").startswith("seeds={"):
            out.append("seeds=1")
        out.append(o)
    return out


def _check_ascii(override: str) -> None:
    """Hydra's override lexer rejects unquoted non-ASCII values with its own exception name; say what is wrong
    instead: no recipe name holds such characters, and another value needs quotes. Raises ``ConfigError``."""
    key, sep, value = override.partition("=")
    if not sep or value.isascii() or value[:1] in "'\"":
        return
    from lowprec.errors import ConfigError

    name = key.lstrip("+~")
    if name in ("recipe", "recipes"):
        from lowprec.recipes import CATALOG

        raise ConfigError(f"unknown recipe {value!r} (recipe names are ASCII); known: {', '.join(CATALOG)}")
    raise ConfigError(f"{name}={value}: a value with non-ASCII characters must be quoted, {name}='{value}'")


def plan_of(cfg: DictConfig) -> Plan:
    """The command's ``Plan``, built once: ``lowprec_lab.plan.preflight.preflight`` and, for an ablation, its
    ``studies`` (their registry sits above the plan wing), and the faults ``LOWPREC_FAULTS`` injects (a test
    channel, read by the runner wing). Raises what they raise (``UserError`` subclasses)."""
    from lowprec_lab.plan.preflight import preflight
    from lowprec_lab.runner.faults import from_env

    plan = preflight(cfg)
    from_env()  # a fault-injection typo is refused here, before any run exists, not recorded as a failed run
    if plan.command == "ablate":
        from lowprec_lab.studies import check_studies

        check_studies(list(plan.studies), plan.study)
    return plan


def tracking_of(overrides: Sequence[str]):
    """The ``tracking`` node (``TrackingConfig``) of the ``ablate`` config composed with ``overrides``, for the
    commands that only reach the store (``sync``, ``ui``); a bad override is a ``ConfigError`` with ``one_line``'s
    text."""
    from lowprec.errors import ConfigError
    from lowprec_lab.plan.config import tracking_from_cfg

    try:
        cfg = compose("ablate", overrides)
    except _user_errors() as e:
        if isinstance(e, UserError):
            raise
        raise ConfigError(one_line(e)) from None
    return tracking_from_cfg(cfg)


def train_main(cfg: DictConfig, echo=print):
    """One run of ``cfg.recipe`` (validated first: ``plan_of``), tracked in MLflow; returns its ``RunOutcome``."""
    from lowprec_lab.runner.train import train

    return train(plan_of(cfg), echo)


def _hydra_main(config_name: str, task, argv: list[str]) -> int:
    import hydra

    from lowprec_lab.plan.config import CONF_DIR, register_configs

    register_configs()
    # Hydra names the program after argv[0] in its help (`eval "$(lowprec -sc install=bash)"`): the command that
    # exists; `lowprec -sc ...` is lowprec_lab.commands.completion's.
    sys.argv = ["lowprec", *_whole_seeds(argv)]
    hydra.main(config_path=CONF_DIR, config_name=config_name, version_base="1.3")(task)()
    return 0


def hydra_value(value: str) -> str:
    """``value`` written as a Hydra override's value that Hydra reads back as exactly this string: as it is when
    Hydra's parser gives it back unchanged (an ablation id, a plain path), else single-quoted with Hydra's escapes (a
    backslash before a quote doubled, the quote escaped, trailing backslashes doubled) and OmegaConf's (``${``
    escaped, the backslashes before it doubled: not an interpolation). Unquoted, ``/runs/a,b`` is a sweep of two
    values and ``null`` is None."""
    import re

    from hydra.core.override_parser.overrides_parser import OverridesParser

    if "${" not in value and "\\" not in value:
        try:
            (o,) = OverridesParser.create().parse_overrides([f"k={value}"])
            if isinstance(o.value(), str) and o.value() == value:
                return value
        except Exception:  # noqa: BLE001 - whatever Hydra cannot read plain is quoted below
            pass
    text = re.sub(r"(\\*)'", lambda m: m[1] * 2 + "\\'", value)
    text = re.sub(r"(\\+)$", lambda m: m[1] * 2, text)
    text = re.sub(r"(\\*)\$\{", lambda m: m[1] * 2 + "\\${", text)  # OmegaConf's escape of an interpolation
    return f"'{text}'"


def _run_composed(config_name: str, argv: list[str], task) -> int:
    """Compose, build the ``Plan`` once and run ``task(plan)``; under a parallel layout outside torchrun, re-run
    this command on its ranks instead (each rank builds its own plan)."""
    from lowprec.train.stop import StopSignal, install_stop_handlers
    from lowprec_lab.plan.launch import spawn_torchrun, under_torchrun

    try:
        plan = plan_of(compose(config_name, argv))
        dims = plan.parallel
        # a dry run plans in one process; a submitit launcher submits from one, each job starts its own torchrun
        if dims.enabled and not under_torchrun() and not plan.dry_run and not plan.launcher.submitit:
            # Validated in one process (plan_of), then this command re-runs on dims.world_size ranks.
            print(
                f"lowprec {config_name}: launching torchrun with {dims.world_size} ranks ({dims.short()})", flush=True
            )
            return spawn_torchrun(dims.world_size, [config_name, *argv])
        install_stop_handlers()  # SIGTERM/SIGINT/SIGUSR1: finish the step, checkpoint, record KILLED
        result = task(plan)
    except _user_errors() as e:
        print(f"lowprec {config_name}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except StopSignal as stop:
        print(f"lowprec {config_name}: {stop.reason()}", file=sys.stderr)
        again = [a for a in argv if not a.lstrip("+").startswith("resume=")]
        # quoted for Hydra (a comma in a runs path would make a sweep of it), then for the shell (`recipes=[a,b]`
        # is a glob to it)
        if stop.checkpoint and config_name == "train":
            resume = f"resume={hydra_value(str(stop.checkpoint))}"
            print(f"resume it: lowprec train {shlex.join([*again, resume])}", file=sys.stderr)
        ablation = getattr(stop, "ablation_id", None)
        if ablation and config_name == "ablate":
            resume = f"resume={hydra_value(str(ablation))}"
            print(f"resume it: lowprec ablate {shlex.join([*again, resume])}", file=sys.stderr)
        return stop.exit_code
    if config_name == "train":
        return 0 if result.status == "FINISHED" else 1
    return 0


def _report(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        from lowprec_lab.plan.help import help_page

        print(help_page("report"))
        return 0
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        print(
            "usage: lowprec report ABLATION_ID [tracking.uri=...] [paths.reports=...] [report.margin=X]",
            file=sys.stderr,
        )
        return 2
    try:
        cfg = compose("ablate", argv[1:])
        # The margin the ablation ran with (on its parent run) unless this command names one: a plain rebuild
        # must reproduce the report's verdicts.
        from lowprec_lab.report.build import build_report
        from lowprec_lab.studies import report_studies
        from lowprec_lab.tracking.tracker import Tracker

        named = any(a.lstrip("+").startswith("report.margin=") for a in argv[1:])
        tracker = Tracker(cfg.tracking.uri, cfg.tracking.experiment, cfg.paths.runs)
        margin = cfg.report.margin if named else None
        path = build_report(tracker, argv[0], Path(cfg.paths.reports), margin, after=report_studies)
    except _user_errors() as e:
        print(f"lowprec report: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


def _recipes(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lowprec recipes")
    p.add_argument("--json", action="store_true", help="print the catalog as JSON")
    args = p.parse_args(argv)
    from lowprec.backends import short_str
    from lowprec.recipes import CATALOG

    if args.json:
        print(
            json.dumps(
                {n: {"short": short_str(r), "hash": r.hash(), **r.to_dict()} for n, r in CATALOG.items()}, indent=1
            )
        )
        return 0
    from lowprec_lab.sizing.tables import render_table

    cols = [("recipe", "left"), ("what it is", "left"), ("description", "left")]
    print(render_table(cols, [(n, short_str(r), r.description) for n, r in CATALOG.items()]))
    return 0


def planning_query(cmd: str, overrides: list[str], emulate: bool = False):
    """The typed query (``EstimateQuery``/``RecommendQuery``) of ``lowprec estimate``/``recommend``'s ``key=value``
    arguments: the keys they took before sharing train's refused with one line naming the new key, the rest composed
    by Hydra from conf/<cmd>.yaml (``lowprec train``'s schema and defaults plus the command's own keys) and typed by
    ``lowprec_lab.plan.estimate_config``; ``recipe=all`` (estimate) asks for the whole catalog. Raises a
    ``UserError`` or a Hydra/OmegaConf exception for a bad key or value."""
    from lowprec_lab.plan.estimate_config import (
        check_old_keys,
        estimate_query,
        override_key,
        recommend_query,
        register_planning_configs,
    )

    check_old_keys(cmd, overrides)
    register_planning_configs()
    if cmd == "recommend":
        return recommend_query(compose(cmd, overrides), overrides)
    all_recipes = "recipe=all" in overrides
    rest = [o for o in overrides if o != "recipe=all"]
    if all_recipes and any(override_key(o).startswith("recipe.") for o in rest):
        raise UserError("recipe.<group>.<field> overrides need a single recipe, not recipe=all")
    return estimate_query(compose(cmd, rest), all_recipes=all_recipes, emulate=emulate)


def _planning(cmd: str, argv: list[str]) -> int:
    """``lowprec estimate`` / ``lowprec recommend``: the ``--`` flags apart, ``planning_query`` of the rest, and its
    output; a bad argument is one line on stderr and exit 2 (anything else is a bug and keeps its traceback)."""
    if "-h" in argv or "--help" in argv:  # before the planning modules' imports (torch): a page prints at once
        from lowprec_lab.plan.help import help_page

        print(help_page(cmd))
        return 0
    from lowprec_lab.sizing import estimate, recommend  # MLflow only when recommend reads a store

    known = estimate.FLAGS if cmd == "estimate" else ("--json",)
    flags = [a for a in argv if a.startswith("-")]
    overrides = [a for a in argv if not a.startswith("-")]
    as_json = "--json" in flags
    try:
        bad = [f for f in flags if f not in known]
        if bad:
            raise UserError(f"unknown flag {bad[0]!r}; known: {', '.join(known)} (everything else is key=value)")
        if "--validate" in flags:
            if overrides:
                raise UserError(f"--validate takes no other key (got {overrides[0]}): it predicts the published points")
            out = estimate.validation(as_json)
        elif cmd == "estimate":
            out = estimate.run(planning_query(cmd, overrides, emulate="--emulate" in flags), as_json)
        else:
            rec = recommend.recommend(planning_query(cmd, overrides))
            out = json.dumps(rec.to_dict(), indent=1) if as_json else recommend.format_table(rec)
    except _user_errors() as e:
        print(f"lowprec {cmd}: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(out)
    return 0


def version() -> str:
    """``lowprec <version>`` and the versions of torch and MLflow, from the installed packages' metadata (no
    import); "not installed" for a package without metadata (a checkout run without ``pip install``)."""
    import importlib.metadata

    def of(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return f"lowprec {of('lowprec')} (torch {of('torch')}, mlflow {of('mlflow')})"


#: The lab's dependencies (pyproject.toml's ``lab`` extra), by the top-level name each is imported as. ``pip install
#: .`` installs the library alone; a lab command that imports one of these then ends in one line naming the extra
#: (tests/unit/test_cli_lab_extra.py keeps this set equal to the extra).
LAB_MODULES = frozenset(
    {
        "hydra",
        "omegaconf",
        "mlflow",
        "sqlalchemy",
        "requests",
        "yaml",
        "matplotlib",
        "scipy",
        "statsmodels",
        "markdown_it",
        "jinja2",
        "rich",
        "psutil",
        "submitit",
    }
)


def missing_lab_module(e: BaseException) -> str | None:
    """The top-level name of the lab dependency whose absence raised ``e`` (a ``ModuleNotFoundError`` for a module
    of ``LAB_MODULES`` or below it), else None: any other ImportError is a bug or a broken install and keeps its
    traceback."""
    if not isinstance(e, ModuleNotFoundError) or not e.name:
        return None
    top = e.name.split(".")[0]
    return top if top in LAB_MODULES else None


def main(argv: Sequence[str] | None = None) -> int:
    """The ``lowprec`` command line; returns the exit status (2 with one line on stderr when a lab dependency is
    not installed: the ``lab`` extra is missing)."""
    try:
        return _main(argv)
    except ModuleNotFoundError as e:
        name = missing_lab_module(e)
        if name is None:
            raise
        msg = f"lowprec: the lab's commands need its extra: pip install 'lowprec[lab]' (missing: {name})"
        print(msg, file=sys.stderr)
        return 2


def _main(argv: Sequence[str] | None) -> int:
    from lowprec_lab.commands.completion import COMPLETION_FLAGS, completion_main

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["help"] and len(argv) == 2:  # `lowprec help train`: that command's page
        argv = [argv[1], "--help"]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(version())
        return 0
    flag = next((a for a in argv if a in COMPLETION_FLAGS), None)
    if flag is not None and (argv[0] == flag or argv[0] in ("train", "ablate")):
        # `lowprec -sc install=bash`, and Hydra's own flag after train/ablate: one script, for `lowprec`
        return completion_main(argv[argv.index(flag) + 1 :], USAGE, _hydra_main)
    cmd, rest = argv[0], argv[1:]
    if cmd == "recipes":
        return _recipes(rest)
    if cmd == "report":
        return _report(rest)
    if cmd in ("estimate", "recommend"):
        return _planning(cmd, rest)
    if cmd == "selfcheck":
        from lowprec_lab.selfcheck.runner import selfcheck_main

        return selfcheck_main(rest)
    if cmd == "sync":
        if "-h" in rest or "--help" in rest:
            from lowprec_lab.plan.help import help_page

            print(help_page("sync"))
            return 0
        from lowprec_lab.tracking.sync import sync_main

        return sync_main(rest, tracking_of)
    if cmd == "data":
        if rest[:1] in (["-h"], ["--help"]) or (rest[:1] == ["prepare"] and ("-h" in rest or "--help" in rest)):
            from lowprec_lab.plan.help import help_page

            print(help_page("data"))
            return 0
        from lowprec_lab.commands.data_prepare import data_main

        return data_main(rest, _user_errors(), one_line)
    if cmd == "checkpoint":
        from lowprec_lab.runner.checkpoint_convert import checkpoint_main

        return checkpoint_main(rest, _user_errors(), one_line)
    if cmd == "ui":
        from lowprec_lab.tracking.ui import ui_main

        try:
            return ui_main(rest, tracking_of)
        except _user_errors() as e:  # a bad override of the store's config
            print(f"lowprec ui: error: {one_line(e)}", file=sys.stderr)
            return 2
    if cmd in ("train", "ablate"):
        if "-h" in rest or "--help" in rest:
            from lowprec_lab.plan.help import help_page

            print(help_page(cmd))
            return 0
        if "--hydra-help" in rest:  # Hydra's own page (its config dump), kept as the escape hatch
            rest = ["--help" if a == "--hydra-help" else a for a in rest]
        elif not any(a.startswith("-") for a in rest):
            # refused before Hydra and torch are imported (seconds, not 10-30 s): what the schema's source shows
            # does not exist
            from lowprec_lab.plan.argcheck import precheck

            try:
                precheck(cmd, rest)
            except UserError as e:
                print(f"lowprec {cmd}: error: {e}", file=sys.stderr)
                return 2
        if cmd == "train":
            from lowprec_lab.runner.train import train as task
        else:
            from lowprec_lab.runner.ablate import ablate as task
        if any(a.startswith("-") for a in rest):  # -m, --cfg, --help ...: Hydra's own command line
            return _hydra_main(cmd, lambda cfg: (task(plan_of(cfg)), None)[1], rest)
        return _run_composed(cmd, rest, task)
    print(f"lowprec: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
