"""Accelerator facts for estimates and MFU: memory capacity and dense peak throughput per dtype.

All peaks are **dense** tensor-core figures in TFLOP/s (10**12 FLOP/s) from the vendors' datasheets,
i.e. half the "with sparsity" numbers NVIDIA prints first. Memory is the datasheet capacity in
decimal bytes (80 GB -> 80e9). CUDA reports a little more on most parts (HBM stacks come in binary
sizes: an "80GB" H100 shows about 79.6 GiB = 85.5e9 bytes total, of which the CUDA context takes
roughly 0.5 GiB), so comparing an estimate against ``memory_bytes`` errs on the safe side.

Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5 and PCIe columns); NVIDIA H200 datasheet
(same SXM compute as H100, 141 GB HBM3e); NVIDIA A100 datasheet (80GB SXM); NVIDIA Blackwell/HGX
B200 datasheet (per-GPU figures of the 8-GPU HGX B200, approximate: NVIDIA lists 180 GB or 192 GB
depending on the document).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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

    def peak_tflops(self, dtype: str) -> float:
        """Dense peak for ``dtype`` (``bf16``, ``fp16``, ``fp8``, ``fp32``) in TFLOP/s.

        Raises ``ValueError`` if the part has no such units (e.g. FP8 on A100) or the dtype is unknown.
        """
        value = {
            "bf16": self.bf16_tflops,
            "fp16": self.bf16_tflops,
            "fp8": self.fp8_tflops,
            "fp32": self.fp32_tflops,
        }.get(dtype, "unknown")
        if value == "unknown":
            raise ValueError(f"unknown compute dtype {dtype!r}; known: bf16, fp16, fp8, fp32")
        if value is None:
            raise ValueError(f"{self.name} has no {dtype} peak (no {dtype} tensor cores or figure unknown)")
        return float(value)

    def to_dict(self) -> dict:
        return asdict(self)


#: name -> Hardware. Names are lower-case; ``get_hardware`` also accepts the aliases in ``ALIASES``.
HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            "h100_sxm",
            80 * 10**9,
            989.0,
            1979.0,
            "NVIDIA H100 SXM5 80GB HBM3 datasheet, dense (sparse figures / 2); FP32 67 TFLOP/s",
            67.0,
        ),
        Hardware(
            "h100_pcie",
            80 * 10**9,
            756.0,
            1513.0,
            "NVIDIA H100 PCIe 80GB datasheet, dense (sparse figures / 2); FP32 51 TFLOP/s",
            51.0,
        ),
        Hardware(
            "h200",
            141 * 10**9,
            989.0,
            1979.0,
            "NVIDIA H200 SXM 141GB HBM3e datasheet: H100 SXM compute, dense; FP32 67 TFLOP/s",
            67.0,
        ),
        Hardware(
            "a100_80gb",
            80 * 10**9,
            312.0,
            None,
            "NVIDIA A100 80GB SXM datasheet, dense; no FP8 tensor cores (SM80); FP32 19.5 TFLOP/s",
            19.5,
        ),
        Hardware(
            "b200",
            192 * 10**9,
            2250.0,
            4500.0,
            "NVIDIA HGX B200 datasheet per GPU, approximate (~2.25 PF bf16, ~4.5 PF fp8 dense); "
            "some documents list 180 GB; FP32 ~75 TFLOP/s",
            75.0,
        ),
    )
}

ALIASES = {
    "h100": "h100_sxm",
    "h100-sxm": "h100_sxm",
    "h100-pcie": "h100_pcie",
    "a100": "a100_80gb",
    "a100-80gb": "a100_80gb",
}


def get_hardware(name: str) -> Hardware:
    """The named device (case-insensitive; aliases ``h100``, ``a100`` ...). Raises ``KeyError`` listing
    the known names."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in HARDWARE:
        raise KeyError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}")
    return HARDWARE[key]


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
    if "A100" in n and "80GB" in n.replace(" ", ""):
        return HARDWARE["a100_80gb"]
    return None
