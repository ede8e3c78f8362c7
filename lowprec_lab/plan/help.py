"""``lowprec CMD --help``: each command's common forms and its keys, one line each.

The keys of ``train`` and ``ablate`` are their schemas' (``lowprec_lab.plan.argcheck.schema``, read from the config
dataclasses' source: a new field shows up by itself); ``DOCS`` says what each means, condensed from the
dataclasses' docstrings (``TrainSpec``, ``DataSpec``, ``OptimHParams``, ``ParallelDims``, ``SpikeRule``,
``LauncherSpec`` and those of lowprec_lab/plan/config.py). tests/config/test_cli_wording.py keeps ``DOCS`` equal
to the composed configs' keys.
Nothing here imports Hydra or torch: a help page prints at once.
"""

from __future__ import annotations

import textwrap

from lowprec_lab.plan.argcheck import group_options, schema

#: key -> its meaning in one line (the default when it helps). Open nodes (``model``, ``recipe``, ``study``) have
#: one line for the node.
DOCS: dict[str, str] = {
    # top level, both commands
    "model": "model size (config groups above); model.<field>=V overrides one field of it (model.n_layers=4; "
    "model.qk_norm=true: RMSNorm of each query/key head before RoPE)",
    "seed": "random seed of the run (ablate: the first seed; seed .. seed+seeds-1)",
    "device": "auto | cpu | cuda | cuda:N (auto: cuda when a GPU is visible)",
    "cpu_kernels": "auto | native | emulated: which kernels run low-precision GEMMs on a CPU (never the numerics)",
    "resume": "train: a checkpoint folder to continue; ablate: the id of an interrupted ablation to continue",
    "recipe": "the recipe (config groups above); recipe.<group>.<field>=V overrides one field "
    "(recipe.fp8.scaling=rowwise)",
    # data (DataSpec)
    "data.source": "stdlib (Python's standard library) | text (files under data.path) | tokens (token shards)",
    "data.path": "the folder text or tokens read (a folder of `lowprec data prepare` shards, with meta.json)",
    "data.pattern": "glob of the files data=text reads under data.path ('**/*.txt')",
    "data.vocab_size": "byte-level BPE vocabulary size the corpus is tokenized to",
    "data.val_fraction": "share of the tokens held out for validation",
    "data.shard_tokens": "tokens per cached shard file",
    "data.cache_dir": "where tokenized corpora are cached (default ${paths.cache})",
    "data.allow_epochs": "train without the warning when the run sees its training tokens more than once",
    # optim (OptimHParams)
    "optim.lr": "AdamW peak learning rate (warmup, then cosine decay to train.min_lr_ratio of it)",
    "optim.beta1": "AdamW beta1, in [0, 1)",
    "optim.beta2": "AdamW beta2, in [0, 1)",
    "optim.eps": "AdamW epsilon, > 0",
    "optim.weight_decay": "AdamW weight decay, on 2-D weights only",
    # tracking, paths
    "tracking.uri": "MLflow store: sqlite:///PATH/mlflow.db (default under paths.runs) or http(s)://server",
    "tracking.experiment": "MLflow experiment name (default lowprec)",
    "paths.runs": "folder of the MLflow store, checkpoints and multirun output (default runs)",
    "paths.reports": "folder reports are written to (default reports)",
    "paths.cache": "token cache folder (default $LOWPREC_CACHE, else ~/.cache/lowprec)",
    # parallel (ParallelDims)
    "parallel.dp_replicate": "HSDP replicas; with dp_shard and tp, >1 runs under torchrun on this machine",
    "parallel.dp_shard": "FSDP2 shards (data parallel, weights sharded)",
    "parallel.tp": "tensor-parallel degree (with sequence parallelism)",
    # train (TrainSpec, TrainNode)
    "train.steps": "optimizer steps",
    "train.batch_size": "sequences per micro-batch (global: across data-parallel ranks)",
    "train.seq_len": "tokens per sequence (at most model.max_seq_len)",
    "train.grad_accum": "micro-batches per optimizer step",
    "train.warmup_steps": "linear LR warmup steps",
    "train.min_lr_ratio": "final LR as a fraction of optim.lr, in [0, 1]",
    "train.grad_clip": "gradient-norm clipping bound, > 0 (inf: off)",
    "train.val_every": "validate every N steps (<= 0: only at the end)",
    "train.val_batches": "batches per validation",
    "train.timing_warmup_steps": "steps left out of tokens/s and step time (auto: min(3, steps - 1))",
    "train.telemetry_every": "sample FP8 numerics telemetry every N steps (0: off)",
    "train.checkpoint_every": "write a checkpoint every N steps (0: never)",
    "train.keep_checkpoints": "keep only the N newest checkpoints (0: all)",
    "train.checkpoint_on_signal": "write a checkpoint when a stop signal ends the run (ablate: on)",
    "train.progress": "show a progress bar",
    "train.resume_recipe_change": "allow resume= from a checkpoint written under another recipe (recorded)",
    "train.ac": "activation checkpointing: auto | none | selective | full (auto: per device and model)",
    "train.compile": "torch.compile the blocks: auto | true | false (auto: on for dense models on CUDA)",
    "train.on_anomaly": "a non-finite loss or a spike: fail | skip (that update) | rollback (to the last checkpoint)",
    "train.max_rollbacks": "rollbacks allowed before the run fails (train.on_anomaly=rollback)",
    "train.max_consecutive_skips": "skipped steps in a row before the run fails (train.on_anomaly=skip)",
    "train.fp8_fallback": "off | layer: an FP8 linear that keeps overflowing runs in high precision from then on",
    "train.fp8_fallback_threshold": "overflow or underflow share above which a layer falls back, in (0, 1]",
    "train.fp8_fallback_samples": "consecutive telemetry samples above the threshold before it falls back",
    "train.skip_batches": "batch indices never trained on ([3,17])",
    "train.fused_casts": "auto | on | off: lowprec's FP8 casts as one compiled kernel each in eager runs",
    "train.eval_ema": "null (off) or a decay in (0, 1): also validate an FP32 EMA of the weights (val_loss_ema)",
    "train.z_loss": "weight of the z-loss mean(logsumexp(logits)**2) in the objective (1e-4; 0: off), logged as z_loss",
    # stability (SpikeRule)
    "stability.ema_window": "loss-spike rule: EMA span in steps the loss is compared with",
    "stability.k": "loss-spike rule: a spike is k robust standard deviations above the EMA",
    "stability.sd_window": "loss-spike rule: trailing steps of the robust standard deviation",
    "stability.min_history": "loss-spike rule: steps of history before a step is tested",
    "stability.divergence_factor": "divergence: the loss stays above this times its first value",
    # ablate (AblateConfig)
    "recipes": "the recipes compared, a bracketed list: 'recipes=[bf16,fp8_rowwise]'",
    "control": "the reference recipe of the loss gaps and verdicts; one of recipes (null: bf16 if listed, else "
    "the first)",
    "controls": "true: add a negative and a positive control to recipes; the report says whether they passed",
    "negative_control": "must come out non-inferior (null: the control with reversed reduction order: bf16_reordered)",
    "positive_control": "must come out inferior (null: fp8_unscaled); both only with controls=true",
    "name": "the ablation's name (set by experiment=)",
    "seeds": "seeds per recipe: N (seed .. seed+N-1, paired across recipes); auto: 3, then one more at a "
    "time for the recipes still inconclusive, up to max_seeds; or per recipe, 'seeds={others: N, NAME: M}' "
    "(seeds.NAME=M changes an entry, +seeds.NAME=M adds one; the control trains the most)",
    "max_seeds": "the most seeds seeds=auto runs per recipe (>= 3)",
    "workers": "runs trained at once, each in its own process: N, or auto (2 on a CPU, one per GPU on CUDA)",
    "studies": "the experiment's own reports beside report.md (registered study names)",
    "study": "study.<name>.<key>=V: a study's own settings (study.deepseek_v3.capture_batches=4)",
    "models": "one ablation per model, 'models=[debug,tiny]' (empty: the ablation runs on model)",
    "grid": "one ablation per point of training settings, '+grid.optim.lr=[0.001,0.003]' (experiment=lr_sweep)",
    "report.margin": "non-inferiority margin, relative, on the validation loss (0.0025 = 0.25%): a recipe is "
    "non-inferior when its paired 95% interval's upper bound is below +margin",
    "report.primary": "the headline comparisons, tested right after the controls with the full alpha; the other "
    "recipes only where each headline is conclusive in that direction (lowprec_lab/stats/order.py)",
    "dry_run": "print the plan (runs, placement, tokens, corpus epochs, predicted time) and train nothing",
    "gpus": "GPUs of the node to use or plan for (null: all visible)",
    "hardware": "the part the dry run predicts for (lowprec estimate's names; null: the detected GPU)",
    # launcher (LauncherSpec)
    "launcher.name": "where the runs are launched: local | slurm (one SLURM job per run) | submitit_local",
    "launcher.partition": "SLURM partition (null: the cluster's default)",
    "launcher.gpus_per_node": "GPUs of one node of the partition (null: not checked)",
    "launcher.time": "each job's time limit, minutes (a timed-out run stops with a checkpoint, resumable)",
    "launcher.cpus_per_task": "sbatch --cpus-per-task (null: not passed)",
    "launcher.mem_gb": "sbatch --mem in GB (null: not passed)",
    "launcher.account": "sbatch --account (null: not passed)",
    "launcher.qos": "sbatch --qos (null: not passed)",
    "launcher.constraint": "sbatch --constraint (null: not passed)",
    "launcher.setup": "shell lines each job runs first (['source .venv/bin/activate'])",
    "launcher.folder": "submitit's job folder (null: <paths.runs>/submitit/<ablation id>)",
    "launcher.max_running": "jobs in flight at once (null: all on SLURM, workers with submitit_local)",
    "launcher.poll_s": "how often the ablation looks at its jobs, seconds (> 0)",
}

