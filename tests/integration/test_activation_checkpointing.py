"""Activation checkpointing (``train.ac``, ``lowprec.train.ac``): the same losses as without it, FP8 side effects
once per forward, FQNs unchanged, and ``lowprec estimate`` agreeing with a real run on saved-activation bytes.
Under FSDP2 and TP: ``tests/distributed/test_ac_parallel.py``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lowprec.build_optim import OptimHParams
from lowprec.data import TokenBatches
from lowprec.estimate.activations import predict_saved_activations
from lowprec.measure.saved_tensors import measure_saved_bytes
from lowprec.model import model_args
from lowprec.numerics.scaling import DelayedScaler
from lowprec.recipes import get_recipe
from lowprec.train.ac import apply_ac, is_checkpointed
from lowprec.train.build import build, build_model_meta
from lowprec.train.loop import run_training
from lowprec.train.spec import TrainSpec

CPU = torch.device("cpu")
MODES = ("none", "full", "selective")


class _Sink:
    def __init__(self):
        self.rows = []

    def log_metrics(self, m, step):
        self.rows.append(dict(m))


def _run(recipe: str, ac: str, token_data, steps: int = 4, telemetry_every: int = 0, **build_kw):
    spec = TrainSpec(
        steps=steps,
        batch_size=2,
        seq_len=64,
        warmup_steps=1,
        val_every=0,
        val_batches=1,
        timing_warmup_steps=1,
        telemetry_every=telemetry_every,
        progress=False,
        ac=ac,
    )
    b = build(get_recipe(recipe), model_args("debug"), spec, OptimHParams(lr=3e-3), 0, CPU, **build_kw)
    sink = _Sink()
    res = run_training(b, TokenBatches(token_data.train, token_data.val, 64, 2, 0), spec, sink)
    return b, res, sink.rows


def test_apply_ac_keeps_fqns_and_state_dict_keys():
    ref = build_model_meta(model_args("debug"))
    for mode in MODES:
        m = build_model_meta(model_args("debug"))
        assert apply_ac(m, mode) == ([] if mode == "none" else ["layers.0", "layers.1"])
        assert list(m.state_dict()) == list(ref.state_dict())
        assert [n for n, _ in m.named_modules()] == [n for n, _ in ref.named_modules()]
        assert all(is_checkpointed(b) == (mode != "none") for b in m.layers.values())
    with pytest.raises(ValueError, match="already checkpointed"):
        apply_ac(m, "full")
    with pytest.raises(ValueError, match="not one of"):
        apply_ac(build_model_meta(model_args("debug")), "sometimes")
    # torchtitan's layer SAC: every N-th block, counted from 1
    m = build_model_meta(model_args("debug"))
    assert apply_ac(m, "selective", selective_option=2) == ["layers.1"]
    assert not is_checkpointed(m.layers["0"]) and m.layers["1"]._ac_mode == "full"


def test_fp32_losses_equal_no_checkpointing_bit_for_bit_and_run_agrees_with_estimate(token_data):
    """The acceptance check through real runs: every mode's logged saved-activation bytes within 5% of
    ``lowprec estimate`` for the same mode (and ``full`` < ``selective`` < ``none``)."""
    runs = {mode: _run("fp32", mode, token_data) for mode in MODES}
    losses = {mode: [r["loss"] for r in rows] for mode, (_, _, rows) in runs.items()}
    norms = {mode: [r["grad_norm"] for r in rows] for mode, (_, _, rows) in runs.items()}
    for mode in ("full", "selective"):
        assert losses[mode] == losses["none"], mode
        assert norms[mode] == norms["none"], mode
        for (n, p), q in zip(runs[mode][0].model.named_parameters(), runs["none"][0].model.parameters(), strict=True):
            assert torch.equal(p, q), (mode, n)
    saved = {}
    for mode, (_, res, _) in runs.items():
        s = res.summary
        measured, estimate = s["mem_saved_activations_bytes"], s["mem_saved_activations_estimate_bytes"]
        assert abs(measured - estimate) <= 0.05 * estimate, (mode, measured, estimate)
        saved[mode] = measured
    assert saved["full"] < saved["selective"] < saved["none"]


def test_fp8_delayed_recompute_records_amax_and_telemetry_once(token_data, monkeypatch):
    """The recompute of a checkpointed block must not record delayed-scaling amaxes (nor all-reduce them) or
    observe telemetry again: the calls are counted (a repeated record would leave a running max unchanged)."""
    from lowprec.measure.telemetry import FP8Telemetry

    counts: dict[str, int] = {}

    def counting(name, fn):
        def wrapped(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(DelayedScaler, "record", counting("record", DelayedScaler.record))
    monkeypatch.setattr(FP8Telemetry, "observe_cast", counting("observe_cast", FP8Telemetry.observe_cast))
    monkeypatch.setattr(FP8Telemetry, "observe_gemm", counting("observe_gemm", FP8Telemetry.observe_gemm))
    out = {}
    for mode in MODES:
        counts.clear()
        b, _, rows = _run("fp8_delayed", mode, token_data, steps=3, telemetry_every=1)
        scalers = {k: v.clone() for k, v in b.model.state_dict().items() if "scalers." in k}
        out[mode] = dict(counts), [r["loss"] for r in rows], scalers, rows
    n_calls, losses, scalers, rows = out["none"]
    assert n_calls["record"] > 0 and n_calls["observe_cast"] > 0 and n_calls["observe_gemm"] > 0
    assert scalers and any(v.abs().sum() > 0 for k, v in scalers.items() if k.endswith("amax_history"))
    for mode in ("full", "selective"):
        assert out[mode][0] == n_calls, mode
        assert out[mode][1] == losses, mode
        assert out[mode][2].keys() == scalers.keys()
        assert all(torch.equal(out[mode][2][k], v) for k, v in scalers.items()), mode
        fp8 = [{k: v for k, v in r.items() if k.startswith("fp8/")} for r in out[mode][3]]
        assert fp8 == [{k: v for k, v in r.items() if k.startswith("fp8/")} for r in rows], mode


#: (model, recipe, qk_norm): debug over every lowprec scaling plus torchao, with and without QK-norm; tiny over the
#: dtypes and DeepSeek's blockwise.
_DEBUG = ("fp32", "bf16", "bf16_pure", "fp16_amp", "fp8_current", "fp8_delayed", "fp8_blockwise", "fp8_tensorwise")
ESTIMATE_CASES = [("debug", r, qk) for r in _DEBUG for qk in (False, True)]
ESTIMATE_CASES += [("tiny", r, False) for r in ("fp32", "bf16", "fp8_blockwise")] + [("tiny", "bf16", True)]


@pytest.mark.parametrize("size, recipe, qk_norm", ESTIMATE_CASES)
def test_estimate_matches_measured_saved_bytes_in_every_mode(size, recipe, qk_norm):
    """``lowprec estimate``'s figure for each mode against ``measure_saved_bytes`` on the checkpointed model
    (batch 2 x seq 64): within 5%, and exact for lowprec's own linears. torchao's FP8 linears are off by the
    0-dim amaxes torchtitan's policy keeps (``aten.max``), a few bytes per block the estimator leaves out."""
    args, batch, seq = model_args(size, qk_norm=qk_norm), 2, 64
    spec = TrainSpec(steps=2, batch_size=batch, seq_len=seq, timing_warmup_steps=1, val_every=0, progress=False)
    b = build(get_recipe(recipe), args, spec, OptimHParams(), 0, CPU)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, args.vocab_size, (batch, seq), generator=gen) for _ in range(2))
    est = predict_saved_activations(args, get_recipe(recipe), batch, seq, device_type="cpu")
    for mode in MODES:
        model = copy.deepcopy(b.model)
        apply_ac(model, mode)

        def forward_and_loss(model=model):
            with b.precision():
                logits = model(x)
            return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

        m = measure_saved_bytes(forward_and_loss, model)
        predicted = (est.recompute_activations[mode], est.recompute[mode] - est.recompute_activations[mode])
        assert abs(m.activations - predicted[0]) <= 0.05 * predicted[0], (mode, m, predicted)
        assert abs(m.total - est.recompute[mode]) <= 0.05 * est.recompute[mode], (mode, m, predicted)
        if get_recipe(recipe).fp8.backend != "torchao":
            assert (m.activations, m.weight_copies) == predicted, (mode, m, predicted)
        if mode != "none":
            assert m.kept + m.recomputed == m.total and m.recomputed > 0


