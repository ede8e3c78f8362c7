"""The typed door. The composed Hydra config (``DictConfig``) stops at the door, ``lowprec_lab/cli.py``, the
command-line parts beside it (``lowprec_lab/commands/``: shell completion, ``lowprec data prepare``) and
``lowprec_lab/plan/`` (config schema, preflight, the ``Plan``); every function below takes the ``Plan`` or its typed
parts. Read with ``ast``: no function outside the door has a parameter named ``cfg``/``config`` or annotated
``DictConfig``, and no module outside the door imports ``omegaconf`` (at the top or inside a function)."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

from lowprec_lab.cli import compose
from lowprec_lab.plan.plan import Plan
from lowprec_lab.plan.preflight import preflight

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "lowprec_lab"
#: The door: the command line's Hydra entry functions and command-line parts, and the plan wing (schema, preflight,
#: the Plan itself).
DOOR = ("lowprec_lab/cli.py", "lowprec_lab/__main__.py", "lowprec_lab/commands/", "lowprec_lab/plan/")
CONFIG_NAMES = ("cfg", "config", "conf")


def _door(rel: str) -> bool:
    return any(rel == d or (d.endswith("/") and rel.startswith(d)) for d in DOOR)


def crossings(path: Path, rel: str) -> list[str]:
    """Where the module at ``path`` lets the config through: a parameter named ``cfg``/``config``/``conf`` or
    annotated with ``DictConfig``, or an import of ``omegaconf``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [f"{rel}:{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] == "omegaconf"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "omegaconf":
            out.append(f"{rel}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is None:
                    continue
                typed = arg.annotation is not None and "DictConfig" in ast.unparse(arg.annotation)
                if arg.arg in CONFIG_NAMES or typed:
                    name = getattr(node, "name", "<lambda>")
                    out.append(f"{rel}:{node.lineno}: {name}({arg.arg}{': DictConfig' if typed else ''})")
    return out


def below_the_door() -> list[tuple[Path, str]]:
    files = [(p, p.relative_to(ROOT).as_posix()) for p in sorted(LAB.rglob("*.py"))]
    return [(p, rel) for p, rel in files if not _door(rel)]


def test_no_function_below_the_door_takes_the_config():
    modules = below_the_door()
    assert len(modules) > 40  # every wing is read (runner, runtime, tracking, report, studies, stats, sizing, ...)
    found = [c for p, rel in modules for c in crossings(p, rel)]
    assert not found, "the composed config crosses the door (take the Plan or its typed parts):\n" + "\n".join(found)


def test_the_check_finds_a_crossing(tmp_path):
    """The counter itself: a runner function that takes ``cfg: DictConfig``, one that takes ``cfg``, and a late
    ``omegaconf`` import are each found."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def a(cfg):\n    return cfg\n\n\n"
        "def b(plan, node: 'DictConfig'):\n    return node\n\n\n"
        "def c():\n    from omegaconf import OmegaConf\n\n    return OmegaConf\n"
    )
    found = crossings(bad, "lowprec_lab/runner/bad.py")
    assert [f.split(": ", 1)[1] for f in found] == ["a(cfg)", "b(node: DictConfig)", "from omegaconf import ..."]
    assert crossings(LAB / "plan" / "plan.py", "lowprec_lab/plan/plan.py")  # the door itself may
    assert _door("lowprec_lab/plan/preflight.py") and not _door("lowprec_lab/runner/run.py")


def test_the_plan_is_built_once_and_pickles(tmp_path):
    """What the workers receive (lowprec_lab/runner/scheduler.py): the Plan itself, equal after a round trip, its
    ``config.yaml`` text the composed config's."""
    cfg = compose(
        "ablate",
        [
            "experiment=smoke",
            "seeds=auto",
            "max_seeds=4",
            f"paths.runs={tmp_path / 'runs'}",
            f"paths.reports={tmp_path / 'reports'}",
        ],
    )
    plan = preflight(cfg)
    assert isinstance(plan, Plan) and plan.command == "ablate"
    assert [r.name for r in plan.recipes] == list(cfg.recipes) and plan.control == "bf16"
    assert plan.seeds == (0, 1, 2) and plan.spending is not None and plan.spending.max_seeds == 4
    assert plan.tracking.uri == f"sqlite:///{tmp_path / 'runs'}/mlflow.db" and plan.paths.runs == str(tmp_path / "runs")
    again = pickle.loads(pickle.dumps(plan))
    assert again == plan and again.yaml(7) == plan.yaml(7)
    assert "seed: 7\n" in plan.yaml(7) and plan.yaml() == plan.config_yaml and "seed: 0\n" in plan.yaml()
