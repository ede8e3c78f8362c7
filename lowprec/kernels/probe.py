"""The ``cpu_kernels=auto`` probe: time native vs emulated BF16 and FP8 GEMMs on this CPU, once, and cache it.

Shapes are small (256 x 256 x 256) so that even oneDNN's reference FP8 kernel (8 s for 1024x256x768 on a 2-core
AMX Xeon) costs well under a second per call. Each figure is the best of ``REPS`` interleaved calls after one warm-up,
in milliseconds. The decision per kind is the faster of the two. The result is cached as JSON in
``$LOWPREC_CACHE`` (default ``~/.cache/lowprec``) under ``cpu_kernels.json``, keyed by CPU model, ISA flags,
torch version and thread count, so later runs on the same machine skip it.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lowprec.kernels.cpu import cpu_model, isa_flags
from lowprec.kernels.emulated import emulated_linear
from lowprec.kernels.scaled_mm import ScaledMMCall, emulated_scaled_mm, native_scaled_mm

SHAPE = (256, 256, 256)  # M, K, N
REPS = 5
CACHE_FILE = "cpu_kernels.json"


@dataclass(frozen=True)
class ProbeResult:
    """``ms``: ``{bf16_native, bf16_emulated, fp8_native, fp8_emulated}`` in milliseconds per call."""

    ms: dict

    def choice(self, kind: str) -> str:
        """``native`` or ``emulated``, whichever was faster for ``kind`` (``bf16`` or ``fp8``)."""
        return "native" if self.ms[f"{kind}_native"] <= self.ms[f"{kind}_emulated"] else "emulated"


def _best_ms(fns: dict) -> dict:
    # Interleaved rounds, best of each: on 2 shared cores another process can stall one call by tens of ms,
    # and interleaving gives every candidate the same chances of a quiet round.
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(REPS):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: t * 1e3 for name, t in best.items()}


def measure() -> ProbeResult:
    """Run the probe now (no cache)."""
    m, k, n = SHAPE
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    call = ScaledMMCall(
        x.to(torch.float8_e4m3fn),
        w.to(torch.float8_e4m3fn).t(),
        torch.tensor(1.0),
        "TensorWise",
        torch.tensor(1.0),
        "TensorWise",
        torch.bfloat16,
    )
    with torch.no_grad():
        ms = _best_ms(
            {
                "bf16_native": lambda: F.linear(x, w),
                "bf16_emulated": lambda: emulated_linear(x, w),
                "fp8_native": lambda: native_scaled_mm(call),
                "fp8_emulated": lambda: emulated_scaled_mm(call),
            }
        )
    return ProbeResult(ms)


def cache_key() -> str:
    """What the cached decision depends on."""
    return f"{cpu_model()}|{' '.join(isa_flags())}|torch {torch.__version__}|threads {torch.get_num_threads()}"


def _cache_path() -> Path:
    return Path(os.environ.get("LOWPREC_CACHE", "~/.cache/lowprec")).expanduser() / CACHE_FILE


@functools.cache
def probe_kernels() -> ProbeResult:
    """The probe's result for this machine: from the cache file when it has this ``cache_key``, else measured
    and written there (a cache that cannot be read or written is ignored: the probe is then run again)."""
    path, key = _cache_path(), cache_key()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached, dict) and isinstance(cached.get(key), dict):
        return ProbeResult(cached[key])
    result = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cached = cached if isinstance(cached, dict) else {}
        cached[key] = result.ms
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    except OSError:
        pass
    return result
