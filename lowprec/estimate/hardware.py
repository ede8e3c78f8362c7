"""Accelerator facts for estimates and MFU: memory capacity and dense peak throughput per dtype, and the compute
capability by which the FP8 backends decide whether a part can run a recipe (``lowprec.estimate.runnable``).

All peaks are **dense** tensor-core figures in TFLOP/s (10**12 FLOP/s) from the vendors' datasheets,
i.e. half the "with sparsity" numbers NVIDIA prints first. Memory is the datasheet capacity in
decimal bytes (80 GB -> 80e9). CUDA reports a little more on most parts (HBM stacks come in binary
sizes: an "80GB" H100 shows about 79.6 GiB = 85.5e9 bytes total, of which the CUDA context takes
roughly 0.5 GiB), so comparing an estimate against ``memory_bytes`` errs on the safe side.

Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5, PCIe and NVL columns); NVIDIA H200 datasheet
(same SXM compute as H100, 141 GB HBM3e); NVIDIA A100 datasheet (80GB SXM); NVIDIA Blackwell/HGX
B200 datasheet (per-GPU figures of the 8-GPU HGX B200, approximate: NVIDIA lists 180 GB or 192 GB
depending on the document); AMD Instinct MI300X datasheet (dense figures); torchtitan
``benchmarks/llama3_h100_202412_torchtitan.md`` for the 96 GB HBM2e H100 at 500 W of its benchmarks.

The cost model (``lowprec.estimate.cost_model``) also reads ``hbm_tb_s`` (datasheet HBM bandwidth, TB/s),
``intra_gb_s`` (per-GPU, per-direction bandwidth to the GPUs of its node: NVLink / Infinity Fabric / PCIe),
``inter_gb_s`` (per-GPU network bandwidth to other nodes, the usual one 400 Gb/s NIC per GPU = 50 GB/s;
A100 systems: 200 Gb/s), ``gpus_per_node``, ``vendor`` (``nvidia`` / ``amd``: the cost model fits one
factor for attention on the ROCm stack) and ``gemm_rel_bf16`` / ``gemm_rel_fp8``: the part's measured
maximum-achievable matmul efficiency (achieved / dense peak) in that dtype, relative to the H100 SXM's, whose
efficiency the calibration carries. The efficiencies are measured ceilings of large GEMMs, not fitted:

| part | bf16 | fp8 | source |
|---|---|---|---|
| H100 SXM | 794.5 / 989 = 80.3% | 1402.6 / 1979 = 70.9% | MAMF [1] (torch 2.7.0+cu126) |
| H200 | "the same" as H100 | 1453.4 / 1979 = 73.4% | MAMF [1] |
| B200 | 1745.0 / 2250 = 77.6% | 3432.5 / 4500 = 76.3% | MAMF [1] (torch 2.7.1+cu128) |
| GB200 | 1822.0 / 2500 = 72.9% | 3615.6 / 5000 = 72.3% | MAMF [1] (torch 2.10.0.dev+cu130) |
| A100 SXM | 271.2 / 312 = 86.9% | (no FP8) | MAMF [1] |
| MI300X | 708 / 1307.4 = 54.2% | 1273 / 2614.9 = 48.7% | AMD MAF [2] (hipBLASLt) |

[1] Stas Bekman, ml-engineering, ``compute/accelerator/README.md``, "Maximum Achievable Matmul FLOPS comparison
table" (commit 744d01e, 2026-08), ``mamf-finder.py``, mean of 100 iterations, best shape of a sweep. [2] AMD ROCm
blog "Measuring Max-Achievable FLOPs - Part 2" (Sander et al., 2025-02-28), Table 1, ``hipblaslt-bench``. Both
MI300X dtypes come from [2], so its bf16 : fp8 ratio is one campaign's; [1] has no MI300X FP8 row. The H100 96 GB
/ 500 W and H100 PCIe/NVL have no measurement: 1.0 (the calibration is fitted on the 96 GB part). FP4 GEMMs take
``gemm_rel_fp8``. These replace an earlier MI300X FP8 factor of 0.9 read off a SemiAnalysis chart
("MI300X vs H100 vs H200 Benchmark Part 1: Training", Dec 2024), which the two measured tables do not support
(they give 1.02).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lowprec.errors import ConfigError


@dataclass(frozen=True)
class Hardware:
    """One accelerator.

    ``memory_bytes``: device memory, decimal bytes. ``bf16_tflops`` / ``fp8_tflops``: dense tensor-core
    peaks in TFLOP/s (``fp8_tflops`` is ``None`` where the part has no FP8 tensor cores).
    ``note``: where the figures come from and their caveats. ``fp32_tflops``: plain FP32 (non tensor-core)
    peak, the rate of FP32 matmuls under torch's default ``allow_tf32=False`` (``None`` if unknown).
    """

    name: str
    memory_bytes: int
    bf16_tflops: float
    fp8_tflops: float | None
    note: str
    fp32_tflops: float | None = None
    hbm_tb_s: float = 3.35
    intra_gb_s: float = 450.0
    inter_gb_s: float = 50.0
    gpus_per_node: int = 8
    vendor: str = "nvidia"
    #: measured max-achievable matmul efficiency relative to the H100 SXM's, per dtype (module doc)
    gemm_rel_fp8: float = 1.0
    gemm_rel_bf16: float = 1.0
    #: dense FP4 (E2M1: NVFP4 / MXFP4) tensor-core peak, TFLOP/s; ``None`` before Blackwell. FP6 runs at the FP8
    #: rate on Blackwell, so ``fp8_tflops`` is its peak too.
    fp4_tflops: float | None = None
    #: what ``torch.cuda.get_device_capability()`` returns on the part (CUDA SM; ROCm reports the gfx arch, 9.4 for
    #: the MI300X's gfx942): the FP8 backends decide from it whether they can run (``Float8Backend.hardware_blocker``)
    compute_capability: tuple[int, int] | None = None

    def peak_tflops(self, dtype: str) -> float:
        """Dense peak for ``dtype`` (``bf16``, ``fp16``, ``fp8``, ``fp6``, ``fp4``, ``fp32``) in TFLOP/s.

        Raises ``ValueError`` if the part has no such units (e.g. FP8 on A100) or the dtype is unknown.
        """
        value = {
            "bf16": self.bf16_tflops,
            "fp16": self.bf16_tflops,
            "fp8": self.fp8_tflops,
            "fp6": self.fp8_tflops if self.fp4_tflops is not None else None,  # Blackwell: FP6 at the FP8 rate
            "fp4": self.fp4_tflops,
            "fp32": self.fp32_tflops,
        }.get(dtype, "unknown")
        if value == "unknown":
            raise ValueError(f"unknown compute dtype {dtype!r}; known: bf16, fp16, fp8, fp6, fp4, fp32")
        if value is None:
            raise ValueError(f"{self.name} has no {dtype} peak (no {dtype} tensor cores or figure unknown)")
        return float(value)

    def to_dict(self) -> dict:
        return asdict(self)


#: measured max-achievable matmul efficiency (achieved TFLOP/s / dense peak) per dtype (module doc, [1] and [2])
H100_MAMF = {"bf16": 794.5 / 989.0, "fp8": 1402.6 / 1979.0}
MI300X_MAF = {"bf16": 708.0 / 1307.4, "fp8": 1273.0 / 2614.9}
MEASURED_MATMUL_EFF = {
    "h100_sxm": H100_MAMF,
    "h200": {"bf16": H100_MAMF["bf16"], "fp8": 1453.4 / 1979.0},
    "b200": {"bf16": 1745.0 / 2250.0, "fp8": 3432.5 / 4500.0},
    "gb200": {"bf16": 1822.0 / 2500.0, "fp8": 3615.6 / 5000.0},
    "a100_80gb": {"bf16": 271.2 / 312.0},
    "mi300x": MI300X_MAF,
}


def _rel(name: str) -> dict:
    """``gemm_rel_*`` keyword arguments of part ``name``: its measured matmul efficiency over the H100 SXM's."""
    return {f"gemm_rel_{k}": v / H100_MAMF[k] for k, v in MEASURED_MATMUL_EFF[name].items()}


