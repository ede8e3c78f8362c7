"""Bad input ends in one line naming the field and the fix, before any MLflow run exists; a bug keeps its
traceback."""

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lowprec_lab.cli import main

DEBUG = [
    "model=debug",
    "train.steps=4",
    "train.batch_size=2",
    "train.seq_len=64",
    "train.val_every=0",
    "train.val_batches=1",
    "train.warmup_steps=1",
    "train.timing_warmup_steps=1",
]


def _tokens_without_splits(tmp_path: Path) -> str:
    d = tmp_path / "tokens"
    d.mkdir()
    (d / "meta.json").write_text(json.dumps({"vocab_size": 8192, "dtype": "uint16"}))
    return str(d)


def _not_a_spool(tmp_path: Path) -> str:
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 0, "loss": 9.1}\n')
    return str(f)


BAD = [
    # (command and overrides, what the one line must contain)
    (["train", "train.grad_clip=-1"], "train.grad_clip=-1"),
    (["train", "train.grad_clip=0"], "train.grad_clip=0"),
    (["train", "train.warmup_steps=-3"], "train.warmup_steps=-3"),
    (["train", "train.min_lr_ratio=1.5"], "train.min_lr_ratio=1.5"),
    (["train", "train.min_lr_ratio=-0.1"], "train.min_lr_ratio=-0.1"),
    (["train", "optim.lr=-1"], "optim.lr=-1"),
    (["train", "optim.beta2=1.0"], "optim.beta2=1.0"),
    (["train", "recipe=fp16_amp", "recipe.compute.init_scale=-1"], "recipe.compute.init_scale=-1"),
    (
        ["train", "recipe=fp8_current", "recipe.fp8.cast.strategy=static", "recipe.fp8.cast.static_scales=[0,0,0]"],
        "recipe.fp8.cast.static_scales=[0.0, 0.0, 0.0] must be finite and > 0",
    ),
    (["train", "train.seq_len=4096"], "train.seq_len=4096 exceeds model.max_seq_len=512"),
    (
        ["train", "recipe=fp32", "recipe.fp8.cast.margin=2"],
        "recipe.fp8.cast.margin=2 has no effect with recipe.fp8.backend='none'",
    ),
    (
        ["train", "recipe=fp8_current", "recipe.fp8.cast.amax_history_len=64"],
        "recipe.fp8.cast.amax_history_len=64 has no effect",
    ),
    (["train", "recipe=bf16", "recipe.compute.growth_interval=10"], "recipe.compute.growth_interval=10 has no effect"),
    (["train", "train.steps=abc"], "train.steps: Value 'abc'"),
    (["train", "recipe.fp8.cast.margin=abc"], "recipe.fp8.cast.margin: Value 'abc'"),
    (["train", "model.n_layers=-10"], "model.n_layers=-10 must be >= 1"),
    (["train", "recipe=fp8_comm8", "parallel.tp=2"], "need FSDP (parallel.dp_shard > 1)"),
    (["train", "recipe=fp8_comm8"], "need FSDP (parallel.dp_shard > 1)"),
    (["train", "data=tokens", "data.path=SPLITLESS"], "has no 'splits' key"),
    (["train", "recipe=fp9"], "unknown recipe 'fp9'; known: fp32, fp32_reordered, bf16"),
    (["train", "recipe=fp8_current", "recipe.fp8.layers.hp_first_blocks=99"], "select no linear"),
    (["train", "recipe=fp8_blockwise", "recipe.fp8.layers.min_features=100000"], "select no linear"),
    # DeepSeek-V3's recipe: E5M6 asked of a layer with no such activation; the recipe's new fields out of range
    (["train", "recipe=deepseek_v3", "recipe.fp8.saved.e5m6_inputs=[feed_forward.w9]"], "match no FP8 linear"),
    (["train", "recipe=deepseek_v3", "recipe.fp8.saved.e5m6_inputs=[output]"], "match no FP8 linear"),
    (["train", "recipe=deepseek_v3", "recipe.fp8.gemm.promotion=false"], "needs recipe.fp8.gemm.accum_mantissa_bits"),
    (["train", "recipe=deepseek_v3", "recipe.fp8.cast.amax_floor=0"], "recipe.fp8.cast.amax_floor=0"),
    # the emulated accumulator's model; it needs the accumulator
    (
        ["train", "recipe=deepseek_v3", "recipe.fp8.gemm.accum_rounding=truncate"],
        "accum_rounding='truncate' has no effect",
    ),
    (
        ["train", "recipe=deepseek_v3_no_promotion", "recipe.fp8.gemm.accum_rounding=up"],
        "accum_rounding='up' is not one",
    ),
    (["train", "recipe=deepseek_v3_no_promotion_hopper", "recipe.fp8.gemm.accum_group=48"], "accum_group=48 conflicts"),
    (
        ["train", "recipe=deepseek_v3_no_promotion", "recipe.fp8.gemm.accum_group=many"],
        "recipe.fp8.gemm.accum_group: Value",
    ),
    (["train", "recipe=fp8_current", "recipe.fp8.cast.grad_output_granularity=block128x128"], "scaling='tensorwise'"),
    (["train", "recipe=deepseek_v3", "recipe.fp8.saved.swiglu_cache=fp16"], "recipe.fp8.saved.swiglu_cache='fp16'"),
    (["train", "train.ac=sometimes"], "train.ac='sometimes' is not one of none, selective, full"),
    (["train", "cpu_kernels=fast"], "cpu_kernels='fast' is not one of auto, native, emulated"),
    (
        ["train", "recipe=fp8_current", "train.compile=true"],
        "cannot compile recipe 'fp8_current': lowprec FP8 telemetry",
    ),
    (["ablate", "cpu_kernels=fast"], "cpu_kernels='fast' is not one of auto, native, emulated"),
    (
        ["train", "recipe.fp8.layers.hp_first_blocks=-1", "recipe=fp8_current"],
        "recipe.fp8.layers.hp_first_blocks=-1 must be >= 0",
    ),
    (["train", "device=tpu"], "device='tpu'"),
    (["ablate", "recipes=[fp32]", "seeds=0"], "seeds=0 must be >= 1"),
    (["ablate", "recipes=[fp32]", "seeds=some"], "seeds=some must be an integer >= 1, auto, or per recipe"),
    (["ablate", "recipes=[fp32,bf16]", "seeds=auto", "max_seeds=2"], "seeds=auto needs max_seeds >= 3 (got 2)"),
    (["ablate", "recipes=[fp32]", "workers=0"], "workers=0 must be >= 1"),
    (["ablate", "recipes=[fp32]", "workers=many"], "workers=many must be an integer >= 1 or auto"),
    (["ablate", "recipes=[fp32]", "workers=2", "parallel.dp_shard=2"], "workers=2 cannot combine with a parallel"),
    (["ablate", "recipes=[fp32]", "stability.k=-1"], "stability: k must be a finite number > 0 (got -1.0)"),
    (["train", "stability.ema_window=0"], "stability: ema_window must be >= 1 (got 0)"),
    (["ablate", "recipes=[fp32]", "report.margin=-1"], "report.margin must be a finite relative margin > 0"),
    (["ablate", "recipes=[fp32]", "report.margin=0"], "report.margin must be a finite relative margin > 0"),
    (["ablate", "recipes=[fp32]", "report.margin=nan"], "report.margin must be a finite relative margin > 0"),
    (["ablate", "recipes=[fp32]", "report.margin=abc"], "report.margin: Value 'abc'"),
    (["ablate", "recipes=[fp32,bf16]", "control=fp16_amp"], "control=fp16_amp is not among recipes=['fp32', 'bf16']"),
    (["ablate", "recipes=[fp32,bf16]", "studies=[nope]"], "studies=['nope']: unknown ['nope']"),
    (["ablate", "recipes=[fp32,fp32]"], "names a recipe twice"),
    # seeds per recipe: catalog recipes, integers >= 1, and a count for the others
    (["ablate", "recipes=[bf16,fp32]", "seeds={others:2,fp9:3}"], "seeds.fp9: no recipe fp9 in the catalog"),
    (["ablate", "recipes=[bf16,fp32]", "seeds={others:2,fp32:0}"], "seeds.fp32=0 must be an integer >= 1"),
    (["ablate", "recipes=[bf16,fp32]", "seeds={others:2,fp32:2.5}"], "seeds.fp32=2.5 must be an integer >= 1"),
    (["ablate", "recipes=[bf16,fp32]", "seeds={others:2,fp32:true}"], "seeds.fp32=True must be an integer"),
    (["ablate", "recipes=[bf16,fp32]", "seeds={others:0,fp32:2}"], "seeds.others=0 must be an integer >= 1"),
    (["ablate", "recipes=[bf16,fp32]", "report.primary=[fp16]"], "report.primary names fp16, which this ablation"),
    (["ablate", "recipes=[bf16,fp32]", "report.primary=[bf16]"], "report.primary names the control bf16"),
    (
        ["ablate", "recipes=[bf16,fp32]", "controls=true", "report.primary=[fp8_unscaled]"],
        "report.primary names the control recipe fp8_unscaled",
    ),
    (["ablate", "recipes=[bf16,fp32]", "report.primary=[fp32,fp32]"], "report.primary=['fp32', 'fp32'] names a"),
    (["ablate", "recipes=[bf16,fp32]", "seeds=auto", "report.primary=[fp32]"], "report.primary needs a fixed seed"),
    (["ablate", "recipes=[bf16,fp32]", "seeds={fp32:2}"], "seeds={fp32: 2} has no others: N"),
    (["ablate", "recipes=[bf16,fp32]", "seeds={others:3,bf16:2}"], "seeds.bf16=2: bf16 is the control, which trains"),
    (["ablate", "recipes=[bf16,fp32]", "seed=4294967293", "seeds={others:1,fp32:4}"], "with 4 seeds runs past"),
    (["ablate", "recipes=[fp32,fp9]"], "unknown recipe 'fp9'; known: fp32, fp32_reordered, bf16"),
    (["ablate", "recipes=[fp32,fp8_current]", "train.grad_clip=-1"], "train.grad_clip=-1"),
    (["ablate", "recipes=[fp32,fp8_current]", "recipe.fp8.layers.hp_first_blocks=99"], "need lowprec train"),
    (["ablate", "recipes=[fp32,fp8_comm8]"], "recipe fp8_comm8: recipe.comm"),
    (["ablate", "experiment=deepseek_v3_quick", "models=[debug,moe_nope]"], "unknown model 'moe_nope'"),
    (["ablate", "experiment=deepseek_v3_quick", "study.deepseek_v3.k_max=100"], "k_max=100 must be >= 256"),
    (["ablate", "experiment=deepseek_v3_quick", "+study.deepseek_v3.kmax=1"], "unknown field(s) ['kmax']"),
    (["ablate", "recipes=[bf16]", "+study.deepseek_v3.k_max=1024"], "not in studies=[]"),
    (["train", "resume=/no/such/checkpoint"], "no checkpoint at '/no/such/checkpoint'"),
    (["train", "train.keep_checkpoints=-1"], "train.keep_checkpoints=-1 must be >= 0"),
    (["ui", "tracking.urx=3"], "unknown key tracking.urx, did you mean tracking.uri?"),
    # fault injection is a test channel (LOWPREC_FAULTS), not a config key
    (["train", "faults.signal=SIGTERM"], "unknown key faults"),
    (["sync", "/no/such/spool"], "no spool file or folder at '/no/such/spool'"),
    (["sync", "NOTASPOOL"], "is not a lowprec spool file (its first line is not a spool header)"),
    # resume= of an ablation takes its id: an unknown one, or a run's checkpoint folder, is refused (no MLflow write)
    (
        ["ablate", "recipes=[fp32]", "resume=abl-20261125-101500-ab12"],
        "resume=abl-20261125-101500-ab12: no ablation abl-20261125-101500-ab12",
    ),
    (
        ["ablate", "recipes=[fp32]", "resume=runs/checkpoints/0c5e1f2a/step_4"],
        "resume=runs/checkpoints/0c5e1f2a/step_4 is not an ablation id: resume= of lowprec ablate takes the id",
    ),
    (["train", "train.on_anomaly=retry"], "train.on_anomaly='retry' is not one of fail, skip, rollback"),
    (["ablate", "recipes=[fp32]", "train.on_anomaly=retry"], "train.on_anomaly='retry' is not one of"),
    (["train", "train.max_rollbacks=-1"], "train.max_rollbacks=-1 must be >= 0"),
    (["train", "train.max_consecutive_skips=0"], "train.max_consecutive_skips=0 must be >= 1"),
    (
        ["train", "train.on_anomaly=rollback"],
        "train.on_anomaly=rollback reloads the last checkpoint: set train.checkpoint_every > 0",
    ),
    (["train", "train.fp8_fallback=always"], "train.fp8_fallback='always' is not one of off, layer"),
    (["train", "train.fp8_fallback_threshold=0"], "train.fp8_fallback_threshold=0.0 must be in (0, 1]"),
    (["train", "train.fp8_fallback_samples=0"], "train.fp8_fallback_samples=0 must be >= 1"),
    (["train", "train.fp8_fallback=layer", "train.telemetry_every=0"], "decides from the FP8 telemetry samples"),
    (
        ["train", "recipe=fp8_tensorwise", "train.fp8_fallback=layer"],
        "cannot run recipe 'fp8_tensorwise': recipe.fp8.backend='torchao' records no per-layer FP8",
    ),
    (
        ["ablate", "recipes=[bf16,fp8_tensorwise]", "train.fp8_fallback=layer"],
        "train.fp8_fallback=layer cannot run recipe 'fp8_tensorwise'",
    ),
    (["train", "recipe=fp8_comm8", "train.fp8_fallback=layer"], "gathers the weights in FP8"),
    (
        ["train", "recipe=fp8_current", "train.fp8_fallback=layer", "train.compile=true"],
        "train.fp8_fallback=layer cannot run with train.compile=true",
    ),
    (["train", "train.skip_batches=[3,-1]"], "train.skip_batches holds -1: batch indices are >= 0"),
    # the DeepSeekMoE model (model=moe_*)
    (
        ["train", "model=moe_debug", "+model.n_experts=4"],
        "unknown key model.n_experts: the model size has no field 'n_experts'",
    ),
    (["train", "model=moe_debug", "model.top_k=9"], "model.top_k=9 is larger than model.n_routed_experts=8"),
    (
        ["train", "model=moe_debug", "recipe=fp8_current", "recipe.fp8.layers.keep_hp_fqns=[output,experts.8.w1]"],
        "recipe.fp8.layers.keep_hp_fqns pattern 'experts.8.w1' names experts but matches no linear of this model",
    ),
    (["train", "model=moe_debug", "parallel.tp=2"], "parallel.tp=2 is not supported for MoE models"),
    (["train", "model=moe_debug", "train.compile=true"], "train.compile=true is not supported for MoE models"),
    # block-scaled recipes: lowprec refuses, never pads, a block that does not divide a contraction dim
    (
        ["train", "recipe=mxfp8", "recipe.fp8.layers.min_features=0"],
        "multiples of its 32-element blocks (lowprec refuses rather than pads); layers.0.attention.wk is 32->16",
    ),
    (["train", "recipe=nvfp4", "recipe.fp8.backend=torchao"], "has no NVFP4 training path"),
    (
        ["train", "recipe=nvfp4", "recipe.fp8.block.rht_size=12"],
        "recipe.fp8.block.rht_size=12 must be 0 (off) or a power of 2",
    ),
    (["train", "recipe=te_nvfp4"], "recipe.fp8.backend='te' needs a CUDA GPU"),
    (["train", "recipe=te_mxfp8"], "recipe.fp8.backend='te' needs a CUDA GPU"),
    (["train", "recipe=bf16", "recipe.fp8.block.rht_size=16"], "recipe.fp8.block.rht_size=16 has no effect with"),
    (["train", "recipe=mxfp8", "recipe.fp8.block.weight_scaling_2d=true"], "weight_scaling_2d=true needs"),
    # refused at preflight, not a traceback or a FAILED run
    (["train", "seed=-1"], "seed=-1 must be an integer in [0, 4294967295]"),
    (["train", "seed=99999999999999999999"], "seed=99999999999999999999 must be an integer in [0, 4294967295]"),
    (["ablate", "recipes=[fp32]", "seed=4294967295", "seeds=2"], "with 2 seeds runs past 4294967295"),
    (["train", "recipe=fp8_tensorwise", "model.dim=40"], "not multiples of 16 (torchao needs it)"),
    (
        ["train", "recipe=fp8_tensorwisé"],
        "unknown recipe 'fp8_tensorwisé', did you mean fp8_tensorwise? known: fp32, fp32_reordered, bf16",
    ),
    (["ablate", "recipes=[bf16,fp8_rowwisé]"], "unknown recipe 'fp8_rowwisé', did you mean fp8_rowwise?"),
    (["train", "tracking.uri=foo://bar"], "tracking.uri=foo://bar: MLflow has no tracking store for 'foo'://"),
    (["train", "paths.runs=/dev/null"], "paths.runs=/dev/null cannot hold lowprec's runs"),
    (["ablate", "recipes=[fp32]", "paths.reports=/dev/null/x"], "paths.reports=/dev/null/x cannot hold"),
    # a grid of training settings (lowprec_lab/plan/grid.py): every point checked before the first trains
    (
        ["ablate", "recipes=[bf16,fp32]", "+grid.optim.lr=[0.003]"],
        "grid.optim.lr=[0.003]: a grid axis needs at least 2",
    ),
    (["ablate", "recipes=[bf16,fp32]", "+grid.optim.lr=[0.003,-0.001]"], "optim.lr=-0.001"),
    (["ablate", "recipes=[bf16,fp32]", "+grid.optim.lr=[0.003,0]"], "optim.lr=0"),
    (["ablate", "recipes=[bf16,fp32]", "+grid.seeds=[1,2]"], "grid.seeds: only training settings can be an axis"),
    (
        ["ablate", "recipes=[bf16,fp32]", "control=fp8_rowwise", "+grid.optim.lr=[0.001,0.003]"],
        "control=fp8_rowwise is not among recipes",
    ),
]


