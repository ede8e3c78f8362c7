"""The ``lowprec`` command's cheap paths: ``--help`` and ``--version`` import neither torch nor MLflow (they took
~10 s), and shell completion registers ``lowprec`` (it registered ``lowprec-train``, a command that does not
exist) and completes through it, checked in a real bash."""

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _python(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], env=ENV, cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    ).stdout


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_neither_torch_nor_mlflow(flag):
    out = _python(
        "import sys\nfrom experiments.cli import main\n"
        f"code = main([{flag!r}])\n"
        "print('HEAVY', sorted(m for m in ('torch', 'mlflow') if m in sys.modules), code)"
    )
    assert out.splitlines()[-1] == "HEAVY [] 0"
    if flag == "--version":
        assert out.startswith(f"lowprec {importlib.metadata.version('lowprec')} (torch ")


@pytest.fixture
def bash_with_lowprec(tmp_path):
    """A bash with ``lowprec`` on PATH (this checkout's command line) and its completion installed as docs/cli.md
    says: ``eval "$(lowprec --shell-completion install=bash)"``."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "lowprec"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m experiments "$@"\n')
    shim.chmod(0o755)
    env = {**ENV, "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    def run(script: str) -> str:
        full = 'eval "$(lowprec --shell-completion install=bash)"\n' + script
        done = subprocess.run(["bash", "-c", full], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    return run


def _complete(line: str) -> str:
    """Bash's state on a TAB at the end of ``line``, then the completion function; prints its candidates."""
    words = line.split() + ([""] if line.endswith(" ") else [])
    arr = " ".join(f"'{w}'" for w in words)
    return (
        f"COMP_LINE='{line}'; COMP_POINT={len(line)}; COMP_WORDS=({arr}); COMP_CWORD={len(words) - 1}\n"
        '_lowprec_completion; echo "${COMPREPLY[@]}"\n'
    )


def test_bash_completion_registers_lowprec_and_completes_its_subcommands(bash_with_lowprec):
    out = bash_with_lowprec(
        "complete -p lowprec\ncomplete -p lowprec-train || echo 'no lowprec-train'\n"
        + _complete("lowprec est")
        + _complete("lowprec estimate --va")
        + _complete("lowprec train rec")
    ).splitlines()
    assert out[0].endswith("-F _lowprec_completion lowprec")
    assert out[1] == "no lowprec-train"
    assert out[2] == "estimate" and out[3] == "--validate"
    assert "recipe=" in out[4].split()  # Hydra's completion of train's config groups, through lowprec


def test_hydra_completion_flag_after_train_installs_lowprec_too():
    out = subprocess.run(
        [sys.executable, "-m", "experiments", "train", "--shell-completion", "install=bash"],
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert out.rstrip().endswith("complete -o nospace -o default -F _lowprec_completion lowprec")
    assert "lowprec-train" not in out
