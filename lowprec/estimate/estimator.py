"""Precision-aware memory and throughput estimates, reconciled with lowprec's own measurements.

Pure functions of (``ModelArgs``, ``Recipe``, parallel layout, batch, seq, ``Hardware``); the only torch
objects made live on the ``meta`` device (``lowprec.estimate.inventory``). Every function returns a dataclass
with ``to_dict()`` for JSON.

**Training state** (``predict_state_bytes``), on one process exactly what
``lowprec.measure.accounting.measure_state_bytes`` measures after one optimizer step, per parameter tensor of
``n`` elements (``pe`` = bytes of the recipe's parameter dtype):

- ``params`` ``n*pe``; ``grads`` ``n*pe`` (gradients take the parameter dtype); ``master`` 0 (no recipe keeps
  an explicit copy: FP32 parameters under autocast are their own master, as docs/architecture.md counts them);
- ``torch.optim.AdamW``: ``exp_avg`` + ``exp_avg_sq`` ``2*n*pe`` plus a 0-dim fp32 ``step`` (4 bytes);
- bitsandbytes ``AdamW8bit`` (``min_8bit_size=4096``, ``bitsandbytes/optim/optimizer.py`` ``init_state``):
  ``n >= 4096``: uint8 ``state1``/``state2`` ``2n`` + fp32 ``absmax1``/``absmax2`` ``2*4*ceil(n/256)``;
  ``n < 4096``: fp32 ``state1``/``state2`` ``8n``; ``step`` is a Python int (0 bytes); the two 256-entry
  fp32 qmaps (``dynamic``, ``udynamic``) are shared by every tensor: 2048 bytes once if any tensor is 8-bit;
- torchao ``AdamW8bit`` (``torchao/optim/adam.py`` ``_new_buffer``): ``n >= 4096 and n % 256 == 0``: per
  state an ``OptimState8bit`` of uint8 ``codes`` ``n``, fp32 ``scale`` ``4n/256`` and its *own* 256-entry fp32
  ``qmap`` (1024), i.e. ``2n + 8n/256 + 2048``; otherwise ``2*n*pe``; plus a 0-dim fp32 ``step``.
- ``fp8_scaling_state`` (module buffers, not in ``measure_state_bytes``; measured by
  ``lowprec.measure.saved_tensors.measure_fp8_scaling_bytes``): lowprec ``Float8Linear`` with delayed scaling keeps,
  per FP8 linear and role (input, weight, grad_output), ``amax_history`` (``amax_history_len`` fp32) and
  ``scale`` (1 fp32). torchao dynamic scaling keeps none. Transformer Engine is approximated (see code).

Under FSDP2 ``dp_shard=N`` each parameter's dim 0 is chunked (rank 0 holds ``ceil(d0/N)`` rows, the largest
share) and params, grads and optimizer states follow the local shard (the 8-bit rules apply to the local
numel); step counters and FP8 scaling buffers are per rank, not divided. Under tensor parallel ``tp``
torchtitan's plan shards every linear and the embedding (``lowprec.estimate.inventory.tp_local_shape``); norm
weights are replicated. ``fsdp_buffers`` (``dp_shard > 1``) approximates the transient unsharded
compute-dtype parameters: the root's (embedding, final norm, output: FSDP2 keeps the root unsharded
between forward and backward) plus two blocks (the current one and the prefetched one); gradient
reduce-scatter buffers are not included.

**Throughput** (PaLM, Chowdhery et al. 2022, appendix B): model FLOPs
per token ``6*N + 12*L*dim*seq`` with ``N`` = every parameter except the token embedding (a lookup), i.e.
the blocks, the final norm and the output layer; the attention term assumes no causal skipping. For a
DeepSeekMoE model ``N`` counts the *activated* parameters (``top_k`` routed experts per MoE block, the shared
experts, the router gate), as DeepSeek-V3 reports its 37B activated of 671B.
FP8 recipes run ``6 * (weights of FP8 linears)`` FLOPs per token in FP8; their peak is the FLOP-weighted
harmonic blend ``1 / (f/peak_fp8 + (1-f)/peak_hp)`` (the time the FLOPs would take at each peak), where
``f`` is that FP8 share. ``predict_throughput`` is the flat-efficiency time, FLOPs / (peak * efficiency),
efficiency 0.4 MFU by default, communication not modelled: it overstates FP8 about 2x; the per-op
``lowprec.estimate.cost_model`` is what ``lowprec estimate`` and ``recommend`` print. Under ``tp`` each GPU
does ``1/tp`` of its group's FLOPs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from lowprec.backends import check_recipe, fp8_backend, optim_impl, short_str
from lowprec.errors import ConfigError
from lowprec.estimate.activations import RECOMPUTE_MODES, ActivationEstimate, predict_saved_activations
from lowprec.estimate.hardware import Hardware
from lowprec.estimate.inventory import fsdp_local_numel, inventory, is_routed_expert, param_counts, tp_local_shape
from lowprec.measure.accounting import StateBytes
from lowprec.model import ModelArgs, MoEArgs
from lowprec.recipe import Float8Spec, Recipe

DEFAULT_EFFICIENCY = 0.4


def _elt(recipe: Recipe) -> int:
    return 4 if recipe.weights.param_dtype == "fp32" else 2


def check_layout(args: ModelArgs, dp_shard: int, tp: int) -> None:
    """Raise ``ValueError`` unless ``dp_shard >= 1``, ``tp >= 1`` and ``tp`` divides the head counts
    (torchtitan's tensor-parallel plan shards attention by heads), and for ``tp > 1`` on a DeepSeekMoE model
    (how its experts would be split, tensor or expert parallel, is not modelled)."""
    if dp_shard < 1 or tp < 1:
        raise ConfigError(f"parallel.dp_shard={dp_shard} and parallel.tp={tp} must be >= 1")
    if args.n_heads % tp or args.n_kv_heads % tp:
        raise ConfigError(
            f"parallel.tp={tp} must divide model.n_heads={args.n_heads} and model.n_kv_heads={args.n_kv_heads}"
        )
    if tp > 1 and isinstance(args, MoEArgs):
        raise ConfigError(f"parallel.tp={tp}: tensor/expert parallelism of a MoE model is not modelled; use tp=1")


# ---- training state -------------------------------------------------------------------------------------


def predict_fp8_scaling_bytes(args: ModelArgs, recipe: Recipe) -> int:
    """Bytes of FP8 scaling buffers per rank (replicated, never sharded).

    lowprec delayed: ``3 roles * (amax_history_len + 1) * 4`` per FP8 linear (exact, see module doc).
    Transformer Engine delayed (approximate, not measured here): ``fp8_meta`` holds per linear 3 forward and
    2 backward tensors, each ``amax_history_len`` history entries plus ``scale`` and ``scale_inv``.
    Current and static scaling keep no state (static scales are recipe constants).
    """
    spec = recipe.fp8
    if not spec.enabled:
        return 0
    n_fp8 = sum(li.kind != "hp" for li in inventory(args, spec).linears.values())
    return fp8_backend(spec.backend).scaling_state_bytes(spec, n_fp8)


@dataclass(frozen=True)
class StateEstimate:
    """Training-state bytes on rank 0 (per GPU), by component, in bytes.

    ``n_params``: all trainable parameters; ``n_local_params``: rank 0's share; ``n_tensors``: parameter
    tensors. ``params``/``grads``/``master``/``optim_states`` are the components of
    ``lowprec.measure.accounting.StateBytes``; ``fp8_scaling_state`` is separate (module buffers).
    """

    n_params: int
    n_local_params: int
    n_tensors: int
    params: int
    grads: int
    master: int
    optim_states: int
    fp8_scaling_state: int
    dp_shard: int = 1
    tp: int = 1
    notes: tuple[str, ...] = ()

    @property
    def model_and_optimizer(self) -> int:
        """``params + grads + master + optim_states`` (what ``StateBytes.total`` measures)."""
        return self.params + self.grads + self.master + self.optim_states

    @property
    def total(self) -> int:
        return self.model_and_optimizer + self.fp8_scaling_state

    @property
    def per_param(self) -> float:
        """Model + optimizer bytes per (local) parameter."""
        return self.model_and_optimizer / self.n_local_params

    def as_state_bytes(self) -> StateBytes:
        """The ``StateBytes`` that ``measure_state_bytes`` should report (single process)."""
        return StateBytes(
            n_params=self.n_local_params,
            params=self.params,
            grads=self.grads,
            master=self.master,
            optim_states=self.optim_states,
        )

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "model_and_optimizer": self.model_and_optimizer,
            "total": self.total,
            "per_param": self.per_param,
        }


def predict_state_bytes(args: ModelArgs, recipe: Recipe, dp_shard: int = 1, tp: int = 1) -> StateEstimate:
    """Predict rank 0's training-state bytes after one optimizer step (rules in the module doc).

    With ``dp_shard == tp == 1`` ``as_state_bytes()`` equals ``measure_state_bytes`` to the byte for every
    catalog recipe that runs on CPU. Raises ``ValueError`` for a bad layout or optimizer implementation.
    """
    check_layout(args, dp_shard, tp)
    inv = inventory(args, recipe.fp8)
    pe = _elt(recipe)
    has_master = recipe.weights.master_dtype == "fp32"
    stepped_pe = 4 if has_master else pe
    kahan = recipe.weights.update_rounding == "kahan"
    n_local = params = optim = 0
    any_8bit = False
    impl = optim_impl(recipe.optim.impl)
    for fqn, shape in inv.params:
        n = fsdp_local_numel(tp_local_shape(fqn, shape, tp), dp_shard)
        n_local += n
        params += n * pe
        optim += impl.state_bytes(n, stepped_pe, recipe.optim.state, kahan)
        any_8bit |= impl.is_quantized(recipe.optim.state, n)
    optim += impl.shared_state_bytes(any_8bit)
    backend = fp8_backend(recipe.fp8.backend)
    n_fp8 = sum(1 for li in inv.linears.values() if li.kind != "hp")
    scales = backend.weight_state_bytes(n_fp8, recipe.comm.weight_all_gather == "fp8" and dp_shard > 1)
    notes = list(backend.estimate_notes())
    return StateEstimate(
        n_params=inv.n_params,
        n_local_params=n_local,
        n_tensors=len(inv.params),
        params=params + scales,
        grads=params,
        master=4 * n_local if has_master else 0,
        optim_states=optim,
        fp8_scaling_state=predict_fp8_scaling_bytes(args, recipe),
        dp_shard=dp_shard,
        tp=tp,
        notes=tuple(notes),
    )


def predict_fsdp_buffers(args: ModelArgs, recipe: Recipe, dp_shard: int, tp: int = 1) -> int:
    """Transient unsharded compute-dtype parameters under FSDP2 (0 when ``dp_shard == 1``): the root's
    parameters plus two blocks' (see module doc). Bytes, rank 0."""
    if dp_shard == 1:
        return 0
    inv = inventory(args, recipe.fp8)
    cs = 4 if recipe.compute_dtype.itemsize == 4 else 2
    local = {fqn: math.prod(tp_local_shape(fqn, s, tp)) for fqn, s in inv.params}
    root = sum(n for fqn, n in local.items() if not fqn.startswith("layers."))
    block = max(
        (sum(n for fqn, n in local.items() if fqn.startswith(f"layers.{i}.")) for i in range(args.n_layers)), default=0
    )
    return cs * (root + min(2, args.n_layers) * block)


# ---- FLOPs, MFU, predicted time -------------------------------------------------------------------------


@dataclass(frozen=True)
class FlopsEstimate:
    """Model FLOPs per token (forward + backward) at sequence length ``seq``.

    ``n_flop_params``: N = the parameters one token's forward uses, except ``tok_embeddings`` (blocks + final
    norm + output; for a DeepSeekMoE model the activated ones: ``top_k`` of the ``n_routed_experts`` routed
    experts of each MoE block, the shared experts and the router gate, ``lowprec.estimate.inventory.param_counts``).
    ``flops_per_token`` = ``6*N + 12*L*dim*seq``; ``fp8_flops_per_token`` = ``6 * n_fp8_params`` (activated
    weights of FP8 linears); ``fp8_fraction`` their share. ``n_total_params``: every parameter but the token
    embedding (equal to ``n_flop_params`` for a dense model).
    """

    seq: int
    n_flop_params: int
    n_fp8_params: int
    flops_per_token: int
    fp8_flops_per_token: int
    n_total_params: int = 0

    @property
    def is_moe(self) -> bool:
        return self.n_total_params != self.n_flop_params

    @property
    def fp8_fraction(self) -> float:
        return self.fp8_flops_per_token / self.flops_per_token

    def to_dict(self) -> dict:
        return {**asdict(self), "fp8_fraction": self.fp8_fraction}


def flops_per_token(args: ModelArgs, seq: int, recipe: Recipe | None = None) -> FlopsEstimate:
    """PaLM appendix-B FLOPs per token (see ``FlopsEstimate``); ``recipe`` only decides the FP8 share.
    Raises ``ValueError`` for ``seq < 1``."""
    if seq < 1:
        raise ConfigError(f"seq={seq} must be >= 1")
    inv = inventory(args, recipe.fp8 if recipe is not None else Float8Spec())
    counts = param_counts(args)
    n = counts.activated - inv.n_embedding
    # a routed expert's weights do FLOPs for top_k / n_routed_experts of the tokens; every expert of a block has
    # one shape, so the sum over a block's experts is top_k experts' worth exactly
    k, e = (args.top_k, args.n_routed_experts) if isinstance(args, MoEArgs) else (1, 1)
    fp8_all = sum(li.numel for li in inv.linears.values() if li.kind != "hp" and not is_routed_expert(li.fqn))
    fp8_exp = sum(li.numel for li in inv.linears.values() if li.kind != "hp" and is_routed_expert(li.fqn))
    n_fp8 = fp8_all + fp8_exp * k // e
    total = 6 * n + 12 * args.n_layers * args.dim * seq
    return FlopsEstimate(
        seq=seq,
        n_flop_params=n,
        n_fp8_params=n_fp8,
        flops_per_token=total,
        fp8_flops_per_token=6 * n_fp8,
        n_total_params=counts.total - inv.n_embedding,
    )


@dataclass(frozen=True)
class Peak:
    """The peak an estimate or MFU is taken against: ``tflops`` (TFLOP/s), ``label`` (e.g. ``bf16`` or
    ``blend(fp8 72%, bf16)``), ``hardware`` name."""

    hardware: str
    label: str
    tflops: float

    def to_dict(self) -> dict:
        return asdict(self)


def peak_for(recipe: Recipe, hardware: Hardware, flops: FlopsEstimate) -> Peak:
    """Peak of the dtypes the recipe's GEMMs run in: the compute dtype's peak (fp32 recipes: the plain FP32
    peak, torch's default without TF32), blended with the FP8 peak for FP8 recipes (module doc).
    Raises ``ValueError`` where the hardware lacks a needed peak (FP8 on A100)."""
    hp_name = {4: "fp32", 2: "bf16"}[recipe.compute_dtype.itemsize]
    hp = hardware.peak_tflops(hp_name)
    f = flops.fp8_fraction if recipe.fp8.enabled else 0.0
    if f == 0.0:
        return Peak(hardware.name, hp_name, hp)
    fp8 = hardware.peak_tflops("fp8")
    return Peak(hardware.name, f"blend(fp8 {100 * f:.0f}%, {hp_name})", 1.0 / (f / fp8 + (1.0 - f) / hp))


@dataclass(frozen=True)
class MfuEstimate:
    """Achieved model TFLOP/s from a measured throughput, and MFU against ``peak`` (``None`` on CPU)."""

    tokens_per_s: float
    achieved_tflops: float
    peak: Peak | None
    mfu: float | None

    def to_dict(self) -> dict:
        return {**asdict(self), "peak": self.peak.to_dict() if self.peak else None}


def mfu(args: ModelArgs, recipe: Recipe, seq: int, tokens_per_s: float, hardware: Hardware | None) -> MfuEstimate:
    """MFU of a run that measured ``tokens_per_s`` (per GPU) at sequence length ``seq``.

    ``hardware=None`` (CPU, or an unknown device) gives ``peak=None, mfu=None``: there is no meaningful peak.
    """
    fl = flops_per_token(args, seq, recipe)
    achieved = fl.flops_per_token * tokens_per_s / 1e12
    if hardware is None:
        return MfuEstimate(tokens_per_s, achieved, None, None)
    pk = peak_for(recipe, hardware, fl)
    return MfuEstimate(tokens_per_s, achieved, pk, achieved / pk.tflops)


@dataclass(frozen=True)
class ThroughputEstimate:
    """Predicted ``step_time_s`` and ``tokens_per_s_per_gpu`` for ``batch`` sequences of ``seq`` tokens per
    data-parallel rank, at ``efficiency`` (MFU) of ``peak``; ``flops_per_step_per_gpu`` in FLOPs."""

    batch: int
    seq: int
    tp: int
    efficiency: float
    peak: Peak
    flops_per_step_per_gpu: float
    step_time_s: float
    tokens_per_s_per_gpu: float

    def to_dict(self) -> dict:
        return {**asdict(self), "peak": self.peak.to_dict()}


def predict_throughput(
    args: ModelArgs,
    recipe: Recipe,
    batch: int,
    seq: int,
    hardware: Hardware,
    efficiency: float = DEFAULT_EFFICIENCY,
    tp: int = 1,
) -> ThroughputEstimate:
    """Step time = FLOPs per step per GPU / (peak * efficiency); communication is not modelled.

    Raises ``ValueError`` for ``efficiency`` outside (0, 1], a bad size, or a peak the hardware lacks.
    """
    if not 0.0 < efficiency <= 1.0:
        raise ConfigError(f"efficiency={efficiency} must be in (0, 1]")
    if batch < 1:
        raise ConfigError(f"batch={batch} must be >= 1")
    fl = flops_per_token(args, seq, recipe)
    pk = peak_for(recipe, hardware, fl)
    flops = fl.flops_per_token * batch * seq / tp
    t = flops / (pk.tflops * 1e12 * efficiency)
    return ThroughputEstimate(batch, seq, tp, efficiency, pk, flops, t, batch * seq / tp / t)


# ---- everything together -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """Per-GPU estimate of one recipe: state, activations by recompute mode, FSDP buffers, totals
    (``totals[mode]`` = state total + ``fsdp_buffers`` + saved activations under ``mode`` +
    ``activations.loss_transient``), FLOPs and predicted throughput (``None`` without hardware or where the
    hardware cannot run the recipe; see ``notes``).

    The totals leave out other backward transients (activation gradients of one block, temporaries),
    gradient reduce-scatter buffers and allocator overhead (fragmentation, the CUDA context): treat them as
    a lower bound on peak memory; ``lowprec.estimate.memory_model`` adds those transients (torchtitan's 77.0 GiB
    reserved for Llama 3 8B on 8 H100s, FSDP2, selective AC, batch 2, seq 8192, is predicted at 78.3 GiB).
    """

    recipe: str
    short: str
    batch: int
    seq: int
    dp_shard: int
    tp: int
    hardware: Hardware | None
    state: StateEstimate
    activations: ActivationEstimate
    fsdp_buffers: int
    flops: FlopsEstimate
    throughput: ThroughputEstimate | None
    notes: tuple[str, ...] = ()
    totals: dict[str, int] = field(default_factory=dict)

    def fits(self, mode: str = "none") -> bool | None:
        """Whether ``totals[mode]`` fits ``hardware.memory_bytes`` (``None`` without hardware)."""
        return None if self.hardware is None else self.totals[mode] <= self.hardware.memory_bytes

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe,
            "short": self.short,
            "batch": self.batch,
            "seq": self.seq,
            "dp_shard": self.dp_shard,
            "tp": self.tp,
            "hardware": self.hardware.to_dict() if self.hardware else None,
            "state": self.state.to_dict(),
            "activations": self.activations.to_dict(),
            "fsdp_buffers": self.fsdp_buffers,
            "totals": dict(self.totals),
            "fits": {m: self.fits(m) for m in RECOMPUTE_MODES},
            "flops": self.flops.to_dict(),
            "throughput": self.throughput.to_dict() if self.throughput else None,
            "notes": list(self.notes),
        }


def estimate(
    args: ModelArgs,
    recipe: Recipe,
    *,
    dp_shard: int = 1,
    tp: int = 1,
    batch: int = 1,
    seq: int | None = None,
    hardware: Hardware | None = None,
    efficiency: float = DEFAULT_EFFICIENCY,
    device_type: str = "cuda",
    compiled_loss: bool = False,
) -> Estimate:
    """Everything for one recipe on rank 0 of the layout. ``seq`` defaults to ``args.max_seq_len``;
    ``compiled_loss``: the loss is ``torch.compile``d (``lowprec.estimate.activations``).

    Raises ``ValueError`` for a bad layout, size or efficiency, ``RecipeError`` for a recipe the backend registry
    refuses (``lowprec.backends.check_recipe``, as training would); a hardware that cannot run the recipe (FP8 on
    A100) leaves ``throughput=None`` with a note instead of raising.
    """
    check_recipe(recipe)
    check_layout(args, dp_shard, tp)
    if not 0.0 < efficiency <= 1.0:
        raise ConfigError(f"efficiency={efficiency} must be in (0, 1]")
    seq = args.max_seq_len if seq is None else seq
    state = predict_state_bytes(args, recipe, dp_shard, tp)
    acts = predict_saved_activations(args, recipe, batch, seq, device_type, dp_shard, tp, compiled_loss)
    fsdp = predict_fsdp_buffers(args, recipe, dp_shard, tp)
    notes = list(state.notes)
    thr = None
    if hardware is not None:
        try:
            thr = predict_throughput(args, recipe, batch, seq, hardware, efficiency, tp)
        except ValueError as e:
            notes.append(str(e))
    totals = {m: state.total + fsdp + acts.recompute[m] + acts.loss_transient for m in RECOMPUTE_MODES}
    return Estimate(
        recipe.name,
        short_str(recipe),
        batch,
        seq,
        dp_shard,
        tp,
        hardware,
        state,
        acts,
        fsdp,
        flops_per_token(args, seq, recipe),
        thr,
        tuple(notes),
        totals,
    )


@dataclass(frozen=True)
class Ranking:
    """``estimate_all``'s result: ``rows`` sorted by ``totals[recompute]`` (ascending), with
    ``rank_memory[name]`` and ``rank_time[name]`` (1 = smallest / fastest; recipes without a predicted
    time rank after the others)."""

    recompute: str
    rows: tuple[Estimate, ...]
    rank_memory: dict[str, int]
    rank_time: dict[str, int]

    def to_dict(self) -> dict:
        return {
            "recompute": self.recompute,
            "rank_memory": dict(self.rank_memory),
            "rank_time": dict(self.rank_time),
            "rows": [r.to_dict() for r in self.rows],
        }


def estimate_all(args: ModelArgs, recipes: Iterable[Recipe], *, recompute: str = "none", **kw) -> Ranking:
    """``estimate`` for every recipe (``kw`` as for ``estimate``), ranked by memory under ``recompute``
    and by predicted step time. Raises ``ValueError`` for an unknown recompute mode."""
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute={recompute!r} is not one of {list(RECOMPUTE_MODES)}")
    return rank_estimates([estimate(args, r, **kw) for r in recipes], recompute)


def rank_estimates(ests: Iterable[Estimate], recompute: str) -> Ranking:
    """The ``Ranking`` of estimates made separately (``estimate``; e.g. each with its own ``compiled_loss``), by
    memory under ``recompute`` (one of ``RECOMPUTE_MODES``) and by predicted step time, as ``estimate_all``."""
    ests = list(ests)
    by_mem = sorted(ests, key=lambda e: e.totals[recompute])
    by_time = sorted(ests, key=lambda e: (e.throughput is None, e.throughput.step_time_s if e.throughput else 0))
    return Ranking(
        recompute,
        tuple(by_mem),
        {e.recipe: i + 1 for i, e in enumerate(by_mem)},
        {e.recipe: i + 1 for i, e in enumerate(by_time)},
    )
