"""Measurement of what a run does: state bytes and peak memory (``accounting``), bytes autograd saves for
backward (``saved_tensors``), FP8 numerics telemetry per layer and role (``telemetry``)."""
