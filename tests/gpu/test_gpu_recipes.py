"""Catalog recipes trained end to end on CUDA through the command line (``lowprec_lab.cli.main``), tracked in a
temp MLflow store: Transformer Engine's ``te_delayed`` and ``te_blockwise`` (never run on a CPU), and every
other recipe, which the CPU suite runs only on CPU kernels.

Per run: exit code 0, status FINISHED, the effective recipe checked (``effective_matches``) with the expected
FP8 linears by module class, one finite loss per step, and the last loss below the first. TE runs must also
track lowprec's implementation of the same scaling (``fp8_delayed``, ``fp8_blockwise``) from the same weights
and batches: the mean of the last 3 losses within 3% (a run that does not learn, or starts from other weights,
is 10-25% away after 12 steps of the tiny model).
"""

from __future__ import annotations

import json
import math

import pytest
from gpu_helpers import needs_cuda, needs_gpus, needs_sm, needs_te

# The command line needs MLflow and Hydra; a GPU machine without them skips this file with the reason instead of
# failing the collection of tests/gpu.
pytest.importorskip("mlflow", reason="the end-to-end GPU runs track in MLflow (not installed here)")
pytest.importorskip("hydra", reason="the end-to-end GPU runs compose with Hydra (not installed here)")
from mlflow.tracking import MlflowClient  # noqa: E402

from lowprec.backends import fp8_backend  # noqa: E402
from lowprec.convert import fp8_candidate_fqns  # noqa: E402
from lowprec.model import model_args  # noqa: E402
from lowprec.recipes import CATALOG, get_recipe  # noqa: E402
from lowprec.train.build import build_model_meta  # noqa: E402
from lowprec_lab.cli import main  # noqa: E402

pytestmark = pytest.mark.gpu


def _needs_fsdp(name: str) -> bool:
    c = get_recipe(name).comm
    return c.weight_all_gather == "fp8" or c.grad_reduce == "fp8"


ONE_GPU = [n for n, r in CATALOG.items() if r.fp8.backend != "te" and not _needs_fsdp(n)]
FSDP_ONLY = [n for n in CATALOG if _needs_fsdp(n)]


def _runs(run_dirs: list[str]) -> dict[str, object]:
    """recipe name -> its (only) run in the temp store."""
    uri = next(o.split("=", 1)[1] for o in run_dirs if o.startswith("tracking.uri="))
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("lowprec").experiment_id])
    return {r.data.tags["recipe"]: (client, r) for r in runs}


def _check_run(name: str, client, run) -> list[float]:
    """The run's checks (module doc); returns its per-step losses."""
    assert run.info.status == "FINISHED", (name, run.data.tags.get("failure_reason"))
    assert run.data.tags["effective_matches"] == "true", name
    recipe = get_recipe(name)
    fqns = fp8_candidate_fqns(build_model_meta(model_args("tiny")), recipe.fp8)
    expected = {fp8_backend(recipe.fp8.backend).module_class: len(fqns)} if fqns else {}
    assert json.loads(run.data.tags["effective_recipe"])["fp8_linears"] == expected, name
    losses = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses), (name, losses)
    assert losses[-1] < losses[0], (name, losses)
    return losses


@needs_cuda("Transformer Engine te_delayed / te_blockwise train 12 steps via the CLI, effective recipe matches")
@needs_te("te_delayed / te_blockwise train 12 steps via the CLI and track lowprec's fp8_delayed / fp8_blockwise")
@pytest.mark.parametrize(
    "te_name, twin",
    [
        pytest.param("te_delayed", "fp8_delayed", marks=needs_sm(8, 9, "te_delayed trains (FP8 tensor cores)")),
        pytest.param(
            "te_blockwise", "fp8_blockwise", marks=needs_sm(9, 0, "te_blockwise (Float8BlockScaling: Hopper)")
        ),
    ],
)
def test_te_recipe_trains_end_to_end_and_tracks_lowprec(cuda_quick, te_name, twin):
    for name in (te_name, twin):
        assert main(["train", *cuda_quick, f"recipe={name}"]) == 0, name
    runs = _runs(cuda_quick)
    te_losses, twin_losses = (_check_run(n, *runs[n]) for n in (te_name, twin))
    tail_te, tail_twin = sum(te_losses[-3:]) / 3, sum(twin_losses[-3:]) / 3
    assert abs(tail_te - tail_twin) / tail_twin < 0.03, (te_losses, twin_losses)


@needs_cuda("every non-TE catalog recipe that runs on one process trains 12 steps on CUDA via the CLI")
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=needs_sm(8, 9, f"{n} trains on CUDA (FP8 GEMMs need FP8 tensor cores)"))
        if get_recipe(n).fp8.enabled
        else n
        for n in ONE_GPU
    ],
)
def test_recipe_trains_on_one_gpu(cuda_quick, name):
    assert main(["train", *cuda_quick, f"recipe={name}"]) == 0, name
    _check_run(name, *_runs(cuda_quick)[name])


@needs_gpus(2, "the FP8-communication recipes train 12 steps under FSDP2 on 2 GPUs (NCCL) via the CLI's torchrun")
@pytest.mark.parametrize("name", FSDP_ONLY)
def test_fp8_communication_recipe_trains_on_two_gpus(cuda_quick, name):
    assert main(["train", *cuda_quick, f"recipe={name}", "parallel.dp_shard=2"]) == 0, name
    client, run = _runs(cuda_quick)[name]
    _check_run(name, client, run)
    assert run.data.tags["parallel"] == "fsdp2" and run.data.metrics["comm_all_gather_fp8_bytes"] > 0, name
