"""Llama 3 decoder (torchtitan layout and module names), precision-agnostic.

The module tree follows torchtitan's ``torchtitan/models/llama3/model/model.py``:
``tok_embeddings``, ``layers.N.attention.{wq,wk,wv,wo}``, ``layers.N.feed_forward.{w1,w2,w3}``,
``layers.N.attention_norm``, ``layers.N.ffn_norm``, ``norm``, ``output``. Construction allocates
nothing on the meta device; ``init_weights()`` fills parameters so a model can be built on
``torch.device("meta")``, converted and sharded, then materialised with ``to_empty`` + ``init_weights``.
The model holds no dtype logic: precision is applied from outside (autocast, module swaps, casts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.errors import ConfigError


@dataclass(frozen=True)
class ModelArgs:
    """Shape of a Llama 3 model.

    ``ffn_hidden`` follows Llama 3: ``int(2 * 4 * dim / 3)``, times ``ffn_dim_multiplier``,
    rounded up to ``multiple_of``. ``qk_norm``: every attention normalises its queries and keys per head
    (``Attention.q_norm`` / ``k_norm``, RMSNorm over ``head_dim`` with ``norm_eps``) after the projections and
    before RoPE, the QK-layernorm of Wortsman et al. 2023 (arXiv 2309.14322, section 3.1) as OLMo 2 and Qwen3 place
    it; off by default, and off adds no module or state-dict key.
    """

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 8192
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be >= 1")
        if self.dim % self.n_heads:
            raise ConfigError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(f"head dim {self.dim // self.n_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def qk_norm_params(self) -> int:
        """Parameters of one block's ``q_norm`` and ``k_norm`` (``2 * head_dim``; 0 without ``qk_norm``)."""
        return 2 * self.head_dim if self.qk_norm else 0

    def num_params(self) -> int:
        """Exact parameter count (embeddings and untied output included)."""
        d, hd = self.dim, self.head_dim
        attn = d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd + self.n_heads * hd * d
        ffn = 3 * d * self.ffn_hidden
        per_layer = attn + ffn + 2 * d + self.qk_norm_params
        return self.n_layers * per_layer + 2 * self.vocab_size * d + d


LLAMA3_VOCAB = 128_256

#: Named sizes. ``debug`` is for tests; ``tiny`` is the CPU default; the ``llama3_*`` entries
#: are the published Llama 3 / 3.2 shapes (torchtitan ``llama3_configs``), for estimates and GPU runs.
LLAMA_CONFIGS: dict[str, ModelArgs] = {
    "debug": ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=512),
    "tiny": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim_multiplier=1.3, multiple_of=256),
    "small": ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim_multiplier=1.3, multiple_of=256),
    "125m": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim_multiplier=1.3, multiple_of=256),
    "llama3_1b": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    "llama3_8b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    "llama3_70b": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
}


def model_args(name: str, **overrides) -> ModelArgs:
    """Named size with optional field overrides. Raises ``ConfigError`` listing the known names."""
    if name not in LLAMA_CONFIGS:
        raise ConfigError(f"unknown model size {name!r}; known: {', '.join(LLAMA_CONFIGS)}")
    return replace(LLAMA_CONFIGS[name], **overrides)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019); statistics in FP32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_cos_sin(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables, each (seq_len, head_dim // 2) fp32 (Su et al. 2021)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]); x is (batch, seq, heads, head_dim)."""
    x32 = x.float().unflatten(-1, (-1, 2))
    a, b = x32[..., 0], x32[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    """Grouped-query causal self-attention through ``F.scaled_dot_product_attention``.

    With ``args.qk_norm``, ``q_norm`` and ``k_norm`` (``RMSNorm`` of weight shape ``(head_dim,)``) normalise each
    head of the projected queries and keys before RoPE; otherwise both are ``None`` and hold no parameter.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # Norm modules rather than Linear, so no FP8 conversion or kernel swap selects them: they run in high
        # precision like the block norms. Over the last dim only, so they see whatever heads a TP rank holds.
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        #: The attention kernel (a function with ``F.scaled_dot_product_attention``'s signature); a slot so that
        #: ``lowprec.convert.convert_kernels`` can put an emulated one in, as it swaps linears.
        self.sdpa = F.scaled_dot_product_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    def reset_qk_norms(self) -> None:
        """Set ``q_norm`` / ``k_norm`` weights to ones (nothing without ``qk_norm``); draws no random numbers, so
        a seed gives the same other weights with and without the norms."""
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()


class SwiGLU(nn.Module):
    """``silu(a) * b``, the SwiGLU operator between ``w1``/``w3`` and ``w2``; a module (no parameters) so a
    recipe can swap how its inputs are saved for backward (``lowprec.float8.swiglu``)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.silu(a) * b


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)`` (Shazeer 2020)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.swiglu = SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.swiglu(self.w1(x), self.w3(x)))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama 3 decoder.

    ``forward(tokens)``: tokens (batch, seq) int64 -> logits (batch, seq, vocab_size) in the
    compute dtype (the output linear's dtype, or autocast's).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # ModuleDict keyed by str(i), as torchtitan, so FQNs are layers.N.* and blocks can be sharded one by one.
        self.layers = nn.ModuleDict({str(i): self.make_block(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def make_block(self, layer_id: int, args: ModelArgs) -> nn.Module:
        """Block ``layer_id``: a Llama ``TransformerBlock`` (a subclass builds its own, e.g. the DeepSeekMoE one)."""
        return TransformerBlock(layer_id, args)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Initialise every parameter in place (torchtitan's scheme: normal(0, 1) embeddings,
        truncated normal std 0.02 for inputs, depth-scaled std for the residual projections,
        output std dim**-0.5). Draws in a fixed module order so a seed fixes the weights.
        """
        nn.init.normal_(self.tok_embeddings.weight, generator=generator)
        for block in self.layers.values():
            std_out = 0.02 / math.sqrt(2 * (block.layer_id + 1))
            for lin in (block.attention.wq, block.attention.wk, block.attention.wv, block.feed_forward.w1):
                nn.init.trunc_normal_(lin.weight, std=0.02, a=-0.06, b=0.06, generator=generator)
            for lin in (block.attention.wo, block.feed_forward.w2, block.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, std=std_out, a=-3 * std_out, b=3 * std_out, generator=generator)
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
            block.attention.reset_qk_norms()
        self.norm.reset_parameters()
        std = self.args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std, generator=generator)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.args.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds model.max_seq_len={self.args.max_seq_len}")
        # Recomputed per call (cheap) rather than a buffer, so meta construction and dtype casts never touch it.
        cos, sin = rope_cos_sin(self.args.head_dim, seq, self.args.rope_theta, device=tokens.device)
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h, cos, sin)
        return self.output(self.norm(h))