#: Config groups named by ``group=option`` (their options are read from the source).
GROUPS = {
    "train": ("model", "recipe", "data"),
    "ablate": ("experiment", "model", "data", "launcher"),
}

FORMS = {
    "train": """usage: lowprec train [recipe=NAME] [model=SIZE] [key=value ...]
       one run, tracked in MLflow (default recipe=bf16 model=tiny)

  lowprec train recipe=fp8_rowwise model=debug train.steps=50
  lowprec train recipe=fp8_tensorwise recipe.fp8.scaling=rowwise   every recipe field is a key
  lowprec train recipe=fp8_comm8 parallel.dp_shard=2               re-runs itself under torchrun on 2 ranks
  lowprec train resume=runs/checkpoints/RUN_ID/step_N              continue from a checkpoint
  lowprec train -m recipe=bf16 optim.lr=1e-3,3e-3                  Hydra multirun: a comma list is a sweep
  lowprec train --hydra-help                                       Hydra's own help (its config dump)""",
    "ablate": """usage: lowprec ablate [experiment=NAME] ['recipes=[a,b,...]'] [seeds=N|auto] [key=value ...]
       recipes x seeds under one MLflow parent run, then the report: a verdict per recipe against the control

  lowprec ablate                                             the default ablation (experiment=default)
  lowprec ablate experiment=smoke                            8 recipes on the debug model, 1 seed
  lowprec ablate 'recipes=[bf16,fp8_rowwise]' seeds=3        quote the brackets for the shell
  lowprec ablate 'recipes=[bf16,fp8_rowwise]' seeds=auto max_seeds=8   more seeds only while inconclusive
  lowprec ablate 'recipes=[bf16,fp8_rowwise]' report.margin=0.005      verdicts at a 0.5% margin
  lowprec ablate experiment=node dry_run=true gpus=8         plan an 8-GPU node, train nothing
  lowprec ablate ... resume=ABLATION_ID                      continue a stopped ablation (same keys)
  lowprec ablate --hydra-help                                Hydra's own help (its config dump)""",
    "report": """usage: lowprec report ABLATION_ID [key=value ...]
       rebuild an ablation's report from the MLflow store alone (reports/<ABLATION_ID>/report.html)

  lowprec report abl-20260101-120000-ab12
  lowprec report abl-20260101-120000-ab12 report.margin=0.005          re-judge at another margin
  lowprec report abl-20260101-120000-ab12 tracking.uri=http://host:5000""",
    "sync": """usage: lowprec sync PATH [key=value ...]
       replay what runs spooled while their tracking server was down (PATH: a spool file, a folder of them, or
       a runs folder)

  lowprec sync runs tracking.uri=http://host:5000""",
}

