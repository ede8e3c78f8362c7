"""The ``lowprec`` command's cheap paths: ``--help``, ``--version``, each command's help page and the refusal of an
unknown key or name import neither torch nor MLflow (they took ~10 s), and shell completion registers ``lowprec`` (it
registered ``lowprec-train``, a command that does not exist) and completes through it, checked in a real bash."""

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
        "import sys\nfrom lowprec_lab.cli import main\n"
        f"code = main([{flag!r}])\n"
        "print('HEAVY', sorted(m for m in ('torch', 'mlflow') if m in sys.modules), code)"
    )
    assert out.splitlines()[-1] == "HEAVY [] 0"
    if flag == "--version":
        assert out.startswith(f"lowprec {importlib.metadata.version('lowprec')} (torch ")


#: wrong names and keys the command line refuses from the schema's source alone, and the help pages: none may
#: import torch, MLflow or Hydra (a refusal took 9-30 s of imports before Hydra said it in its own words)
CHEAP = [
    (["train", "train.step=3"], 2),
    (["train", "model=nonexistent"], 2),
    (["train", "recipe=fp8_rowwse"], 2),
    (["ablate", "recipe=bf16"], 2),
    (["ablate", "recipes=bf16,fp8_rowwise"], 2),
    (["ablate", "recipes=[bf16,fp8_rowwse]"], 2),
    (["ablate", "experiment=smok"], 2),
    (["ablate", "report.marign=0.01"], 2),
    *[([cmd, "--help"], 0) for cmd in ("train", "ablate", "report", "sync", "estimate", "recommend")],
    (["data", "prepare", "--help"], 0),
    (["help", "ablate"], 0),
]


def test_refusals_of_unknown_names_and_help_pages_import_no_heavy_module():
    out = _python(
        "import sys, contextlib, io\nfrom lowprec_lab.cli import main\n"
        f"codes = []\nfor argv, _ in {CHEAP!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        codes.append(main(argv))\n"
        "print('HEAVY', sorted(m for m in ('torch', 'mlflow', 'hydra') if m in sys.modules), codes)"
    )
    assert out.splitlines()[-1] == f"HEAVY [] {[code for _, code in CHEAP]}"


@pytest.fixture
def bash_with_lowprec(tmp_path):
    """A bash with ``lowprec`` on PATH (this checkout's command line) and its completion installed as docs/cli.md
    says: ``eval "$(lowprec --shell-completion install=bash)"``."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "lowprec"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m lowprec_lab "$@"\n')
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


#: per subcommand: a line typed so far, and a candidate TAB must offer there (Hydra's own after train and ablate,
#: estimate's and recommend's keys from their schemas, the usage text's for the others)
EVERY_SUBCOMMAND = {
    "train": ("lowprec train rec", "recipe="),
    "ablate": ("lowprec ablate max_se", "max_seeds="),
    "report": ("lowprec report ABL ", "report.margin="),
    "recipes": ("lowprec recipes ", "--json"),
    "estimate": ("lowprec estimate ", "train.batch_size="),
    "recommend": ("lowprec recommend ", "gpus="),
    "selfcheck": ("lowprec selfcheck ", "--quick"),
    "ui": ("lowprec ui ", "--port"),
    "sync": ("lowprec sync runs ", "tracking.uri="),
    "data": ("lowprec data prepare ", "source="),
}


def test_bash_completion_registers_lowprec_and_completes_every_subcommand(bash_with_lowprec):
    """One real bash: ``complete -p`` names ``lowprec`` (never ``lowprec-train``), the first word completes to each
    subcommand of the usage text, and after each subcommand TAB offers its keys (about 10 s: Hydra's completion of
    train and ablate composes their configs)."""
    from lowprec_lab.cli import USAGE
    from lowprec_lab.commands.completion import PLANNING_KEYS, subcommands

    assert sorted(EVERY_SUBCOMMAND) == sorted(subcommands(USAGE))
    script = "complete -p lowprec\ncomplete -p lowprec-train || echo 'no lowprec-train'\n" + _complete("lowprec ")
    script += _complete("lowprec estimate --va") + _complete("lowprec estimate train.")
    script += "".join(_complete(line) for line, _ in EVERY_SUBCOMMAND.values())
    out = bash_with_lowprec(script).splitlines()
    assert out[0].endswith("-F _lowprec_completion lowprec")
    assert out[1] == "no lowprec-train"
    assert set(subcommands(USAGE)) <= set(out[2].split())
    assert out[3] == "--validate"
    assert out[4].split() == ["train.batch_size=", "train.seq_len=", "train.ac=", "train.compile="]
    for (cmd, (line, want)), got in zip(EVERY_SUBCOMMAND.items(), out[5:], strict=True):
        assert want in got.split(), (cmd, line, got)
    for cmd in ("estimate", "recommend"):  # the static keys of their schemas, not the usage's words (`key=value`)
        assert out[5 + list(EVERY_SUBCOMMAND).index(cmd)].split() == list(PLANNING_KEYS[cmd])


@pytest.mark.parametrize("cmd", ["estimate", "recommend"])
def test_static_completion_keys_are_the_schema_keys(cmd):
    """``PLANNING_KEYS`` (static, for a fast TAB) against the real composition: every key offered composes in
    conf/<cmd>.yaml, the command's own keys (``OWN_KEYS``) are all offered, and so are its flags."""
    from omegaconf import OmegaConf

    from lowprec_lab.cli import compose
    from lowprec_lab.commands.completion import PLANNING_KEYS
    from lowprec_lab.plan.estimate_config import OWN_KEYS, register_planning_configs
    from lowprec_lab.sizing import estimate

    register_planning_configs()
    cfg = compose(cmd, [])
    keys = [k[:-1] for k in PLANNING_KEYS[cmd] if k.endswith("=")]
    for k in keys:
        parent, _, leaf = k.rpartition(".")
        assert leaf in (OmegaConf.select(cfg, parent) if parent else cfg).keys(), k  # keys(): also the ??? ones
    assert set(OWN_KEYS[cmd]) <= set(keys)
    flags = {k for k in PLANNING_KEYS[cmd] if k.startswith("--")}
    assert flags == (set(estimate.FLAGS) if cmd == "estimate" else {"--json"})


def test_hydra_completion_flag_after_train_installs_lowprec_too():
    out = subprocess.run(
        [sys.executable, "-m", "lowprec_lab", "train", "--shell-completion", "install=bash"],
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert out.rstrip().endswith("complete -o nospace -o default -F _lowprec_completion lowprec")
    assert "lowprec-train" not in out
