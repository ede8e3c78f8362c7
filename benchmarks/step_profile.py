"""Where a training step's wall time goes: the device busy or the host feeding it (an eager step
can leave the GPU idle while the host launches its kernels).

``summarize(events, steps, wall_s)`` reads the events of ``torch.profiler`` over ``steps`` training steps that took
``wall_s`` seconds in all and returns, per step:

- ``wall_ms``: the step's wall time;
- ``device_busy_ms``: the union of the GPU kernels' intervals (overlapping kernels counted once), ``None`` without
  device events (a CPU run);
- ``device_busy_fraction``: busy / wall. Near 1, the step is device-bound: fewer bytes or faster kernels help; well
  below 1, the GPU waits on the host (Python and dispatch: fewer ops per FP8 linear help) or on a synchronization;
- ``host_ops``: top-level ``aten::`` ops dispatched (an op called from inside another is not counted again);
- ``kernels``: GPU kernels launched;
- ``syncs``: host calls that wait for the device (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
  ``cudaEventSynchronize``, a synchronous ``cudaMemcpy``), each of which drains the queue the host built up;
- ``top_kernels``: the 12 kernels with the most device time, ``[name, ms per step, launches per step]``.

torch's profiler API: ``torch/autograd/profiler_util.py`` ``FunctionEvent`` (``device_type``, ``time_range`` in
microseconds, ``cpu_parent``). Used by ``benchmarks/gpu_step_vs_model.py --profile``; the summary of a CPU run is
tested in ``tests/unit/test_step_profile.py``.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch

#: Host calls that block until the device has finished the work queued before them.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(events, steps: int, wall_s: float) -> dict:
    """Per-step summary (module doc) of profiler ``events`` (``prof.events()``) over ``steps`` steps that took
    ``wall_s`` seconds of wall time together. Raises ``ValueError`` unless ``steps >= 1`` and ``wall_s > 0``."""
    if steps < 1 or not wall_s > 0:
        raise ValueError(f"need steps >= 1 and wall_s > 0; got {steps}, {wall_s}")
    device = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    top_ops = [
        e
        for e in host
        if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    ]
    syncs = Counter(e.name for e in host if e.name in SYNC_CALLS)
    per_kernel_us: dict[str, float] = defaultdict(float)
    launches: Counter = Counter()
    for e in device:
        per_kernel_us[e.name] += e.time_range.elapsed_us()
        launches[e.name] += 1
    busy_ms = _busy_us([(e.time_range.start, e.time_range.end) for e in device]) / 1e3 / steps if device else None
    wall_ms = wall_s * 1e3 / steps
    top = sorted(per_kernel_us.items(), key=lambda kv: -kv[1])[:12]
    return {
        "wall_ms": wall_ms,
        "device_busy_ms": busy_ms,
        "device_busy_fraction": busy_ms / wall_ms if busy_ms is not None else None,
        "host_ops": len(top_ops) / steps,
        "kernels": len(device) / steps,
        "syncs": {k: v / steps for k, v in sorted(syncs.items())},
        "top_kernels": [[name[:120], us / 1e3 / steps, launches[name] / steps] for name, us in top],
    }
