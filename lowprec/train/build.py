"""Build step: turn (recipe, model shape, hyper-parameters) into the objects the loop runs.

Named builders in a fixed order (docs/architecture.md, "Build order"): 1 model on meta, 2 converters,
3 parallelize (TP, FSDP2,
communication hooks; ``lowprec.parallel``), 4 ``to_empty`` + ``init_weights``, 5 optimizer, 6
post-optimizer hooks, 7 effective recipe (inspected after the first step by ``lowprec.train.effective``).
The mixed-precision mechanism is chosen here and only here (``choose_precision``): FSDP2's
``MixedPrecisionPolicy`` when parameters are sharded, ``torch.autocast`` otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from lowprec.backends import check_recipe, fp8_backend
from lowprec.build_optim import OptimHParams, build_optimizer
from lowprec.build_parallel import ParallelPlan, check_layout, mixed_precision_policy, parallelize
from lowprec.convert import convert_fp8, convert_kernels, fp8_candidate_fqns
from lowprec.errors import ConfigError
from lowprec.float8 import Float8Linear
from lowprec.float8.mx_linear import MXLinear
from lowprec.kernels import KernelPolicy, resolve_kernels
from lowprec.measure.block_telemetry import BlockScaleTelemetry
from lowprec.measure.telemetry import FP8Telemetry
from lowprec.model import ModelArgs, Transformer, build_model
from lowprec.numerics.reorder import ReversedReductionOrder
from lowprec.optim.loss_scale import DynamicLossScaler, NoLossScaler, grad_underflow_share
from lowprec.optim.state_telemetry import OptimStateTelemetry, default_sample
from lowprec.parallel.comm_metrics import StepCommMetrics
from lowprec.parallel.dims import ParallelDims, dp_coordinate
from lowprec.parallel.runtime import DistContext
from lowprec.recipe import DTYPES, Recipe, RecipeError
from lowprec.train.ac import apply_ac
from lowprec.train.compile import apply_compile, build_z_loss, compile_loss, cross_entropy_fp32
from lowprec.train.moe_balance import ExpertBalance, check_moe_layout
from lowprec.train.schedule import build_scheduler
from lowprec.train.spec import TrainSpec


@dataclass
class Built:
    """Everything a run needs; the loop reads only these objects, never the recipe's fields."""

    recipe: Recipe
    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Callable[[], AbstractContextManager]
    device: torch.device
    fp8_fqns: list[str] = field(default_factory=list)
    master_params: list[torch.Tensor] = field(default_factory=list)
    loss_scaler: DynamicLossScaler = field(default_factory=NoLossScaler)
    #: Called before / after every optimizer step (telemetry); ``after`` hooks return metrics to log.
    before_step: list[Callable[[int, Built], None]] = field(default_factory=list)
    after_step: list[Callable[[int, Built], dict]] = field(default_factory=list)
    #: Batch slicing, metric averaging and clipping for this process's place in the layout.
    dist: DistContext = field(default_factory=DistContext)
    #: ``lowprec.build_parallel.ParallelPlan`` when the model is sharded, else ``None``.
    parallel: ParallelPlan | None = None
    #: ``lowprec.parallel.comm_metrics.StepCommMetrics`` when sharded (meters sampled steps), else ``None``.
    comm_metrics: StepCommMetrics | None = None
    #: Which kernels run the low-precision GEMMs and attention (``cpu_kernels`` resolved for this device).
    kernels: KernelPolicy = field(default_factory=KernelPolicy)
    #: ``train.ac`` and ``train.compile`` as built (every block checkpointed / compiled accordingly).
    ac: str = "none"
    compiled: bool = False
    #: ``(logits (B, S, V), targets (B, S) int64) -> 0-dim FP32 mean cross-entropy``; compiled under
    #: ``train.compile`` (torchtitan compiles the loss apart from the blocks).
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_fp32
    #: ``train.z_loss`` > 0: ``logits (B, S, V) -> 0-dim FP32`` weighted z-loss term the training step adds to its
    #: objective (``lowprec.train.compile.build_z_loss``, compiled under ``train.compile``); ``None``: off.
    z_loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    #: The model's auxiliary loss of its last training forward, added to the objective (0-dim FP32), or
    #: ``None``: the MoE sequence-wise balance loss (``MoETransformer.aux_loss``); always ``None`` for Llama.
    aux_loss: Callable[[], torch.Tensor | None] = lambda: None
    #: ``recipe.compute.reduction_order=reversed``: the dispatch mode that reverses every FP32 matmul's contraction
    #: in the training step (it counts the matmuls it reversed: ``lowprec.train.effective``); ``None``: natural.
    reduction_order: ReversedReductionOrder | None = None

    @contextlib.contextmanager
    def step_context(self, step: int) -> Iterator[None]:
        """Context around forward, backward and clipping of one optimizer step: the communication meter on
        sampled steps when sharded, the reversed FP32 reduction order when the recipe asks for it."""
        with contextlib.ExitStack() as stack:
            if self.comm_metrics is not None:
                stack.enter_context(self.comm_metrics.context(step))
            if self.reduction_order is not None:
                stack.enter_context(self.reduction_order)
            yield