#: name -> Hardware. Names are lower-case; ``get_hardware`` also accepts the aliases in ``ALIASES``.
HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            "h100_sxm",
            80 * 10**9,
            989.0,
            1979.0,
            "NVIDIA H100 SXM5 80GB HBM3 datasheet, dense (sparse figures / 2); FP32 67 TFLOP/s; HBM3 3.35 TB/s; "
            "NVLink 4 900 GB/s bidirectional",
            67.0,
            3.35,
            450.0,
            compute_capability=(9, 0),
        ),
        Hardware(
            "h100_96gb_500w",
            96 * 10**9,
            912.0,
            1825.0,
            "H100 SXM with 96 GB HBM2e (2.4 TB/s) at the 500 W power limit, torchtitan's benchmark machine "
            "(benchmarks/llama3_h100_202412_torchtitan.md: 'the actual peak TFLOPs number is between SXM and NVL, "
            "and we don't know its exact value'): peaks are the midpoint of SXM (989/1979) and NVL (835/1671) "
            "dense; NVLink 4; 400 Gb/s RDMA per GPU",
            63.0,
            2.4,
            450.0,
            compute_capability=(9, 0),
        ),
        Hardware(
            "h100_pcie",
            80 * 10**9,
            756.0,
            1513.0,
            "NVIDIA H100 PCIe 80GB datasheet, dense (sparse figures / 2); FP32 51 TFLOP/s; HBM2e 2.0 TB/s; "
            "GPUs talk over PCIe Gen5 (64 GB/s per direction) without NVLink bridges",
            51.0,
            2.0,
            64.0,
            compute_capability=(9, 0),
        ),
        Hardware(
            "h200",
            141 * 10**9,
            989.0,
            1979.0,
            "NVIDIA H200 SXM 141GB HBM3e datasheet: H100 SXM compute, dense; FP32 67 TFLOP/s; HBM3e 4.8 TB/s; NVLink 4",
            67.0,
            4.8,
            450.0,
            **_rel("h200"),
            compute_capability=(9, 0),
        ),
        Hardware(
            "a100_80gb",
            80 * 10**9,
            312.0,
            None,
            "NVIDIA A100 80GB SXM datasheet, dense; no FP8 tensor cores (SM80); FP32 19.5 TFLOP/s; HBM2e "
            "2.039 TB/s; NVLink 3 600 GB/s bidirectional; 200 Gb/s HDR per GPU",
            19.5,
            2.039,
            300.0,
            25.0,
            **_rel("a100_80gb"),
            compute_capability=(8, 0),
        ),
        Hardware(
            "b200",
            192 * 10**9,
            2250.0,
            4500.0,
            "NVIDIA HGX B200 datasheet per GPU, approximate (~2.25 PF bf16, ~4.5 PF fp8/fp6, ~9 PF fp4 dense: the "
            "sparse figures 18 PF fp4, 9 PF fp8/fp6, 4.5 PF bf16 halved); some documents list 180 GB; FP32 ~75 "
            "TFLOP/s; HBM3e 8 TB/s; NVLink 5 1.8 TB/s bidirectional",
            75.0,
            8.0,
            900.0,
            fp4_tflops=9000.0,
            **_rel("b200"),
            compute_capability=(10, 0),
        ),
        Hardware(
            "gb200",
            186 * 10**9,
            2500.0,
            5000.0,
            "NVIDIA GB200 NVL72 datasheet divided by its 72 Blackwell GPUs, approximate (rack: 1,440 PF fp4, 720 PF "
            "fp8/fp6, 360 PF bf16, all with sparsity; dense = half: per GPU 10 PF fp4, 5 PF fp8/fp6, 2.5 PF bf16); "
            "13.4 TB HBM3e per rack = 186 GB per GPU at 8 TB/s; NVLink 5 1.8 TB/s bidirectional within the 72-GPU "
            "domain; FP32 5,760 TFLOP/s per rack = 80 per GPU",
            80.0,
            8.0,
            900.0,
            50.0,
            72,
            fp4_tflops=10000.0,
            **_rel("gb200"),
            compute_capability=(10, 0),
        ),
        Hardware(
            "mi300x",
            192 * 10**9,
            1307.4,
            2614.9,
            "AMD Instinct MI300X datasheet, dense (bf16 1307.4, fp8 2614.9 TFLOP/s; FP32 vector 163.4); HBM3 "
            "5.3 TB/s; 7 Infinity Fabric links of 64 GB/s per direction to the other 7 GPUs of the node",
            163.4,
            5.3,
            448.0,
            50.0,
            8,
            "amd",
            **_rel("mi300x"),
            compute_capability=(9, 4),
        ),
    )
}