FORMS["estimate"] = """usage: lowprec estimate [model=SIZE] [recipe=NAME|all] [key=value ...] [--emulate] [--json]
       lowprec estimate --validate [--json]
       predicted memory by component and step time of the run `lowprec train` would make with the same keys

  lowprec estimate model=llama3_8b recipe=fp8_rowwise parallel.dp_shard=8 train.batch_size=8 train.seq_len=8192
  lowprec estimate model=llama3_8b recipe=all parallel.dp_shard=8 --json     every recipe, ranked
  lowprec estimate --validate                                                the cost model against measurements"""
FORMS["recommend"] = """usage: lowprec recommend model=SIZE hardware=NAME gpus=N tokens=T [key=value ...] [--json]
       the recipe and layout to pretrain a model with, and the train and ablate lines that would test it

  lowprec recommend model=llama3_8b hardware=h100 gpus=64 tokens=2e12
  lowprec recommend model=llama3_8b hardware=h100 gpus=64 tokens=2e12 max_loss_gap=0.5% train.seq_len=4096"""
FORMS["data"] = """usage: lowprec data prepare source=PATH|HF_DATASET out=DIR [key=value ...]
       token shards of any corpus, for data=tokens data.path=DIR (resumable: the same command continues)

  lowprec data prepare source=/my/corpus out=/my/shards
  lowprec data prepare source=roneneldan/TinyStories out=shards/tinystories tokenizer=gpt2 max_tokens=50000000"""

