"""Registries of FP8 backends and optimizer implementations: one object per name owns everything lowprec
knows about it, so a recipe's ``fp8.backend`` and ``optim.impl`` strings are looked up here and nowhere else.

The pattern is torchtitan's model-converter registry (``torchtitan/protocols/model_converter.py``:
``register_model_converter(cls, name)``): built-in entries register themselves when ``lowprec.backends``
is imported, and a user (or a test) adds one with ``register_fp8_backend`` / ``register_optim_impl``.

An object answers every question the library asks about its backend: recipe validation (``validate``, asked by
``lowprec.backends.check``),
whether this machine can run it (``check_runtime``, from
``hardware_blocker``, which the estimator asks too), module conversion (``convert``), the forward context
(``precision_context``), hooks after the optimizer step (``register_hooks``), the FP8 fallback
(``fallback_blocker``), sharding (``check_layout``,
``prepare_sharding``, ``finish_sharding``), what the effective-recipe inspection must find
(``module_class``) and what the estimator predicts (``scaling_state_bytes``, ``weight_state_bytes``,
``saved_input``). The estimator and the effective-recipe check ask the same object the run was built
from, so prediction and run cannot drift apart.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from lowprec.errors import RecipeError

if TYPE_CHECKING:  # type hints only
    import torch
    from torch import nn

    from lowprec.parallel.dims import ParallelDims
    from lowprec.recipe import CommSpec, Float8Spec


class Float8Backend(ABC):
    """An FP8 implementation for the linears a recipe selects. Subclass it, set the class attributes and
    override what differs from the defaults (which do nothing), then ``register_fp8_backend(obj)``.

    Attributes: ``name`` (the value of ``recipe.fp8.backend``), ``scalings`` (the ``recipe.fp8.scaling``
    values it implements), ``enabled`` (False only for ``none``), ``module_class`` (qualified class name
    of its FP8 linear, which the effective-recipe check counts), ``format_in_name`` (whether
    ``fp8_format`` is a free choice and belongs in ``short_str``), ``block_fields`` (the block-scaling fields of
    ``Float8Spec`` it implements: ``mx_scale_mode``, ``rht_size``, ...; the recipe refuses them elsewhere),
    ``fused_casts`` (``None``: its casts are not lowprec's to fuse; ``fp8``: lowprec's FP8 casts,
    ``lowprec.kernels.fused_casts``; ``block_scaled``: the MX/NVFP4 casts, ``lowprec.kernels.fused_mx_casts``).
    """

    name: str = ""
    scalings: tuple[str, ...] = ()
    enabled: bool = True
    module_class: str = ""
    format_in_name: bool = True
    block_fields: tuple[str, ...] = ()
    fused_casts: str | None = None

    # ---- recipe -------------------------------------------------------------------------------------
    def validate(self, spec: Float8Spec) -> None:
        """Refuse a ``Float8Spec`` this backend cannot honour (``RecipeError`` naming the field)."""
        if spec.scaling not in self.scalings:
            raise RecipeError(
                f"recipe.fp8.scaling={spec.scaling!r} is not one of {list(self.scalings)} "
                f"(recipe.fp8.backend={self.name!r})"
            )

    def supports_fp8_weight_all_gather(self, spec: Float8Spec) -> bool:
        """Whether ``comm.weight_all_gather='fp8'`` can move this backend's weights in FP8."""
        return False

    # ---- build ----------------------------------------------------------------------------------------
    def hardware_blocker(self, spec: Float8Spec, capability: tuple[int, int]) -> str | None:
        """Why a GPU of compute capability ``capability`` (``torch.cuda.get_device_capability``: ``(9, 0)`` for an
        H100, ``(10, 0)`` for a B200, ``(9, 4)`` for an MI300X under ROCm) cannot run ``spec`` with this backend, or
        ``None`` when it can. The one hardware rule: training asks it through ``check_runtime`` with the device's
        capability, ``lowprec estimate`` / ``lowprec recommend`` with the planned part's
        (``lowprec.estimate.runnable``), so a plan never times a recipe the run would refuse. The default: an FP8
        backend needs FP8 tensor cores, compute capability 8.9 or higher (``torch._scaled_mm``'s requirement:
        Ada, Hopper, Blackwell; MI300 on ROCm)."""
        if self.enabled and tuple(capability) < (8, 9):
            return (
                f"recipe.fp8.backend={self.name!r} runs FP8 GEMMs, which need FP8 tensor cores (compute capability "
                f"8.9+: Ada, Hopper, Blackwell, MI300); SM{capability[0]}{capability[1]} has no FP8 tensor cores"
            )
        return None

    def check_runtime(self, spec: Float8Spec, device: torch.device) -> None:
        """Raise ``RecipeError`` before anything is built if this machine cannot run the spec as asked. The default:
        on a CUDA device, ``hardware_blocker`` with the device's compute capability (nothing on CPU, where every
        backend but ``te`` emulates)."""
        if device.type != "cuda":
            return
        import torch

        why = self.hardware_blocker(spec, torch.cuda.get_device_capability(device))
        if why is not None:
            raise RecipeError(why)

    def check_shapes(self, spec: Float8Spec, shapes: dict[str, tuple[int, int]], tokens: int) -> None:
        """Refuse (``RecipeError``) GEMM shapes the backend cannot take: ``shapes`` maps each selected linear's FQN to
        ``(in_features, out_features)``, ``tokens`` is a step's batch_size x seq_len (e.g. block-scaled GEMMs whose
        contraction dims the blocks must divide)."""

    def compile_blocker(self, spec: Float8Spec, telemetry_every: int, device_type: str = "cpu") -> str | None:
        """Why this backend's linears cannot run inside a ``torch.compile``d block (``train.compile``) on a
        ``device_type`` (``cpu`` / ``cuda``) device with FP8 telemetry sampled every ``telemetry_every`` steps, or
        ``None`` when they can."""
        return None

    def fallback_blocker(self, spec: Float8Spec, comm: CommSpec) -> str | None:
        """Why ``train.fp8_fallback=layer`` cannot watch this backend's linears and switch one to high precision
        during a run (``lowprec.train.fp8_fallback``), or ``None`` when it can. The fallback decides from lowprec's
        per-layer FP8 telemetry (overflow and underflow shares), so by default it cannot."""
        return (
            f"recipe.fp8.backend={self.name!r} records no per-layer FP8 overflow/underflow share (lowprec's FP8 "
            "telemetry) and has no switch back to high precision; use backend=lowprec or train.fp8_fallback=off"
        )

    @abstractmethod
    def convert(
        self, model: nn.Module, spec: Float8Spec, fqns: list[str], fp8_weight_all_gather: bool, fp8_kernel: str
    ) -> None:
        """Swap the linears at ``fqns`` (already selected by ``Float8Spec.selects_linear``) in place, on the
        meta device. ``fp8_weight_all_gather``: the run gathers weights in FP8 under FSDP2. ``fp8_kernel``:
        ``native`` or ``emulated`` (``lowprec.kernels``: the run's scaled matmuls as exact FP32 arithmetic);
        a backend that cannot emulate raises ``RecipeError`` for ``emulated``."""

    def precision_context(self, spec: Float8Spec) -> Callable[[], AbstractContextManager] | None:
        """A factory of the context the forward runs in (Transformer Engine's ``fp8_autocast``), or None."""
        return None

    def register_hooks(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, fp8_weight_all_gather: bool
    ) -> list[str]:
        """Install post-optimizer-step hooks (build step 6); returns a description of each."""
        return []

    def register_schedule(self, model: nn.Module, optimizer: torch.optim.Optimizer, spec: Float8Spec, total_steps: int):
        """Install what depends on the run's length (``total_steps`` optimizer steps), e.g. a switch to high
        precision for the last part of training; returns a description of each."""
        return []

    # ---- sharding -------------------------------------------------------------------------------------
    def check_layout(self, spec: Float8Spec, comm: CommSpec, dims: ParallelDims) -> None:
        """Refuse (``RecipeError``) a layout this backend cannot shard as the recipe asks; no model needed."""

    def prepare_sharding(
        self, model: nn.Module, spec: Float8Spec, comm: CommSpec, dims: ParallelDims
    ) -> dict[str, str]:
        """Before TP/FSDP (on meta): wrap or check weights; returns mechanisms for the effective recipe."""
        return {}

    def after_tensor_parallel(self, model: nn.Module, world_group: Any) -> dict[str, str]:
        """After TP, before FSDP: e.g. make delayed-scaling amaxes reduce over ``world_group``."""
        return {}

    def finish_sharding(self, model: nn.Module, spec: Float8Spec, comm: CommSpec, dims: ParallelDims) -> dict[str, str]:
        """After ``fully_shard``: communication hooks; returns mechanisms for the effective recipe."""
        return {}

    def kernel_of(self, module: nn.Module) -> str:
        """``native`` or ``emulated``: how this backend's converted ``module`` runs its scaled matmuls (read
        from the module, for the effective recipe)."""
        return "native"

    def needs_blockwise_gemm(self, spec: Float8Spec) -> bool:
        """True when ``spec``'s linears issue blockwise (1x128/128x128) FP8 GEMMs through
        ``lowprec.float8.gemm``, whose kernel the build chooses (``lowprec.kernels.blockwise``)."""
        return False

    def blockwise_gemm_of(self, module: nn.Module) -> str | None:
        """The blockwise GEMM kernel a converted ``module`` runs (``lowprec.kernels.blockwise.BLOCKWISE_GEMMS``),
        or ``None`` when it has no blockwise GEMM (read from the module, for the effective recipe)."""
        return None

    # ---- estimator ------------------------------------------------------------------------------------
    def scaling_state_bytes(self, spec: Float8Spec, n_fp8_linears: int) -> int:
        """Bytes of FP8 scaling buffers (amax histories, scales) per rank for ``n_fp8_linears`` linears."""
        return 0

    def weight_state_bytes(self, n_fp8_linears: int, fp8_weight_all_gather: bool) -> int:
        """Extra bytes held inside the parameters (e.g. precomputed scales for FP8 all-gather) per rank."""
        return 0

    def saved_input(self, spec: Float8Spec, rows: int, in_features: int, device_type: str) -> tuple[str, int]:
        """What one FP8 linear saves of its input for backward, as the estimator counts it:
        ``("cast", 0)`` the input after the autocast cast, ``("raw", 0)`` the input as it arrives, or
        ``("own", nbytes)`` a tensor of its own (an FP8 copy and its scales)."""
        return ("cast", 0)

    def estimate_notes(self) -> tuple[str, ...]:
        """Caveats the estimator prints for this backend (e.g. figures never measured)."""
        return ()


