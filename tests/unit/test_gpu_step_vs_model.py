"""``benchmarks/gpu_step_vs_model.py`` on a CPU: its arguments, its rows (lowprec recipes and torchao peers) and
``--dry-run``, so that the GPU check (``scripts/gpu_check.sh``'s step tables) cannot fail on a typo. The
measurement itself needs CUDA."""

from __future__ import annotations

import importlib.util

import pytest
from bench_scripts import load_script

from lowprec.backends import fp8_backend
from lowprec.errors import RecipeError


@pytest.fixture(scope="module")
def bench():
    return load_script("gpu_step_vs_model")


def test_peers_are_torchaos_recipes_beside_lowprecs(bench):
    recipe, swap = bench.resolve("torchao_rowwise")
    assert (recipe.fp8.backend, recipe.fp8.scaling, recipe.fp8.cast.fp8_format, swap) == (
        "torchao",
        "rowwise",
        "e4m3",
        None,
    )
    fp8_backend("torchao").validate(recipe.fp8)  # a recipe torchao's backend accepts
    for name, triton in (("torchao_blockwise", False), ("torchao_blockwise_triton", True)):
        recipe, swap = bench.resolve(name)
        assert recipe.name == name and not recipe.fp8.enabled and swap is triton  # bf16's model, linears swapped
    assert bench.resolve("deepseek_v3") == (bench.get_recipe("deepseek_v3"), None)


def test_a_missing_package_skips_a_peer_with_its_name(bench, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert bench.peer_missing("torchao_blockwise_triton") == "torchao and triton not installed"
    assert bench.peer_missing("torchao_rowwise") == "torchao not installed"
    assert bench.peer_missing("fp8_blockwise") is None


def test_dry_run_checks_the_gpu_checks_tables(bench, capsys):
    recipes = "bf16,fp8_blockwise,deepseek_v3,fp8_rowwise,torchao_rowwise,torchao_blockwise,torchao_blockwise_triton"
    assert bench.main(["--model", "llama3_8b", "--layers", "8", "--steps", "8", "--recipes", recipes, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "llama3_8b (8 layers, dim 4096), 1 x 8192, compile, ok" in out
    assert bench.main(["--model", "llama3_1b", "--eager", "--recipes", "bf16,fp8_current", "--dry-run"]) == 0
    assert "llama3_1b (16 layers, dim 2048), 1 x 8192, eager, ok" in capsys.readouterr().out


def test_bad_arguments_fail_before_any_gpu_work(bench, capsys):
    with pytest.raises(RecipeError, match="unknown recipe 'fp8_typo'"):
        bench.main(["--recipes", "bf16,fp8_typo", "--dry-run"])
    with pytest.raises(SystemExit) as e:
        bench.main(["--steps", "4", "--dry-run"])
    assert e.value.code == 2 and "use at least 6" in capsys.readouterr().err
