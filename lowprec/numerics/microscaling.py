"""Block-scaled ("microscaling") formats, exact on CPU: MXFP8, MXFP4 and NVFP4.

Sources:

- OCP Microscaling Formats (MX) Specification v1.0 (2023), section 5 (E8M0 scale: 8 exponent bits, bias 127,
  code 255 = NaN, no zero, no sign), section 5.3 (E2M1: values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives),
  section 6.3 (conversion: ``X = 2**(floor(log2(amax)) - emax_elem)``, elements ``x / X`` rounded to the element
  format, saturating). lowprec calls that scale mode ``floor``.
- torchao ``torchao/prototype/mx_formats/mx_tensor.py`` ``_to_mx_rceil`` (after Transformer Engine's
  ``cvt.rp.satfinite.ue8m0``): ``X = 2**ceil(log2(amax / max_elem))``, so no element saturates. lowprec calls that
  scale mode ``rceil`` (torchao's MXFP8 training default).
- NVFP4 (NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv 2509.25149, section 2 and appendix B;
  torchao ``nvfp4_tensor.py`` ``nvfp4_quantize``): 16-element blocks of E2M1 with an E4M3 block scale and one
  FP32 tensor scale. The tensor decode scale is ``amax / (448 * 6)``; each block's decode scale
  ``amax_block / 6`` is divided by it and rounded to E4M3 (round to nearest even); elements are multiplied by
  ``(1 / tensor_scale) / e4m3_block_scale``, clamped to +-6 and rounded to E2M1.

torch has no working float4 on CPU, so E2M1 codes (4 bits: sign, 2 exponent bits, 1 mantissa bit) are packed two
per ``uint8``: element ``2i`` in the low nibble, ``2i + 1`` in the high nibble (torchao's ``pack_uint4`` order).
E8M0 scales are kept as their ``uint8`` codes. FP8 elements are torch ``float8_e4m3fn`` / ``float8_e5m2``.

Element rounding is ``nearest`` (round to nearest, ties to even, as the hardware casts) or ``stochastic``
(round up with probability equal to the distance from the value below over the gap, so ``E[q(x)] = x``; the
random numbers come from the ``torch.Generator`` passed in, so a seed reproduces them).

Blocks run along the last dimension (the GEMM's contraction dimension K); K not a multiple of the block size is
refused (``ValueError``), never padded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

E8M0_BIAS = 127
E8M0_NAN = 255
#: E2M1 magnitudes by code (OCP MX v1.0 table 5); bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16
MX_BLOCK = 32
SCALE_MODES = ("floor", "rceil")
ROUNDINGS = ("nearest", "stochastic")


@dataclass(frozen=True)
class ElementFormat:
    """A block element format: ``emax`` the exponent of its largest power of two (OCP MX ``emax_elem``),
    ``max`` its largest finite magnitude, ``bits`` its width."""

    name: str
    emax: int
    max: float
    bits: int
    dtype: torch.dtype | None  # torch's dtype where it has one usable on CPU (FP8), else None (E2M1: packed uint8)


ELEMENTS: dict[str, ElementFormat] = {
    "e4m3": ElementFormat("e4m3", 8, 448.0, 8, torch.float8_e4m3fn),
    "e5m2": ElementFormat("e5m2", 15, 57344.0, 8, torch.float8_e5m2),
    "e2m1": ElementFormat("e2m1", 2, 6.0, 4, None),
}


# ---- codes ----------------------------------------------------------------------------------------------------
def e8m0_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (``uint8``, any shape) -> float32 ``2**(code - 127)``; code 255 -> NaN. Exact: 2**-127 is a
    float32 subnormal."""
    e = codes.to(torch.int32) - E8M0_BIAS
    out = torch.ldexp(torch.ones_like(e, dtype=torch.float64), e).to(torch.float32)
    return torch.where(codes == E8M0_NAN, torch.full_like(out, float("nan")), out)