class OptimizerImpl(ABC):
    """An AdamW implementation. Attributes: ``name`` (``recipe.optim.impl``), ``states`` (the
    ``recipe.optim.state`` values it provides), ``roundings`` (the ``weights.update_rounding`` values it
    implements), ``description`` (what it is, for error messages)."""

    name: str = ""
    states: tuple[str, ...] = ()
    roundings: tuple[str, ...] = ("nearest",)
    description: str = ""

    @abstractmethod
    def build(
        self,
        groups: list[dict],
        *,
        state: str,
        stepped_dtype: str,
        update_rounding: str,
        hparams: dict[str, Any],
        sharded: bool,
    ) -> torch.optim.Optimizer:
        """The optimizer over ``groups`` (torch param groups). ``stepped_dtype``: ``fp32``/``bf16``, the
        dtype of the tensors it steps; ``hparams``: ``lr``, ``betas``, ``eps``; ``sharded``: parameters
        are DTensors (FSDP2/TP)."""

    def is_quantized(self, state: str, numel: int) -> bool:
        """Whether a tensor of ``numel`` elements keeps its moments in the low-bit ``state`` form."""
        return False

    @abstractmethod
    def state_bytes(self, numel: int, stepped_bytes: int, state: str, kahan: bool) -> int:
        """Optimizer-state bytes of one (local) tensor of ``numel`` elements whose stepped copy has
        ``stepped_bytes`` per element (4 under an FP32 master)."""

    def shared_state_bytes(self, any_quantized: bool) -> int:
        """Bytes shared by all tensors (e.g. bitsandbytes' two quantization maps)."""
        return 0


