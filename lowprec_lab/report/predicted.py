"""What ``lowprec estimate`` predicts for an ablation's recipes on a GPU: the report's predicted ratio columns."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lowprec.errors import UserError
from lowprec.estimate.cost_model import Layout, step_cost
from lowprec.estimate.estimator import estimate
from lowprec.estimate.hardware import get_hardware
from lowprec.estimate.runnable import hardware_blocker
from lowprec.recipes import get_recipe
from lowprec_lab.plan.config import model_from_cfg
from lowprec_lab.report import markdown
from lowprec_lab.report.verdict_table import Prediction

if TYPE_CHECKING:
    from mlflow.entities import Run


#: Hardware of the predicted throughput and memory ratios (``lowprec estimate``'s default).
PREDICT_HARDWARE = "h100_sxm"


def predict_recipes(parent: Run, names: list[str]) -> tuple[dict[str, Prediction], str]:
    """What ``lowprec estimate`` predicts for each recipe of the ablation on ``PREDICT_HARDWARE``: tokens/s per GPU
    and total bytes per GPU (state + FSDP buffers + saved activations under the ablation's ``train.ac`` + the loss
    transient), for the ablation's model (``model`` tag and ``model.*`` params), ``train.batch_size`` /
    ``parallel`` dp sequences of ``train.seq_len`` tokens per GPU; tokens/s from the per-op cost model
    (``lowprec.estimate.cost_model.step_cost``) under the ablation's ``train.ac`` and ``train.compile``.

    Returns ``({recipe: Prediction}, setup)``: ``setup`` is the sentence the report prints about the prediction,
    or why there is none (``{}`` then: a parent run without those params, e.g. from an older lowprec).
    """
    params = parent.data.params
    try:
        model = _ablation_model(parent)
        dp_shard, tp = int(params.get("parallel.dp_shard", 1)), int(params.get("parallel.tp", 1))
        dp = dp_shard * int(params.get("parallel.dp_replicate", 1))
        batch, seq = max(int(params["train.batch_size"]) // dp, 1), int(params["train.seq_len"])
    except (KeyError, ValueError, UserError) as e:
        return {}, f"the ablation's parent run does not name its model and batch ({markdown.text(e)})"
    hw = get_hardware(PREDICT_HARDWARE)
    ac = params.get("train.ac", "none")
    compiled = str(params.get("train.compile", "False")).lower() == "true"
    out = {}
    for name in names:
        try:
            r = get_recipe(name)
            if hardware_blocker(r, hw) is not None:  # training refuses it there (mxfp8 on an H100): no prediction
                out[name] = Prediction(hw.name, None, None)
                continue
            e = estimate(model, r, dp_shard=dp_shard, tp=tp, batch=batch, seq=seq, hardware=hw, compiled_loss=compiled)
            tps = step_cost(model, r, hw, Layout(dp_shard, tp, batch, seq, ac, compiled)).tokens_per_s_per_gpu
        except (ValueError, UserError):  # a recipe outside the catalog, or a layout the estimator refuses
            out[name] = Prediction(hw.name, None, None)
            continue
        out[name] = Prediction(hw.name, tps, float(e.totals[ac]))
    setup = (
        f"`lowprec estimate` for model {markdown.code(parent.data.tags.get('model'))}, {batch} x {seq} tokens per GPU "
        f"(parallel.dp_shard={dp_shard}, tp={tp}), activation checkpointing {markdown.code(ac)}, on {hw.name} "
        f"({hw.note.split(';')[0]}), step time from the per-op cost model (GEMMs by shape and dtype, FP8 casts, "
        "memory-bound kernels, communication; `lowprec estimate --validate` shows its error against published "
        "measurements)"
    )
    return out, setup


def _ablation_model(parent: Run):
    """The ablation's ``ModelArgs``: its ``model`` tag with the ``model.<field>`` params it logged."""
    fields = {k.removeprefix("model."): v for k, v in parent.data.params.items() if k.startswith("model.")}
    fields = {k: (None if v == "None" else v) for k, v in fields.items()}  # MLflow params are str(value)
    return model_from_cfg({**fields, "name": parent.data.tags["model"]})
