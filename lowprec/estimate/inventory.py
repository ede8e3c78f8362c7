"""What a built model would hold, read from a meta-device model: parameter shapes and linear kinds.

The estimator (``lowprec.estimate``) works from this inventory so that it follows the real model code
and the real FP8 selection (``lowprec.convert.fp8_candidate_fqns``) instead of re-deriving shapes by
hand. Building a model (``lowprec.model.build_model``: Llama or DeepSeekMoE) on the ``meta`` device allocates no
memory (even for Llama 3 70B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from lowprec.convert import fp8_candidate_fqns
from lowprec.model import ModelArgs, MoEArgs, build_model
from lowprec.recipe import Float8Spec

#: Linears whose weight torchtitan's tensor parallel plan shards by rows of the GEMM input (RowwiseParallel);
#: every other linear is ColwiseParallel (output features sharded).
ROWWISE_TP = ("attention.wo", "feed_forward.w2")


@dataclass(frozen=True)
class LinearInfo:
    """One linear: ``fqn``, ``in_features``, ``out_features``, ``kind`` (``hp`` or the FP8 backend:
    ``torchao``, ``lowprec``, ``te``)."""

    fqn: str
    in_features: int
    out_features: int
    kind: str

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True)
class Inventory:
    """Parameter shapes (``params``: ``(fqn, shape)`` in ``model.named_parameters()`` order) and
    ``linears`` (fqn -> ``LinearInfo``) of ``build_model(args)`` after the FP8 conversion of ``fp8``."""

    args: ModelArgs
    params: tuple[tuple[str, tuple[int, ...]], ...]
    linears: dict[str, LinearInfo]

    @property
    def n_params(self) -> int:
        """All trainable parameters (embedding and output included)."""
        return sum(math.prod(s) for _, s in self.params)

    @property
    def n_embedding(self) -> int:
        """Parameters of ``tok_embeddings`` (a lookup: no FLOPs)."""
        return sum(math.prod(s) for n, s in self.params if n.startswith("tok_embeddings."))

    @property
    def n_fp8_linear(self) -> int:
        """Weight elements of the linears whose GEMMs run in FP8."""
        return sum(li.numel for li in self.linears.values() if li.kind != "hp")

    def block_params(self, layer: int) -> int:
        return sum(math.prod(s) for n, s in self.params if n.startswith(f"layers.{layer}."))


def tp_local_shape(fqn: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """Shape of rank 0's tensor-parallel shard (torchtitan's Llama plan; DTensor ``Shard`` chunks like
    ``torch.chunk``, so rank 0 holds ``ceil(d / tp)``): ColwiseParallel linears (``wq wk wv w1 w3 output``)
    shard dim 0, RowwiseParallel linears (``wo w2``) dim 1, ``tok_embeddings`` (RowwiseParallel on an
    embedding) dim 0 (vocab); norm weights are replicated."""
    if tp == 1 or len(shape) < 2:
        return shape
    dim = 1 if fqn.removesuffix(".weight").endswith(ROWWISE_TP) else 0
    out = list(shape)
    out[dim] = -(-out[dim] // tp)
    return tuple(out)


def fsdp_local_numel(shape: tuple[int, ...], dp_shard: int) -> int:
    """Elements of rank 0's FSDP2 shard: ``fully_shard`` chunks dim 0 (``ceil(d0 / dp_shard)`` rows on
    rank 0, the largest; FSDP2 pads every rank's storage to that size)."""
    if dp_shard == 1 or not shape:
        return math.prod(shape)
    return -(-shape[0] // dp_shard) * math.prod(shape[1:])


@lru_cache(maxsize=64)
def inventory(args: ModelArgs, fp8: Float8Spec) -> Inventory:
    """Inventory of ``build_model(args)`` (Llama or DeepSeekMoE) with the linears ``fp8`` selects marked by backend.

    Raises ``ValueError`` from ``ModelArgs`` for an inconsistent shape.
    """
    with torch.device("meta"):
        model = build_model(args)
    selected = set(fp8_candidate_fqns(model, fp8))
    linears = {
        fqn: LinearInfo(fqn, m.in_features, m.out_features, fp8.backend if fqn in selected else "hp")
        for fqn, m in model.named_modules()
        if isinstance(m, nn.Linear)
    }
    params = tuple((n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad)
    return Inventory(args=args, params=params, linears=linears)


def is_routed_expert(fqn: str) -> bool:
    """Whether ``fqn`` (a parameter or linear) belongs to a routed expert ``layers.N.moe.experts.E.*`` of a
    DeepSeekMoE block (``lowprec.model.moe``): one token uses ``top_k`` of the ``n_routed_experts`` of a block."""
    return ".moe.experts." in fqn


def tokens_per_expert(args: ModelArgs, tokens: int) -> float:
    """Expected tokens of one routed expert when ``tokens`` tokens are routed: ``tokens * top_k /
    n_routed_experts`` (perfect balance, the aim of the auxiliary-loss-free bias); ``tokens`` for a dense model."""
    if not isinstance(args, MoEArgs):
        return float(tokens)
    return tokens * args.top_k / args.n_routed_experts


@dataclass(frozen=True)
class ParamCounts:
    """``total``: every trainable parameter; ``activated``: those one token's forward uses (a MoE model's routed
    experts count ``top_k`` of ``n_routed_experts`` per MoE block; equal to ``total`` for a dense model)."""

    total: int
    activated: int


def param_counts(args: ModelArgs) -> ParamCounts:
    """Total and activated parameters of ``build_model(args)``, counted on the meta-device model's parameter
    shapes (``inventory``): per MoE block the routed experts ``layers.N.moe.experts.E.*`` are summed per expert
    and only ``top_k`` experts' worth is activated (all experts of a block have one shape)."""
    inv = inventory(args, Float8Spec())
    total = inv.n_params
    if not isinstance(args, MoEArgs):
        return ParamCounts(total, total)
    experts: dict[tuple[str, str], int] = {}
    for fqn, shape in inv.params:
        head, sep, tail = fqn.partition(".moe.experts.")
        if sep:
            key = (head, tail.split(".", 1)[0])
            experts[key] = experts.get(key, 0) + math.prod(shape)
    idle = 0
    for block in {b for b, _ in experts}:
        sizes = [n for (b, _), n in experts.items() if b == block]
        idle += sum(sizes) - args.top_k * max(sizes)
    return ParamCounts(total, total - idle)