@pytest.mark.parametrize("args, needle", BAD, ids=[" ".join(a[1:]) for a, _ in BAD])
def test_bad_input_is_one_line_and_creates_no_mlflow_run(args, needle, run_dirs, tmp_path, capsys):
    args = [a.replace("SPLITLESS", _tokens_without_splits(tmp_path)) if "SPLITLESS" in a else a for a in args]
    args = [_not_a_spool(tmp_path) if a == "NOTASPOOL" else a for a in args]
    assert main(args[:1] + run_dirs + DEBUG + args[1:]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"lowprec {args[0]}: error: ") and needle in err, err
    db = tmp_path / "runs" / "mlflow.db"
    if db.exists():  # nothing may have been logged, not even a FAILED run
        client = MlflowClient(f"sqlite:///{db}")
        exps = [e.experiment_id for e in client.search_experiments()]
        assert client.search_runs(exps) == []


def test_unknown_recipe_lists_the_valid_names(run_dirs, capsys):
    assert main(["train", *run_dirs, "recipe=fp9"]) == 2
    err = capsys.readouterr().err
    assert "known: " in err and "fp8_blockwise" in err and "deepseek_v3" in err


def test_an_internal_error_keeps_its_traceback(run_dirs, monkeypatch):
    """A KeyError raised by a bug is not mistaken for a user's bad value: it propagates with its traceback."""
    import lowprec_lab.plan.preflight

    def bug(*a, **k):
        raise KeyError("internal bug")

    monkeypatch.setattr(lowprec_lab.plan.preflight, "build_model_meta", bug)
    with pytest.raises(KeyError, match="internal bug"):
        main(["train", *run_dirs, *DEBUG])


