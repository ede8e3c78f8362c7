"""The blockwise FP8 GEMM kernels (``lowprec.kernels.blockwise``) on a GPU against the emulated reference.

Each kernel lowprec can choose (torch's cuBLASLt ``torch_scaled_mm_blockwise``, torchao's Triton
``torchao_triton_blockwise``) runs ``fp8_gemm`` on the *same* quantized operands as the CPU reference
(``backend="emulated"``: dequantize, one FP32 matmul) for the pairs lowprec issues: 1x128 tiles x 128x128 blocks
(output and input-gradient GEMMs), 1x128 x 1x128 (weight gradient) and, on torch's kernel only, 128x128 x 1x128
(the weight gradient with ``grad_output_granularity=block128x128``). Bounds, as in ``test_gpu_fp8_gemm.py``:
SQNR against the reference >= 40 dB (the kernels differ from it only in accumulation order and the final
rounding), and SQNR against the unquantized FP32 product no more than 0.5 dB below the reference's own (a kernel
cannot be more wrong than FP8 quantization already is). Bit-level agreement between kernels is not expected.
Also: the device's choice is torch's kernel wherever its preconditions hold (sm90, CUDA 12.9+, torch >= 2.10).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gpu_helpers import needs_sm

from lowprec.float8.gemm import fp8_gemm
from lowprec.kernels.blockwise import BLOCKWISE_RUNNERS, probe_blockwise_gemm, select_blockwise_gemm
from lowprec.kernels.scaled_mm import native_blockwise_supported
from lowprec.numerics.formats import E4M3, sqnr_db
from lowprec.numerics.scaling import QTensor, quantize_operand

pytestmark = [pytest.mark.gpu, needs_sm(9, 0, "blockwise FP8 GEMM kernels vs the emulated reference (>= 40 dB)")]

MIN_SQNR_DB = 40.0
# (M, N, K). Two shapes: torchao's Triton GEMM autotunes 6 configurations per (N, K), about a second each.
SHAPES = [(256, 1024, 4096), (128, 384, 1024)]
TORCHAO = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="needs torchao; would check its Triton blockwise GEMM"
)
#: (a, bt) granularities: the output / input-gradient GEMM, the weight-gradient GEMM, and the weight gradient of
#: grad_output_granularity=block128x128 (torch's kernel only).
PAIRS = [("tile1x128", "block128x128"), ("tile1x128", "tile1x128"), ("block128x128", "tile1x128")]
KERNELS = [
    pytest.param("torch_scaled_mm_blockwise", id="torch"),
    pytest.param("torchao_triton_blockwise", marks=TORCHAO, id="torchao"),
]


def _operand(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g) * torch.exp(6 * torch.rand(rows, 1, generator=g) - 3)


def _cuda(q: QTensor) -> QTensor:
    return QTensor(q.data.cuda(), q.scale.cuda(), q.granularity, q.fmt)


def test_the_device_chooses_torchs_kernel_where_it_can_exist():
    dev = torch.device("cuda")
    if not native_blockwise_supported(dev):
        pytest.skip(f"torch {torch.__version__} / CUDA {torch.version.cuda}: no native blockwise kernel here")
    assert probe_blockwise_gemm("torch_scaled_mm_blockwise", dev) is None
    assert select_blockwise_gemm(dev) == "torch_scaled_mm_blockwise"


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16-out", "fp32-out"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("gran_a, gran_b", PAIRS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_blockwise_kernel_matches_the_emulated_reference(kernel, gran_a, gran_b, shape, out_dtype):
    if kernel == "torch_scaled_mm_blockwise" and not native_blockwise_supported(torch.device("cuda")):
        pytest.skip("no native blockwise kernel in this torch/CUDA build")
    if gran_a == "block128x128" and kernel != "torch_scaled_mm_blockwise":
        pytest.skip(f"{kernel} has no 128x128 x 1x128 GEMM (that GEMM runs K-chunked there)")
    m, n, k = shape
    x, w = _operand(m, k, 0), _operand(n, k, 1)
    a, bt = quantize_operand(x, E4M3, gran_a), quantize_operand(w, E4M3, gran_b)
    ref = fp8_gemm(a, bt, torch.float32, backend="emulated")
    calls = []
    real = BLOCKWISE_RUNNERS[kernel]
    BLOCKWISE_RUNNERS[kernel] = lambda call: calls.append(call.recipe_b) or real(call)
    try:
        out = fp8_gemm(_cuda(a), _cuda(bt), out_dtype, blockwise_gemm=kernel)
    finally:
        BLOCKWISE_RUNNERS[kernel] = real
    assert len(calls) == 1, f"{kernel} did not run as one blockwise call"
    assert out.dtype == out_dtype and out.shape == (m, n)
    db = sqnr_db(ref, out.float().cpu())
    assert db >= MIN_SQNR_DB, f"{kernel} {gran_a} x {gran_b} {shape} -> {out_dtype}: {db:.1f} dB"
    exact = x @ w.t()
    assert sqnr_db(exact, out.float().cpu()) >= sqnr_db(exact, ref) - 0.5, kernel