def _apply_fused_casts(model: nn.Module, train: TrainSpec, device: torch.device, kernels: KernelPolicy) -> KernelPolicy:
    """``train.fused_casts`` resolved and set on every lowprec ``Float8Linear`` and block-scaled ``MXLinear``;
    recorded in the kernel policy (run tags, effective recipe). Raises ``ConfigError`` for ``on`` where the casts
    cannot compile (the probe of each kind of cast the model has)."""
    from lowprec.kernels.fused_casts import resolve_fused_casts

    linears = [m for m in model.modules() if isinstance(m, Float8Linear | MXLinear)]
    if not linears:
        return kernels
    kinds = sorted({isinstance(m, MXLinear) for m in linears})  # False: FP8 casts, True: block-scaled casts
    states = [resolve_fused_casts(train.fused_casts, device, train.compile, block_scaled=k) for k in kinds]
    state = next((s for s in states if s != "on"), "on")
    for m in linears:
        m.fused_casts = state == "on"
    return dataclasses.replace(kernels, fused_casts=state)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; raises ``ConfigError`` for an unknown or unavailable device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device={name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} requested but CUDA is not available; use device=cpu")
    return dev


def build_model_meta(args: ModelArgs) -> Transformer:
    """The model of ``args`` (``lowprec.model.build_model``: Llama or DeepSeekMoE) on the meta device."""
    with torch.device("meta"):
        return build_model(args)


def materialize(model: Transformer, device: torch.device, seed: int) -> None:
    """Allocate on ``device`` and initialise with a generator seeded by ``seed`` (same seed, same weights).

    Modules with state buffers (FP8 amax histories, RHT sign vectors) define ``init_buffers(generator)``, called
    here with the seeded generator (after the weights drew from it) because ``to_empty`` leaves buffers
    uninitialised.
    """
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        model.init_weights(generator=gen)
        for m in model.modules():
            if hasattr(m, "init_buffers"):
                m.init_buffers(gen)


def check_runtime(recipe: Recipe, device: torch.device) -> None:
    """Refuse, before anything is built, a recipe that cannot run as asked (no silent fallback): the backend
    registry's checks of the recipe (``lowprec.backends.check_recipe``; a ``Recipe`` is a pure value and has not
    met them before), then whether this machine can run it (``Float8Backend.check_runtime``). Preflight and
    ``build`` call it first. Raises ``RecipeError``."""
    check_recipe(recipe)
    fp8_backend(recipe.fp8.backend).check_runtime(recipe.fp8, device)


def check_fp8_shapes(recipe: Recipe, model: nn.Module, train: TrainSpec) -> None:
    """Refuse, before anything is built, GEMM shapes the FP8 backend cannot take (``Float8Backend.check_shapes``:
    e.g. block sizes that do not divide a selected linear's features or a step's tokens). ``model`` may be on
    the meta device. Raises ``RecipeError``."""
    modules = dict(model.named_modules())
    shapes = {f: (modules[f].in_features, modules[f].out_features) for f in fp8_candidate_fqns(model, recipe.fp8)}
    fp8_backend(recipe.fp8.backend).check_shapes(recipe.fp8, shapes, train.batch_size * train.seq_len)


