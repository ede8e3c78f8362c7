"""MoE training components built once by ``lowprec.train.build``: the auxiliary-loss-free load-balancing bias
update after each optimizer step with the expert-load metrics (``ExpertBalance``), and the layout checks of a
MoE model (``check_moe_layout``). The loop sees only the ``before_step`` / ``after_step`` hooks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lowprec.errors import ConfigError
from lowprec.model import ModelArgs, MoE, MoEArgs
from lowprec.model.moe import update_expert_bias
from lowprec.parallel.dims import ParallelDims
from lowprec.train.spec import TrainSpec


def check_moe_layout(args: ModelArgs, dims: ParallelDims, train: TrainSpec) -> None:
    """Refuse, before anything is built, what the MoE model does not support: tensor parallelism (no expert
    parallel plan exists) and ``train.compile`` (the expert loop's data-dependent split cannot compile with
    ``fullgraph=True``). Raises ``ConfigError``; a no-op for a dense model."""
    if not isinstance(args, MoEArgs):
        return
    if dims.tp > 1:
        raise ConfigError(
            f"parallel.tp={dims.tp} is not supported for MoE models (no expert-parallel plan); use parallel.dp_shard"
        )
    if train.compile:
        raise ConfigError(
            "train.compile=true is not supported for MoE models (the per-expert loop has data-dependent shapes); "
            "set train.compile=false"
        )


def load_metrics(counts: torch.Tensor) -> dict[str, float]:
    """``max_over_mean`` (max load / mean load, 1 when balanced) and ``load_cv`` (coefficient of variation:
    population std / mean) of per-expert token counts ``counts`` (E,); both 0 when no token was routed."""
    c = counts.double()
    mean = c.mean()
    if mean <= 0:
        return {"max_over_mean": 0.0, "load_cv": 0.0}
    return {"max_over_mean": float(c.max() / mean), "load_cv": float(c.std(unbiased=False) / mean)}


class ExpertBalance:
    """After each optimizer step: sums each MoE layer's token-expert assignment counts over the data-parallel
    ranks (so every rank moves its biases identically, and as one process would), updates the layer's
    ``router.expert_bias`` by ``update_expert_bias`` with the layer's ``bias_update_speed``, and returns metrics:
    per layer ``moe/layers.N.moe/max_over_mean`` and ``.../load_cv`` every step, per-expert counts
    ``.../tokens_eEE`` on telemetry steps (``step % every == 0``, ``every`` > 0), and over layers
    ``moe/max_over_mean`` (the worst), ``moe/load_cv`` (the mean) and ``moe/seq_aux_loss`` (the sum). Before each
    step it clears the counts, so only that step's training forwards count (not the memory probe's).

    A step the health policy skips still moves the bias (its routing happened); a rolled-back step's bias is
    restored with the checkpoint (``expert_bias`` is a saved buffer).
    """

    def __init__(self, layers: dict[str, MoE], every: int):
        self.layers, self.every = layers, every

    @classmethod
    def of(cls, model: nn.Module, every: int) -> ExpertBalance | None:
        """The balance of ``model``'s MoE layers (``layers.N.moe``), or ``None`` when it has none."""
        layers = {fqn: m for fqn, m in model.named_modules() if isinstance(m, MoE)}
        return cls(layers, every) if layers else None

    def before_step(self, step: int, built) -> None:
        for m in self.layers.values():
            m.router.pop_counts()

    def after_step(self, step: int, built) -> dict[str, float]:
        metrics: dict[str, float] = {}
        worst, cvs, aux = 0.0, [], 0.0
        for fqn, m in self.layers.items():
            counts = m.router.pop_counts()
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                counts = counts.clone()
                dist.all_reduce(counts)
            if m.bias_update_speed > 0 and counts.sum() > 0:
                with torch.no_grad():
                    update_expert_bias(m.router.expert_bias, counts, m.bias_update_speed)
            lm = load_metrics(counts)
            metrics.update({f"moe/{fqn}/{k}": v for k, v in lm.items()})
            worst, cvs = max(worst, lm["max_over_mean"]), [*cvs, lm["load_cv"]]
            if self.every > 0 and step % self.every == 0:
                metrics.update({f"moe/{fqn}/tokens_e{e:02d}": float(c) for e, c in enumerate(counts.tolist())})
            if m.last_aux_value is not None:
                aux += float(m.last_aux_value)
        metrics.update({"moe/max_over_mean": worst, "moe/load_cv": sum(cvs) / len(cvs), "moe/seq_aux_loss": aux})
        return metrics
