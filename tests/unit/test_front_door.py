"""The library's front door (``lowprec.__all__``) and the split of dependencies between ``pip install lowprec`` (the
library: torch and what ``lowprec/`` and the catalog import) and ``pip install lowprec[lab]`` (``lowprec_lab/``).

The third-party imports are read with ``ast`` (imports inside functions count: a lazy import still needs its
package installed when that path runs), mapped to distributions with ``importlib.metadata.packages_distributions``
of this environment, and compared with ``pyproject.toml`` both ways: an import without its dependency, and a
dependency nothing imports, both fail. A subprocess then refuses every lab package on ``sys.meta_path`` and trains
through the front door alone.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lowprec

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
OURS = {"lowprec", "lowprec_lab"}

#: Every third-party package the library (``lowprec/``, its catalog ``lowprec/recipes/`` too) may import: the base
#: install.
LIBRARY_IMPORTS = {
    "torch",
    "torchao",  # FP8 backend torchao, its low-bit AdamW, the blockwise FP8 kernels
    "bitsandbytes",  # AdamW8bit
    "numpy",  # token shards and batches
    "tokenizers",  # the BPE tokenizer
    "tqdm",  # progress of data preparation and runs
    "filelock",  # one builder of a cold data cache
    "datasets",  # data prepare from parquet/jsonl/arrow or a Hugging Face dataset
    "pyarrow",  # parquet schemas, checked before datasets reads a row
    "huggingface_hub",  # a hub dataset's revision
}
#: Imported by the library only where it is optional: no dependency of any install declares it.
LIBRARY_OPTIONAL = {
    "transformers",  # a hub tokenizer's fast version when installed; tokenizers' own loader otherwise
    "transformer_engine",  # the ``te`` extra (GPU only), refused with a RecipeError when absent
}
#: The lab's imports that are optional there: the report's browser check (``dev`` extra).
LAB_OPTIONAL = {"playwright"}
#: The lab's packages: the library imports none (refused by the subprocess below). A base install may still hold
#: some as another package's dependency (torch's inductor needs jinja2), never as the library's.
LAB_ONLY = {
    "lowprec_lab",
    "hydra",
    "omegaconf",
    "mlflow",
    "submitit",
    "statsmodels",
    "scipy",
    "jinja2",
    "rich",
    "matplotlib",
    "psutil",
    "markdown_it",
    "yaml",
    "requests",
    "sqlalchemy",
}


def _third_party_imports(folders: list[str]) -> dict[str, set[str]]:
    """``{top-level package: {file, ...}}`` of every import under ``folders`` that is neither the standard library
    nor ours (relative imports are ours)."""
    out: dict[str, set[str]] = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in OURS - {"lowprec_lab"}:
                        out.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return out


def _library_imports() -> dict[str, set[str]]:
    return _third_party_imports(["lowprec"])


def _lab_imports() -> dict[str, set[str]]:
    return {k: v for k, v in _third_party_imports(["lowprec_lab"]).items() if k not in OURS}


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _requirement_names(reqs: list[str]) -> set[str]:
    return {_norm(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in reqs}


def _distributions(imports: set[str]) -> dict[str, set[str]]:
    """``{import name: its installed distributions}`` (``yaml``: ``pyyaml``; ``mlflow``: ``mlflow`` and the
    ``mlflow-skinny`` / ``mlflow-tracing`` that share its folder)."""
    table = importlib.metadata.packages_distributions()
    missing = sorted(i for i in imports if i not in table)
    assert not missing, f"not installed here, so their distribution is unknown: {missing}"
    return {i: {_norm(d) for d in table[i]} for i in imports}


def _compare(imports: set[str], declared: set[str], provided: set[str] = frozenset()) -> tuple[list, list]:
    """(imports none of whose distributions is in ``declared`` or ``provided``, ``declared`` names no import
    installs)."""
    dists = _distributions(imports)
    undeclared = sorted(i for i, ds in dists.items() if not ds & (declared | provided))
    unused = sorted(d for d in declared if not any(d in ds for ds in dists.values()))
    return undeclared, unused


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_public_name_resolves():
    assert sorted(lowprec.__all__) == sorted(lowprec._EXPORTS), "__all__ and the lazy table must list the same names"
    for name in lowprec.__all__:
        assert getattr(lowprec, name) is not None, name
    assert callable(lowprec.estimate.estimate) and issubclass(lowprec.RecipeError, lowprec.UserError)
    assert issubclass(lowprec.Float8Linear, __import__("torch").nn.Linear)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        lowprec.no_such_name  # noqa: B018


def test_import_lowprec_loads_neither_torch_nor_the_catalog():
    names = "('torch', 'lowprec.recipes', 'lowprec.recipe')"
    code = f"import sys, lowprec; print(sorted(m for m in {names} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_front_doors_modules_sit_below_it_in_the_layer_table():
    # The lazy table names its modules as strings, which the layer test's ast scan cannot see.
    from test_import_layers import _layer

    above = sorted({m for m, _ in lowprec._EXPORTS.values() if _layer(m) > _layer("lowprec")})
    assert not above, f"lowprec's __init__ imports modules above its layer: {above}"


def test_the_library_imports_only_its_base_dependencies():
    found = _library_imports()
    extra = {k: sorted(v) for k, v in found.items() if k not in LIBRARY_IMPORTS | LIBRARY_OPTIONAL}
    assert not extra, f"lowprec/ imports a package the base install lacks: {extra}"
    lab = {k: sorted(v) for k, v in found.items() if k in LAB_ONLY}
    assert not lab, f"lowprec/ imports the lab's packages: {lab}"


def test_the_base_dependencies_are_exactly_the_librarys_imports():
    imported = set(_library_imports()) - LIBRARY_OPTIONAL
    assert imported == LIBRARY_IMPORTS, "update LIBRARY_IMPORTS with the library's imports"
    undeclared, unused = _compare(imported, _requirement_names(_pyproject()["project"]["dependencies"]))
    assert not undeclared and not unused, f"base dependencies lack {undeclared}; nothing imports {unused}"


def test_the_lab_extra_holds_the_labs_imports():
    project = _pyproject()["project"]
    base = _requirement_names(project["dependencies"])
    lab = _requirement_names(project["optional-dependencies"]["lab"])
    imported = set(_lab_imports()) - LAB_OPTIONAL
    undeclared, unused = _compare(imported, lab, provided=base)
    assert not undeclared and not unused, f"the lab extra lacks {undeclared}; nothing of the lab imports {unused}"
    assert LAB_ONLY - {"lowprec_lab"} <= imported, "LAB_ONLY names a package the lab no longer imports"


def test_the_library_trains_with_every_lab_package_refused():
    """``import lowprec``, a ``Float8Linear``, ``convert_fp8`` of an ``nn.Sequential`` and two training steps of the
    ``debug`` model, forward and backward on CPU, in a process where importing any lab package raises."""
    code = textwrap.dedent(
        f"""
        import importlib.abc, sys

        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {sorted(LAB_ONLY)!r}:
                    raise ModuleNotFoundError(f"lab package {{name}} refused", name=name)
                return None

        sys.meta_path.insert(0, Refuse())
        import numpy as np
        import torch
        from torch import nn

        import lowprec

        torch.manual_seed(0)
        recipe = lowprec.get_recipe("fp8_current")
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        swapped = lowprec.convert_fp8(model, recipe.fp8)
        assert swapped == ["0", "2"] and isinstance(model[0], lowprec.Float8Linear), swapped
        x = torch.randn(4, 32, requires_grad=True)
        model(x).square().mean().backward()
        assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
        assert x.grad.isfinite().all()

        class Sink:
            def __init__(self):
                self.rows = []

            def log_metrics(self, metrics, step):
                self.rows.append((step, metrics))

        spec = lowprec.TrainSpec(
            steps=2, batch_size=2, seq_len=16, warmup_steps=1, timing_warmup_steps=1, val_every=0, val_batches=1
        )
        built = lowprec.build(
            recipe, lowprec.model_args("debug"), spec, lowprec.OptimHParams(), 0, torch.device("cpu")
        )
        rng = np.random.default_rng(0)
        vocab = lowprec.model_args("debug").vocab_size
        shards = [rng.integers(0, vocab, 4096).astype(np.uint16)]
        sink = Sink()
        result = lowprec.run_training(built, lowprec.TokenBatches(shards, shards, 16, 2, 0), spec, sink)
        assert [s for s, m in sink.rows if "loss" in m] == [0, 1], sink.rows
        assert np.isfinite(result.summary["final_loss"])
        lab = sorted(m for m in sys.modules if m.split(".")[0] in {sorted(LAB_ONLY)!r})
        assert not lab, lab
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
