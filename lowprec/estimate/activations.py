"""Predicted bytes saved for backward by ``lowprec.model.llama.Transformer`` under a recipe (and, approximately,
by the DeepSeekMoE blocks of ``lowprec.model.moe.MoETransformer``: ``_moe_ffn``).

The prediction replays, op by op, what autograd saves in ``lowprec/model/llama.py`` (read from the code
and checked against ``lowprec.measure.saved_tensors.measure_saved_bytes``, which counts the same way: distinct
storages once, parameters and buffers excluded, parameter casts reported as ``weight_copies``).
With ``T = batch * seq`` tokens, ``D`` dim, ``F`` ffn hidden, ``H``/``KV`` heads, ``hd`` head dim,
``c`` the compute dtype and ``r`` the residual dtype (the embedding's dtype):

- ``RMSNorm``: ``x.float()`` (``4TD``; the input itself when ``r`` is fp32), ``rsqrt`` (``4T``), the
  normalised ``y`` (``4TD``), and ``weight.float()`` (``4D``, a weight copy) when weights are not fp32.
  Its output (dtype ``r``) is saved by the linears that read it. With ``qk_norm`` the same ``RMSNorm`` runs on
  ``wq``'s and ``wk``'s outputs (dtype ``c``) over ``hd`` per (token, head) row: the FP32 input (``wq``'s output
  itself when ``c`` is fp32), ``rstd`` (``4*T*H`` / ``4*T*KV``), ``y`` and the ``4*hd`` weight copy; its output
  feeds RoPE, which saves only its tables, so nothing of q or k is saved twice.
- linear input: an ``nn.Linear`` under autocast saves its own autocast cast of the input (one copy per
  linear: ``wq``, ``wk``, ``wv`` each save one) and autocast's cast of the weight (a weight copy); without
  a cast the input itself is saved, shared. lowprec ``Float8Linear`` saves the input cast to the autocast
  dtype, or, with ``cache_fp8_activations``, the FP8 input (1 byte/element) and its scale (tensorwise ``4``,
  rowwise ``4T``, 1x128 tiles ``4T*ceil(in/128)``; a delayed scale is the module buffer, not counted).
  torchao ``Float8Linear`` casts its input only under *CUDA* autocast (``torch.is_autocast_enabled()``),
  so on CPU it saves the fp32 input itself.
- attention: the RoPE tables ``cos``/``sin`` (``2 * 4 * seq * hd/2``, one pair per forward, shared by
  every layer); SDPA (flash/CPU-flash kernel) saves q, the repeated k and v, its output (each ``c*T*H*hd``)
  and the logsumexp (``4*batch*H*seq``); ``wo`` reads the SDPA output through a view (the kernel's output
  is laid out (batch, seq, heads, hd)), so it adds nothing.
- SwiGLU: ``w1`` out (silu input), ``silu`` out, ``w3`` out (the product's inputs) and the product (``w2``'s
  input): ``4 * c*T*F``. With ``swiglu_cache='fp8'`` the two inputs are saved as e4m3 plus a float32 scale per
  1x128 tile each (``T*F + 4*T*ceil(F/128)``) and ``silu`` is recomputed; a linear of ``e5m6_inputs`` saves its
  input as emulated E5M6 held in float32 (``4*T*in``; 1.5 bytes per element packed, which lowprec does not do).
- head and loss: final norm, the output linear, ``log_softmax`` in fp32 (``4*T*vocab``, also what
  ``nll_loss`` saves), the targets (int64 ``8T``), ``total_weight`` (4), and the embedding's token ids
  (int64 ``8T``). A compiled loss (``compiled_loss=True``: ``torch.compile`` of the FP32 cross-entropy, what
  ``lowprec.train.compile.compile_loss`` does under ``train.compile`` and torchtitan does since commit bbb1b61,
  2025-04-02) saves instead the logits themselves in their dtype (``c*T*vocab``) and two FP32 statistics per row
  (max and logsumexp, ``8T``): AOTAutograd's partitioner recomputes the softmax in the fused backward
  (measured on CPU, ``tests/unit/test_estimate.py``).

Mechanism: on one device (``dp_shard == 1``) precision is ``torch.autocast`` as ``lowprec.train.build``
sets it; under FSDP2 (``dp_shard > 1``) it is ``MixedPrecisionPolicy(param_dtype=compute dtype)``, so the
forward sees compute-dtype weights, a compute-dtype residual stream and no autocast casts (the FSDP
all-gather buffers are state, estimated in ``lowprec.estimate``).

Recompute (activation checkpointing per transformer block, torchtitan's modes, ``lowprec.train.ac``):
``none`` is the ledger above. ``full`` keeps each block's input (``r*T*D``); ``selective`` is torchtitan's
op-level SAC policy: per block the input, SDPA's output and logsumexp, and the outputs of every other matmul
in call order (``wq``, ``wv``, ``w1``, ``w2``, each ``c*T*out``; an FP8 linear is one matmul). Both add,
during backward, the block being recomputed: its ledger entries that are not already kept. That is not
the block's whole ledger: with an FP32 residual the norm saves the block's input itself, and under
``selective`` SDPA's output and logsumexp, ``w1``'s output (the SiLU input) and, without GQA, ``wv``'s
output are the cached storages (measured: counting them twice overstated ``full`` by the block input and
``selective`` by about a quarter of a block). Head, loss and globals are never recomputed. Under ``tp > 1``
the reduce-scatter outputs torchtitan's policy also keeps (sequence parallelism) are not included.

Tensor parallel (``tp > 1``, torchtitan's plan with sequence parallel and loss parallel): every block and
head tensor is divided by ``tp`` (rounded up); token ids, targets and the RoPE tables are not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from lowprec.backends import fp8_backend
from lowprec.errors import ConfigError
from lowprec.estimate.inventory import Inventory, LinearInfo, inventory
from lowprec.model import ModelArgs
from lowprec.recipe import DTYPES, Float8Spec, Recipe

F32, I64 = torch.float32, torch.int64
RECOMPUTE_MODES = ("none", "selective", "full")


def _size(dtype: torch.dtype) -> int:
    return dtype.itemsize


@dataclass(frozen=True)
class _Precision:
    residual: torch.dtype
    compute: torch.dtype
    autocast: torch.dtype | None
    weight_fwd: torch.dtype
    device_type: str


def forward_precision(recipe: Recipe, dp_shard: int = 1, device_type: str = "cuda") -> _Precision:
    """The dtypes the forward pass sees (see the module doc for the two mechanisms)."""
    compute = recipe.compute_dtype
    if dp_shard > 1:
        return _Precision(compute, compute, None, compute, device_type)
    autocast = None if recipe.compute.autocast_dtype == "none" else DTYPES[recipe.compute.autocast_dtype]
    return _Precision(recipe.param_dtype, compute, autocast, recipe.param_dtype, device_type)


@dataclass(frozen=True)
class _T:
    key: str
    dtype: torch.dtype
    numel: int


@dataclass
class _Entry:
    nbytes: int
    kind: str  # "act" | "weight"
    scope: str  # "block.<i>" | "head" | "global"
    tp_divides: bool


@dataclass
class _Ledger:
    entries: dict[str, _Entry] = field(default_factory=dict)

    def save(self, key: str, nbytes: int, scope: str, kind: str = "act", tp_divides: bool = True) -> None:
        if key not in self.entries:  # one storage counted once, however often it is saved
            self.entries[key] = _Entry(int(nbytes), kind, scope, tp_divides)

    def save_t(self, t: _T, scope: str) -> None:
        self.save(t.key, t.numel * _size(t.dtype), scope)

    def total(
        self,
        scope_prefix: str = "",
        kind: str | None = None,
        tp: int = 1,
        exact: bool = False,
        exclude: frozenset[str] = frozenset(),
    ) -> int:
        """Bytes (rank 0's share under ``tp``) of the entries whose scope starts with (or, with ``exact``,
        equals) ``scope_prefix``, whose kind is ``kind`` (any when ``None``) and whose key is not in ``exclude``."""
        out = 0
        for key, e in self.entries.items():
            in_scope = e.scope == scope_prefix if exact else e.scope.startswith(scope_prefix)
            if in_scope and (kind is None or e.kind == kind) and key not in exclude:
                out += -(-e.nbytes // tp) if e.tp_divides else e.nbytes
        return out


def _linear(led: _Ledger, scope: str, lin: LinearInfo, x: _T, p: _Precision, spec: Float8Spec, rows: int) -> _T:
    """Record what ``lin`` saves when it reads ``x`` (rows = tokens); returns its output."""
    autocast = p.autocast
    needs_cast = autocast is not None and x.dtype != autocast
    cast = _T(f"{lin.fqn}.input_cast", autocast, rows * lin.in_features) if needs_cast else None
    if lin.kind == "hp":
        led.save_t(cast or x, scope)
        if autocast is not None and p.weight_fwd != autocast:
            led.save(f"{lin.fqn}.weight_cast", lin.numel * _size(autocast), scope, kind="weight")
    elif lin.kind == "lowprec" and spec.saves_e5m6_input(lin.fqn):
        # emulated E5M6 (lowprec.numerics.e5m6): the rounded values are held in float32; packed would be 1.5 B
        led.save(f"{lin.fqn}.e5m6_input", 4 * rows * lin.in_features, scope)
    else:
        what, nbytes = fp8_backend(lin.kind).saved_input(spec, rows, lin.in_features, p.device_type)
        if what == "own":
            led.save(f"{lin.fqn}.fp8_input", nbytes, scope)
        else:
            led.save_t(cast if (cast and what == "cast") else x, scope)
    return _T(f"{lin.fqn}.out", p.compute, rows * lin.out_features)


def _norm(led: _Ledger, scope: str, prefix: str, x: _T, p: _Precision, dim: int, rows: int) -> _T:
    if x.dtype == F32:
        led.save_t(x, scope)  # x.float() is x itself
    else:
        led.save(f"{prefix}.x_fp32", 4 * rows * dim, scope)
    led.save(f"{prefix}.rstd", 4 * rows, scope)
    led.save(f"{prefix}.y", 4 * rows * dim, scope)
    if p.weight_fwd != F32:
        led.save(f"{prefix}.weight_fp32", 4 * dim, scope, kind="weight")
    return _T(f"{prefix}.out", x.dtype, rows * dim)


def _block(led: _Ledger, i: int, x: _T, inv: Inventory, p: _Precision, spec: Float8Spec, batch: int, seq: int) -> _T:
    a = inv.args
    rows, scope, pre = batch * seq, f"block.{i}", f"layers.{i}"
    lin = {k.removeprefix(pre + "."): v for k, v in inv.linears.items() if k.startswith(pre + ".")}
    c, cs = p.compute, _size(p.compute)
    H, KV, hd = a.n_heads, a.n_kv_heads, a.head_dim
    xn = _norm(led, scope, f"{pre}.attention_norm", x, p, a.dim, rows)
    q = _linear(led, scope, lin["attention.wq"], xn, p, spec, rows)
    k = _linear(led, scope, lin["attention.wk"], xn, p, spec, rows)
    v = _linear(led, scope, lin["attention.wv"], xn, p, spec, rows)
    if a.qk_norm:  # an RMSNorm over head_dim per (token, head) row; an FP32 projection output is saved itself
        _norm(led, scope, f"{pre}.attention.q_norm", q, p, hd, rows * H)
        _norm(led, scope, f"{pre}.attention.k_norm", k, p, hd, rows * KV)
    for t in ("cos", "sin"):
        led.save(f"rope.{t}", 4 * seq * (hd // 2), "global", tp_divides=False)
    led.save(f"{pre}.q_rope", cs * rows * H * hd, scope)
    rep = H // KV
    led.save(f"{pre}.k_rope" if rep == 1 else f"{pre}.k_repeated", cs * rows * H * hd, scope)
    if rep == 1:
        led.save_t(v, scope)
    else:
        led.save(f"{pre}.v_repeated", cs * rows * H * hd, scope)
    attn = _T(f"{pre}.sdpa_out", c, rows * H * hd)
    led.save_t(attn, scope)
    led.save(f"{pre}.sdpa_logsumexp", 4 * batch * H * seq, scope)
    _linear(led, scope, lin["attention.wo"], attn, p, spec, rows)
    h = _T(f"{pre}.h", torch.promote_types(x.dtype, c), rows * a.dim)
    xn2 = _norm(led, scope, f"{pre}.ffn_norm", h, p, a.dim, rows)
    if "moe.experts.0.w1" in lin:  # a DeepSeekMoE block
        _moe_ffn(led, scope, pre, lin, xn2, inv, p, spec, batch, seq)
        return _T(f"{pre}.out", h.dtype, rows * a.dim)
    a1 = _linear(led, scope, lin["feed_forward.w1"], xn2, p, spec, rows)
    a3 = _linear(led, scope, lin["feed_forward.w3"], xn2, p, spec, rows)
    if spec.enabled and spec.saved.swiglu_cache == "fp8":
        # lowprec.float8.swiglu: both inputs in e4m3 with a float32 scale per 1x128 tile; silu(a) is recomputed
        tiles = rows * -(-(a1.numel // rows) // 128)
        led.save(f"{pre}.swiglu_a_fp8", a1.numel + 4 * tiles, scope)
        led.save(f"{pre}.swiglu_b_fp8", a3.numel + 4 * tiles, scope)
    else:
        led.save_t(a1, scope)
        led.save(f"{pre}.silu_out", cs * a1.numel, scope)
        led.save_t(a3, scope)
    _linear(led, scope, lin["feed_forward.w2"], _T(f"{pre}.swiglu_product", c, a1.numel), p, spec, rows)
    return _T(f"{pre}.out", h.dtype, rows * a.dim)


def _swiglu(led: _Ledger, scope: str, lin: dict, prefix: str, x: _T, p: _Precision, spec: Float8Spec, rows: int):
    a1 = _linear(led, scope, lin[f"{prefix}.w1"], x, p, spec, rows)
    a3 = _linear(led, scope, lin[f"{prefix}.w3"], x, p, spec, rows)
    led.save_t(a1, scope)
    led.save(f"{a1.key}.silu_out", _size(p.compute) * a1.numel, scope)
    led.save_t(a3, scope)
    _linear(led, scope, lin[f"{prefix}.w2"], _T(f"{a1.key}.swiglu_product", p.compute, a1.numel), p, spec, rows)


def _moe_ffn(
    led: _Ledger, scope: str, pre: str, lin: dict, xn: _T, inv: Inventory, p: _Precision, spec, batch: int, seq: int
) -> None:
    """What a DeepSeekMoE FFN (``lowprec.model.moe.MoE``) saves, APPROXIMATE (not checked against
    ``measure_saved_bytes``): the FP32 router (input cast, gate weight cast, sigmoid scores ``4TE``, the top-k
    gather's indices ``8Tk`` and the normalised gates ``4Tk``), the routed tokens (``T*k`` rows: every token goes
    to exactly ``top_k`` experts, so the experts together are one SwiGLU over ``T*k`` rows, counted with expert 0's
    shapes, plus every other expert's autocast weight copy), the gate products' inputs, and the shared experts'
    SwiGLU over ``T`` rows. Measured on ``moe_debug`` / ``moe_tiny`` (batch 4 x 128, CPU): activations 1-4% below
    ``measure_saved_bytes`` (the sequence-wise loss's tensors are not modelled), weight copies exact."""
    a, rows = inv.args, batch * seq
    k, n_exp = a.top_k, a.n_routed_experts
    if xn.dtype != F32:
        led.save(f"{pre}.moe.router.x_fp32", 4 * rows * a.dim, scope)
    else:
        led.save_t(xn, scope)
    if p.weight_fwd != F32:
        led.save(f"{pre}.moe.router.weight_fp32", 4 * n_exp * a.dim, scope, kind="weight")
    led.save(f"{pre}.moe.router.scores", 4 * rows * n_exp, scope)
    led.save(f"{pre}.moe.router.topk_idx", 8 * rows * k, scope)
    led.save(f"{pre}.moe.router.gates", 4 * rows * k + 4 * rows, scope)
    led.save(f"{pre}.moe.dispatch_idx", 2 * 8 * rows * k, scope)  # the sort order and the token of each slot
    routed = _T(f"{pre}.moe.routed_in", xn.dtype, rows * k * a.dim)
    _swiglu(led, scope, lin, "moe.experts.0", routed, p, spec, rows * k)
    for e in range(1, n_exp):  # every expert that runs casts its own weights under autocast
        for w in ("w1", "w2", "w3"):
            li = lin[f"moe.experts.{e}.{w}"]
            if li.kind == "hp" and p.autocast is not None and p.weight_fwd != p.autocast:
                led.save(f"{li.fqn}.weight_cast", li.numel * _size(p.autocast), scope, kind="weight")
    led.save(f"{pre}.moe.routed_out", _size(p.compute) * rows * k * (a.dim + 1), scope)
    if "moe.shared_experts.w1" in lin:
        _swiglu(led, scope, lin, "moe.shared_experts", xn, p, spec, rows)


def _kept(inv: Inventory, p: _Precision, batch: int, seq: int, mode: str) -> dict[str, int]:
    """Ledger key -> bytes of what a checkpointed forward keeps per block under ``mode`` (see module doc)."""
    a, rows, cs = inv.args, batch * seq, _size(p.compute)
    kept: dict[str, int] = {}
    for i in range(a.n_layers):
        pre = f"layers.{i}"
        kept["embedding.out" if i == 0 else f"layers.{i - 1}.out"] = rows * a.dim * _size(p.residual)
        if mode != "selective":
            continue
        kept[f"{pre}.sdpa_out"] = cs * rows * a.n_heads * a.head_dim
        kept[f"{pre}.sdpa_logsumexp"] = 4 * batch * a.n_heads * seq
        for name in ("attention.wq", "attention.wv", "feed_forward.w1", "feed_forward.w2"):
            if f"{pre}.{name}" not in inv.linears:  # a MoE block: its experts' matmuls are not modelled here
                continue
            kept[f"{pre}.{name}.out"] = cs * rows * inv.linears[f"{pre}.{name}"].out_features
    return kept


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes saved for backward in one forward + loss on one GPU (rank 0), by recompute mode.

    ``activations`` / ``weight_copies`` / ``total``: no recompute, counted as
    ``lowprec.measure.saved_tensors.measure_saved_bytes`` counts (equal to it on one device, ``tp == 1``).
    ``by_scope``: no-recompute bytes of ``blocks`` (all layers), ``head`` (final norm, output, loss) and
    ``globals`` (token ids, RoPE tables). ``recompute``: ``none`` / ``selective`` / ``full`` totals (weight
    copies included): what the forward keeps plus the largest block being recomputed, counted as
    ``measure_saved_bytes`` counts under ``lowprec.train.ac``; ``recompute_activations``: the same without
    the weight copies (what a run logs as ``mem_saved_activations_bytes``). ``loss_transient``: not saved
    but alive at the loss during backward: eager, the gradient of the fp32 ``log_softmax`` output and of its
    input, ``8 * T * vocab``; compiled, the fused backward's one output, the logits' gradient in their dtype
    (``c * T * vocab``); divided by ``tp``; an estimate not checked by measurement. ``korthikanti``: the
    reference ``L*s*b*h*(34 + 5*a*s/h)`` bytes (Korthikanti et al. 2022, 16-bit, no recompute, the ``s x s``
    attention scores stored, i.e. no flash attention), and ``korthikanti_selective`` ``L*s*b*h*34`` (scores
    recomputed); both ignore the head, the loss and the recipe's dtypes.
    """

    batch: int
    seq: int
    activations: int
    weight_copies: int
    by_scope: dict[str, int]
    recompute: dict[str, int]
    recompute_activations: dict[str, int]
    loss_transient: int
    korthikanti: int
    korthikanti_selective: int

    @property
    def total(self) -> int:
        return self.activations + self.weight_copies

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def korthikanti_bytes(args: ModelArgs, batch: int, seq: int, tp: int = 1, selective: bool = False) -> int:
    """Korthikanti et al. 2022 (arXiv 2205.05198, section 4, 16-bit activations) per-layer memory times
    ``L``, divided by ``tp`` (tensor + sequence parallel): ``s*b*h*(34 + 5*a*s/h)`` bytes without recompute,
    ``34*s*b*h`` with selective recompute of the attention scores."""
    s, b, h, a = seq, batch, args.dim, args.n_heads
    per_layer = 34 * s * b * h + (0 if selective else 5 * a * s * s * b)
    return args.n_layers * per_layer // tp


def predict_saved_activations(
    args: ModelArgs,
    recipe: Recipe,
    batch: int,
    seq: int,
    device_type: str = "cuda",
    dp_shard: int = 1,
    tp: int = 1,
    compiled_loss: bool = False,
) -> ActivationEstimate:
    """Predict the bytes autograd saves for one micro-batch of ``batch`` x ``seq`` tokens (per GPU).

    ``compiled_loss``: the loss runs ``torch.compile``d (module doc); the blocks are counted eager either way
    (a run's ``mem_saved_activations_bytes`` is measured eager too, ``lowprec.train.meter``).

    ``device_type``: ``cuda`` or ``cpu`` (torchao FP8 linears cast their input only under CUDA autocast).
    Raises ``ValueError`` for non-positive sizes, ``seq > args.max_seq_len`` or an unknown device type.
    CUDA predictions assume SDPA's flash or memory-efficient kernel (same saved set as CPU's flash kernel,
    up to the logsumexp padding of the efficient kernel); only the CPU path has been measured.
    """
    if batch < 1 or seq < 1 or dp_shard < 1 or tp < 1:
        raise ConfigError(f"batch={batch}, seq={seq}, dp_shard={dp_shard}, tp={tp} must all be >= 1")
    if seq > args.max_seq_len:
        raise ConfigError(f"seq={seq} exceeds model.max_seq_len={args.max_seq_len}")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type={device_type!r} is not 'cuda' or 'cpu'")
    inv = inventory(args, recipe.fp8)
    p = forward_precision(recipe, dp_shard, device_type)
    led = _Ledger()
    rows = batch * seq
    led.save("tokens", 8 * rows, "global", tp_divides=False)
    x = _T("embedding.out", p.residual, rows * args.dim)
    for i in range(args.n_layers):
        x = _block(led, i, x, inv, p, recipe.fp8, batch, seq)
    xn = _norm(led, "head", "norm", x, p, args.dim, rows)
    logits = _linear(led, "head", inv.linears["output"], xn, p, recipe.fp8, rows)
    logit_bytes = logits.dtype.itemsize * logits.numel
    if compiled_loss:
        led.save("loss.logits", logit_bytes, "head")
        led.save("loss.row_max_logsumexp", 8 * rows, "head")
    else:
        led.save("loss.log_softmax", 4 * rows * args.vocab_size, "head")
    led.save("loss.target", 8 * rows, "head", tp_divides=False)
    led.save("loss.total_weight", 4, "head", tp_divides=False)

    blocks = led.total("block.", tp=tp)
    head, glob = led.total("head", tp=tp), led.total("global", tp=tp)
    recompute = {"none": blocks + head + glob}
    recompute_acts = {"none": led.total(kind="act", tp=tp)}
    for mode in ("selective", "full"):
        kept = _kept(inv, p, batch, seq, mode)
        keys = frozenset(kept)
        kept_bytes = sum(-(-n // tp) for n in kept.values())
        # the block being recomputed: its ledger entries that are not kept storages (all blocks are alike;
        # the largest is taken)
        i = max(range(args.n_layers), key=lambda i: led.total(f"block.{i}", tp=tp, exact=True, exclude=keys))
        extra = led.total(f"block.{i}", tp=tp, exact=True, exclude=keys)
        extra_acts = led.total(f"block.{i}", kind="act", tp=tp, exact=True, exclude=keys)
        recompute[mode] = kept_bytes + extra + head + glob
        recompute_acts[mode] = (
            kept_bytes + extra_acts + led.total("head", kind="act", tp=tp) + led.total("global", kind="act", tp=tp)
        )
    return ActivationEstimate(
        batch=batch,
        seq=seq,
        activations=led.total(kind="act", tp=tp),
        weight_copies=led.total(kind="weight", tp=tp),
        by_scope={"blocks": blocks, "head": head, "globals": glob},
        recompute=recompute,
        recompute_activations=recompute_acts,
        loss_transient=-(-(logit_bytes if compiled_loss else 8 * rows * args.vocab_size) // tp),
        korthikanti=korthikanti_bytes(args, batch, seq, tp),
        korthikanti_selective=korthikanti_bytes(args, batch, seq, tp, selective=True),
    )
