"""The estimator: memory and step time of a recipe on a model, layout and device, before any run.

``estimator`` (state bytes, FLOPs, MFU, throughput, the ``estimate`` entry point), ``activations`` (bytes
saved for backward per recompute mode), ``inventory`` (parameters and linears of the real model code, with
the FP8 selection applied), ``hardware`` (peak FLOP/s, memory and bandwidths of known accelerators, with
sources), ``cost_model`` (per-op step time, calibrated on ``published.yaml``), ``memory_model`` (peak reserved
memory: the estimator's totals plus transients and fragmentation).
``runnable`` (whether a planned part can run a recipe: the FP8 backend's own ``hardware_blocker``, as training asks).
Every run logs the estimator's prediction beside its measurement (``pred_mem_*`` next to ``mem_*``). A bad input
(a size, a layout, an unknown part) raises ``lowprec.errors.ConfigError`` (a ``ValueError``), which the command
line prints as one line; any other exception is a bug and keeps its traceback.
"""

from lowprec.estimate.estimator import (
    Estimate,
    StateEstimate,
    estimate,
    estimate_all,
    flops_per_token,
    mfu,
    predict_state_bytes,
    predict_throughput,
)

__all__ = [
    "Estimate",
    "StateEstimate",
    "estimate",
    "estimate_all",
    "flops_per_token",
    "mfu",
    "predict_state_bytes",
    "predict_throughput",
]
