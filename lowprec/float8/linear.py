"""lowprec's FP8 linear: three FP8 GEMMs with a format and a scaling per operand role.

``output = input @ weight.T``, ``grad_input = grad_output @ weight``, ``grad_weight = grad_output.T @ input``
(torchao's naming; ``torchao/float8/float8_linear.py``'s ``matmul_with_hp_or_float8_args`` is the model).
Each GEMM quantizes its operands along its own contraction dimension: rowwise/tile scales of ``input`` run
along features in the forward GEMM and along tokens in the weight-gradient GEMM. Tensorwise and 128x128
block operands are transposed without requantizing; others are requantized (from the FP8 cache when
activation caching is on, as DeepSeek-V3 and Transformer Engine do).

Under autocast the input is cast to the autocast dtype (the output takes it too); the weight is quantized
directly from the stored (master) parameter. Weight gradients are accumulated in FP32 and returned in the
parameter's dtype.

``fallback_kernel`` (set by the FP8 fallback, ``lowprec.train.fp8_fallback``) makes the linear run as a plain
high-precision linear from then on: ``F.linear`` in the compute dtype (autocast's, else the input's), or its exact
emulation (``lowprec.kernels.emulated_linear``) when the run emulates its BF16 GEMMs; same parameters, same FQN.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard

from lowprec.float8.config import ROLES, LinearFP8Config
from lowprec.float8.gemm import fp8_gemm
from lowprec.kernels import recompute
from lowprec.kernels.emulated import emulated_linear
from lowprec.kernels.fused_casts import fused_quantize_operand
from lowprec.numerics.e5m6 import e5m6_tiles
from lowprec.numerics.scaling import DelayedScaler, QTensor, compute_amax, quantize_operand

_TRANSPOSABLE = ("tensorwise", "block128x128")


class Float8Linear(nn.Linear):
    """``nn.Linear`` whose GEMMs run in FP8 as ``config`` says.

    Shapes: input (..., in_features) -> output (..., out_features). Buffers: one ``DelayedScaler`` per
    role whose strategy is ``delayed`` (under ``scalers.<role>``), so amax histories are checkpointed.
    ``telemetry`` (``None`` or an object with ``observe(module, role, ...)``) is set by
    ``lowprec.measure.telemetry`` on sampled steps.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool, config: LinearFP8Config, device=None, dtype=None
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fp8_config = config
        self.scalers = nn.ModuleDict(
            {
                role: DelayedScaler(
                    config.role(role).fmt,
                    config.cast.amax_history_len,
                    config.cast.amax_compute_algo,
                    config.cast.margin,
                    config.cast.power_of_2_scales,
                )
                for role in ROLES
                if config.role(role).strategy == "delayed"
            }
        )
        self.telemetry = None
        #: Process group over which delayed-scaling amaxes are max-reduced (set when the model is sharded).
        self.amax_group = None
        #: ``native`` | ``emulated``: how the scaled matmuls run (``lowprec.kernels``; set at build from the
        #: run's ``cpu_kernels``; never changes the numerics beyond FP32 accumulation order).
        self.fp8_kernel = "native"
        #: The kernel of tile/block GEMMs (``lowprec.kernels.blockwise.BLOCKWISE_GEMMS``; set at build from the
        #: run's ``KernelPolicy.blockwise``; ``None``: chosen for the operands' device at the first call).
        self.blockwise_gemm: str | None = None
        #: None: the GEMMs run in FP8. ``native`` | ``emulated``: switched to high precision by the FP8 fallback,
        #: with that kernel for the high-precision GEMM (the run's ``cpu_kernels`` BF16 choice).
        self.fallback_kernel: str | None = None
        #: Current-scaling casts run as one compiled kernel each (``lowprec.kernels.fused_casts``; set at build from
        #: ``train.fused_casts``; the same bits as the eager casts).
        self.fused_casts = False

    @classmethod
    def from_linear(cls, mod: nn.Linear, config: LinearFP8Config) -> Float8Linear:
        """Swap for ``mod`` sharing its parameters (works on the meta device)."""
        new = cls(
            mod.in_features,
            mod.out_features,
            mod.bias is not None,
            config,
            device=mod.weight.device,
            dtype=mod.weight.dtype,
        )
        new.weight = mod.weight
        if mod.bias is not None:
            new.bias = mod.bias
        return new

    def init_buffers(self, generator: torch.Generator | None = None) -> None:
        """Reset FP8 scaling state (called after ``to_empty`` at build; draws nothing from ``generator``)."""
        for s in self.scalers.values():
            s.reset()

    def update_scales(self) -> None:
        """Delayed scaling: roll amax histories and compute next step's scales (post-optimizer hook)."""
        for s in self.scalers.values():
            s.update()

    def quantize(self, role: str, t: torch.Tensor) -> QTensor:
        """Quantize the 2-D operand ``t`` (rows, K) as ``role`` (``input``, ``weight``, ``grad_output``)."""
        cfg = self.fp8_config
        rc = cfg.role(role)
        if rc.strategy == "current":
            # inside a compiled block the casts are traced with the block; a nested compiled call is not wanted there
            fused = self.fused_casts and not torch.compiler.is_compiling()
            cast = fused_quantize_operand if fused else quantize_operand
            c = cfg.cast
            q = cast(t, rc.fmt, rc.granularity, power_of_2=c.power_of_2_scales, amax_floor=c.amax_floor)
        elif rc.strategy == "delayed":
            scaler = self.scalers[role]
            # A checkpointed block's recompute casts with the same scale and must not record its amax again
            # (nor all-reduce it): the forward did (lowprec.kernels.recompute).
            if not recompute.in_recompute():
                amax = compute_amax(t, "tensorwise")
                if self.amax_group is not None:
                    # Transformer Engine's reduce_amax: every rank records the global amax, so histories and
                    # scales are identical across ranks and equal those of one process on the global batch.
                    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.amax_group)
                scaler.record(amax)
            q = quantize_operand(t, rc.fmt, "tensorwise", scale=scaler.scale)
        else:
            q = quantize_operand(t, rc.fmt, "tensorwise", scale=torch.tensor(rc.static_scale, device=t.device))
        if self.telemetry is not None and not recompute.in_recompute():
            self.telemetry.observe_cast(self, role, t, q)
        return q

    def gemm(self, a: QTensor, bt: QTensor, out_dtype: torch.dtype) -> torch.Tensor:
        g = self.fp8_config.gemm  # the recipe's ``recipe.fp8.gemm`` group, read here where it is used
        return fp8_gemm(
            a,
            bt,
            out_dtype,
            g.gemm_backend,
            g.promotion_interval,
            g.accum_mantissa_bits,
            self.fp8_kernel,
            g.promotion,
            accum_rounding=g.accum_rounding,
            accum_group=g.accum_group,
            blockwise_gemm=self.blockwise_gemm,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            return self._forward_tensor_parallel(x)
        return self._forward_local(x, self.weight)

    def _forward_tensor_parallel(self, x: torch.Tensor) -> torch.Tensor:
        """Under ``lowprec.parallel.tp.apply_tp`` (1-D TP mesh, no bias; checked there): the FP8 GEMMs run
        on the local shards, with scales per shard.

        Column-wise (weight ``Shard(0)``): the input is replicated, the output ``Shard(-1)``, and each rank's
        input gradient is a partial sum. Row-wise (weight ``Shard(1)``): the input is ``Shard(-1)`` and the
        output ``Partial`` (the plan's output hook all-reduces or reduce-scatters it).
        """
        w = self.weight
        colwise = w.placements[0] == Shard(0)
        if isinstance(x, DTensor):
            x = x.to_local(grad_placements=[Partial()] if colwise else None)
        elif colwise:
            raise ValueError("a column-wise parallel Float8Linear expects a replicated DTensor input")
        out = self._forward_local(x, w.to_local())
        return DTensor.from_local(out, w.device_mesh, [Shard(out.ndim - 1) if colwise else Partial()], run_check=False)

    def _forward_local(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            x = x.to(torch.get_autocast_dtype(dev))
        if self.fallback_kernel is not None:
            # x is in the compute dtype already (cast above under autocast); the weight follows it, as autocast would.
            out = (emulated_linear if self.fallback_kernel == "emulated" else F.linear)(x, weight.to(x.dtype))
        else:
            shape = x.shape
            out = _Float8Matmul.apply(x.reshape(-1, shape[-1]), weight, self)
            out = out.reshape(*shape[:-1], out.shape[-1])
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        c = self.fp8_config
        roles = ", ".join(f"{r}={c.role(r).fmt.name}/{c.role(r).granularity}/{c.role(r).strategy}" for r in ROLES)
        fallback = f", fallback={self.fallback_kernel}" if self.fallback_kernel is not None else ""
        return (
            f"{super().extra_repr()}, {roles}, gemm={c.gemm.gemm_backend}, kernel={self.fp8_kernel}, "
            f"saved_input={c.saved_input}, "
            f"fused_casts={self.fused_casts}{fallback}"
        )


class _Float8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, mod: Float8Linear) -> torch.Tensor:
        e5m6 = mod.fp8_config.saved_input == "e5m6"
        cache = mod.fp8_config.saved_input == "fp8"
        # One matmul for activation checkpointing's selective policy; the forward GEMM's output may be
        # served from its cache during a recompute (lowprec.kernels.recompute).
        with recompute.matmul_unit() as unit, torch.autocast(x.device.type, enabled=False):
            qx = mod.quantize("input", x) if cache else None

            def gemm() -> torch.Tensor:
                qin = qx if qx is not None else mod.quantize("input", x)
                return mod.gemm(qin, mod.quantize("weight", weight), x.dtype)

            out = unit.output(gemm)
            if mod.telemetry is not None and not recompute.in_recompute():
                mod.telemetry.observe_gemm(mod, "output", x, weight, out)
        ctx.mod, ctx.x_dtype, ctx.cached = mod, x.dtype, cache
        if cache:
            ctx.q_meta = (qx.granularity, qx.fmt)
            ctx.save_for_backward(qx.data, qx.scale, weight)
        elif e5m6:
            # DeepSeek-V3 3.3.3: this input is kept for backward in E5M6 with power-of-2 1x128 tile scales; the
            # weight-gradient GEMM requantizes it (128x1 tiles along tokens) like an uncached input.
            ctx.save_for_backward(e5m6_tiles(x)[0], weight)
        else:
            ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        mod: Float8Linear = ctx.mod
        cfg = mod.fp8_config
        if ctx.cached:
            data, scale, weight = ctx.saved_tensors
            qx_cached = QTensor(data, scale, *ctx.q_meta)
            x = None
        else:
            x, weight = ctx.saved_tensors
            qx_cached = None
        dy = dy.contiguous()
        with torch.autocast(dy.device.type, enabled=False):
            # grad_input = grad_output @ weight: contraction over out_features.
            qdy = mod.quantize("grad_output", dy)
            if cfg.weight.granularity in _TRANSPOSABLE:
                qwt = mod.quantize("weight", weight).t()
            else:
                qwt = mod.quantize("weight", weight.t())
            grad_input = mod.gemm(qdy, qwt, ctx.x_dtype)
            # grad_weight = grad_output.T @ input: contraction over tokens.
            qdyt = qdy.t() if cfg.grad_output.granularity in _TRANSPOSABLE else mod.quantize("grad_output", dy.t())
            if qx_cached is not None:
                if qx_cached.granularity in _TRANSPOSABLE:
                    qxt = qx_cached.t()
                else:
                    qxt = mod.quantize("input", qx_cached.dequantize().t())
            elif cfg.input.granularity in _TRANSPOSABLE:
                qxt = mod.quantize("input", x).t()
            else:
                qxt = mod.quantize("input", x.t())
            grad_weight = mod.gemm(qdyt, qxt, torch.float32).to(weight.dtype)
        if mod.telemetry is not None:
            mod.telemetry.observe_gemm(mod, "grad_input", dy, weight, grad_input, transpose_b=False)
        return grad_input, grad_weight, None