ALIASES = {
    "h100": "h100_sxm",
    "h100-sxm": "h100_sxm",
    "h100-pcie": "h100_pcie",
    "a100": "a100_80gb",
    "a100-80gb": "a100_80gb",
    "h100-96gb-500w": "h100_96gb_500w",
}


class UnknownHardwareError(ConfigError, KeyError):
    """A hardware name the table does not list: the user's input (a ``ConfigError``, printed as one line), and a
    ``KeyError`` for callers that look parts up like a dict."""

    def __str__(self) -> str:  # KeyError's own would quote the message
        return str(self.args[0]) if self.args else ""


def get_hardware(name: str) -> Hardware:
    """The named device (case-insensitive; aliases ``h100``, ``a100`` ...). Raises ``UnknownHardwareError`` (a
    ``ConfigError`` and a ``KeyError``) listing the known names."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in HARDWARE:
        raise UnknownHardwareError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}")
    return HARDWARE[key]


def cuda_device_hardware() -> tuple[str, Hardware]:
    """``(name, table entry)`` of CUDA device 0 (``torch.cuda.get_device_name(0)``, ``hardware_from_device_name``).
    Raises ``RuntimeError`` without CUDA and ``LookupError`` for a part this table does not list."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available; this needs a GPU")
    name = torch.cuda.get_device_name(0)
    hw = hardware_from_device_name(name)
    if hw is None:
        raise LookupError(f"{name!r} is not in lowprec.estimate.hardware")
    return name, hw


def hardware_from_device_name(device_name: str | None) -> Hardware | None:
    """The table entry for a CUDA device name (``torch.cuda.get_device_name()``, e.g.
    ``"NVIDIA H100 80GB HBM3"``), or ``None`` for a CPU, ``None`` or an unlisted part (MFU is then
    reported as ``None`` rather than against a guessed peak). A100s other than the 80GB part return ``None``."""
    if not device_name:
        return None
    n = device_name.upper()
    if "H100" in n:
        return HARDWARE["h100_pcie" if "PCIE" in n else "h100_sxm"]
    if "H200" in n:
        return HARDWARE["h200"]
    if "B200" in n:
        return HARDWARE["b200"]
    if "MI300X" in n:
        return HARDWARE["mi300x"]
    if "A100" in n and "80GB" in n.replace(" ", ""):
        return HARDWARE["a100_80gb"]
    return None
