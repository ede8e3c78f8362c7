"""Every scaled matmul lowprec would hand a CUDA GPU satisfies the kernel's documented contract, checked on CPU.

For each catalog recipe whose FP8 GEMMs are lowprec's, a ``Float8Linear`` runs forward and backward on CPU and
its three GEMMs' quantized operands are recorded; ``scaled_mm_calls`` turns them into the exact calls the
kernel would receive, with the native sm90 blockwise kernel and with the K-chunked path. Each call is replayed
on fake CUDA tensors (same shapes, strides, dtypes) through ``torch.nn.functional.scaled_mm``, whose meta
kernel runs torch's own CUDA checks (``torch/_meta_registrations.py``: row-major ``mat_a``, column-major
``mat_b``, dims divisible by 16, scale shapes and strides per ``ScalingType``). A layout error a GPU run would
meet at its first step fails here instead.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import lowprec.float8.linear as linear_mod
from lowprec.float8 import Float8Linear
from lowprec.float8.config import linear_config
from lowprec.float8.gemm import scaled_mm_calls
from lowprec.kernels.scaled_mm import SCALED_MM_OP
from lowprec.recipes import CATALOG

LOWPREC_FP8 = [n for n, r in CATALOG.items() if r.fp8.backend == "lowprec" and r.fp8.gemm.gemm_backend == "scaled_mm"]
#: tokens, in_features, out_features: multiples of 128 so the native blockwise kernel applies
SHAPE = (256, 256, 384)

pytestmark = pytest.mark.skipif(SCALED_MM_OP != "torch.nn.functional.scaled_mm", reason="needs torch's public op")


@functools.cache
def _recorded_gemms(recipe: str) -> list[tuple]:
    tokens, fin, fout = SHAPE
    cfg = linear_config(CATALOG[recipe].fp8)
    lin = Float8Linear(fin, fout, False, cfg)
    seen = []
    real = linear_mod.fp8_gemm

    def recording(a, bt, out_dtype, backend, promotion_interval, accum_bits, kernel, promotion=True, **kw):
        seen.append((a, bt, out_dtype, promotion_interval))
        return real(a, bt, out_dtype, backend, promotion_interval, accum_bits, kernel, promotion, **kw)

    linear_mod.fp8_gemm = recording
    try:
        x = torch.randn(tokens, fin, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
        y.float().sum().backward()
    finally:
        linear_mod.fp8_gemm = real
    assert len(seen) == 3, "forward, grad_input and grad_weight GEMMs"
    return seen


def _replay_on_fake_cuda(call) -> torch.Size:
    def fake(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")

    with FakeTensorMode(allow_non_fake_inputs=True):
        out = F.scaled_mm(
            fake(call.mat_a),
            fake(call.mat_b),
            fake(call.scale_a),
            getattr(F.ScalingType, call.recipe_a),
            fake(call.scale_b),
            getattr(F.ScalingType, call.recipe_b),
            output_dtype=call.out_dtype,
        )
        return out.shape


@pytest.mark.parametrize("native_blockwise", [True, False], ids=["sm90-blockwise", "k-chunked"])
@pytest.mark.parametrize("recipe", LOWPREC_FP8)
def test_cuda_calls_meet_the_contract(recipe, native_blockwise):
    blockwise = CATALOG[recipe].fp8.scaling == "blockwise"
    kernel = "torch_scaled_mm_blockwise" if native_blockwise else "emulated"
    for a, bt, out_dtype, interval in _recorded_gemms(recipe):
        calls = scaled_mm_calls(a, bt, out_dtype, interval, kernel)
        if blockwise and native_blockwise and a.granularity == "tile1x128":  # CUDA has no 128x128 x 128x128 kernel
            assert len(calls) == 1 and calls[0].recipe_a == "BlockWise1x128", "the native kernel was not used"
        for call in calls:
            assert _replay_on_fake_cuda(call) == (a.shape[0], bt.shape[0])


def test_the_check_catches_a_row_major_second_operand():
    a, bt, out_dtype, interval = _recorded_gemms("fp8_current")[0]
    call = scaled_mm_calls(a, bt, out_dtype, interval)[0]
    call.mat_b = call.mat_b.contiguous()  # row-major: what passing bt.T without a transpose copy would give
    with pytest.raises(RuntimeError, match="col_major"):
        _replay_on_fake_cuda(call)


def test_the_check_catches_a_row_major_blockwise_scale():
    a, bt, out_dtype, interval = _recorded_gemms("fp8_blockwise")[0]
    call = scaled_mm_calls(a, bt, out_dtype, interval, "torch_scaled_mm_blockwise")[0]
    call.scale_a = call.scale_a.contiguous()  # (M, K/128) row-major instead of stride (1, M)
    with pytest.raises(RuntimeError, match="blockwise scaling"):
        _replay_on_fake_cuda(call)
