"""``train.compile=true``: compiled blocks train like eager ones, and what cannot compile is refused up front.

Each recipe runs 30 steps on ``debug`` eager and with every block compiled (inductor). Inductor fuses and
reorders FP32 arithmetic (and keeps every BF16 rounding: ``emulate_precision_casts``), so the yardstick is the
one of ``test_parity``: the recipe's own FP32-reordering spread, floored by ``bf16``'s; compiled vs eager must
stay within ``MULTIPLE`` times it. The full catalog is covered by ``benchmarks/compile_catalog.py`` (a compile
costs 20-60 s on 2 cores); here, one recipe per kind of block: FP32, lowprec FP8 (with BF16 autocast around
it), torchao FP8, and a ``bf16`` run with ``train.ac=full`` through the command line.
"""

from __future__ import annotations

import pytest
from parity import max_gap, train_losses

from lowprec.errors import RecipeError
from lowprec.train.build import check_compile
from lowprec.train.spec import TrainSpec
from recipes import CATALOG

STEPS = 30
MULTIPLE = 10


# The yardstick is measured on the emulated kernels, whatever this CPU's ``auto`` picks for the compared runs: only
# there does every low-precision GEMM go through an FP32 matmul that the reversed reduction order reaches. On a CPU
# where ``auto`` runs native BF16 GEMMs (AVX-512-BF16, AMX), a yardstick measured with ``auto`` reordered nothing but
# the FP32 matmuls, and bf16's and fp8_current's spreads came out 0.
YARDSTICK_KERNELS = "emulated"


@pytest.fixture(scope="module")
def bf16_floor(token_data) -> float:
    base = train_losses(token_data, "bf16", YARDSTICK_KERNELS, steps=STEPS)
    return max_gap(base, train_losses(token_data, "bf16", YARDSTICK_KERNELS, reorder=True, steps=STEPS))


@pytest.mark.parametrize("recipe", ["fp32", "fp8_current", "fp8_tensorwise"])
def test_compiled_blocks_train_like_eager(token_data, bf16_floor, recipe):
    eager = train_losses(token_data, recipe, "auto", steps=STEPS, telemetry_every=0)
    mine = train_losses(token_data, recipe, YARDSTICK_KERNELS, steps=STEPS, telemetry_every=0)
    kw = dict(reorder=True, steps=STEPS, telemetry_every=0)
    own = max_gap(mine, train_losses(token_data, recipe, YARDSTICK_KERNELS, **kw))
    spread = own if recipe == "fp32" else max(own, bf16_floor)
    assert spread > 0
    compiled = train_losses(token_data, recipe, "auto", steps=STEPS, telemetry_every=0, compile=True)
    gap = max_gap(eager, compiled)
    assert gap <= MULTIPLE * spread, (
        f"{recipe}: compiled vs eager losses differ by {gap:.3g} over {STEPS} steps, more than {MULTIPLE} x the "
        f"FP32-reordering spread {spread:.3g}"
    )


@pytest.mark.parametrize(
    "recipe, telemetry_every, needle",
    [
        ("te_delayed", 0, "Transformer Engine's te.Linear runs its own kernels outside torch.compile"),
        ("fp8_current", 25, "lowprec FP8 telemetry (train.telemetry_every=25)"),
    ],
)
def test_what_cannot_compile_is_refused_naming_the_part(recipe, telemetry_every, needle):
    with pytest.raises(RecipeError, match="train.compile=true cannot compile") as e:
        check_compile(CATALOG[recipe], TrainSpec(compile=True, telemetry_every=telemetry_every))
    assert needle in str(e.value) and "\n" not in str(e.value)
    check_compile(CATALOG[recipe], TrainSpec(compile=False, telemetry_every=telemetry_every))  # eager: fine


@pytest.mark.parametrize(
    "recipe, version, refused",
    [
        ("fp8_blockwise", "2.11.0+cu130", True),
        ("deepseek_v3_tensorwise", "2.11.0+cu130", True),  # cache_fp8_activations
        ("fp8_current", "2.11.0+cu130", False),
        ("fp8_rowwise", "2.11.0+cu130", False),
        ("fp8_blockwise", "2.13.0+cu130", False),
    ],
)
def test_lowprec_fp8_linears_torch_2_11_cannot_trace_on_cuda_are_refused_there(recipe, version, refused):
    # What an H100 run with torch 2.11 showed (lowprec.backends.fp8_lowprec.cuda_compile_blocker); CPU is unaffected.
    from lowprec.backends.fp8_lowprec import cuda_compile_blocker

    reason = cuda_compile_blocker(CATALOG[recipe].fp8, "cuda", version)
    assert (reason is not None) == refused, reason
    assert cuda_compile_blocker(CATALOG[recipe].fp8, "cpu", version) is None
    if refused:
        assert "train.compile=false" in reason and "\n" not in reason


def test_a_compiled_run_logs_compile_time_apart_and_records_its_blocks(run_dirs, tmp_path):
    import json

    from mlflow.tracking import MlflowClient

    from experiments.cli import main

    args = ["model=debug", "train.steps=4", "train.timing_warmup_steps=1", "train.batch_size=2", "train.seq_len=32"]
    assert main(["train", *run_dirs, *args, "recipe=bf16", "train.compile=true", "train.ac=full"]) == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    m, tags = run.data.metrics, run.data.tags
    assert m["compile_time_s"] > 0
    steps = {h.step: h.value for h in client.get_metric_history(run.info.run_id, "step_compile_s")}
    assert 0 in steps, "the first step compiles, and says so"
    assert json.loads(tags["effective_recipe"])["blocks"] == {"n": 2, "checkpointed": 2, "compiled": 2}