def compile_blocker(recipe: Recipe, telemetry_every: int, device_type: str = "cpu") -> str | None:
    """Why ``recipe`` cannot be compiled on ``device_type`` (``None`` when it can): the reversed FP32 reduction order
    (a Python dispatch mode, which dynamo does not trace), else ``Float8Backend.compile_blocker``."""
    if recipe.compute.reduction_order == "reversed":
        return "recipe.compute.reduction_order='reversed' is a dispatch mode that torch.compile does not trace"
    return fp8_backend(recipe.fp8.backend).compile_blocker(recipe.fp8, telemetry_every, device_type)


def check_compile(recipe: Recipe, train: TrainSpec, device: torch.device | None = None) -> None:
    """With ``train.compile``, refuse before training a recipe whose blocks cannot be compiled whole on ``device``
    (default CPU; no silent fallback to eager): ``compile_blocker``. Raises ``RecipeError`` naming the part."""
    if not train.compile:
        return
    dev = "cpu" if device is None else device.type
    reason = compile_blocker(recipe, train.telemetry_every, dev)
    if reason:
        raise RecipeError(f"train.compile=true cannot compile recipe {recipe.name!r}: {reason}")


def check_fp8_fallback(recipe: Recipe, train: TrainSpec) -> None:
    """With ``train.fp8_fallback=layer``, refuse before training a recipe whose FP8 linears the fallback cannot
    watch or switch (``Float8Backend.fallback_blocker``), and ``train.compile`` with FP8 linears (the fallback reads
    FP8 telemetry, which compiled FP8 blocks do not record, and a switched layer would change the compiled graph).
    Raises ``RecipeError`` / ``ConfigError`` naming the reason."""
    if train.fp8_fallback == "off" or not recipe.fp8.enabled:
        return
    if train.compile:
        raise ConfigError(
            f"train.fp8_fallback=layer cannot run with train.compile=true (recipe {recipe.name!r}): it decides from "
            "FP8 telemetry, which compiled FP8 blocks do not record, and switching a layer would change the compiled "
            "graph; set train.compile=false or train.fp8_fallback=off"
        )
    reason = fp8_backend(recipe.fp8.backend).fallback_blocker(recipe.fp8, recipe.comm)
    if reason:
        raise RecipeError(f"train.fp8_fallback=layer cannot run recipe {recipe.name!r}: {reason}")


def cast_weights(model: Transformer, recipe: Recipe) -> None:
    """Store parameters in ``recipe.weights.param_dtype`` (initialised in FP32 first, then rounded)."""
    if recipe.param_dtype != torch.float32:
        model.to(dtype=recipe.param_dtype)


def choose_precision(recipe: Recipe, device: torch.device, dims: ParallelDims):
    """The mixed-precision mechanism: ``(context factory, MixedPrecisionPolicy | None)``.

    Sharded data parallel (FSDP2/HSDP): the policy gathers parameters in the compute dtype and reduces
    gradients in ``recipe.comm.grad_reduce``; no autocast. Otherwise ``torch.autocast`` in the recipe's
    dtype, and no policy (torchtitan makes the same choice).
    """
    if dims.dp > 1:
        return build_precision_context(recipe, device, autocast=False), mixed_precision_policy(recipe)
    return build_precision_context(recipe, device), None


def build_precision_context(
    recipe: Recipe, device: torch.device, autocast: bool = True
) -> Callable[[], AbstractContextManager]:
    """A factory of the forward-pass context: ``torch.autocast`` in the recipe's dtype (or nothing), plus
    Transformer Engine's ``fp8_autocast`` for ``te`` recipes."""
    contexts: list[Callable[[], AbstractContextManager]] = []
    if autocast and recipe.compute.autocast_dtype != "none":
        dtype = DTYPES[recipe.compute.autocast_dtype]
        contexts.append(lambda: torch.autocast(device_type=device.type, dtype=dtype))
    backend_context = fp8_backend(recipe.fp8.backend).precision_context(recipe.fp8)
    if backend_context is not None:
        contexts.append(backend_context)
    if not contexts:
        return contextlib.nullcontext
    if len(contexts) == 1:
        return contexts[0]

    @contextlib.contextmanager
    def combined():
        with contextlib.ExitStack() as stack:
            for c in contexts:
                stack.enter_context(c())
            yield

    return combined