_TRAIN_KEYS = "any key of lowprec train (lowprec train --help): model.<field>=, recipe.<group>.<field>=, train.*, ..."

#: the keys of the commands that are not train or ablate, with their own meaning there
STORE_KEYS = {
    "estimate": {
        "model": "model size (default tiny); model.<field>=V overrides one field",
        "recipe": "a recipe name, or all: every catalog recipe, ranked",
        "hardware": "the part predicted for (default h100_sxm; h200, a100, ...: a wrong name lists them all)",
        "train.batch_size": "the global batch in sequences (per GPU: divided by the data-parallel ranks)",
        "train.seq_len": "tokens per sequence",
        "train.ac": "activation checkpointing: auto | none | selective | full (auto: as lowprec train on hardware)",
        "train.compile": "auto | true | false (auto: as lowprec train would on hardware; the output says which)",
        "parallel.dp_shard": "FSDP2 shards (GPUs, with parallel.tp)",
        "parallel.tp": "tensor-parallel degree",
        "efficiency": "also print the flat-MFU step time at this MFU (null: not printed)",
        "async_tp": "the cost model hides TP traffic too (needs parallel.tp > 1)",
        "other keys": _TRAIN_KEYS,
        "--emulate": "predict memory of a recipe the hardware cannot run (no step time)",
        "--json": "machine-readable output",
        "--validate": "predict the published measurements and print the errors",
    },
    "recommend": {
        "model": "model size to pretrain",
        "hardware": "the GPU (lowprec estimate's names)",
        "gpus": "GPUs available",
        "tokens": "training tokens (2e12)",
        "max_loss_gap": "the largest loss gap to bf16 accepted, relative (0.0025 or 0.25%; default 0.25%)",
        "recipes": "the candidates, 'recipes=[bf16,fp8_rowwise]' (null: the catalog)",
        "ablate_steps": "steps of the printed evidence ablation (default 1000)",
        "train.batch_size": "pin the global batch (unset: 1 sequence per data-parallel rank)",
        "train.seq_len": "pin the sequence length (unset: the model's max_seq_len)",
        "train.ac": "pin activation checkpointing (unset: the lightest that fits)",
        "parallel.tp": "pin the tensor-parallel degree (unset: every layout is tried)",
        "parallel.dp_shard": "pin the FSDP2 shards (unset: every layout is tried)",
        "tracking.uri": "a store whose ablations' verdicts recommend reads",
        "other keys": _TRAIN_KEYS,
        "--json": "machine-readable output",
    },
    "data": {
        "source": "a local folder or file (text, jsonl, parquet) or a Hugging Face dataset name",
        "out": "the folder the shards and meta.json are written to",
        "tokenizer": "bpe (lowprec's byte-level BPE), a tokenizer.json, a folder with one, or a hub name",
        "vocab_size": "ids of the bpe tokenizer (default 8192)",
        "bpe_train_bytes": "bytes of train documents the bpe tokenizer is trained on",
        "text_column": "the column of a table source (default text)",
        "config": "the Hugging Face dataset's config name",
        "split": "the Hugging Face dataset's split (default train)",
        "pattern": "the files of a text folder ('**/*.txt')",
        "eot_token": "the end-of-document token (null: found among the usual names)",
        "val_fraction": "share of documents held out for validation, in (0, 1)",
        "shard_tokens": "train tokens per shard",
        "max_tokens": "stop after this many train tokens (0: the whole source)",
        "encode_batch": "documents per tokenizer call (speed only)",
        "progress": "show a progress bar (default true)",
    },
    "report": {
        "ABLATION_ID": "the id the ablation printed (abl-YYYYMMDD-HHMMSS-xxxx; the MLflow UI shows it as a tag)",
        "report.margin": "non-inferiority margin to judge at (default: the one the ablation ran with)",
        "tracking.uri": DOCS["tracking.uri"],
        "tracking.experiment": DOCS["tracking.experiment"],
        "paths.runs": DOCS["paths.runs"],
        "paths.reports": DOCS["paths.reports"],
    },
    "sync": {
        "PATH": "a spool file (<run id>.jsonl), a folder of them, or a runs folder",
        "tracking.uri": "the store to replay into (default: the one each spool names)",
        "tracking.experiment": DOCS["tracking.experiment"],
        "paths.runs": DOCS["paths.runs"],
    },
}


