"""Per-step communication metrics from ``CommMeter``, and the communication dtypes a run actually used.

Collective bytes are the same every step of a run, so the meter (a ``TorchDispatchMode``, which costs
Python time on every op) is entered only on sampled steps: the run's first step and every ``every``-th.
Metrics: ``comm_<kind>_bytes`` (this rank's payload per optimizer step, see ``comm_meter``'s byte
convention) and ``comm_<kind>_<dtype>_bytes``. ``observed_comm_dtypes`` turns the first step's counts into
the effective recipe's ``comm`` entry (1-byte payloads, float8 moved as uint8 views, count as ``fp8``).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

from lowprec.parallel.comm_meter import CommMeter

ONE_BYTE = {"uint8", "int8", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}


def _wire_name(dtype: str) -> str:
    return "fp8" if dtype in ONE_BYTE else dtype


class StepCommMetrics:
    """Meters sampled steps. ``context(step)`` wraps one optimizer step; ``after_step(step, built)`` returns
    the metrics of a metered step (``{}`` otherwise). ``meter`` keeps the last metered step's counts until
    the next metered step starts."""

    def __init__(self, every: int):
        self.every = every
        self.meter = CommMeter()
        self._metered: int | None = None
        self._any = False

    def context(self, step: int) -> AbstractContextManager:
        if self._any and (self.every <= 0 or step % self.every):
            return contextlib.nullcontext()
        self.meter.reset()
        self._metered, self._any = step, True
        return self.meter

    def after_step(self, step: int, built) -> dict[str, float]:
        if self._metered != step:
            return {}
        self._metered = None
        by = self.meter.bytes_by_kind_dtype()
        out: dict[str, float] = {}
        for kind, dtypes in by.items():
            out[f"comm_{kind}_bytes"] = float(sum(dtypes.values()))
            for dt, b in dtypes.items():
                out[f"comm_{kind}_{_wire_name(dt)}_bytes"] = out.get(f"comm_{kind}_{_wire_name(dt)}_bytes", 0.0) + b
        return out


def observed_comm_dtypes(by_kind_dtype: dict[str, dict[str, int]]) -> dict[str, str]:
    """``{kind: wire dtype}`` for the kinds that moved anything: ``fp8`` if any 1-byte payload moved (an FP8
    recipe gathers only its FP8 linears in FP8; embeddings, norms and the head keep the compute dtype),
    else the dtype carrying most bytes."""
    out = {}
    for kind, dtypes in by_kind_dtype.items():
        merged: dict[str, int] = {}
        for dt, b in dtypes.items():
            if b:
                merged[_wire_name(dt)] = merged.get(_wire_name(dt), 0) + b
        if merged:
            out[kind] = "fp8" if "fp8" in merged else max(merged, key=merged.get)
    return out