def build_telemetry(model: nn.Module, every: int):
    """An ``FP8Telemetry`` over the model's lowprec FP8 linears, or ``None`` when there are none or
    ``every`` <= 0."""
    if every <= 0 or not any(isinstance(m, Float8Linear) for m in model.modules()):
        return None
    return FP8Telemetry(model, every)


def build_block_telemetry(model: nn.Module, every: int):
    """A ``BlockScaleTelemetry`` over the model's block-scaled linears, or ``None`` when there are none or
    ``every`` <= 0."""
    if every <= 0 or not any(isinstance(m, MXLinear) for m in model.modules()):
        return None
    return BlockScaleTelemetry(model, every)


def materialize_sharded(model: nn.Module, args: ModelArgs, recipe: Recipe, device: torch.device, seed: int) -> None:
    """Step 4 for a sharded model: the same weights as one process with the same seed, whatever the layout.

    A full replica is initialised exactly as ``materialize`` + ``cast_weights`` do on one process, and
    each rank copies its shards out of it (``set_model_state_dict`` with ``full_state_dict=True``, the
    DCP way to load full weights into DTensors). This costs one full model per rank at build time.
    """
    ref = build_model_meta(args)
    convert_fp8(ref, recipe.fp8)
    materialize(ref, device, seed)
    cast_weights(ref, recipe)
    model.to_empty(device=device)
    set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True, strict=True))
    del ref


