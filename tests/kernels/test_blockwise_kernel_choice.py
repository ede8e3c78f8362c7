"""Which kernel runs blockwise FP8 GEMMs (``lowprec.kernels.blockwise``): the choice on a faked GPU, the probe
against stand-ins that implement each kernel's documented contract in torch on the CPU (so the layouts lowprec
builds for torch's cuBLASLt kernel and for torchao's Triton GEMM are checked here, without a GPU), and what a
run's effective recipe records. The kernels themselves are checked on a GPU in
``tests/gpu/test_gpu_blockwise_kernels.py``."""

from __future__ import annotations

import json

import pytest
import torch
from mlflow.tracking import MlflowClient

import lowprec.kernels.blockwise as bw
from lowprec.errors import RecipeError
from lowprec.float8.gemm import fp8_gemm
from lowprec.kernels import resolve_kernels
from lowprec.numerics.formats import E4M3, sqnr_db
from lowprec.numerics.scaling import quantize_operand
from lowprec_lab.cli import main

CPU = torch.device("cpu")


def _expand_cols(s: torch.Tensor, k: int) -> torch.Tensor:
    return s.repeat_interleave(128, dim=-1)[..., :k]


def _laid_out(t: torch.Tensor, shape: tuple, stride: tuple) -> bool:
    # torch's check_size_stride: the stride of a dimension of size 1 is not checked.
    return tuple(t.shape) == shape and all(n == 1 or s == e for n, s, e in zip(shape, t.stride(), stride))


