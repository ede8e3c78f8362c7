"""Peak reserved memory of a training step: the estimator's totals plus the transients it leaves out.

``lowprec.estimate.Estimate.totals[ac]`` (training state, FSDP2 unsharded blocks, saved activations, the loss
transient) is a lower bound on what the CUDA caching allocator reserves. ``peak_breakdown`` adds:

- ``backward_working_set``: during a block's backward its recomputed activations exist at once: under ``full``
  one block's activations without recompute (``recompute['none'] / n_layers``), under ``selective`` the part
  the policy recomputes (``(recompute['none'] - recompute['selective']) / n_layers``), under ``none`` nothing;
- ``tp_buffers`` (``tp > 1``, sequence parallel): the all-gathered input of a column-parallel linear and the
  partial output waiting for its reduce-scatter, ``2 * batch * seq * dim`` elements in the compute dtype; async
  TP (torchtitan's symmetric-memory pipeline) keeps a second pair;
- ``fp8_transposed``: FP8 linears keep, for the block being computed and the prefetched one, the transposed
  FP8 copy of each gathered weight (1 byte per element) beside the FSDP2 buffer the estimator counts.

The allocator's fragmentation is a stated factor ``FRAGMENTATION`` (reserved / allocated at peak), fitted by
``lowprec_lab/sizing/fit_cost_model.py`` on the same ``fit`` points of ``published.yaml`` as the step-time model.
DeepSeekMoE models (``lowprec.model.moe``, FSDP2 without expert parallelism, ``tp == 1``): weights, gradients and
optimizer states hold every expert (``predict_state_bytes`` counts the built model's parameters: the *total*,
not the activated ones), the FSDP2 unsharded buffers hold two whole MoE blocks (all their experts); saved
activations are those of the ``top_k`` experts each token visits plus the routing buffers (FP32 router input and
scores, top-k indices and gates, the dispatch order, the routed input and output copies:
``lowprec.estimate.activations._moe_ffn``, approximate, 1-4% below measured on CPU); ``fp8_transposed`` counts
the transposed FP8 copy of every expert's weight (each expert is its own FP8 linear) of the largest block. No
all-to-all buffers: without expert parallelism tokens never leave their rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lowprec.errors import ConfigError
from lowprec.estimate.estimator import estimate
from lowprec.estimate.inventory import inventory
from lowprec.model import ModelArgs, MoEArgs
from lowprec.recipe import Recipe

FRAGMENTATION = 1.0


@dataclass(frozen=True)
class PeakMemory:
    """Bytes per GPU: ``lower_bound`` (the estimator's total for the AC mode) and the added transients;
    ``allocated`` their sum; ``reserved`` = ``allocated * fragmentation``."""

    lower_bound: int
    backward_working_set: int
    tp_buffers: int
    fp8_transposed: int
    fragmentation: float

    @property
    def allocated(self) -> int:
        return self.lower_bound + self.backward_working_set + self.tp_buffers + self.fp8_transposed

    @property
    def reserved(self) -> float:
        return self.allocated * self.fragmentation

    def to_dict(self) -> dict:
        return {**asdict(self), "allocated": self.allocated, "reserved": self.reserved}


def peak_breakdown(
    args: ModelArgs,
    recipe: Recipe,
    *,
    dp_shard: int = 1,
    tp: int = 1,
    batch: int = 1,
    seq: int | None = None,
    ac: str = "selective",
    async_tp: bool = False,
    fragmentation: float = FRAGMENTATION,
    compiled_loss: bool = False,
) -> PeakMemory:
    """Peak memory of rank 0 (rules in the module doc); ``compiled_loss``: the loss is ``torch.compile``d
    (``lowprec.estimate.activations``: what it saves and its backward transient). Raises ``ValueError`` for a
    bad layout or AC mode, and for ``tp > 1`` on a MoE model (tensor/expert parallelism of its experts is not
    modelled)."""
    if isinstance(args, MoEArgs) and tp > 1:
        raise ConfigError(f"parallel.tp={tp}: tensor/expert parallelism of a MoE model is not modelled; use tp=1")
    e = estimate(args, recipe, dp_shard=dp_shard, tp=tp, batch=batch, seq=seq, compiled_loss=compiled_loss)
    if ac not in e.totals:
        raise ConfigError(f"ac={ac!r} is not one of {', '.join(e.totals)}")
    rec = e.activations.recompute
    per_layer = {"none": 0, "selective": rec["none"] - rec["selective"], "full": rec["none"]}[ac]
    work = per_layer // args.n_layers
    cs = 4 if recipe.compute_dtype.itemsize == 4 else 2
    tp_buf = 0
    if tp > 1:
        tp_buf = 2 * e.batch * e.seq * args.dim * cs * (2 if async_tp else 1)
    fp8_t = 0
    if recipe.fp8.enabled and dp_shard > 1:
        inv = inventory(args, recipe.fp8)
        # the largest block: a DeepSeekMoE model's dense first blocks differ from its MoE blocks
        block = max(
            sum(li.numel for f, li in inv.linears.items() if f.startswith(f"layers.{i}.") and li.kind != "hp")
            for i in range(args.n_layers)
        )
        fp8_t = 2 * block // tp
    return PeakMemory(e.totals[ac], work, tp_buf, fp8_t, fragmentation)