def test_a_bug_inside_a_run_is_recorded_failed_with_its_traceback(run_dirs, tmp_path, monkeypatch, capsys):
    import lowprec.train.meter

    def bug(*a, **k):
        raise KeyError("internal bug in accounting")

    monkeypatch.setattr(lowprec.train.meter, "measure_state_bytes", bug)
    assert main(["train", *run_dirs, *DEBUG, "recipe=fp32"]) == 1
    assert "Traceback" in capsys.readouterr().err
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lowprec").experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags["failure_reason"] == "KeyError: 'internal bug in accounting'"
    tb = Path(client.download_artifacts(run.info.run_id, "failure_traceback.txt", str(tmp_path)))
    assert "measure_state_bytes" in tb.read_text() or "bug" in tb.read_text()


BAD_ESTIMATE = [
    # what a new user tried on `lowprec estimate`, each refused with one line; the keys are lowprec train's and so
    # are the messages
    (["model=llama3_8b", "recipe=bf16", "model.n_layers=-10"], "model.n_layers=-10 must be >= 1"),
    (["model=llama3_8b", "recipe=bf16", "train.ac=sometimes"], "train.ac='sometimes' is not one of none"),
    (["model=llama3_8b", "recipe=fp8_tensorwise", "hardware=a100"], "has no FP8 tensor cores"),
    (["model=llama3_8b", "recipe=bf16", "train.batch_size=0"], "train.batch_size=0"),
    (["model=llama3_8b", "recipe=bf16", "train.seq_len=-1"], "train.seq_len=-1"),
    (["model=llama3_8b", "recipe=bf16", "train.seq_len=100000"], "train.seq_len=100000 exceeds model.max_seq_len=8192"),
    (["model=llama3_8b", "recipe=bf16", "parallel.dp_shard=0"], "parallel.dp_shard=0"),
    (["model=llama3_8b", "recipe=bf16", "parallel.tp=3"], "parallel.tp=3 must divide"),
    (
        ["model=llama3_8b", "recipe=bf16", "parallel.dp_shard=3"],
        "train.batch_size=8 is not divisible by the data-parallel",
    ),
    (["model=llama3_8b", "recipe=bf16", "efficiency=1.5"], "efficiency=1.5 must be in (0, 1]"),
    (["model=llama3_8b", "recipe=bf16", "hardware=tpu"], "unknown hardware 'tpu'"),
    (["model=llama3_8b", "recipe=bf16", "train.batch_size=two"], "train.batch_size: Value 'two'"),
    (["model=llama3_8b", "recipe=fp8_current", "recipe.fp8.cast.margin=-1"], "recipe.fp8.cast.margin"),
    (["model=llama3_8b", "recipe=bf16", "--fast"], "unknown flag '--fast'"),
    (["model=llama3_8b", "recipe=bf16", "model.dim=abc"], "model.dim: Value 'abc'"),
    (["model=llama3_8b", "recipe=bf16", "model.foo=1"], "unknown key model.foo"),
    (["model=llama3_8b", "recipe=bf16", "train.compile=maybe"], "train.compile='maybe' must be true, false or auto"),
    (["model=llama3_8b", "recipe=bf16", "async_tp=true"], "async_tp=true needs parallel.tp > 1"),
    (["model=llama3_8b", "recipe=bf16", "recipe.fp9.x=1"], "unknown key recipe.fp9, did you mean recipe.fp8?"),
    (["model=llama3_8b", "recipe=all", "recipe.fp8.cast.margin=1"], "overrides need a single recipe, not recipe=all"),
    (["--validate", "model=llama3_8b"], "--validate takes no other key"),
    # the keys estimate took before it shared train's: one line naming the new one
    (
        ["model=llama3_8b", "recipe=bf16", "batch=2"],
        "batch= is gone: lowprec estimate takes lowprec train's keys, train.batch_size",
    ),
    (
        ["model=llama3_8b", "recipe=bf16", "seq=512"],
        "seq= is gone: lowprec estimate takes lowprec train's keys, train.seq_len",
    ),
    (
        ["model=llama3_8b", "recipe=bf16", "recompute=full"],
        "recompute= is gone: lowprec estimate takes lowprec train's keys, train.ac",
    ),
    (
        ["model=llama3_8b", "recipe=bf16", "compile=true"],
        "compile= is gone: lowprec estimate takes lowprec train's keys, train.compile",
    ),
    # a MoE model: what lowprec train refuses of it (tensor parallel, compile), with train's message
    (
        ["model=moe_debug", "recipe=bf16", "parallel.tp=2", "train.batch_size=2"],
        "parallel.tp=2 is not supported for MoE models",
    ),
    (["model=moe_debug", "recipe=bf16", "train.compile=true"], "train.compile=true is not supported for MoE models"),
    # block-scaled recipes need sm100 (Blackwell), as FP8 ones need FP8 tensor cores: the backend's own check
    (
        ["model=llama3_8b", "recipe=nvfp4", "hardware=h100"],
        "recipe nvfp4 cannot run on hardware=h100_sxm: recipe.fp8.backend='mx' on a GPU needs block-scaled",
    ),
]


@pytest.mark.parametrize("args, needle", BAD_ESTIMATE, ids=[" ".join(a[1:]) for a, _ in BAD_ESTIMATE])
def test_bad_estimate_input_is_one_line(args, needle, capsys):
    assert main(["estimate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("lowprec estimate: error: ") and needle in err, err


def test_fp8_on_a100_runs_with_emulate_and_predicts_no_time(capsys):
    assert main(["estimate", "model=llama3_8b", "recipe=fp8_tensorwise", "hardware=a100", "--emulate"]) == 0
    out = capsys.readouterr().out
    assert "total, recompute none" in out and "predicted step" not in out
