"""``pip install .`` without the lab's extra: a lab command that needs one of its packages ends in one line naming
the extra (exit 2), not a ModuleNotFoundError traceback; any other ImportError keeps its traceback."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import lowprec_lab.cli as cli

ROOT = Path(__file__).resolve().parents[2]

# The package's absence simulated in a fresh interpreter: a finder ahead of every other raises what Python raises
# for a module that is not installed, for the package and each of its submodules.
BLOCKED_RUN = """
import sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
from lowprec_lab.cli import main
sys.exit(main({argv!r}))
"""


def test_lowprec_train_without_omegaconf_is_one_line_naming_the_extra(tmp_path):
    code = BLOCKED_RUN.format(blocked="omegaconf", argv=["train", "model=debug", "train.steps=2"])
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "lowprec: the lab's commands need its extra: pip install 'lowprec[lab]' (missing: omegaconf)"
    ]
    assert p.stdout == ""
    assert list(tmp_path.iterdir()) == []  # nothing written: no run, no Hydra output folder


def test_a_missing_module_outside_the_lab_and_other_import_errors_keep_their_traceback(monkeypatch):
    for error in (
        ModuleNotFoundError("No module named 'tokenizers'", name="tokenizers"),  # the library's own dependency
        ModuleNotFoundError("No module named 'lowprec_lab.nothing'", name="lowprec_lab.nothing"),  # a bug
        ImportError("cannot import name 'Thing' from 'mlflow'", name="mlflow"),  # a broken install, not a missing one
    ):

        def recipes(argv, error=error):
            raise error

        monkeypatch.setattr(cli, "_recipes", recipes)
        with pytest.raises(ImportError) as raised:
            cli.main(["recipes"])
        assert raised.value is error


def test_a_missing_lab_submodule_names_its_package(monkeypatch, capsys):
    def recipes(argv):
        raise ModuleNotFoundError("No module named 'mlflow.tracking'", name="mlflow.tracking")

    monkeypatch.setattr(cli, "_recipes", recipes)
    assert cli.main(["recipes"]) == 2
    assert capsys.readouterr().err.endswith("(missing: mlflow)\n")


#: Distribution names of the lab extra whose import name differs from the name with '-' read as '_'.
IMPORT_NAME = {"hydra-core": "hydra", "pyyaml": "yaml", "markdown-it-py": "markdown_it"}


def test_the_lab_modules_are_the_lab_extras_packages():
    lab = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["lab"]
    names = {re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower() for req in lab}
    assert cli.LAB_MODULES == {IMPORT_NAME.get(n, n.replace("-", "_")) for n in names}
