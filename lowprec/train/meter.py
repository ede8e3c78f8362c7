"""What a run measures besides the loss: step time and throughput, peak memory, the bytes autograd saves for
backward, and the bytes of the training state; ``RunMeter.summary`` turns them into the run's summary."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

from lowprec.measure.accounting import PeakMemory, StateBytes, measure_state_bytes
from lowprec.measure.saved_tensors import SavedBytes, measure_fp8_scaling_bytes, measure_saved_bytes
from lowprec.train.build import Built
from lowprec.train.guards import preserve_buffers
from lowprec.train.spec import TrainSpec
from lowprec.train.step import Batch, forward_loss


class RunMeter:
    """Measurements of one ``run_training`` call whose first step is ``start``.

    Call ``start()`` first, ``probe_saved_bytes`` once before the first step, wrap each ``train_step`` in
    ``timed()`` and follow it with ``after_step``; ``summary()`` at the end.
    """

    def __init__(self, built: Built, spec: TrainSpec, start: int):
        self.built, self.spec, self.first_step = built, spec, start
        self.peak = PeakMemory(built.device)
        self.saved: SavedBytes | None = None
        #: Measured after the first step whose update ran: a skipped step has created no optimizer state.
        self.state: StateBytes | None = None
        #: Wall time of the last ``timed()`` block (s).
        self.last_step_s = math.nan
        self._timed_s, self._timed_steps = 0.0, 0

    def start(self) -> None:
        """Set the peak-memory baseline: what is resident now is not the run's growth."""
        self.peak.reset()

    def probe_saved_bytes(self, batch: Batch) -> None:
        """Measure the bytes autograd saves for backward with one extra forward on ``batch`` (the first step's
        first micro-batch). It runs under ``preserve_buffers``: delayed-scaling histories never see it."""
        built = self.built
        x, y = built.dist.shard_batch(*batch)
        with preserve_buffers(built.model):
            self.saved = measure_saved_bytes(
                lambda: forward_loss(built, x.to(built.device), y.to(built.device)), built.model
            )

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Time the block (one optimizer step) into ``last_step_s``; an exception leaves it unchanged."""
        t0 = time.perf_counter()
        yield
        self.last_step_s = time.perf_counter() - t0

    def after_step(self, step: int) -> dict[str, float]:
        """The step's metrics: ``step_time_s`` (s), ``tokens_per_s`` and ``tokens`` (consumed after this step).

        Steps from ``spec.timing_warmup_steps`` after the first count towards the summary's means.
        """
        built, spec, dt = self.built, self.spec, self.last_step_s
        if self.state is None and not built.loss_scaler.last_step_skipped:
            self.state = measure_state_bytes(built.model, built.optimizer, built.master_params)
        if step - self.first_step >= spec.timing_warmup_steps:
            self._timed_s += dt
            self._timed_steps += 1
        return {
            "step_time_s": dt,
            "tokens_per_s": spec.tokens_per_step / dt,
            "tokens": (step + 1) * spec.tokens_per_step,
        }

    @property
    def peak_kind(self) -> str:
        """What ``mem_peak_bytes`` measures (``PeakMemory.kind``); final only after ``summary()``."""
        return self.peak.kind

    def summary(self) -> dict[str, float]:
        """Means over the timed steps (``mean_step_time_s`` in s, ``mean_tokens_per_s``; NaN with none), peak
        memory and its growth since ``start()``, saved-for-backward bytes, FP8 scaling-state bytes and the
        state bytes (``StateBytes.as_metrics``), all in bytes. Needs a step whose update ran."""
        if self.saved is None or self.state is None:
            raise RuntimeError("RunMeter.summary needs probe_saved_bytes and a step whose update ran")
        timed_s, n = self._timed_s, self._timed_steps
        peak_bytes = self.peak.read()
        return {
            "mean_step_time_s": timed_s / n if n else float("nan"),
            "mean_tokens_per_s": self.spec.tokens_per_step * n / timed_s if n else float("nan"),
            "mem_peak_bytes": peak_bytes,
            "mem_peak_growth_bytes": peak_bytes - self.peak.baseline,
            "mem_saved_activations_bytes": self.saved.activations,
            "mem_saved_weight_copies_bytes": self.saved.weight_copies,
            "mem_fp8_scaling_state_bytes": measure_fp8_scaling_bytes(self.built.model),
            **self.state.as_metrics(),
        }
