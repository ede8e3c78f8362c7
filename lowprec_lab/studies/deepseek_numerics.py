"""The numerical analyses of the DeepSeek-V3 study (arXiv 2412.19437, section 3.3.2): pure computations on given
operands, no training, no store.

- ``accumulation_errors``: the error of an FP8 GEMM's accumulation against FP64, as a function of K, with the
  emulated limited-precision tensor-core accumulator (``lowprec.float8.accumulator``; by default
  ``HOPPER_ACCUMULATOR``, the one place its parameters and their source live) without promotion and with
  promotion to FP32 every N_C elements.
- ``granularity_stats``: what each scaling granularity does to one tensor in e4m3: SQNR, the share of elements at
  the top of the range (saturated) and the share of non-zero elements quantized to zero (flushed).
- ``with_channel_outliers``: the same tensor with a few feature channels scaled up, the outliers the paper's
  fine-grained quantization exists for.
- ``capture_linears``: a forward and backward of a model recording each linear's input, weight and output
  gradient (the operands of its three GEMMs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lowprec.float8.accumulator import HOPPER_ACCUMULATOR, AccumulatorModel, accumulation_error
from lowprec.float8.gemm import fp8_gemm
from lowprec.numerics.formats import E4M3, Format, sqnr_db
from lowprec.numerics.scaling import GRANULARITIES, quantize_operand

#: The emulated Hopper accumulator's mantissa bits (``HOPPER_ACCUMULATOR``, with its source).
HOPPER_ACCUM_BITS = HOPPER_ACCUMULATOR.bits


@dataclass(frozen=True)
class AccumulationError:
    """One GEMM's accumulation error. ``k``: contraction length; ``promotion``: N_C, or None for none (all of K in
    the limited accumulator); ``scaling``: of both operands; ``rel_err``: ``||C - C64|| / ||C64||`` (Frobenius);
    ``max_rel_err``: ``max |C - C64| / |C64|`` over the outputs with ``|C64|`` at least the median (outputs that
    cancel to near zero have no meaningful relative error). ``C64``: the FP64 product of the same e4m3 operands,
    so quantization error is excluded and only the accumulation is measured."""

    operands: str
    scaling: str
    k: int
    promotion: int | None
    rel_err: float
    max_rel_err: float


def accumulation_errors(
    a: torch.Tensor,
    b: torch.Tensor,
    ks: list[int],
    intervals: list[int | None],
    operands: str,
    model: AccumulatorModel = HOPPER_ACCUMULATOR,
) -> list[AccumulationError]:
    """``a`` (M, K_max) and ``b`` (N, K_max) float operands of ``a @ b.T``; for each ``k`` of ``ks`` (<= K_max) the
    first ``k`` columns are quantized (e4m3, rowwise scales, so any N_C is possible) and multiplied with the
    emulated accumulator ``model``, once per promotion interval of ``intervals`` (None: no promotion).
    Also, for ``k`` multiples of 128, DeepSeek-V3's own layout: 1x128 tiles for both operands, promotion every 128
    against none (``scaling='tile1x128'``). Raises ``ValueError`` for a ``k`` above K_max."""
    out = []
    for k in ks:
        if k > a.shape[1] or k > b.shape[1]:
            raise ValueError(f"k={k} exceeds the operands' K ({a.shape[1]}, {b.shape[1]})")
        for scaling in ("rowwise", "tile1x128") if k % 128 == 0 else ("rowwise",):
            qa = quantize_operand(a[:, :k].contiguous(), E4M3, scaling)
            qb = quantize_operand(b[:, :k].contiguous(), E4M3, scaling)
            exact = qa.dequantize().double() @ qb.dequantize().double().t()
            runs = intervals if scaling == "rowwise" else [None, 128]
            acc = {"accum_mantissa_bits": model.bits, "accum_rounding": model.rounding, "accum_group": model.group}
            for nc in runs:
                if nc is None:
                    c = fp8_gemm(qa, qb, torch.float32, promotion=False, **acc)
                else:
                    c = fp8_gemm(qa, qb, torch.float32, promotion_interval=nc, **acc)
                e = accumulation_error(c, exact)
                out.append(AccumulationError(operands, scaling, k, nc, e["rel_err"], e["max_rel_err"]))
    return out


@dataclass(frozen=True)
class GranularityStats:
    """One tensor quantized to e4m3 at one granularity (current scaling). ``sqnr_db``: ``lowprec.numerics.formats
    .sqnr_db`` of the dequantized tensor; ``saturated``: share of elements at ``±fmt.max`` after quantization (with
    current scaling only each group's amax element: the top of the range is used, never exceeded);
    ``flushed``: share of the non-zero elements quantized to zero."""

    tensor: str
    granularity: str
    sqnr_db: float
    saturated: float
    flushed: float


def granularity_stats(
    name: str, x: torch.Tensor, fmt: Format = E4M3, amax_floor: float = 1e-12
) -> list[GranularityStats]:
    """``x`` (R, K) float, quantized along K at every granularity of ``lowprec.numerics.scaling.GRANULARITIES``."""
    x = x.float().contiguous()
    nonzero = x != 0
    out = []
    for g in GRANULARITIES:
        q = quantize_operand(x, fmt, g, amax_floor=amax_floor)
        raw = q.data.float()
        deq = q.dequantize()
        flushed = (deq == 0) & nonzero
        out.append(
            GranularityStats(
                name,
                g,
                sqnr_db(x, deq),
                float((raw.abs() == fmt.max).float().mean()),
                float(flushed.sum() / max(int(nonzero.sum()), 1)),
            )
        )
    return out


def with_channel_outliers(x: torch.Tensor, factor: float, n_channels: int = 4, seed: int = 0) -> torch.Tensor:
    """``x`` (R, K) with ``n_channels`` feature columns (chosen by ``seed``) multiplied by ``factor``: per-channel
    activation outliers of controlled size (the LLM.int8() / DeepSeek-V3 3.3.2 picture)."""
    g = torch.Generator().manual_seed(seed)
    cols = torch.randperm(x.shape[1], generator=g)[:n_channels]
    y = x.clone().float()
    y[:, cols] *= factor
    return y


@dataclass
class Captured:
    """The GEMM operands of one ``nn.Linear`` at ``fqn`` from one forward and backward: ``input`` (tokens, in),
    ``weight`` (out, in), ``grad_output`` (tokens, out), float32 on CPU."""

    fqn: str
    input: torch.Tensor
    weight: torch.Tensor
    grad_output: torch.Tensor | None = None

    @property
    def role(self) -> str:
        """The torchtitan module name without the block index, e.g. ``attention.wo``, ``feed_forward.w2``."""
        parts = self.fqn.split(".")
        return ".".join(parts[2:]) if parts[0] == "layers" else self.fqn

    @property
    def layer(self) -> int | None:
        parts = self.fqn.split(".")
        return int(parts[1]) if parts[0] == "layers" else None


def capture_linears(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> list[Captured]:
    """Run ``model(tokens)`` (``tokens``/``targets`` (batch, seq) int64) with the cross-entropy loss and backward,
    recording every ``nn.Linear`` inside ``layers.*`` (the block linears an FP8 recipe converts). FP32 throughout:
    the operands as a high-precision run produces them. The model's gradients are left set."""
    caps: dict[str, Captured] = {}
    handles = []
    for fqn, m in model.named_modules():
        if isinstance(m, nn.Linear) and fqn.startswith("layers."):

            def fwd(mod, args, out, fqn=fqn):
                x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
                caps[fqn] = Captured(fqn, x, mod.weight.detach().float().clone())

            def bwd(mod, grad_in, grad_out, fqn=fqn):
                caps[fqn].grad_output = grad_out[0].detach().reshape(-1, grad_out[0].shape[-1]).float()

            handles += [m.register_forward_hook(fwd), m.register_full_backward_hook(bwd)]
    try:
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    return list(caps.values())


def gaussian_operands(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard normal ``a`` (m, k) and ``b`` (n, k), float32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)


def wgrad_operands(caps: list[Captured], m: int, n: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The weight-gradient GEMM of the captured linear with the most tokens (its K is the token count, the longest
    contraction a small model has): ``grad_output.T`` rows (first ``n`` output features) and ``input.T`` rows
    (first ``m`` input features), each (rows, tokens); and the linear's FQN."""
    c = max((c for c in caps if c.grad_output is not None), key=lambda c: c.input.shape[0])
    return c.grad_output.t()[:n].contiguous(), c.input.t()[:m].contiguous(), c.fqn


def ks_up_to(k_max: int, lo: int = 256) -> list[int]:
    """Powers of two from ``lo`` to ``k_max`` (inclusive where ``k_max`` is one)."""
    return [2**e for e in range(int(math.log2(lo)), int(math.log2(k_max)) + 1)]