def test_report_shows_measured_and_estimated_saved_bytes_under_the_run_mode(run_dirs, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from lowprec_lab.cli import main

    quick = ["model=debug"]  # the default experiment turns QK-norm on: the estimate models its norms too
    quick += ["train.steps=3", "train.batch_size=2", "train.seq_len=64", "train.val_every=0"]
    quick += ["train.val_batches=1", "train.warmup_steps=1", "train.timing_warmup_steps=1", "train.ac=full"]
    assert main(["ablate", "controls=false", "recipes=[fp32]", "seeds=1", *quick, *run_dirs]) == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lowprec").experiment_id
    (run,) = client.search_runs([exp], filter_string="tags.recipe = 'fp32'")
    m = run.data.metrics
    assert run.data.params["train.ac"] == "full" and run.data.params["model.qk_norm"] == "True"
    assert m["mem_saved_activations_bytes"] == m["mem_saved_activations_estimate_bytes"]
    assert m["pred_mem_saved_activations_bytes"] == m["mem_saved_activations_estimate_bytes"]
    (report,) = (tmp_path / "reports").glob("*/report.md")
    (row,) = [line for line in report.read_text().splitlines() if line.startswith("| `fp32` | full |")]
    assert f"{m['mem_saved_activations_bytes']:,.0f} (exact)" in row