def build(
    recipe: Recipe,
    args: ModelArgs,
    train: TrainSpec,
    hp: OptimHParams,
    seed: int,
    device: torch.device,
    parallel: ParallelDims | None = None,
    cpu_kernels: str = "auto",
) -> Built:
    """Run the build steps in order. Raises ``ValueError``/``RuntimeError``/``ImportError`` before training
    if the recipe cannot run as asked (no silent fallback). ``parallel`` (world size > 1) needs an
    initialised process group whose size is its world size. ``cpu_kernels``: ``auto`` | ``native`` |
    ``emulated`` (``lowprec.kernels.policy``; ignored on CUDA, which never emulates)."""
    check_runtime(recipe, device)
    check_fp8_fallback(recipe, train)
    check_compile(recipe, train, device)
    dims = parallel or ParallelDims()
    check_moe_layout(args, dims, train)
    kernels = resolve_kernels(cpu_kernels, device, fp8_backend(recipe.fp8.backend).needs_blockwise_gemm(recipe.fp8))
    if dist.is_available() and dist.is_initialized():
        # One decision for every rank (rank 0's probe): ranks that timed the kernels differently must not run
        # different kernels on the shards of one model.
        box = [kernels]
        dist.broadcast_object_list(box, src=0)
        kernels = box[0]

    check_layout(recipe, dims)
    model = build_model_meta(args)  # 1
    check_fp8_shapes(recipe, model, train)
    # FP8 weight all-gather: some backends choose it at conversion (torchao's weight wrapper) and need a hook
    # after each optimizer step (step 6).
    fp8_gather = dims.fsdp and recipe.comm.weight_all_gather == "fp8"
    fp8_fqns = convert_fp8(model, recipe.fp8, fp8_weight_all_gather=fp8_gather, fp8_kernel=kernels.fp8)  # 2
    convert_kernels(model, kernels)
    kernels = _apply_fused_casts(model, train, device, kernels)
    apply_ac(model, train.ac)  # activation checkpointing per block, before sharding (torchtitan's order)
    if train.compile:
        apply_compile(model)  # after AC, before sharding (torchtitan's order)
    precision, mp_policy = choose_precision(recipe, device, dims)
    plan, dctx = None, DistContext()
    if dims.enabled:  # 3
        dims.check(batch_size=train.batch_size, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads)
        mesh = dims.build_mesh(device.type)
        cast_weights(model, recipe)
        plan = parallelize(model, recipe, dims, mesh, mp_policy)
        materialize_sharded(model, args, recipe, device, seed)  # 4
        dctx = DistContext(*dp_coordinate(mesh))
    else:
        materialize(model, device, seed)  # 4
        cast_weights(model, recipe)
    # The process-global RNGs feed stochastic rounding (torchao's bf16_stochastic_round, lowprec's SR). torch
    # seeds them randomly per process, so without this a run's losses would change from one process to the
    # next and with whatever earlier runs of an ablation consumed; checkpoints save and restore them.
    torch.manual_seed(seed)
    optimizer = build_optimizer(model, recipe, hp)  # 5
    scheduler = build_scheduler(optimizer, train.warmup_steps, train.steps, train.min_lr_ratio)
    fp8_backend(recipe.fp8.backend).register_hooks(model, optimizer, fp8_gather)  # 6
    fp8_backend(recipe.fp8.backend).register_schedule(model, optimizer, recipe.fp8, train.steps)
    telemetry = build_telemetry(model, train.telemetry_every)
    block_telemetry = build_block_telemetry(model, train.telemetry_every)
    scaler = build_loss_scaler(recipe)
    after = [t.after_step for t in (telemetry, block_telemetry) if t]
    if scaler.enabled:
        after.append(lambda step, built: built.loss_scaler.metrics())
    state_tel = build_state_telemetry(model, optimizer, recipe, train.telemetry_every)
    if state_tel is not None:
        after.append(state_tel.after_step)
    if recipe.compute.autocast_dtype == "fp16" and train.telemetry_every > 0:
        after.append(underflow_probe(model, train.telemetry_every))
    before = [t.before_step for t in (telemetry, block_telemetry) if t]
    balance = ExpertBalance.of(model, train.telemetry_every)
    if balance is not None:  # MoE: the load-balancing bias update and the expert-load metrics
        before.append(balance.before_step)
        after.append(balance.after_step)
    comm_metrics = None
    if plan is not None:
        comm_metrics = StepCommMetrics(train.telemetry_every)
        after.append(comm_metrics.after_step)
    return Built(
        recipe=recipe,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        precision=precision,
        device=device,
        fp8_fqns=fp8_fqns,
        master_params=list(getattr(optimizer, "master_params", [])),
        loss_scaler=scaler,
        before_step=before,
        after_step=after,
        dist=dctx,
        parallel=plan,
        comm_metrics=comm_metrics,
        kernels=kernels,
        ac=train.ac,
        compiled=train.compile,
        loss_fn=compile_loss(cross_entropy_fp32) if train.compile else cross_entropy_fp32,
        z_loss_fn=build_z_loss(train.z_loss, train.compile),
        aux_loss=getattr(model, "aux_loss", lambda: None),
        reduction_order=ReversedReductionOrder(DTYPES.get(recipe.compute.autocast_dtype))
        if recipe.compute.reduction_order == "reversed"
        else None,
    )


def build_loss_scaler(recipe: Recipe):
    """``DynamicLossScaler`` for ``compute.loss_scaling=dynamic``, else a ``NoLossScaler`` with the same API."""
    c = recipe.compute
    if c.loss_scaling == "dynamic":
        return DynamicLossScaler(init_scale=c.init_scale, growth_interval=c.growth_interval)
    return NoLossScaler()


def underflow_probe(model: nn.Module, every: int):
    """Every ``every`` steps, ``grad_underflow_share``: the share of gradient elements that are exactly
    zero, over every parameter but ``tok_embeddings`` (whose rows of unseen tokens are zero by nature)."""
    params = [p for n, p in model.named_parameters() if not n.startswith("tok_embeddings")]
    return lambda step, built: {"grad_underflow_share": grad_underflow_share(params)} if step % every == 0 else {}


def build_state_telemetry(model: nn.Module, optimizer: torch.optim.Optimizer, recipe: Recipe, every: int):
    """Relative error of quantized/low-precision AdamW moments against an FP32 shadow on a few sampled
    tensors, every ``every`` steps; ``None`` for FP32 moments or ``every`` <= 0."""
    full = recipe.optim.state in ("param", "fp32") and (
        recipe.param_dtype == torch.float32 or recipe.weights.master_dtype == "fp32"
    )
    if every <= 0 or full:
        return None
    return OptimStateTelemetry(optimizer, default_sample(model), every)
