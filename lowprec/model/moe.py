"""DeepSeekMoE decoder: the Llama blocks of ``lowprec.model.llama`` with a mixture-of-experts FFN.

The FFN follows DeepSeek-V3 (arXiv 2412.19437, section 2.1.2): ``n_shared_experts`` shared experts that see every
token plus ``n_routed_experts`` fine-grained routed experts of hidden size ``moe_inter_dim``, of which each token
uses ``top_k``. Affinities are sigmoid scores ``s_{i,t} = sigmoid(u_t . e_i)``; the top-k experts are chosen on
``s_{i,t} + b_i`` (the bias of auxiliary-loss-free load balancing, used for selection only) and their gates are the
selected *unbiased* scores normalised to sum 1 (eq. 12-16). ``b_i`` is moved by ``+/- bias_update_speed``
(gamma) after each optimizer step from the sign of the expert's load against the mean load
(``update_expert_bias``); the small sequence-wise balance loss (eq. 17-20, weight ``seq_aux_alpha``) is computed in
training forwards and read by ``MoETransformer.aux_loss()``. The first ``n_dense_layers`` blocks keep a dense
SwiGLU FFN, as DeepSeek-V3's first three layers. Multi-head latent attention is not built: attention is Llama's GQA.

Module names follow torchtitan's ``torchtitan/models/moe``: ``layers.N.moe.router.gate``,
``layers.N.moe.experts.E.{w1,w2,w3}``, ``layers.N.moe.shared_experts.{w1,w2,w3}``, and ``layers.N.feed_forward``
in dense blocks. Experts are ordinary ``nn.Linear`` SwiGLUs, so every recipe's FP8 conversion swaps them like the
dense model's linears. The router gate is not an ``nn.Linear`` (``RouterGate``): no FP8 conversion or kernel swap
touches it and it computes in FP32, as the paper keeps the gating modules in high precision (section 3.3.1).

Expert GEMMs run as a Python loop over experts (one GEMM per expert on its tokens): right for a CPU. A GPU should
run them as one grouped GEMM (``torch._grouped_mm``, torchtitan's ``GroupedExperts``, or torchao's MoE float8
training, ``torchao.prototype.moe_training``), which this module does not do (untested here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.errors import ConfigError
from lowprec.model.llama import Attention, FeedForward, ModelArgs, RMSNorm, Transformer


@dataclass(frozen=True)
class MoEArgs(ModelArgs):
    """Shape of a DeepSeekMoE model: ``ModelArgs`` (attention, dense FFN of the first ``n_dense_layers`` blocks)
    plus the MoE FFN.

    ``n_routed_experts`` experts of hidden size ``moe_inter_dim``, ``top_k`` of them per token;
    ``n_shared_experts`` shared experts (one SwiGLU of hidden ``n_shared_experts * moe_inter_dim``, as DeepSeek's
    reference); ``bias_update_speed``: gamma of the load-balancing bias update (0 turns it off);
    ``seq_aux_alpha``: alpha of the sequence-wise balance loss (0 turns it off). Raises ``ConfigError`` naming the
    field for an inconsistent shape (e.g. ``top_k > n_routed_experts``).
    """

    n_routed_experts: int = 8
    n_shared_experts: int = 1
    top_k: int = 2
    moe_inter_dim: int = 128
    bias_update_speed: float = 0.001
    seq_aux_alpha: float = 0.0001
    n_dense_layers: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_routed_experts", "top_k", "moe_inter_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be >= 1")
        for name in ("n_shared_experts", "n_dense_layers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be >= 0")
        if self.top_k > self.n_routed_experts:
            raise ConfigError(f"model.top_k={self.top_k} is larger than model.n_routed_experts={self.n_routed_experts}")
        if self.n_dense_layers >= self.n_layers:
            raise ConfigError(
                f"model.n_dense_layers={self.n_dense_layers} leaves no MoE block of model.n_layers={self.n_layers}"
            )
        for name in ("bias_update_speed", "seq_aux_alpha"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be finite and >= 0")

    def num_params(self) -> int:
        """Every parameter (all experts, embeddings and untied output included)."""
        return self.param_counts()[0]

    def num_activated_params(self) -> int:
        """Parameters one token uses: all but the ``n_routed_experts - top_k`` routed experts it skips."""
        return self.param_counts()[1]

    def param_counts(self) -> tuple[int, int]:
        """``(total, activated)`` parameters, by hand from the shapes (the estimator counts the built model)."""
        d, hd = self.dim, self.head_dim
        attn = d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd + self.n_heads * hd * d
        dense = 3 * d * self.ffn_hidden
        expert = 3 * d * self.moe_inter_dim
        shared = self.n_shared_experts * expert
        router = self.n_routed_experts * d
        n_moe = self.n_layers - self.n_dense_layers
        base = (
            self.n_layers * (attn + 2 * d + self.qk_norm_params)
            + self.n_dense_layers * dense
            + n_moe * (shared + router)
        )
        base += 2 * self.vocab_size * d + d
        return base + n_moe * self.n_routed_experts * expert, base + n_moe * self.top_k * expert


#: Named MoE sizes (``model=moe_*``). ``moe_debug`` is for tests; ``moe_tiny`` activates about as many
#: parameters per token as ``tiny`` (dim 256, 4 layers, FFN 768 = shared 256 + 2 x 256 routed of 16 experts),
#: so it trains at a comparable speed on a CPU; ``moe_small`` matches ``small``'s attention with 32 experts.
MOE_CONFIGS: dict[str, MoEArgs] = {
    "moe_debug": MoEArgs(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        multiple_of=32,
        max_seq_len=512,
        n_routed_experts=8,
        n_shared_experts=1,
        top_k=2,
        moe_inter_dim=32,
    ),  # fmt: skip
    "moe_tiny": MoEArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim_multiplier=1.3,
        multiple_of=256,
        n_routed_experts=16,
        n_shared_experts=1,
        top_k=2,
        moe_inter_dim=256,
        n_dense_layers=1,
    ),  # fmt: skip
    "moe_small": MoEArgs(
        dim=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim_multiplier=1.3,
        multiple_of=256,
        n_routed_experts=32,
        n_shared_experts=1,
        top_k=4,
        moe_inter_dim=256,
        n_dense_layers=1,
    ),  # fmt: skip
}


class RouterGate(nn.Module):
    """The expert centroids ``e_i``: ``weight`` (n_routed_experts, dim). ``forward(x (T, dim))`` -> logits
    ``u_t . e_i`` (T, n_routed_experts) in FP32 whatever the autocast or parameter dtype. Deliberately not an
    ``nn.Linear``: FP8 conversion and kernel swaps select linears, and the paper keeps gating in high precision."""

    def __init__(self, dim: int, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float())


class Router(nn.Module):
    """Sigmoid top-k routing with normalised gates and the load-balancing bias (DeepSeek-V3 eq. 12-16).

    ``expert_bias`` (n_routed_experts,) FP32 buffer (kept FP32 under ``model.to(dtype)``; saved in checkpoints):
    added to the scores for the top-k choice only. ``tokens_per_expert``: FP32 (n_routed_experts,) counts of the
    token-expert assignments of the training forwards since the last ``pop_counts()`` (not a buffer: nothing to
    save, and ``to_empty`` must not leave it uninitialised).
    """

    def __init__(self, dim: int, n_experts: int, top_k: int):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.gate = RouterGate(dim, n_experts)
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
        self.tokens_per_expert: torch.Tensor | None = None

    def _apply(self, fn, recurse=True):
        # The bias moves by gamma ~ 1e-3 per step: in BF16 (8 mantissa bits) most updates would round away.
        out = super()._apply(fn, recurse)
        if self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return out

    def init_buffers(self, generator: torch.Generator | None = None) -> None:
        """Zero the load-balancing bias (``generator``: the build's, unused: nothing here is random)."""
        self.expert_bias.zero_()
        self.tokens_per_expert = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` (T, dim) -> ``(scores (T, E) FP32 sigmoid affinities, indices (T, top_k) int64, gates (T, top_k)
        FP32 summing to 1 per token)``. Selection on ``scores + expert_bias``; gates from the unbiased scores."""
        scores = torch.sigmoid(self.gate(x))
        idx = torch.topk(scores.detach() + self.expert_bias, self.top_k, dim=-1).indices
        chosen = scores.gather(-1, idx)
        gates = chosen / chosen.sum(-1, keepdim=True)
        # Not while autograd runs a backward: there the forward is activation checkpointing's recompute.
        if self.training and torch._C._current_graph_task_id() == -1:
            counts = torch.bincount(idx.reshape(-1), minlength=self.n_experts).float()
            self.tokens_per_expert = counts if self.tokens_per_expert is None else self.tokens_per_expert + counts
        return scores, idx, gates

    def pop_counts(self) -> torch.Tensor:
        """The accumulated (n_routed_experts,) FP32 assignment counts (zeros if none), and reset them."""
        counts = self.tokens_per_expert
        self.tokens_per_expert = None
        return counts if counts is not None else torch.zeros(self.n_experts, device=self.expert_bias.device)


def update_expert_bias(bias: torch.Tensor, load: torch.Tensor, speed: float) -> torch.Tensor:
    """Auxiliary-loss-free balancing (DeepSeek-V3 section 2.1.2): ``b_i += speed * sign(mean(load) - load_i)``,
    in place on ``bias`` (E,) FP32; ``load`` (E,) token counts. An overloaded expert's bias falls by ``speed``, an
    underloaded one's rises, one exactly at the mean stays. Returns ``bias``."""
    load = load.to(bias.dtype)
    bias.add_(speed * torch.sign(load.mean() - load))
    return bias


def sequence_balance_loss(scores: torch.Tensor, idx: torch.Tensor, top_k: int, alpha: float) -> torch.Tensor:
    """Sequence-wise balance loss (DeepSeek-V3 eq. 17-20), averaged over the batch's sequences.

    ``scores`` (B, S, E) sigmoid affinities, ``idx`` (B, S, top_k) the chosen experts. Per sequence:
    ``f_i = E / (top_k * S) * #{t: i chosen for t}``, ``P_i = mean_t s_{i,t} / sum_j s_{j,t}``,
    ``L = alpha * sum_i f_i P_i``. 0-dim FP32; ``f`` carries no gradient (a count), ``P`` does.
    """
    n_exp, seq = scores.shape[-1], scores.shape[1]
    chosen = torch.zeros_like(scores).scatter_(-1, idx, 1.0)
    f = chosen.sum(1) * (n_exp / (top_k * seq))  # (B, E)
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)  # (B, E)
    return alpha * (f * p).sum(-1).mean()


class MoE(nn.Module):
    """DeepSeekMoE FFN: ``x (B, S, dim) -> shared_experts(x) + sum_{i in topk} g_i * experts[i](x)`` (same shape
    and dtype as the experts' output). In training forwards it keeps ``last_aux_loss`` (the sequence-wise loss,
    ``None`` when ``seq_aux_alpha`` is 0) for ``MoETransformer.aux_loss``."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.top_k, self.alpha = args.top_k, args.seq_aux_alpha
        self.bias_update_speed = args.bias_update_speed
        self.router = Router(args.dim, args.n_routed_experts, args.top_k)
        self.experts = nn.ModuleList(FeedForward(args.dim, args.moe_inter_dim) for _ in range(args.n_routed_experts))
        hidden = args.n_shared_experts * args.moe_inter_dim
        self.shared_experts = FeedForward(args.dim, hidden) if hidden else None
        self.last_aux_loss: torch.Tensor | None = None
        self.last_aux_value: torch.Tensor | None = None  # detached, for the metrics (not cleared by aux_loss)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        scores, idx, gates = self.router(flat)
        if self.training and self.alpha > 0:
            self.last_aux_loss = sequence_balance_loss(
                scores.view(bsz, seq, -1), idx.view(bsz, seq, -1), self.top_k, self.alpha
            )
            self.last_aux_value = self.last_aux_loss.detach()
        # Sort the (token, slot) assignments by expert so each expert's tokens are one contiguous slice.
        flat_idx = idx.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        counts = torch.bincount(flat_idx, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        routed_in = flat[tokens]
        outs, idle = [], []
        for expert, chunk in zip(self.experts, routed_in.split(counts), strict=True):
            if chunk.shape[0]:
                outs.append(expert(chunk))
            else:
                idle.append(expert)
        routed = torch.cat(outs)
        routed = routed * gates.reshape(-1)[order, None].to(routed.dtype)
        out = torch.zeros(flat.shape[0], dim, dtype=routed.dtype, device=x.device).index_add_(0, tokens, routed)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        if idle and torch.is_grad_enabled():
            # An expert with no token this step still gets a (zero) gradient: under FSDP2 every rank must
            # reduce-scatter the same set of gradients, and an expert idle on one rank may be busy on another.
            out = out + sum(p.sum() for e in idle for p in e.parameters()).to(out.dtype) * 0.0
        return out.view(bsz, seq, dim)


class MoEBlock(nn.Module):
    """Llama block with ``moe`` (an ``MoE``) or, for the first ``n_dense_layers``, ``feed_forward`` as FFN."""

    def __init__(self, layer_id: int, args: MoEArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        if layer_id < args.n_dense_layers:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden)
        else:
            self.moe = MoE(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    @property
    def ffn(self) -> nn.Module:
        return self.moe if hasattr(self, "moe") else self.feed_forward

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.ffn(self.ffn_norm(h))


class MoETransformer(Transformer):
    """DeepSeekMoE decoder with Llama attention: ``lowprec.model.llama.Transformer`` (its embeddings, norm, output
    and ``forward(tokens (B, S) int64) -> logits (B, S, vocab_size)``) with ``MoEBlock`` blocks."""

    def make_block(self, layer_id: int, args: MoEArgs) -> nn.Module:
        return MoEBlock(layer_id, args)

    def moe_layers(self) -> dict[str, MoE]:
        """``{"layers.N.moe": MoE}`` of the MoE blocks, in order."""
        return {f"layers.{i}.moe": b.moe for i, b in self.layers.items() if hasattr(b, "moe")}

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Llama's scheme (``Transformer.init_weights``) for attention, norms, embeddings and output; every
        expert's ``w1`` like Llama's ``w1`` and ``w2/w3`` with the depth-scaled std; router centroids std 0.02
        (DeepSeek's reference initialises its gate like the other input projections); bias zero."""
        nn.init.normal_(self.tok_embeddings.weight, generator=generator)
        for block in self.layers.values():
            std_out = 0.02 / math.sqrt(2 * (block.layer_id + 1))
            ffns = [block.ffn] if not isinstance(block.ffn, MoE) else list(block.moe.experts)
            if isinstance(block.ffn, MoE) and block.moe.shared_experts is not None:
                ffns.append(block.moe.shared_experts)
            for lin in (block.attention.wq, block.attention.wk, block.attention.wv, *(f.w1 for f in ffns)):
                nn.init.trunc_normal_(lin.weight, std=0.02, a=-0.06, b=0.06, generator=generator)
            outs = [block.attention.wo, *(f.w2 for f in ffns), *(f.w3 for f in ffns)]
            for lin in outs:
                nn.init.trunc_normal_(lin.weight, std=std_out, a=-3 * std_out, b=3 * std_out, generator=generator)
            if isinstance(block.ffn, MoE):
                nn.init.trunc_normal_(block.moe.router.gate.weight, std=0.02, a=-0.06, b=0.06, generator=generator)
                block.moe.router.init_buffers()
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
            block.attention.reset_qk_norms()
        self.norm.reset_parameters()
        std = self.args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std, generator=generator)

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the MoE layers' sequence-wise balance losses of the last training forward (0-dim FP32), then
        cleared; ``None`` when none was computed (eval, or ``seq_aux_alpha`` 0)."""
        losses = [m.last_aux_loss for m in self.moe_layers().values() if m.last_aux_loss is not None]
        for m in self.moe_layers().values():
            m.last_aux_loss = None
        return torch.stack(losses).sum() if losses else None