_FP8: dict[str, Float8Backend] = {}
_OPTIM: dict[str, OptimizerImpl] = {}


def register_fp8_backend(backend: Float8Backend) -> Float8Backend:
    """Add (or replace) ``backend`` under ``backend.name``; returns it. Raises ``ValueError`` for a nameless
    backend, and for one whose ``enabled`` disagrees with its name: ``none`` is the recipe's own "no FP8" value
    (``Float8Spec.enabled`` reads the name, not this registry), so it alone is disabled."""
    if not backend.name:
        raise ValueError("an FP8 backend needs a name")
    if backend.enabled != (backend.name != "none"):
        raise ValueError(
            f"FP8 backend {backend.name!r} has enabled={backend.enabled}: only 'none' (the recipe's no-FP8 value) "
            "is disabled"
        )
    _FP8[backend.name] = backend
    return backend


def register_optim_impl(impl: OptimizerImpl) -> OptimizerImpl:
    """Add (or replace) ``impl`` under ``impl.name``; returns it."""
    if not impl.name:
        raise ValueError("an optimizer implementation needs a name")
    _OPTIM[impl.name] = impl
    return impl


def fp8_backend(name: str) -> Float8Backend:
    """The FP8 backend registered as ``name``; ``RecipeError`` listing the registered names otherwise."""
    try:
        return _FP8[name]
    except KeyError:
        raise RecipeError(f"recipe.fp8.backend={name!r} is not one of {sorted(_FP8)}") from None


def optim_impl(name: str) -> OptimizerImpl:
    """The optimizer implementation registered as ``name``; ``RecipeError`` listing the names otherwise."""
    try:
        return _OPTIM[name]
    except KeyError:
        raise RecipeError(f"recipe.optim.impl={name!r} is not one of {sorted(_OPTIM)}") from None


def fp8_backends() -> dict[str, Float8Backend]:
    return dict(_FP8)


def optim_impls() -> dict[str, OptimizerImpl]:
    return dict(_OPTIM)