def keys(command: str) -> list[str]:
    """The keys a help page of ``train`` / ``ablate`` lists: the schema's leaves (an open node as one key), in
    the schema's order."""
    out: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        for k, sub in node.items():
            if k == "hydra":
                continue
            if isinstance(sub, dict):
                walk(sub, f"{prefix}{k}.")
            else:
                out.append(f"{prefix}{k}")

    walk(schema(command) or {}, "")
    return out


#: the order of a page's sections: what an ablation is about first
SECTION_ORDER = ("", "report", "train", "data", "optim", "parallel", "launcher", "stability", "tracking", "paths")


def _table(rows: dict[str, str]) -> str:
    """``rows`` as two columns, each meaning wrapped at 118 characters under its own column."""
    width = min(max(len(k) for k in rows), 30) + 2
    lines = []
    for k, v in rows.items():
        text = textwrap.wrap(v, 116 - width) or [""]
        lines.append(f"  {k:<{width}}{text[0]}")
        lines += [f"  {'':<{width}}{t}" for t in text[1:]]
    return "\n".join(lines)


def help_page(command: str) -> str:
    """The help page of ``command`` (``train``, ``ablate``, ``report``, ``sync``, ``estimate``, ``recommend`` or
    ``data``): its forms, the config groups' options and every key with one line."""
    if command in STORE_KEYS:
        return f"{FORMS[command]}\n\nkeys:\n{_table(STORE_KEYS[command])}"
    groups = {}
    for g in GROUPS[command]:
        options = group_options(g)
        if options is not None:
            groups[f"{g}="] = ", ".join(options)
    sections: dict[str, dict[str, str]] = {}
    for k in keys(command):
        head = k.split(".")[0] if "." in k else ""
        sections.setdefault(head, {})[k] = DOCS.get(k, "")
    parts = [FORMS[command], f"config groups (group=option):\n{_table(groups)}"]
    order = {h: i for i, h in enumerate(SECTION_ORDER)}
    for head, rows in sorted(sections.items(), key=lambda kv: order.get(kv[0], len(order))):
        title = f"{head}.* keys" if head else "keys"
        parts.append(f"{title}:\n{_table(rows)}")
    parts.append("Every key is key=value on the command line; docs/cli.md has the whole reference.")
    return "\n\n".join(parts)
