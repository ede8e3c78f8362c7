"""Per-op step-time model: GEMMs by shape and dtype, attention, memory-bound kernels, FP8 casts, communication.

One training step on one GPU of a (``dp_shard``, ``tp``) layout is a list of ops, each with its FLOPs and the
bytes it moves through HBM; an op takes the roofline time ``max(FLOPs / achievable FLOP/s, bytes / achievable
bandwidth)``. The step is

    compute = sum(op times) over forward, the recompute of the AC mode, backward and the optimizer
    step    = compute + exposed(FSDP comm) + exposed(TP comm)
    exposed(c) = max(c * (1 - overlap), c - compute)       (at most ``overlap`` of ``c`` hides under compute)

**GEMMs** (every linear, per layer ``wq wk wv wo w1 w3 w2`` and ``output``; M = tokens, K/N the local shape after
torchtitan's TP plan: column-parallel ``wq wk wv w1 w3 output`` split N, row-parallel ``wo w2`` split K): forward
``M x K x N``, dgrad ``M x N x K``, wgrad ``K x M x N``, ``2*M*K*N`` FLOPs each. Achievable FLOP/s =
``peak(dtype) * eff(dtype) * m / (m + d0)`` with ``m`` the smallest of M, K, N (a GEMM whose smallest side is ``d0``
fills half the machine: wave quantization on small sides, torchtitan#1207's slow ``wk``/``wv`` after TP);
``d0`` = 128 (bf16) and 256 (FP8: torchao's float8 README finds FP8 slower than bf16 at 1024x2048x1024 and
1.39x faster at 4096x8192x16384). ``eff`` is fitted per dtype (``Calibration``) on H100s; another part's GEMMs
run at ``eff * hw.gemm_rel_<dtype>``, its measured maximum-achievable matmul efficiency relative to the H100 SXM's
(``lowprec.estimate.hardware``: Bekman's MAMF table, AMD's MAF table), so that MI300X GEMMs are as far from their
peak as AMD's own hipBLASLt measurement says, not by a fitted factor. Rowwise-scaled FP8 GEMMs
(CUTLASS kernels in torchao; cuBLAS tensorwise is faster) run at ``rowwise_gemm`` of the tensorwise rate
(fitted); blockwise (1x128 / 128x128) forward and dgrad as rowwise, wgrad at 457/1234 of that (torchao's
blockwise prototype README: DeepGEMM 1,234 TFLOP/s forward, 457 wgrad on H100; no end-to-end figure
exists, so blockwise predictions are not validated). GEMM bytes: both operands and the output.

**Attention** (SDPA flash, causal): forward ``2 * 2 * M * seq * (n_heads/tp) * head_dim / 2`` FLOPs (QK^T and PV,
half skipped by the causal mask), backward 2.5x forward (five matmuls against two); forward at
``ATTENTION_EFF`` (0.35) of the bf16 peak, backward at ``ATTENTION_BWD_EFF`` (0.27): FlashAttention-2 on H100
at head dim 128, causal, long sequences, runs about 330-350 TFLOP/s forward and 250-280 backward
(FlashAttention-3 paper, Shah et al. 2024, figures 5 and 6; approximate readings). On AMD parts attention runs at
``rocm_attention`` (fitted on torchao's MI300X bf16 row) of that: the only fitted ROCm factor, so it also carries
whatever else of that row the H100-calibrated model misses (no published MI300X SDPA figure separates them).

**Memory-bound kernels** at ``BW_FRAC`` (0.8) of the datasheet HBM bandwidth (torchao's float8 README and
blockwise prototype: cast kernels reach 85-94% of achievable bandwidth, achievable being ~90% of the datasheet).
Per token and layer, bf16 elements read + written in the forward under ``compile`` (Inductor fuses each chain
into one kernel): attention_norm ``2*dim``, RoPE ``2*(q + k)``, residual add + ffn_norm ``4*dim``, SwiGLU
``3*ffn``, residual add ``3*dim``; backward twice that. Eager runs ``eager_factor`` times those bytes (fitted:
RMSNorm alone is five kernels with an FP32 round trip). The loss: logits ``vocab/tp`` per token, 12 bytes each
compiled (bf16 logits to FP32 and softmax-grad), 24 eager. AdamW: 36 bytes per local parameter (FP32 param,
grad, two moments read, three written).

**FP8 casts** per FP8 linear and step, over the input ``X`` (M x K) and the output gradient ``G`` (M x N) of E
elements each (h = 2 bytes high precision, 1 byte FP8); both layouts are made (the wgrad GEMM needs the
transposed operand):

- tensorwise current: an amax pass (read ``E*h``) then one cast kernel writing both layouts (``E*h + 2E``);
  without compile the transposed copy is a separate kernel (``+2E``);
- tensorwise delayed: no amax pre-pass (the amax of this step is taken inside the cast): ``E*h + 2E``;
- rowwise and blockwise: per-row / per-tile amax fused with the cast, once per layout (the scales differ per
  axis): ``2*(E*h + E)``;
- weights: the same rule over the local weight, forward and again in backward (torchao's
  ``force_recompute_fp8_weight_in_bwd``), except with an FP8 weight all-gather (``recipe.comm``): each rank
  casts its ``1/dp_shard`` shard once and only the transposed copy of the gathered weight is made (``2E``).

**Recompute**: ``none`` nothing; ``full`` the whole forward (GEMMs, attention, kernels, casts); ``selective``
torchtitan's op policy, whose save list (``torchtitan/models/llama3/parallelize_llama.py``, Dec 2024) holds
``mm``, SDPA, ``reduce_scatter`` and ``max`` but not ``_scaled_mm``: under bf16 every second ``mm`` of a block
(``wk wo w3``) is recomputed, under FP8 every FP8 GEMM is, plus every memory-bound forward kernel.

**Communication**, FSDP2 bytes as ``lowprec.parallel.comm_meter`` measures them (``fsdp_comm_bytes``): the
parameters all-gathered in forward and again in backward (``reshard_after_forward``; the last block stays
gathered) in the compute dtype, or 1 byte for FP8 linears under ``comm.weight_all_gather=fp8``, and the
gradients reduce-scattered in ``comm.grad_reduce`` (fp32 4, bf16 2, fp8 1 byte + block scales); a ring moves
``(n-1)/n`` of the gathered bytes per GPU. Tensor parallel with sequence
parallelism: per layer, forward two all-gathers and two reduce-scatters of ``M x dim`` activations (the
all-gathers in FP8 for tensorwise FP8 linears, torchtitan's float8 TP), backward the same again, ``full``
recompute once more. Bandwidth: ``intra_gb_s`` when the group fits in a node, else ``inter_gb_s``. Async TP
(torchtitan ``enable_async_tensor_parallel``) hides TP comm like FSDP's; plain TP comm is exposed.

**DeepSeekMoE models** (``lowprec.model.moe``, ``tp == 1`` only: tensor and expert parallelism of a MoE model are
not modelled and raise ``ValueError``): each routed expert ``layers.N.moe.experts.E.{w1,w3,w2}`` is its own GEMM
triple at the expected ``M_e = M * top_k / n_routed_experts`` tokens (perfect balance, what the bias of the
auxiliary-loss-free balancing aims at), so the small-shape efficiency ``m / (m + d0)`` applies to the expert shapes
and the step's expert FLOPs are those of the ``top_k`` activated experts; the shared experts run at ``M``; the
router gate is an FP32 GEMM ``M x dim x n_routed`` per MoE block (forward, dgrad, wgrad; recomputed only under
``full``). FP8 casts follow each expert's ``M_e``-row input and gradient, and every expert's weight is cast each
step (all experts' states exist). Memory-bound kernels add the routing (``_moe_kernel_elements``). This is the
per-expert loop lowprec runs on CPU. A grouped GEMM on GPU (``torch._grouped_mm``, torchtitan's
``GroupedExperts``, torchao's ``moe_training``) runs all experts of a block as one kernel: its efficiency follows
the concatenated ``M * top_k`` rows more than the per-expert ``M_e`` (fewer, fuller waves; no per-expert launch),
so this model is pessimistic for fine-grained experts there; load imbalance (the busiest expert sets a grouped
GEMM's tail) works the other way. Neither is calibrated: ``published.yaml`` holds no MoE measurement, so MoE
predictions are not validated.

``Calibration`` holds the six fitted numbers; ``lowprec_lab/sizing/fit_cost_model.py`` fits them on the
``fit`` points of ``lowprec/estimate/published.yaml`` and reports the held-out error.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from lowprec.errors import ConfigError
from lowprec.estimate.hardware import Hardware
from lowprec.estimate.inventory import inventory, is_routed_expert, tokens_per_expert
from lowprec.model import ModelArgs, MoEArgs
from lowprec.recipe import Recipe

ATTENTION_EFF = 0.35
ATTENTION_BWD_EFF = 0.27
BW_FRAC = 0.8
D0 = {"bf16": 128, "fp8": 256}
BLOCKWISE_WGRAD = 457.0 / 1234.0
ADAMW_BYTES_PER_PARAM = 36
AC_MODES = ("none", "selective", "full")
# torchtitan's op-level SAC recomputes every second mm of a block: with forward order wq wk wv wo w1 w3 w2,
# the 2nd, 4th and 6th.
SELECTIVE_RECOMPUTED_MM = ("wk", "wo", "w3")


@dataclass(frozen=True)
class Calibration:
    """The fitted parameters: GEMM efficiency for large shapes in bf16 and FP8 (fraction of the dense peak),
    the rowwise FP8 GEMM rate relative to tensorwise, the eager/compiled memory-traffic ratio of the
    elementwise kernels, the fraction of communication hidden under compute, and the rate of attention on AMD's
    ROCm stack relative to the NVIDIA-calibrated one (GEMMs there follow measured matmul ceilings, not a fit).
    Dimensionless. The defaults are
    the fit of ``lowprec_lab/sizing/fit_cost_model.py`` on ``published.yaml`` (a test refits and compares)."""

    gemm_eff_bf16: float = 0.5356
    gemm_eff_fp8: float = 0.6042
    rowwise_gemm: float = 0.6923
    eager_factor: float = 2.9608
    overlap: float = 0.9336
    rocm_attention: float = 0.2916

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Layout:
    """Where and how a step runs: ``dp_shard`` (FSDP2 degree), ``tp`` (tensor parallel with sequence
    parallelism), ``batch`` sequences of ``seq`` tokens per data-parallel rank, ``ac`` (none | selective |
    full), ``compile`` (Inductor fusion of the elementwise kernels and FP8 casts), ``async_tp``,
    ``compiled_loss`` (the cross-entropy compiled too; ``None``: as ``compile``, what lowprec and torchtitan since
    2025-04-02 do; torchtitan before that compiled the blocks only)."""

    dp_shard: int = 1
    tp: int = 1
    batch: int = 1
    seq: int = 8192
    ac: str = "selective"
    compile: bool = True
    async_tp: bool = False
    compiled_loss: bool | None = None

    @property
    def loss_compiled(self) -> bool:
        return self.compile if self.compiled_loss is None else self.compiled_loss

    def __post_init__(self) -> None:
        for k in ("dp_shard", "tp", "batch", "seq"):
            if getattr(self, k) < 1:
                raise ConfigError(f"{k}={getattr(self, k)} must be >= 1")
        if self.ac not in AC_MODES:
            raise ConfigError(f"ac={self.ac!r} is not one of {', '.join(AC_MODES)}")
        if self.async_tp and self.tp == 1:
            raise ConfigError("async_tp=true needs tp > 1")


@dataclass(frozen=True)
class StepCost:
    """Predicted step of one GPU, seconds by part: ``gemm``, ``attention``, ``kernels`` (memory-bound
    elementwise, loss, optimizer), ``fp8_casts``, ``fsdp_comm`` / ``tp_comm`` (total, not only the exposed
    part), ``exposed_comm``; ``step_time_s`` and ``tokens_per_s_per_gpu`` (torchtitan's TPS/GPU:
    ``batch*seq / tp / step``)."""

    recipe: str
    hardware: str
    layout: Layout
    gemm: float
    attention: float
    kernels: float
    fp8_casts: float
    fsdp_comm: float
    tp_comm: float
    exposed_comm: float
    step_time_s: float
    tokens_per_s_per_gpu: float
    calibration: Calibration = field(default_factory=Calibration)

    @property
    def compute(self) -> float:
        return self.gemm + self.attention + self.kernels + self.fp8_casts

    @property
    def bound(self) -> str:
        """What sets the step: ``"communication"`` when the compute hides entirely under the communication that
        overlaps it (FSDP's, and TP's under async TP: ``comm - compute`` exceeds the ``1 - overlap`` share that never
        hides, so the step is the communication's time and recipes that differ only in compute tie), else
        ``"compute"``."""
        hideable = self.fsdp_comm + (self.tp_comm if self.layout.async_tp else 0.0)
        return "communication" if hideable - self.compute > hideable * (1.0 - self.calibration.overlap) else "compute"

    def to_dict(self) -> dict:
        return {**asdict(self), "compute": self.compute, "bound": self.bound}


#: Block-scaled scalings whose elements are E2M1 (4 bits): their GEMMs run at the part's FP4 peak.
E2M1_SCALINGS = ("mxfp4", "nvfp4")


def gemm_dtype(recipe: Recipe) -> str:
    """The peak a recipe's low-precision GEMMs run at: ``fp4`` for E2M1 elements (MXFP4, NVFP4), ``fp8`` otherwise
    (MXFP8 runs at the FP8 rate on Blackwell)."""
    return "fp4" if recipe.fp8.scaling in E2M1_SCALINGS else "fp8"


def _granularity(recipe: Recipe) -> str | None:
    """``tensorwise``/``rowwise``/``blockwise`` of the recipe's FP8 GEMMs, ``None`` without FP8."""
    return recipe.fp8.scaling if recipe.fp8.enabled else None


def gemm_time(m: int, k: int, n: int, dtype: str, hw: Hardware, cal: Calibration, scale: float = 1.0) -> float:
    """Roofline seconds of one ``m x k x n`` GEMM in ``dtype`` (``bf16``/``fp32``/``fp8``/``fp4``) on ``hw``;
    ``scale`` multiplies the FP8 rate (rowwise/blockwise kernels)."""
    peak = hw.peak_tflops(dtype) * 1e12
    low = dtype in ("fp8", "fp4")  # FP4 GEMMs take the FP8 efficiency: no published FP4 training point to fit
    eff = (cal.gemm_eff_fp8 * scale * hw.gemm_rel_fp8) if low else cal.gemm_eff_bf16 * hw.gemm_rel_bf16
    small = min(m, k, n)
    rate = peak * eff * small / (small + D0["fp8" if low else "bf16"])
    ib = {"fp8": 1, "fp4": 0.5, "fp32": 4}.get(dtype, 2)
    nbytes = (m * k + k * n) * ib + m * n * 2
    return max(2.0 * m * k * n / rate, nbytes / (hw.hbm_tb_s * 1e12 * BW_FRAC))


def _ring(nbytes: float, n: int, hw: Hardware, span: int) -> float:
    """Seconds of a ring collective moving ``(n-1)/n * nbytes`` per GPU over a group spanning ``span`` GPUs."""
    if n <= 1:
        return 0.0
    bw = hw.intra_gb_s if span <= hw.gpus_per_node else hw.inter_gb_s
    return nbytes * (n - 1) / n / (bw * 1e9)


def step_cost(
    args: ModelArgs, recipe: Recipe, hw: Hardware, layout: Layout, cal: Calibration | None = None
) -> StepCost:
    """Predicted step time of ``recipe`` on ``hw`` under ``layout`` (rules in the module doc).

    Raises ``ValueError`` where ``hw`` lacks the recipe's GEMM dtype (FP8 on A100), for a layout whose ``tp``
    does not divide the head counts, or for a bad layout field.
    """
    cal = cal or Calibration()
    lo = layout
    tp = lo.tp
    if args.n_heads % tp or args.n_kv_heads % tp:
        raise ConfigError(f"parallel.tp={tp} must divide model.n_heads={args.n_heads} and n_kv_heads={args.n_kv_heads}")
    moe = isinstance(args, MoEArgs)
    if moe and tp > 1:
        raise ConfigError(f"parallel.tp={tp}: tensor/expert parallelism of a MoE model is not modelled; use tp=1")
    inv = inventory(args, recipe.fp8)
    gran = _granularity(recipe)
    hp = "fp32" if recipe.compute_dtype.itemsize == 4 else "bf16"
    low = gemm_dtype(recipe)
    if gran is not None:
        hw.peak_tflops(low)  # raises for hardware without FP8 (or, for E2M1 recipes, FP4) tensor cores
    m_tok = lo.batch * lo.seq
    bw = hw.hbm_tb_s * 1e12 * BW_FRAC
    h = 2 if hp == "bf16" else 4

    fwd_gemm = bwd_gemm = recompute_gemm = 0.0
    fwd_cast = bwd_cast = 0.0
    cast_weight_bytes = 0.0
    for fqn, li in inv.linears.items():
        short = fqn.rsplit(".", 1)[-1]
        k, n = li.in_features, li.out_features
        if tp > 1:
            if short in ("wo", "w2"):
                k //= tp
            else:
                n //= tp
        is_fp8 = li.kind != "hp"
        dt = low if is_fp8 else hp
        m = tokens_per_expert(args, m_tok) if is_routed_expert(fqn) else m_tok
        s_fd = s_wg = 1.0
        if is_fp8 and gran == "rowwise":
            s_fd = s_wg = cal.rowwise_gemm
        elif is_fp8 and gran == "blockwise":
            s_fd, s_wg = cal.rowwise_gemm, cal.rowwise_gemm * BLOCKWISE_WGRAD
        f = gemm_time(m, k, n, dt, hw, cal, s_fd)
        fwd_gemm += f
        bwd_gemm += gemm_time(m, n, k, dt, hw, cal, s_fd) + gemm_time(k, m, n, dt, hw, cal, s_wg)
        if lo.ac == "full" or (
            lo.ac == "selective" and fqn.startswith("layers.") and (is_fp8 or short in SELECTIVE_RECOMPUTED_MM)
        ):
            recompute_gemm += f
        if is_fp8:
            e_x, e_g, e_w = m * k, m * n, k * n
            fwd_cast += _cast_bytes(e_x, recipe, lo.compile, h)
            bwd_cast += _cast_bytes(e_g, recipe, lo.compile, h)
            if recipe.comm.weight_all_gather == "fp8" and lo.dp_shard > 1:
                cast_weight_bytes += _cast_bytes(e_w / lo.dp_shard, recipe, lo.compile, h) + 2 * e_w
            else:
                cast_weight_bytes += 2 * _cast_bytes(e_w, recipe, lo.compile, h)

    if moe:  # the router gate of every MoE block: an FP32 GEMM (T x dim x n_routed), never FP8, never recomputed
        n_moe = args.n_layers - args.n_dense_layers  # but under full AC
        d, ne = args.dim, args.n_routed_experts
        f = n_moe * gemm_time(m_tok, d, ne, "fp32", hw, cal)
        fwd_gemm += f
        bwd_gemm += n_moe * (gemm_time(m_tok, ne, d, "fp32", hw, cal) + gemm_time(d, m_tok, ne, "fp32", hw, cal))
        recompute_gemm += f if lo.ac == "full" else 0.0

    # attention
    nh = args.n_heads // tp
    hd = args.dim // args.n_heads
    att_fwd_flops = args.n_layers * 2 * 2 * m_tok * lo.seq * nh * hd / 2
    att_rate = hw.peak_tflops("bf16") * 1e12 * ATTENTION_EFF * (cal.rocm_attention if hw.vendor == "amd" else 1.0)
    att_fwd = att_fwd_flops / att_rate
    att = att_fwd * (1 + (1 if lo.ac == "full" else 0)) + 2.5 * att_fwd_flops / (
        att_rate / ATTENTION_EFF * ATTENTION_BWD_EFF
    )

    # memory-bound kernels
    q = args.dim
    kv = args.n_kv_heads * hd
    if moe:
        fwd_elem = _moe_kernel_elements(args, inv, m_tok) * h
    else:
        ffn = inv.linears["layers.0.feed_forward.w1"].out_features
        per_tok_layer = 2 * args.dim + 2 * (q + kv) + 4 * args.dim + 3 * ffn / tp + 3 * args.dim
        if tp > 1:  # norms and residuals run on the 1/tp sequence shard; RoPE and SwiGLU on the local heads/columns
            per_tok_layer = (9 * args.dim) / tp + 2 * (q + kv) / tp + 3 * ffn / tp
        fwd_elem = per_tok_layer * m_tok * args.n_layers * h
    eager = 1.0 if lo.compile else cal.eager_factor
    fwd_k = fwd_elem * eager / bw
    rec_k = fwd_k if lo.ac in ("selective", "full") else 0.0
    loss_bytes = m_tok * args.vocab_size / tp * (12 if lo.loss_compiled else 24)
    n_local = sum(_numel(s) for _, s in inv.params) / (lo.dp_shard * tp)
    opt = ADAMW_BYTES_PER_PARAM * n_local / bw
    kernels = fwd_k * 3 + rec_k + loss_bytes / bw + opt

    casts = (fwd_cast * (2 if lo.ac == "full" or (lo.ac == "selective" and gran) else 1) + bwd_cast) / bw
    casts += cast_weight_bytes / bw
    gemm = fwd_gemm + bwd_gemm + recompute_gemm
    compute = gemm + att + kernels + casts

    # communication
    fsdp = 0.0
    if lo.dp_shard > 1:
        ag, rs = fsdp_comm_bytes(args, recipe, tp)
        span = lo.dp_shard * tp
        fsdp = _ring(ag, lo.dp_shard, hw, span) + _ring(rs, lo.dp_shard, hw, span)
    tpc = 0.0
    if tp > 1:
        act = m_tok * args.dim
        ag_b = 1 if gran == "tensorwise" else h
        per_layer_fwd = 2 * act * ag_b + 2 * act * h
        per_layer_bwd = 4 * act * h
        n_fwd = 2 if lo.ac == "full" else 1
        tpc = _ring(args.n_layers * (n_fwd * per_layer_fwd + per_layer_bwd), tp, hw, tp)
    exposed = _exposed(fsdp + (tpc if lo.async_tp else 0.0), compute, cal.overlap)
    if not lo.async_tp:
        exposed += tpc
    step = compute + exposed
    return StepCost(
        recipe.name,
        hw.name,
        lo,
        gemm,
        att,
        kernels,
        casts,
        fsdp,
        tpc,
        exposed,
        step,
        m_tok / tp / step,
        cal,
    )


def fsdp_comm_bytes(args: ModelArgs, recipe: Recipe, tp: int = 1) -> tuple[float, float]:
    """FSDP2 bytes of one step as ``lowprec.parallel.comm_meter.CommMeter`` counts them (all-gather: the gathered
    output; reduce-scatter: the full input), summed over the step: ``(all_gather, reduce_scatter)``.

    All-gathers: the root's parameters (embedding, final norm, output) twice and the blocks' ``2 * (L - 1)`` block
    gathers in all (the last block stays unsharded from its forward to its backward, ``lowprec.parallel.fsdp``),
    in the compute dtype, or 1 byte per element for FP8 linears under ``comm.weight_all_gather=fp8`` (scales,
    under 1%, left out). Reduce-scatter: every parameter once in ``comm.grad_reduce`` (fp32 4, bf16 2 bytes; fp8
    1 byte plus a 4-byte scale per ``grad_reduce_block`` elements). ``tp`` divides every parameter. Measured
    by ``benchmarks/comm_bytes.py`` (FSDP2 world size 2): ``tests/unit/test_cost_model.py`` holds its figures.
    """
    inv = inventory(args, recipe.fp8)
    pe = 4 if recipe.compute_dtype.itemsize == 4 else 2
    fp8_ag = recipe.comm.weight_all_gather == "fp8" and recipe.fp8.enabled
    c = recipe.comm
    grad_b = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 4.0 / c.grad_reduce_block}[c.grad_reduce]
    block_gathers = 2 * (args.n_layers - 1) / args.n_layers  # per block, on average
    ag = rs = 0.0
    for fqn, shape in inv.params:
        numel = _numel(shape) / tp
        li = inv.linears.get(fqn.removesuffix(".weight"))
        b = 1 if (fp8_ag and li is not None and li.kind != "hp") else pe
        ag += numel * b * (block_gathers if fqn.startswith("layers.") else 2)
        rs += numel * grad_b
    return ag, rs