def _torch_contract(call) -> torch.Tensor:
    """torch's ``_scaled_mm_v2`` blockwise contract (``ScaledBlas.cpp`` ``_scaled_block1x128_block128x128``,
    ``_scaled_block128x128_block1x128``, ``_scaled_block1x128_block1x128``), strides asserted, computed in FP32."""
    a, b = call.mat_a, call.mat_b  # (M, K) row-major, (K, N) column-major
    (m, k), n, kb = a.shape, b.shape[1], a.shape[1] // 128
    l4 = -(-kb // 4) * 4
    assert a.stride() == (k, 1) and b.stride() == (1, k)
    if call.recipe_a == "BlockWise128x128":
        assert _laid_out(call.scale_a, (l4, m // 128), (1, l4))
        sa = _expand_cols(call.scale_a[:kb].t().repeat_interleave(128, dim=0), k)
    else:
        assert _laid_out(call.scale_a, (m, kb), (1, m))
        sa = _expand_cols(call.scale_a, k)
    if call.recipe_b == "BlockWise128x128":
        assert _laid_out(call.scale_b, (l4, n // 128), (1, l4))
        sb = _expand_cols(call.scale_b[:kb].t().repeat_interleave(128, dim=0), k)
    else:
        assert _laid_out(call.scale_b, (n, kb), (1, n))
        sb = _expand_cols(call.scale_b, k)
    return ((a.float() * sa) @ (b.float().t() * sb).t()).to(call.out_dtype)


def _torchao_contract(call) -> torch.Tensor:
    """torchao's ``triton_fp8_gemm_1x128_128x128`` / ``_128x1`` contract (their asserts and their kernels'
    indexing: ``b_s`` (K/128, N/128) column-major, or (K/128, N) row-major), computed in FP32 on the CPU."""
    a, b = call.mat_a, call.mat_b
    (m, k), n, kb = a.shape, b.shape[1], a.shape[1] // 128
    assert a.stride() == (k, 1) and b.stride() == (1, k)
    assert _laid_out(call.scale_a, (m, kb), (1, m))
    sa = _expand_cols(call.scale_a, k)
    if call.recipe_b == "BlockWise128x128":
        assert _laid_out(call.scale_b, (kb, n // 128), (1, kb))
        sb = _expand_cols(call.scale_b.t().repeat_interleave(128, dim=0), k)
    else:
        assert _laid_out(call.scale_b, (kb, n), (n, 1))
        sb = _expand_cols(call.scale_b.t(), k)
    return ((a.float() * sa) @ (b.float().t() * sb).t()).to(call.out_dtype)


@pytest.fixture
def stand_ins(monkeypatch):
    """Both kernels replaced by their contracts; torchao reported as installed."""
    monkeypatch.setitem(bw.BLOCKWISE_RUNNERS, "torch_scaled_mm_blockwise", _torch_contract)
    monkeypatch.setitem(bw.BLOCKWISE_RUNNERS, "torchao_triton_blockwise", _torchao_contract)
    monkeypatch.setattr(bw, "torchao_blockwise_available", lambda: True)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device index 0 named 'Fake H100' (sm 9.0) whose probe results the test sets."""
    bw._cuda_choice.cache_clear()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake H100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    results = {}
    monkeypatch.setattr(bw, "probe_blockwise_gemm", lambda kernel, device: results.get(kernel))
    yield results
    bw._cuda_choice.cache_clear()


def test_a_cpu_runs_blockwise_gemms_emulated():
    assert bw.select_blockwise_gemm(CPU) == "emulated"
    assert resolve_kernels("native", CPU, blockwise=True).blockwise == "emulated"


@pytest.mark.parametrize(
    "failing, chosen",
    [
        ((), "torch_scaled_mm_blockwise"),
        (("torch_scaled_mm_blockwise",), "torchao_triton_blockwise"),
    ],
)
def test_a_gpu_takes_the_first_kernel_whose_probe_passes(fake_gpu, failing, chosen):
    fake_gpu.update(dict.fromkeys(failing, "RuntimeError: no kernel"))
    assert bw.select_blockwise_gemm(torch.device("cuda")) == chosen
    policy = resolve_kernels("auto", torch.device("cuda"), blockwise=True)
    assert policy.blockwise == chosen and policy.summary()["fp8_blockwise_gemm"] == chosen
    assert resolve_kernels("auto", torch.device("cuda")).blockwise == "emulated"  # no blockwise GEMM, no probe


def test_a_gpu_without_a_blockwise_kernel_is_refused_with_each_reason(fake_gpu):
    fake_gpu.update(
        {"torch_scaled_mm_blockwise": "torch 2.9 has no F.scaled_mm", "torchao_triton_blockwise": "not installed"}
    )
    with pytest.raises(RecipeError, match="no blockwise FP8 GEMM kernel on Fake H100 .sm 9.0") as e:
        resolve_kernels("native", torch.device("cuda"), blockwise=True)
    assert "torch 2.9 has no F.scaled_mm" in str(e.value) and "torchao_triton_blockwise: not installed" in str(e.value)
    assert "does not emulate them on a GPU" in str(e.value)


@pytest.mark.parametrize("kernel", ["torch_scaled_mm_blockwise", "torchao_triton_blockwise"])
def test_the_probe_passes_a_kernel_given_its_layouts(stand_ins, kernel):
    assert bw.probe_blockwise_gemm(kernel, CPU) is None


def test_the_probe_rejects_a_kernel_that_misreads_a_scale(stand_ins, monkeypatch):
    def transposed_blocks(call):  # takes each 128-row weight block's scales from the block at the other end
        if call.recipe_b == "BlockWise128x128":
            call.scale_b = bw.column_major(call.scale_b.flip(1))
        return _torch_contract(call)

    monkeypatch.setitem(bw.BLOCKWISE_RUNNERS, "torch_scaled_mm_blockwise", transposed_blocks)
    why = bw.probe_blockwise_gemm("torch_scaled_mm_blockwise", CPU)
    assert why is not None and why.startswith("1x128 x 128x128") and "dB SQNR" in why


_NAMES = {"BlockWise1x128": "1x128", "BlockWise128x128": "128x128"}
_TILE_BLOCK, _TILE_TILE, _BLOCK_TILE = (
    ("BlockWise1x128", "BlockWise128x128"),
    ("BlockWise1x128", "BlockWise1x128"),
    ("BlockWise128x128", "BlockWise1x128"),
)
#: Each pairing fp8_gemm sends to each kernel (128x128 x 1x128: grad_output_granularity=block128x128, torch only).
_PAIRINGS = [
    ("torch_scaled_mm_blockwise", _torch_contract, _TILE_BLOCK),
    ("torch_scaled_mm_blockwise", _torch_contract, _TILE_TILE),
    ("torch_scaled_mm_blockwise", _torch_contract, _BLOCK_TILE),
    ("torchao_triton_blockwise", _torchao_contract, _TILE_BLOCK),
    ("torchao_triton_blockwise", _torchao_contract, _TILE_TILE),
]


@pytest.mark.parametrize(
    "kernel, contract, pair", _PAIRINGS, ids=[f"{k} {_NAMES[p[0]]} x {_NAMES[p[1]]}" for k, _, p in _PAIRINGS]
)
def test_the_probe_checks_every_pairing_the_kernel_runs(stand_ins, monkeypatch, kernel, contract, pair):
    """A kernel wrong on one pairing only (it decodes with twice the scale: an exponent off by one) is refused,
    whichever pairing it is: the probe runs each pairing fp8_gemm sends to that kernel."""
    seen = []

    def wrong_on_one_pairing(call):
        seen.append((call.recipe_a, call.recipe_b))
        out = contract(call)
        return out * 2 if (call.recipe_a, call.recipe_b) == pair else out

    monkeypatch.setitem(bw.BLOCKWISE_RUNNERS, kernel, wrong_on_one_pairing)
    why = bw.probe_blockwise_gemm(kernel, CPU)
    name = f"{_NAMES[pair[0]]} x {_NAMES[pair[1]]}"
    assert why is not None and why.startswith(name) and "dB SQNR" in why, why
    assert seen[-1] == pair


def test_the_probe_reports_a_kernel_that_raises(monkeypatch):
    # The real torch op on a CPU: blockwise scaling is refused ("Invalid scaling configuration").
    why = bw.probe_blockwise_gemm("torch_scaled_mm_blockwise", CPU)
    assert why is not None and "Error" in why
    monkeypatch.setattr(bw, "torchao_blockwise_available", lambda: False)
    assert bw.probe_blockwise_gemm("torchao_triton_blockwise", CPU) == "torchao or triton is not installed"


@pytest.mark.parametrize("kernel", ["torch_scaled_mm_blockwise", "torchao_triton_blockwise"])
@pytest.mark.parametrize("gran_b", ["block128x128", "tile1x128"])
def test_fp8_gemm_on_a_blockwise_kernel_matches_the_reference(stand_ins, kernel, gran_b):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 512, generator=g) * torch.exp(4 * torch.rand(128, 1, generator=g) - 2)
    w = torch.randn(256, 512, generator=g)
    a, bt = quantize_operand(x, E4M3, "tile1x128"), quantize_operand(w, E4M3, gran_b)
    ref = fp8_gemm(a, bt, torch.float32, backend="emulated")
    calls = []
    real = bw.BLOCKWISE_RUNNERS[kernel]
    bw.BLOCKWISE_RUNNERS[kernel] = lambda call: calls.append(call) or real(call)
    try:
        out = fp8_gemm(a, bt, torch.bfloat16, blockwise_gemm=kernel)
    finally:
        bw.BLOCKWISE_RUNNERS[kernel] = real
    assert len(calls) == 1, "one blockwise call, not 128-wide K chunks"
    assert sqnr_db(ref, out.float()) >= 40.0


@pytest.mark.parametrize("kernel, n_calls", [("torch_scaled_mm_blockwise", 1), ("torchao_triton_blockwise", 0)])
def test_block_by_tile_runs_on_torchs_kernel_only(stand_ins, kernel, n_calls):
    # grad_output_granularity=block128x128's weight gradient: torch has a 128x128 x 1x128 kernel, torchao has not
    # (its GEMM runs as 128-wide K chunks of rowwise calls there).
    g = torch.Generator().manual_seed(2)
    a = quantize_operand(torch.randn(256, 640, generator=g), E4M3, "block128x128")
    bt = quantize_operand(torch.randn(128, 640, generator=g) * 3, E4M3, "tile1x128")
    calls = []
    real = bw.BLOCKWISE_RUNNERS[kernel]
    bw.BLOCKWISE_RUNNERS[kernel] = lambda call: calls.append(call) or real(call)
    try:
        out = fp8_gemm(a, bt, torch.float32, blockwise_gemm=kernel)
    finally:
        bw.BLOCKWISE_RUNNERS[kernel] = real
    assert len(calls) == n_calls
    assert sqnr_db(fp8_gemm(a, bt, torch.float32, backend="emulated"), out) >= 40.0


def test_the_emulated_path_is_unchanged():
    # The CPU default: no blockwise kernel; 128-wide chunks, bit-identical to asking for "emulated" explicitly.
    g = torch.Generator().manual_seed(1)
    a = quantize_operand(torch.randn(64, 384, generator=g), E4M3, "tile1x128")
    bt = quantize_operand(torch.randn(128, 384, generator=g), E4M3, "block128x128")
    for kernel in ("native", "emulated"):
        default = fp8_gemm(a, bt, torch.bfloat16, kernel=kernel)
        assert torch.equal(default, fp8_gemm(a, bt, torch.bfloat16, kernel=kernel, blockwise_gemm="emulated"))
    with pytest.raises(ValueError, match="unknown blockwise GEMM kernel 'cutlass'"):
        fp8_gemm(a, bt, torch.bfloat16, blockwise_gemm="cutlass")


def test_a_run_records_its_blockwise_gemm_kernel(run_dirs, tmp_path):
    common = ["model=debug", "model.dim=128", "model.n_heads=2", "model.n_kv_heads=1", "model.multiple_of=128"]
    common += ["train.steps=2", "train.timing_warmup_steps=1", "train.batch_size=2", "train.seq_len=64"]
    assert main(["train", *run_dirs, *common, "recipe=fp8_blockwise", "cpu_kernels=native"]) == 0
    assert main(["train", *run_dirs, *common, "recipe=fp8_rowwise", "cpu_kernels=native"]) == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], order_by=["start_time"])
    blockwise, rowwise = (r.data.tags for r in runs)
    assert blockwise["effective_matches"] == "true" and blockwise["fp8_blockwise_gemm"] == "emulated"
    kernels = json.loads(blockwise["effective_recipe"])["kernels"]
    assert kernels == {"bf16": "native", "fp8": "native", "fp8_blockwise_gemm": "emulated", "fp8_casts": "eager"}
    assert "fp8_blockwise_gemm" not in json.loads(rowwise["effective_recipe"])["kernels"]


def test_the_choice_is_a_constant_under_torch_compile(monkeypatch):
    # A compiled GEMM without an explicit kernel asks for the device's choice; dynamo must not trace the probe
    # (random operands, host copies: a graph break, so fullgraph=True would fail).
    def untraceable_probe(index):
        torch.randn(2, generator=torch.Generator().manual_seed(0)).cpu().tolist()
        return "torchao_triton_blockwise", ()

    monkeypatch.setattr(bw, "_cuda_choice", untraceable_probe)

    def gemm_kernel(x):
        kernel = bw.select_blockwise_gemm(torch.device("cuda", 0))
        return x * (2 if kernel == "torchao_triton_blockwise" else 3)

    torch._dynamo.reset()
    out = torch.compile(gemm_kernel, fullgraph=True, backend="eager")(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0))


def test_the_kernel_choice_is_marked_as_dynamo_marks_a_constant_result():
    """``select_blockwise_gemm`` sets by hand what ``torch._dynamo.assume_constant_result`` sets (so that importing
    lowprec does not import dynamo); on CUDA a traced FP8 step would otherwise trace into the probe and break the
    graph. Fails if torch changes what the decorator marks."""
    import torch._dynamo

    from lowprec.kernels.blockwise import select_blockwise_gemm

    def plain():
        return None

    before = dict(vars(plain))
    marked = {k: v for k, v in vars(torch._dynamo.assume_constant_result(plain)).items() if k not in before}
    assert marked and all(getattr(select_blockwise_gemm, k, None) == v for k, v in marked.items()), marked