def float32_to_e8m0(x: torch.Tensor) -> torch.Tensor:
    """Powers of two (float32, in [2**-127, 2**127]) -> their E8M0 codes (``uint8``); NaN -> 255. Raises
    ``ValueError`` for a value that is not an exact power of two in range."""
    m, e = torch.frexp(x.to(torch.float64))
    finite = ~torch.isnan(x)
    if bool(((m[finite] != 0.5) | (e[finite] - 1 < -E8M0_BIAS) | (e[finite] - 1 > E8M0_BIAS)).any()):
        raise ValueError("E8M0 holds only powers of two between 2**-127 and 2**127")
    return torch.where(finite, e - 1 + E8M0_BIAS, torch.full_like(e, E8M0_NAN)).to(torch.uint8)


_E2M1_TABLE = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)


def e2m1_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """Unpacked E2M1 codes (``uint8`` 0..15, any shape) -> float32 values (code 8 is -0.0)."""
    return _E2M1_TABLE.to(codes.device)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(..., K) codes 0..15 -> (..., K/2) ``uint8``: element 2i in the low nibble, 2i+1 in the high one.
    Raises ``ValueError`` for odd K."""
    if codes.shape[-1] % 2:
        raise ValueError(f"packing E2M1 needs an even last dimension, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """(..., K/2) ``uint8`` -> (..., K) codes 0..15 (inverse of ``pack_e2m1``)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# ---- element rounding -----------------------------------------------------------------------------------------
_GRIDS: dict[str, torch.Tensor] = {}


def _grid(fmt: ElementFormat) -> torch.Tensor:
    """Non-negative finite values of ``fmt`` in code order (code == index for codes below the sign bit)."""
    g = _GRIDS.get(fmt.name)
    if g is None:
        if fmt.dtype is None:
            g = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        else:
            vals = torch.arange(128, dtype=torch.uint8).view(fmt.dtype).float()
            g = vals[torch.isfinite(vals)]
        _GRIDS[fmt.name] = g
    return g


def round_to_codes(
    y: torch.Tensor, fmt: ElementFormat, rounding: str = "nearest", generator: torch.Generator | None = None
) -> torch.Tensor:
    """Round float32 ``y`` (already scaled; magnitudes beyond ``fmt.max`` saturate) to ``fmt``'s codes, ``uint8``
    with the sign in the top bit of the format (bit 3 for E2M1, bit 7 for FP8). ``nearest`` breaks ties to the
    even code; ``stochastic`` rounds up with probability ``(|y| - lo) / (hi - lo)`` using ``torch.rand`` from
    ``generator`` (the global generator when ``None``). NaN maps to an FP8 NaN code and is refused for E2M1
    (``ValueError``), which has none."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is not one of {list(ROUNDINGS)}")
    mag = y.abs().clamp(max=fmt.max)
    nan = torch.isnan(y)
    if fmt.dtype is None:
        if torch.compiler.is_compiling():
            # reading the flag is a graph break under torch.compile; the traced graph asserts it instead
            # (a RuntimeError when the compiled code runs)
            torch._assert_async(~nan.any(), "E2M1 has no NaN; the block holds NaN")
        elif bool(nan.any()):
            raise ValueError("E2M1 has no NaN; the block holds NaN")
    mag = torch.where(nan, torch.zeros_like(mag), mag)
    if fmt.dtype is None:
        idx = _e2m1_index(mag, rounding, generator)
    else:
        idx = _grid_index(mag, fmt, rounding, generator)
    idx = idx.to(torch.uint8)
    sign_bit = fmt.bits - 1
    codes = idx | (torch.signbit(y).to(torch.uint8) << sign_bit)
    if fmt.dtype is not None:
        nan_code = torch.tensor(float("nan"), dtype=torch.float32).to(fmt.dtype).view(torch.uint8)
        codes = torch.where(nan, nan_code.to(y.device), codes)
    return codes


def _e2m1_index(mag: torch.Tensor, rounding: str, generator) -> torch.Tensor:
    """E2M1 code index of magnitudes in [0, 6]: the grid is uniform on [0, 2) (step 0.5), [2, 4) (step 1) and
    [4, 6] (step 2, codes 6-7), so the position inside each segment is exact in FP32 (a product by a power of two or
    a Sterbenz subtraction); rounding it half-to-even picks the even code on ties (each segment starts at an even
    code)."""
    low, mid = mag < 2, mag < 4
    base = torch.where(low, 0.0, torch.where(mid, 4.0, 6.0))
    rel = torch.where(low, mag * 2, torch.where(mid, mag - 2, (mag - 4) * 0.5))
    if rounding == "nearest":
        return base + torch.round(rel)  # half to even
    lo = torch.floor(rel)
    return base + lo + (torch.rand(rel.shape, generator=generator, device=rel.device) < rel - lo)


def _grid_index(mag: torch.Tensor, fmt: ElementFormat, rounding: str, generator) -> torch.Tensor:
    """Code index of magnitudes on ``fmt``'s table of non-negative values (any format; used for FP8 SR)."""
    grid = _grid(fmt).to(mag.device)
    hi = torch.searchsorted(grid, mag.contiguous()).clamp(max=len(grid) - 1)  # first grid value >= mag
    lo = (hi - 1).clamp(min=0)
    exact = grid[hi] == mag
    lo = torch.where(exact, hi, lo)
    gap = torch.where(exact, torch.ones_like(mag), grid[hi] - grid[lo])
    frac = torch.where(exact, torch.zeros_like(mag), (mag - grid[lo]) / gap)
    if rounding == "nearest":
        up = (frac > 0.5) | ((frac == 0.5) & (hi % 2 == 0))
    else:
        up = torch.rand(mag.shape, generator=generator, device=mag.device) < frac
    return torch.where(up, hi, lo)