def _moe_kernel_elements(args: MoEArgs, inv, m_tok: int) -> float:
    """Elements read + written by the forward's memory-bound kernels of a DeepSeekMoE model (``tp == 1``),
    summed over the blocks: the dense block's rule of the module doc with the SwiGLU over the activated hidden
    (shared + ``top_k`` routed) in MoE blocks, plus the routing: sigmoid and top-k over ``n_routed_experts``
    scores (3 per expert), the dispatch gather of ``top_k`` copies of each token (read + write ``2*top_k*dim``)
    and the gated combine (``top_k*dim`` read, ``dim`` written)."""
    d, hd = args.dim, args.dim // args.n_heads
    base = 2 * d + 2 * (d + args.n_kv_heads * hd) + 4 * d + 3 * d
    total = 0.0
    for i in range(args.n_layers):
        dense = inv.linears.get(f"layers.{i}.feed_forward.w1")
        if dense is not None:
            total += base + 3 * dense.out_features
            continue
        shared = inv.linears.get(f"layers.{i}.moe.shared_experts.w1")
        hidden = (shared.out_features if shared else 0) + args.top_k * args.moe_inter_dim
        total += base + 3 * hidden + 3 * args.n_routed_experts + 3 * args.top_k * d + d
    return total * m_tok


def _exposed(comm: float, compute: float, overlap: float) -> float:
    return max(comm * (1.0 - overlap), comm - compute, 0.0)


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _cast_bytes(e: float, recipe: Recipe, compiled: bool, h: int) -> float:
    """HBM bytes to make both FP8 layouts of an ``e``-element high-precision tensor (module doc)."""
    spec = recipe.fp8
    if spec.scaling in E2M1_SCALINGS or spec.scaling == "mxfp8":
        # block-scaled (OCP MX / NVFP4): per-block amax fused with the cast, once per layout as rowwise, writing
        # the elements (1 byte, or 0.5 for E2M1) and one 1-byte scale per 32 (16 for NVFP4) elements
        eb = 0.5 if spec.scaling in E2M1_SCALINGS else 1.0
        blk = 16 if spec.scaling == "nvfp4" else 32
        return 2 * (e * h + e * eb + e / blk) + (0 if compiled else 2 * e * eb)
    if spec.scaling in ("rowwise", "blockwise"):
        return 2 * (e * h + e) + (0 if compiled else 2 * e)
    amax = 0 if spec.cast.strategy in ("delayed", "static") else e * h
    return amax + e * h + 2 * e + (0 if compiled else 2 * e)
