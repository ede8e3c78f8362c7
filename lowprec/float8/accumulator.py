"""Emulated limited-precision tensor-core accumulators for FP8 GEMMs (DeepSeek-V3, arXiv 2412.19437, 3.3.2).

Two models of the accumulator, both keeping ``bits`` explicit mantissa bits in the running sum:

- ``group=None`` (lowprec's original model): the products of one 32-element WGMMA k-step are summed in FP32 and
  added to the running sum, which is then rounded to ``bits`` mantissa bits; one rounding per step.
- ``group=g`` (the multi-term adder of Fasi, Higham, Mikaitis and Pranesh, "Numerical behavior of NVIDIA tensor
  cores", PeerJ CS 2021, and DeepSeek-V3 3.5.2: "after aligning 32 mantissa products by right-shifting based on
  the maximum exponent, the Tensor Core only uses the highest 14 bits of each mantissa product for addition, and
  truncates bits exceeding this range"): ``g`` exact products and the running sum are aligned to the largest
  exponent among them, each is cut to ``bits`` fraction bits below that exponent, the aligned terms are added
  exactly (fixed point) and the sum is normalised to ``bits`` mantissa bits. Every product, not only the sum, is
  cut, so a large running sum swallows the low bits of every small product.

``rounding`` says how bits are dropped, at the alignment and at the normalisation: ``nearest`` (ties to even),
``truncate`` (toward zero: a sign-magnitude shifter) or ``floor`` (toward minus infinity: a two's-complement,
sign-filling right shift, DeepSeek's wording). The defaults (``AccumulatorModel()``) are lowprec's original
model, so ``lowprec.float8.gemm`` computes what it always did unless told otherwise.

``HOPPER_ACCUMULATOR`` is the one place the lab's Hopper accumulator parameters live, with their source; the
benchmark ``benchmarks/hopper_accumulation.py`` measures the hardware and fits them (its ``--fit``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

ROUNDINGS = ("nearest", "truncate", "floor")
#: One WGMMA k-step of FP8 operands (Hopper ``wgmma.mma_async`` with e4m3/e5m2 inputs has K = 32).
WGMMA_K = 32
#: Bound on the (rows, N, group) float64 product tensor of the aligned model, in elements (128 MiB).
_MAX_PRODUCTS = 1 << 24


def check_accumulator(bits: int, rounding: str = "nearest", group: int | None = None) -> None:
    """Raise ``ValueError`` unless ``bits`` is in 1..22, ``rounding`` in ``ROUNDINGS`` and ``group`` None or >= 1."""
    if not 0 < bits < 23:
        raise ValueError(f"accum_mantissa_bits={bits} must be between 1 and 22")
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown accumulator rounding {rounding!r}; known: {ROUNDINGS}")
    if group is not None and group < 1:
        raise ValueError(f"accumulator alignment group={group} must be a positive number of products")


@dataclass(frozen=True)
class AccumulatorModel:
    """An emulated FP8 tensor-core accumulator (module doc). ``bits``: explicit mantissa bits kept (1..22);
    ``rounding``: one of ``ROUNDINGS``; ``group``: products aligned together with the running sum (None: lowprec's
    original per-32-step rounding); ``source``: where these numbers come from; ``fitted``: whether they were fitted
    to a measurement of the hardware (and not taken from the paper's prose). Raises ``ValueError`` on bad values."""

    bits: int = 14
    rounding: str = "nearest"
    group: int | None = None
    source: str = "lowprec's default"
    fitted: bool = False

    def __post_init__(self):
        check_accumulator(self.bits, self.rounding, self.group)

    def describe(self) -> str:
        """One phrase for reports, e.g. ``14-bit accumulator, round to nearest after every 32-element WGMMA step``."""
        how = {"nearest": "round to nearest", "truncate": "truncation toward zero", "floor": "rounding toward -inf"}
        if self.group is None:
            return f"{self.bits}-bit accumulator, {how[self.rounding]} after every {WGMMA_K}-element WGMMA step"
        return (
            f"{self.bits}-bit accumulator, products aligned with the running sum to the largest exponent in groups "
            f"of {self.group}, {how[self.rounding]} of the shifted-out bits and of the sum"
        )


#: The accumulator lowprec emulates for Hopper without promotion. Until it is fitted to a measurement
#: (``python benchmarks/hopper_accumulation.py`` on a Hopper GPU, then ``--fit`` on its JSON), the paper's prose.
HOPPER_ACCUMULATOR = AccumulatorModel(
    bits=13,
    rounding="truncate",
    group=32,
    source=(
        "fitted to an NVIDIA H200 (torch 2.11.0+cu130, cuBLAS _scaled_mm use_fast_accum=True), 2026-11-26: "
        "benchmarks/hopper_accumulation.py, measurement in benchmarks/results/hopper_accumulation_h200.json; "
        "within 1.24x of the measured error at every K = 256..16384 of 4 operand sets"
    ),
    fitted=True,
)


def round_mantissa(x: torch.Tensor, bits: int, rounding: str = "nearest") -> torch.Tensor:
    """Float32 ``x`` with ``bits`` explicit mantissa bits (the low ``23 - bits`` cleared); ``rounding`` (``ROUNDINGS``)
    ties to even for ``nearest``. Works on the IEEE bit pattern; infinities and NaN are not special-cased."""
    check_accumulator(bits, rounding)
    drop = 23 - bits
    i = x.contiguous().view(torch.int32)
    mask = (1 << drop) - 1
    if rounding == "nearest":
        lsb = (i >> drop) & 1
        i = (i + ((1 << (drop - 1)) - 1) + lsb) & ~mask
    elif rounding == "truncate":
        i = i & ~mask  # sign-magnitude: clearing bits moves toward zero
    else:
        # toward -inf: negative values with dropped bits grow by one unit in magnitude
        up = (i < 0) & ((i & mask) != 0)
        i = (i & ~mask) + up.to(torch.int32) * (1 << drop)
    return i.view(torch.float32)


def _to_integer(x: torch.Tensor, rounding: str) -> torch.Tensor:
    if rounding == "nearest":
        return torch.round(x)  # half to even
    return torch.trunc(x) if rounding == "truncate" else torch.floor(x)


def round_mantissa64(x: torch.Tensor, bits: int, rounding: str = "nearest") -> torch.Tensor:
    """Float64 ``x`` rounded to ``bits`` explicit mantissa bits (``bits + 1`` significant), exactly, by ``frexp``."""
    f, e = torch.frexp(x)  # x = f * 2**e, 0.5 <= |f| < 1
    return torch.ldexp(_to_integer(torch.ldexp(f, torch.tensor(bits + 1)), rounding), e - (bits + 1))


def aligned_sum(acc: torch.Tensor, products: torch.Tensor, bits: int, rounding: str) -> torch.Tensor:
    """One step of the aligned model: float64 ``acc`` (M, N) plus ``products`` (M, N, g), all aligned to the largest
    exponent among the g + 1 terms, each cut to ``bits`` fraction bits below it, summed exactly and normalised to
    ``bits`` mantissa bits. Exact in float64 for FP8 products (every term is a multiple of the cut's unit and
    fewer than 2**(bits + 1) of them in magnitude)."""
    top = torch.maximum(acc.abs(), products.abs().amax(-1))
    _, e = torch.frexp(top)  # the largest term's leading bit is 2**(e - 1)
    unit = torch.ldexp(torch.ones_like(top), e - 1 - bits)[..., None]
    terms = torch.cat([acc[..., None], products], dim=-1) / unit  # exact: a power-of-two scaling
    return round_mantissa64(_to_integer(terms, rounding).sum(-1) * unit[..., 0], bits, rounding)


def limited_accumulation(
    a: torch.Tensor,
    b: torch.Tensor,
    model: AccumulatorModel,
    ks: Sequence[int] | None = None,
    step_divisor: Callable[[int, int], torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """``a @ b.T`` through the accumulator ``model`` (module doc), without promotion. ``a`` (M, K) and ``b`` (N, K)
    float32 hold the raw FP8 values (their products exact in float32); returns float32 (M, N) running sums after
    the first ``k`` products for each ``k`` of ``ks`` (default ``[K]``; the prefixes of one pass, so each must be a
    multiple of the step: ``model.group``, or 32 without one). ``step_divisor(s, e)`` (optional) is the float32
    (M, N) divisor of the products of K columns [s, e): per-step tile scales (then the step must divide 128 so no
    step straddles two tiles). Raises ``ValueError`` for a ``k`` beyond K or off the step grid."""
    k = a.shape[1]
    step = model.group or WGMMA_K
    ks = [k] if ks is None else sorted(ks)
    bad = [kk for kk in ks if kk > k or (kk % step and kk != k) or kk < 1]
    if bad:
        raise ValueError(f"prefix lengths {bad} must be multiples of the step {step} up to K={k}")
    if model.group is not None:
        rows = max(1, _MAX_PRODUCTS // max(1, b.shape[0] * (step + 1)))
        parts = [
            _aligned_rows(a[r0 : r0 + rows].double(), b.double(), model, ks, step_divisor, r0, rows)
            for r0 in range(0, a.shape[0], rows)
        ]
        return [torch.cat([p[i] for p in parts]) for i in range(len(ks))]
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    states = []
    for s in range(0, ks[-1], step):
        e = min(s + step, k)
        p = a[:, s:e] @ b[:, s:e].t()
        acc = round_mantissa(acc + (p if step_divisor is None else p / step_divisor(s, e)), model.bits, model.rounding)
        states += [acc] * ks.count(e)
    return states


def _aligned_rows(a, b, model: AccumulatorModel, ks, step_divisor, r0: int, rows: int) -> list[torch.Tensor]:
    # rows [r0, r0 + rows) of the aligned model; rows are independent, and a bounded slice keeps the
    # (rows, N, group) product tensor within _MAX_PRODUCTS
    k, g = a.shape[1], model.group
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64, device=a.device)
    states = []
    for s in range(0, ks[-1], g):
        e = min(s + g, k)
        p = a[:, None, s:e] * b[None, :, s:e]
        if step_divisor is not None:
            p = p / step_divisor(s, e)[r0 : r0 + rows].double()[..., None]
        acc = aligned_sum(acc, p, model.bits, model.rounding)
        states += [acc.float()] * ks.count(e)
    return states


def accumulation_error(c: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    """The error of a GEMM result ``c`` against its FP64 reference ``exact`` (same shape): ``rel_err``
    ``||c - exact|| / ||exact||`` (Frobenius); ``max_rel_err`` ``max |c - exact| / |exact|`` over the outputs with
    ``|exact|`` at least its median (the DeepSeek-V3 study's definition: outputs that cancel to near zero have no
    meaningful relative error); ``max_elem_rel_err`` the same over every non-zero output."""
    err = (c.double() - exact.double()).abs()
    mag = exact.double().abs()
    big = mag >= mag.median()
    nz = mag > 0
    return {
        "rel_err": float(err.norm() / mag.norm()),
        "max_rel_err": float((err[big] / mag[big]).max()),
        "max_elem_rel_err": float((err[nz] / mag[nz]).max()) if bool(nz.any()) else 0.0,
    }