def codes_to_float32(codes: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Codes of ``fmt`` (``uint8``, unpacked) -> float32 values."""
    if fmt.dtype is None:
        return e2m1_to_float32(codes)
    return codes.view(fmt.dtype).float()


# ---- block-scaled tensors -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockQTensor:
    """A 2-D tensor (rows, K) quantized in blocks of ``block`` elements along K.

    ``data``: FP8 elements (rows, K) as ``float8_e4m3fn``/``float8_e5m2``, or E2M1 codes packed two per ``uint8``
    (rows, K/2). ``scale``: one decode scale per block, (rows, K/block): E8M0 codes (``uint8``) for MX, E4M3
    (``float8_e4m3fn``) for NVFP4. ``tensor_scale``: NVFP4's FP32 tensor decode scale (0-dim), else ``None``.
    ``two_d``: the block scales are shared by 16x16 tiles (NVFP4 2-D weight scaling), so the transpose is
    exact (``t()``). The value of element (r, k) is ``elem * block_scale * tensor_scale``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    tensor_scale: torch.Tensor | None
    elem: str
    block: int
    shape: tuple[int, int]
    two_d: bool = False

    @property
    def fmt(self) -> ElementFormat:
        return ELEMENTS[self.elem]

    def codes(self) -> torch.Tensor:
        """Unpacked element codes (rows, K), ``uint8``."""
        if self.fmt.dtype is None:
            return unpack_e2m1(self.data)
        return self.data.view(torch.uint8)

    def elements(self) -> torch.Tensor:
        """Element values before scaling, float32 (rows, K)."""
        if self.fmt.dtype is None:
            return e2m1_to_float32(unpack_e2m1(self.data))
        return self.data.float()

    def block_decode_scale(self) -> torch.Tensor:
        """Per-block decode scale as float32 (rows, K/block), the tensor scale folded in (one FP32 rounding for
        NVFP4; exact for MX)."""
        if self.scale.dtype == torch.uint8:
            return e8m0_to_float32(self.scale)
        s = self.scale.float()
        return s * self.tensor_scale if self.tensor_scale is not None else s

    def dequantize(self) -> torch.Tensor:
        """float32 (rows, K). Exact for MX formats (element times a power of two); for NVFP4 the element is
        multiplied by the product ``e4m3_scale * tensor_scale`` (one FP32 rounding, as torchao and the
        hardware apply it)."""
        r, k = self.shape
        el = self.elements().view(r, k // self.block, self.block)
        return (el * self.block_decode_scale()[:, :, None]).view(r, k)

    def t(self) -> BlockQTensor:
        """The transpose, quantized along the other dimension; exact only for ``two_d`` scaling (each 16x16 tile
        has one scale). Raises ``ValueError`` otherwise (re-quantize the transposed tensor instead)."""
        if not self.two_d:
            raise ValueError("only 2-D (16x16) block-scaled tensors transpose without requantizing")
        r, k = self.shape
        codes = self.codes().t().contiguous()
        data = pack_e2m1(codes) if self.fmt.dtype is None else codes.view(self.fmt.dtype)
        tiles = self.scale[:: self.block]  # (r/16, k/16): rows of a tile share its scale
        scale = tiles.t().repeat_interleave(self.block, dim=0).contiguous()  # (k, r/16)
        return replace(self, data=data, scale=scale, shape=(k, r))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"block quantization takes a 2-D (rows, K) tensor, got shape {tuple(x.shape)}")
    r, k = x.shape
    if k % block:
        raise ValueError(
            f"K={k} (last dim of {tuple(x.shape)}) is not a multiple of the block size {block}; "
            "lowprec refuses rather than pads"
        )
    return x.float().reshape(r, k // block, block)


def mx_scale_exponent(amax: torch.Tensor, fmt: ElementFormat, mode: str) -> torch.Tensor:
    """Unbiased E8M0 exponent (int32, shape of ``amax``) of each block's decode scale.

    ``floor`` (OCP MX v1.0 section 6.3): ``floor(log2(amax)) - emax``; ``rceil`` (torchao ``_to_mx_rceil``):
    ``ceil(log2(amax / max))`` with the division rounded in FP32 as torchao does. Both clamped to [-127, 127]
    (an all-zero block gets 2**-127). ``log2`` is taken exactly from ``frexp``."""
    if mode not in SCALE_MODES:
        raise ValueError(f"scale mode {mode!r} is not one of {list(SCALE_MODES)}")
    a = amax.float()
    if mode == "floor":
        m, e = torch.frexp(a)  # a = m * 2**e, m in [0.5, 1)
        exp = e - 1 - fmt.emax
    else:
        m, e = torch.frexp(a / fmt.max)
        exp = torch.where(m == 0.5, e - 1, e)  # ceil(log2): exact powers of two stay
    exp = torch.where(a == 0, torch.full_like(exp, -E8M0_BIAS), exp)
    return exp.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def quantize_mx(
    x: torch.Tensor,
    elem: str,
    block: int = MX_BLOCK,
    scale_mode: str = "floor",
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> BlockQTensor:
    """MX-quantize ``x`` (rows, K), any float dtype, in ``block``-element blocks along K with E8M0 scales.

    ``elem``: ``e4m3``/``e5m2`` (MXFP8) or ``e2m1`` (MXFP4). Elements are ``x * 2**-exp`` (exact) clamped to
    +-max and rounded (``rounding``, ``generator``: ``round_to_codes``). Raises ``ValueError`` when K is not a
    multiple of ``block`` or for unknown modes."""
    fmt = ELEMENTS[elem]
    xb = _blocks(x, block)
    exp = mx_scale_exponent(xb.abs().amax(-1), fmt, scale_mode)
    y = torch.ldexp(xb, -exp[..., None]).reshape(x.shape)
    data = _encode(y, fmt, rounding, generator)
    return BlockQTensor(data, (exp + E8M0_BIAS).to(torch.uint8), None, elem, block, tuple(x.shape))


def _encode(y: torch.Tensor, fmt: ElementFormat, rounding: str, generator) -> torch.Tensor:
    if fmt.dtype is not None and rounding == "nearest":
        return y.clamp(-fmt.max, fmt.max).to(fmt.dtype)  # torch's cast is round-to-nearest-even
    codes = round_to_codes(y, fmt, rounding, generator)
    return pack_e2m1(codes) if fmt.dtype is None else codes.view(fmt.dtype)


def nvfp4_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's FP32 tensor decode scale ``amax / (448 * 6)`` (1.0 for an all-zero tensor), so that the largest
    block's E4M3 scale lands at 448 (arXiv 2509.25149 appendix B; torchao ``per_tensor_amax_to_scale``)."""
    a = amax.float()
    return torch.where(a > 0, a / (448.0 * 6.0), torch.ones_like(a))


def quantize_nvfp4(
    x: torch.Tensor,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    two_d: bool = False,
    tensor_amax: torch.Tensor | None = None,
) -> BlockQTensor:
    """NVFP4-quantize ``x`` (rows, K): E2M1 elements in 16-element blocks along K, E4M3 block scales, one FP32
    tensor scale (module doc; torchao ``nvfp4_quantize`` with a per-tensor scale, bit for bit under ``nearest``).

    ``two_d``: one scale per 16x16 tile (the paper's weight scaling, section 4.3), so forward and backward use
    the same quantized weight; needs rows divisible by 16. ``tensor_amax`` overrides the tensor's own amax.
    Raises ``ValueError`` for K (or, with ``two_d``, rows) not a multiple of 16."""
    r, k = x.shape
    if two_d and r % NVFP4_BLOCK:
        raise ValueError(f"2-D 16x16 scaling needs rows divisible by 16, got shape {tuple(x.shape)}")
    y, scale, ts = nvfp4_scaled(x, two_d, tensor_amax)
    data = _encode(y, ELEMENTS["e2m1"], rounding, generator)
    return BlockQTensor(data, scale, ts.reshape(()), "e2m1", NVFP4_BLOCK, (r, k), two_d)


def nvfp4_scaled(
    x: torch.Tensor, two_d: bool = False, tensor_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scaling half of ``quantize_nvfp4`` (also traced by ``lowprec.kernels.fused_mx_casts``): ``x`` (rows, K)
    -> ``(y, scale, ts)``: ``y`` float32 (rows, K), each 16-element block divided by its E4M3 block scale and the
    FP32 tensor scale and clamped to E2M1's range, ready for rounding to codes; ``scale`` float8_e4m3fn
    (rows, K/16); ``ts`` the tensor scale (float32). ``two_d``: one scale per 16x16 tile (rows divisible by 16,
    checked by the caller). Raises ``ValueError`` for K not a multiple of 16."""
    fmt = ELEMENTS["e2m1"]
    xb = _blocks(x, NVFP4_BLOCK)
    r, k = x.shape
    ts = nvfp4_tensor_scale(x.float().abs().amax() if tensor_amax is None else tensor_amax)
    amax = xb.abs().amax(-1)  # (r, k/16)
    if two_d:
        tile = amax.view(r // NVFP4_BLOCK, NVFP4_BLOCK, -1).amax(1)
        amax = tile.repeat_interleave(NVFP4_BLOCK, dim=0)
    e4m3 = torch.finfo(torch.float8_e4m3fn)
    scale = torch.clamp(amax / 6.0 / ts, min=e4m3.tiny, max=e4m3.max).to(torch.float8_e4m3fn)
    recip = (1.0 / ts) / scale.float()
    y = (xb * recip[..., None]).clamp(-fmt.max, fmt.max).reshape(r, k)
    return y, scale, ts


# ---- random Hadamard transform --------------------------------------------------------------------------------
def hadamard(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of size ``n`` (a power of two), ``H @ H.T = I``. Raises
    ``ValueError`` otherwise."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard transform needs a power-of-2 size, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / math.sqrt(n)).to(dtype)


def random_hadamard(signs: torch.Tensor) -> torch.Tensor:
    """``diag(signs) @ H`` (float32, n x n) for a vector of +-1 ``signs`` of power-of-2 length: orthogonal, so
    applying it to both GEMM operands along K leaves the product unchanged (arXiv 2509.25149 section 4.2)."""
    return signs.float()[:, None] * hadamard(signs.numel())


def apply_rht(x: torch.Tensor, rht: torch.Tensor) -> torch.Tensor:
    """``x`` (rows, K) float with each consecutive group of ``n = rht.shape[0]`` elements along K multiplied by the
    n x n transform ``rht``; float32 out. Raises ``ValueError`` when n does not divide K."""
    r, k = x.shape
    n = rht.shape[0]
    if k % n:
        raise ValueError(f"the random Hadamard transform of size {n} needs K={k} divisible by {n}")
    return (x.float().reshape(r, k // n, n) @ rht).reshape(r, k)
